"""Raw-HTTP tests of Backstop: inputs the SDKs can't send, health, metrics, the CLI."""

from __future__ import annotations

import re
import subprocess

import pytest

from backstop_support import (
    MAX_BODY_BYTES,
    TENANT_A_KEY,
    assert_anthropic_error,
    assert_openai_error,
)

OPENAI_AUTH = {"authorization": f"Bearer {TENANT_A_KEY}"}
ANTHROPIC_AUTH = {"x-api-key": TENANT_A_KEY, "anthropic-version": "2023-06-01"}
CHAT = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}
MESSAGES = {"model": "claude-3-5-sonnet-latest", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}


def _sc(scenario: str, **extra) -> dict:
    return {"x-mock-scenario": scenario, **extra}


# --- authentication ------------------------------------------------------------------------

@pytest.mark.parametrize("path,body", [("/v1/chat/completions", CHAT),
                                       ("/v1/embeddings", {"model": "text-embedding-3-small", "input": "x"})])
def test_openai_missing_key_401(backstop, scenario, path, body):
    r = backstop.post(path, json_body=body, headers=_sc(scenario))
    assert_openai_error(r, status=401, type_="authentication_error", code="invalid_api_key")
    assert r.headers.get("x-request-id")
    assert backstop.attempts(scenario) == 0


def test_models_missing_key_401(backstop):
    r = backstop.get("/v1/models")
    assert_openai_error(r, status=401, type_="authentication_error", code="invalid_api_key")


def test_openai_wrong_key_401(backstop, scenario):
    r = backstop.post("/v1/chat/completions", json_body=CHAT,
                      headers=_sc(scenario, authorization="Bearer bk-wrong"))
    assert_openai_error(r, status=401, type_="authentication_error", code="invalid_api_key")
    assert backstop.attempts(scenario) == 0


def test_anthropic_missing_key_401(backstop, scenario):
    r = backstop.post("/v1/messages", json_body=MESSAGES,
                      headers=_sc(scenario, **{"anthropic-version": "2023-06-01"}))
    assert_anthropic_error(r, status=401, type_="authentication_error")
    assert r.headers.get("x-request-id")
    assert backstop.attempts(scenario) == 0


def test_anthropic_wrong_bearer_401(backstop, scenario):
    r = backstop.post("/v1/messages", json_body=MESSAGES,
                      headers=_sc(scenario, authorization="Bearer bk-wrong", **{"anthropic-version": "2023-06-01"}))
    assert_anthropic_error(r, status=401, type_="authentication_error")
    assert backstop.attempts(scenario) == 0


# --- bad input -----------------------------------------------------------------------------

def test_openai_invalid_json_400(backstop, scenario):
    r = backstop.post("/v1/chat/completions", content=b"{this is not json",
                      headers=_sc(scenario, **OPENAI_AUTH))
    assert_openai_error(r, status=400, type_="invalid_request_error", code="invalid_json")
    assert r.headers.get("x-request-id")
    assert backstop.attempts(scenario) == 0


def test_embeddings_invalid_json_400(backstop, scenario):
    r = backstop.post("/v1/embeddings", content=b'{"model": "text-embedding-3-small", "input": ',
                      headers=_sc(scenario, **OPENAI_AUTH))
    assert_openai_error(r, status=400, type_="invalid_request_error", code="invalid_json")
    assert backstop.attempts(scenario) == 0


def test_anthropic_invalid_json_400(backstop, scenario):
    r = backstop.post("/v1/messages", content=b"{this is not json", headers=_sc(scenario, **ANTHROPIC_AUTH))
    assert_anthropic_error(r, status=400, type_="invalid_request_error")
    assert backstop.attempts(scenario) == 0


def test_openai_missing_model_400(backstop, scenario):
    r = backstop.post("/v1/chat/completions", json_body={"messages": CHAT["messages"]},
                      headers=_sc(scenario, **OPENAI_AUTH))
    assert_openai_error(r, status=400, type_="invalid_request_error", code="missing_model", param="model")
    assert backstop.attempts(scenario) == 0


def test_embeddings_missing_model_400(backstop, scenario):
    r = backstop.post("/v1/embeddings", json_body={"input": "x"}, headers=_sc(scenario, **OPENAI_AUTH))
    assert_openai_error(r, status=400, type_="invalid_request_error", code="missing_model", param="model")
    assert backstop.attempts(scenario) == 0


def test_anthropic_missing_model_400(backstop, scenario):
    body = {k: v for k, v in MESSAGES.items() if k != "model"}
    r = backstop.post("/v1/messages", json_body=body, headers=_sc(scenario, **ANTHROPIC_AUTH))
    assert_anthropic_error(r, status=400, type_="invalid_request_error")
    assert backstop.attempts(scenario) == 0


def test_openai_unknown_model_404(backstop, scenario):
    r = backstop.post("/v1/chat/completions", json_body={**CHAT, "model": "unknown-xyz"},
                      headers=_sc(scenario, **OPENAI_AUTH))
    assert_openai_error(r, status=404, type_="invalid_request_error", code="model_not_found", param="model")
    assert backstop.attempts(scenario) == 0


def test_anthropic_unknown_model_404(backstop, scenario):
    r = backstop.post("/v1/messages", json_body={**MESSAGES, "model": "unknown-xyz"},
                      headers=_sc(scenario, **ANTHROPIC_AUTH))
    assert_anthropic_error(r, status=404, type_="not_found_error")
    assert backstop.attempts(scenario) == 0


def _oversize_chat() -> bytes:
    body = b'{"model":"gpt-4o","messages":[{"role":"user","content":"' + b"y" * (MAX_BODY_BYTES + 100) + b'"}]}'
    assert len(body) > MAX_BODY_BYTES
    return body


def test_openai_oversize_413(backstop, scenario):
    r = backstop.post("/v1/chat/completions", content=_oversize_chat(), headers=_sc(scenario, **OPENAI_AUTH))
    assert_openai_error(r, status=413, type_="invalid_request_error", code="request_too_large")
    assert backstop.attempts(scenario) == 0


def test_anthropic_oversize_413(backstop, scenario):
    body = (b'{"model":"claude-3-5-sonnet-latest","max_tokens":16,"messages":[{"role":"user","content":"'
            + b"y" * (MAX_BODY_BYTES + 100) + b'"}]}')
    r = backstop.post("/v1/messages", content=body, headers=_sc(scenario, **ANTHROPIC_AUTH))
    assert_anthropic_error(r, status=413, type_="request_too_large")
    assert backstop.attempts(scenario) == 0


def test_body_just_under_limit_is_accepted(backstop, scenario):
    prefix = b'{"model":"gpt-4o","messages":[{"role":"user","content":"'
    suffix = b'"}]}'
    body = prefix + b"z" * (MAX_BODY_BYTES - 1024 - len(prefix) - len(suffix)) + suffix
    r = backstop.post("/v1/chat/completions", content=body, headers=_sc(scenario, **OPENAI_AUTH))
    assert r.status_code == 200, r.text
    assert backstop.attempts(scenario) == 1


def test_openai_dead_upstream_502(backstop, scenario):
    r = backstop.post("/v1/chat/completions", json_body={**CHAT, "model": "dead-model"},
                      headers=_sc(scenario, **OPENAI_AUTH))
    assert_openai_error(r, status=502, type_="upstream_error", code="upstream_unavailable")
    assert r.headers.get("x-request-id")


def test_anthropic_dead_upstream_502(backstop, scenario):
    r = backstop.post("/v1/messages", json_body={**MESSAGES, "model": "dead-claude"},
                      headers=_sc(scenario, **ANTHROPIC_AUTH))
    assert_anthropic_error(r, status=502, type_="upstream_unavailable")


def test_openai_timeout_504(backstop, scenario):
    r = backstop.post("/v1/chat/completions", json_body={**CHAT, "model": "slow-model"},
                      headers=_sc(scenario, **OPENAI_AUTH, **{"x-mock-fault": "delay=2s"}))
    assert_openai_error(r, status=504, type_="upstream_error", code="upstream_timeout")


def test_request_id_echoed_on_error(backstop):
    r = backstop.post("/v1/chat/completions", json_body=CHAT, headers={"x-request-id": "abc-123"})
    assert r.status_code == 401
    assert r.headers.get("x-request-id") == "abc-123"


def test_request_id_echoed_raw_anthropic(backstop, scenario):
    r = backstop.post("/v1/messages", json_body=MESSAGES,
                      headers=_sc(scenario, **ANTHROPIC_AUTH, **{"x-request-id": "abc-123"}))
    assert r.status_code == 200, r.text
    assert r.headers.get("x-request-id") == "abc-123"


# --- health & metrics ----------------------------------------------------------------------

@pytest.mark.parametrize("path", ["/healthz", "/readyz"])
def test_health_endpoints(backstop, path):
    r = backstop.get(path)
    assert r.status_code == 200


@pytest.mark.parametrize("path", ["/healthz", "/readyz", "/metrics"])
def test_every_response_carries_request_id(backstop, path):
    r = backstop.get(path)
    assert r.status_code == 200
    assert r.headers.get("x-request-id"), f"GET {path}: no x-request-id; headers {dict(r.headers)}"
    echoed = backstop.get(path, headers={"x-request-id": "abc-123"})
    assert echoed.headers.get("x-request-id") == "abc-123"


_SAMPLE = re.compile(r"^(backstop_requests_total)(\{[^}]*\})?\s+([0-9.eE+-]+|NaN|\+Inf)(\s+\d+)?$")


def _requests_total(text: str) -> float:
    total = 0.0
    found = False
    for line in text.splitlines():
        m = _SAMPLE.match(line.strip())
        if m:
            found = True
            total += float(m.group(3))
    assert found, "no sample line starting with backstop_requests_total in /metrics:\n" + text[:3000]
    return total


def test_metrics_prometheus_text(backstop, scenario):
    ok = backstop.post("/v1/chat/completions", json_body=CHAT, headers=_sc(scenario, **OPENAI_AUTH))
    assert ok.status_code == 200, ok.text
    r = backstop.get("/metrics")
    assert r.status_code == 200
    ctype = r.headers.get("content-type", "")
    assert ctype.startswith("text/plain") or ctype.startswith("application/openmetrics-text"), ctype
    text = r.text
    assert any(line.startswith("backstop_requests_total") for line in text.splitlines()), text[:3000]
    before = _requests_total(text)
    assert before >= 1

    for _ in range(3):
        assert backstop.post("/v1/chat/completions", json_body=CHAT,
                             headers=_sc(scenario, **OPENAI_AUTH)).status_code == 200
    after = _requests_total(backstop.get("/metrics").text)
    assert after >= before + 3, f"backstop_requests_total went from {before} to {after} after 3 requests"


# --- CLI -----------------------------------------------------------------------------------

def test_check_config_accepts_test_config(backstop):
    p = subprocess.run([str(backstop.binary), "check-config", "--config", str(backstop.config_path)],
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, f"stdout={p.stdout!r} stderr={p.stderr!r}"


def test_check_config_rejects_unknown_upstream(backstop, tmp_path):
    bad = backstop.config_path.read_text() + '\n[[routes]]\nmodel = "ghost"\ntargets = [{ upstream = "nope" }]\n'
    path = tmp_path / "bad.toml"
    path.write_text(bad)
    p = subprocess.run([str(backstop.binary), "check-config", "--config", str(path)],
                       capture_output=True, text=True, timeout=30)
    assert p.returncode != 0, f"check-config accepted a route to an unknown upstream: {p.stdout!r} {p.stderr!r}"
    assert "nope" in (p.stdout + p.stderr), f"error does not name the bad upstream: {p.stdout!r} {p.stderr!r}"

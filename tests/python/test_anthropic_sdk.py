"""End-to-end tests driving Backstop with the official `anthropic` Python SDK.

Note: recent anthropic SDKs send the `api_key` as `Authorization: Bearer <key>`; older
ones (and curl examples) send `x-api-key: <key>`. Backstop must accept both on /v1/messages.
"""

from __future__ import annotations

import time

import anthropic
import pytest
from anthropic._constants import ANTHROPIC_API_VERSION

from backstop_support import (
    PROVIDER_ANTHROPIC_KEY,
    TENANT_A_KEY,
    TENANT_B_KEY,
    assert_anthropic_error,
    assert_no_tenant_key,
)

MODEL = "claude-3-5-sonnet-latest"


def _hdrs(scenario: str, **extra: str) -> dict:
    return {"x-mock-scenario": scenario, **extra}


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def _assert_upstream_auth(up: dict) -> None:
    assert up["headers"].get("x-api-key") == PROVIDER_ANTHROPIC_KEY
    assert_no_tenant_key(up)


def test_messages_non_stream(backstop, anth, scenario):
    prompt = "Hello from the anthropic SDK"
    raw = anth.messages.with_raw_response.create(
        model=MODEL, max_tokens=64, system="be brief", messages=_user(prompt),
        extra_headers=_hdrs(scenario),
    )
    assert raw.status_code == 200
    assert raw.headers.get("x-request-id"), f"x-request-id header missing; headers: {dict(raw.headers)}"

    msg = raw.parse()
    assert msg.type == "message"
    assert msg.role == "assistant"
    assert msg.id.startswith("msg_")
    assert [b.type for b in msg.content] == ["text"]
    assert msg.content[0].text == f"mock: {prompt}"
    assert msg.stop_reason == "end_turn"
    assert msg.model == MODEL
    assert msg.usage.input_tokens > 0
    assert msg.usage.output_tokens > 0

    assert backstop.attempts(scenario) == 1
    up = backstop.last_upstream_request(scenario)
    assert up["method"] == "POST"
    assert up["path"] == "/v1/messages"
    _assert_upstream_auth(up)
    assert up["headers"].get("anthropic-version") == ANTHROPIC_API_VERSION
    assert up["body"]["model"] == MODEL
    assert up["body"]["max_tokens"] == 64
    assert up["body"]["messages"] == _user(prompt)


def test_messages_reported_usage(anth, scenario):
    msg = anth.messages.create(
        model=MODEL, max_tokens=32, messages=_user("count"),
        extra_headers=_hdrs(scenario, **{"x-mock-fault": "usage=9/4"}),
    )
    assert msg.content[0].text == "mock: count"
    assert (msg.usage.input_tokens, msg.usage.output_tokens) == (9, 4)


def test_anthropic_version_passes_through(backstop, anth, scenario):
    anth.messages.create(
        model=MODEL, max_tokens=16, messages=_user("v"),
        extra_headers=_hdrs(scenario, **{"anthropic-version": "2023-06-01"}),
    )
    up = backstop.last_upstream_request(scenario)
    assert up["headers"].get("anthropic-version") == "2023-06-01"
    _assert_upstream_auth(up)


def test_messages_stream_helper(backstop, anth, scenario):
    prompt = "stream me with the helper, please, in several pieces"
    with anth.messages.stream(
        model=MODEL, max_tokens=64, messages=_user(prompt), extra_headers=_hdrs(scenario),
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == f"mock: {prompt}"
    assert final.content[0].text == f"mock: {prompt}"
    assert final.stop_reason == "end_turn"
    assert final.usage.output_tokens > 0

    assert backstop.attempts(scenario) == 1
    up = backstop.last_upstream_request(scenario)
    assert up["body"]["stream"] is True
    _assert_upstream_auth(up)
    assert up["headers"].get("anthropic-version") == ANTHROPIC_API_VERSION


def test_messages_stream_raw_events(anth, scenario):
    prompt = "raw events"
    stream = anth.messages.create(
        model=MODEL, max_tokens=64, messages=_user(prompt), stream=True, extra_headers=_hdrs(scenario),
    )
    events = list(stream)
    types = [e.type for e in events]
    assert types[0] == "message_start"
    assert types[-1] == "message_stop"
    for required in ("content_block_start", "content_block_delta", "content_block_stop", "message_delta"):
        assert required in types, f"{required} missing from {types}"
    assert types.index("content_block_start") < types.index("content_block_delta")
    assert types.index("content_block_stop") < types.index("message_delta") < types.index("message_stop")
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta" and e.delta.type == "text_delta")
    assert text == f"mock: {prompt}"
    message_delta = next(e for e in events if e.type == "message_delta")
    assert message_delta.delta.stop_reason == "end_turn"
    assert events[0].message.role == "assistant"


def test_messages_stream_is_not_buffered(anth, scenario):
    prompt = "slowly streamed text that is long enough to be split into chunks"
    first_at = last_at = None
    with anth.messages.stream(
        model=MODEL, max_tokens=64, messages=_user(prompt),
        extra_headers=_hdrs(scenario, **{"x-mock-fault": "chunks=5;chunk_delay=300ms"}),
    ) as stream:
        pieces = []
        for piece in stream.text_stream:
            pieces.append(piece)
            if first_at is None:
                first_at = time.monotonic()
        last_at = time.monotonic()
    assert "".join(pieces) == f"mock: {prompt}"
    assert first_at is not None
    spread = last_at - first_at
    assert spread > 0.6, f"first text delta arrived only {spread:.3f}s before the end: stream is buffered"


def test_tenant_b_key_works(backstop, anth_b, scenario):
    msg = anth_b.messages.create(model=MODEL, max_tokens=16, messages=_user("team b"),
                                 extra_headers=_hdrs(scenario))
    assert msg.content[0].text == "mock: team b"
    _assert_upstream_auth(backstop.last_upstream_request(scenario))


def test_x_api_key_header_auth(backstop, scenario, monkeypatch):
    """The classic Anthropic auth header `x-api-key` (sent by curl users and older SDKs)."""
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    monkeypatch.delenv("ANTHROPIC_AUTH_TOKEN", raising=False)
    client = anthropic.Anthropic(
        api_key=None, auth_token=None, base_url=backstop.anthropic_base_url, max_retries=0,
        default_headers={"x-api-key": TENANT_B_KEY},
    )
    # Make sure this client really authenticates with x-api-key only.
    assert "authorization" not in {k.lower() for k in client.auth_headers}
    msg = client.messages.create(model=MODEL, max_tokens=16, messages=_user("xak"),
                                 extra_headers=_hdrs(scenario))
    assert msg.content[0].text == "mock: xak"
    _assert_upstream_auth(backstop.last_upstream_request(scenario))

    r = backstop.post(
        "/v1/messages",
        json_body={"model": MODEL, "max_tokens": 16, "messages": _user("raw")},
        headers={"x-api-key": TENANT_A_KEY, "anthropic-version": "2023-06-01", "x-mock-scenario": scenario},
    )
    assert r.status_code == 200, r.text
    assert r.json()["content"][0]["text"] == "mock: raw"


def test_request_id_is_echoed(anth, scenario):
    raw = anth.messages.with_raw_response.create(
        model=MODEL, max_tokens=16, messages=_user("id"),
        extra_headers=_hdrs(scenario, **{"x-request-id": "abc-123"}),
    )
    assert raw.status_code == 200
    assert raw.headers.get("x-request-id") == "abc-123"


# --- errors (Anthropic shape) --------------------------------------------------------------

def test_wrong_key_401(backstop, scenario):
    client = anthropic.Anthropic(api_key="bk-not-a-tenant", base_url=backstop.anthropic_base_url, max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as exc:
        client.messages.create(model=MODEL, max_tokens=16, messages=_user("x"), extra_headers=_hdrs(scenario))
    assert exc.value.status_code == 401
    assert_anthropic_error(exc.value.response, status=401, type_="authentication_error")
    assert exc.value.response.headers.get("x-request-id")
    assert backstop.attempts(scenario) == 0


def test_wrong_x_api_key_401(backstop, scenario):
    r = backstop.post(
        "/v1/messages",
        json_body={"model": MODEL, "max_tokens": 16, "messages": _user("x")},
        headers={"x-api-key": "bk-not-a-tenant", "anthropic-version": "2023-06-01", "x-mock-scenario": scenario},
    )
    assert_anthropic_error(r, status=401, type_="authentication_error")
    assert backstop.attempts(scenario) == 0


def test_invalid_json_400_via_sdk(backstop, anth, scenario):
    with pytest.raises(anthropic.BadRequestError) as exc:
        anth.post(
            "/v1/messages", cast_to=object, content=b'{"model": "claude-3", "max_tokens": ',
            options={"headers": _hdrs(scenario)},
        )
    assert exc.value.status_code == 400
    assert_anthropic_error(exc.value.response, status=400, type_="invalid_request_error")
    assert backstop.attempts(scenario) == 0


def test_unknown_model_404(backstop, anth, scenario):
    with pytest.raises(anthropic.NotFoundError) as exc:
        anth.messages.create(model="no-such-model", max_tokens=16, messages=_user("x"),
                             extra_headers=_hdrs(scenario))
    assert exc.value.status_code == 404
    assert_anthropic_error(exc.value.response, status=404, type_="not_found_error")
    assert backstop.attempts(scenario) == 0


def test_oversize_body_413(backstop, anth, scenario):
    big = "x" * 70_000  # > max_body_bytes = 65536
    with pytest.raises(anthropic.APIStatusError) as exc:
        anth.messages.create(model=MODEL, max_tokens=16, messages=_user(big), extra_headers=_hdrs(scenario))
    assert exc.value.status_code == 413
    assert_anthropic_error(exc.value.response, status=413, type_="request_too_large")
    assert backstop.attempts(scenario) == 0


def test_dead_upstream_502(anth, scenario):
    with pytest.raises(anthropic.APIStatusError) as exc:
        anth.messages.create(model="dead-claude", max_tokens=16, messages=_user("x"),
                             extra_headers=_hdrs(scenario))
    assert exc.value.status_code == 502
    assert_anthropic_error(exc.value.response, status=502, type_="upstream_unavailable")


def test_attempt_timeout_504(backstop, anth, scenario):
    started = time.monotonic()
    with pytest.raises(anthropic.APIStatusError) as exc:
        anth.messages.create(model="slow-claude", max_tokens=16, messages=_user("x"),
                             extra_headers=_hdrs(scenario, **{"x-mock-fault": "delay=2s"}))
    elapsed = time.monotonic() - started
    assert exc.value.status_code == 504
    assert_anthropic_error(exc.value.response, status=504, type_="upstream_timeout")
    assert elapsed < 1.8, f"504 took {elapsed:.2f}s; attempt_timeout=300ms was not enforced"
    assert backstop.attempts(scenario) >= 1


def test_upstream_error_passthrough(backstop, anth, scenario):
    fault = {"x-mock-fault": "status=400"}
    direct = backstop.http.post(
        f"{backstop.mock_url}/v1/messages",
        json={"model": MODEL, "max_tokens": 16, "messages": _user("x")},
        headers={"x-mock-scenario": f"{scenario}-direct", "x-api-key": "x",
                 "anthropic-version": "2023-06-01", **fault},
    )
    assert direct.status_code == 400

    with pytest.raises(anthropic.BadRequestError) as exc:
        anth.messages.create(model=MODEL, max_tokens=16, messages=_user("x"),
                             extra_headers=_hdrs(scenario, **fault))
    assert exc.value.status_code == 400
    assert exc.value.response.json() == direct.json()
    assert backstop.attempts(scenario) == 1

"""Issue 11, through the official SDKs: model discovery (`models.list`, `models.retrieve`),
Anthropic `messages.count_tokens`, unknown endpoints, and the session id taken from the
body for frameworks that cannot set a header per run."""


import anthropic
import openai
import pytest

from backstop_support import PROVIDER_ANTHROPIC_KEY, TENANT_A_KEY, assert_no_tenant_key


def test_models_retrieve_a_listed_id_and_one_a_glob_serves(oai):
    listed = oai.models.retrieve("gpt-4o-mini")
    assert listed.id == "gpt-4o-mini"
    assert listed.object == "model"
    # Not listed, but the gpt-* route serves it: retrievable.
    assert oai.models.retrieve("gpt-5-nano").id == "gpt-5-nano"
    ids = [m.id for m in oai.models.list()]
    assert "gpt-4o-mini" in ids and "gpt-*" not in ids, ids


def test_models_retrieve_unknown_is_404_model_not_found(oai):
    with pytest.raises(openai.NotFoundError) as exc:
        oai.models.retrieve("llama-3-70b")
    assert exc.value.status_code == 404
    assert exc.value.response.headers["x-should-retry"] == "false"
    assert exc.value.body["code"] == "model_not_found"


def test_anthropic_models_retrieve(anth):
    model = anth.models.retrieve("claude-mock-1")
    assert model.id == "claude-mock-1"
    assert model.type == "model"
    with pytest.raises(anthropic.NotFoundError):
        anth.models.retrieve("llama-3-70b")


def test_count_tokens_is_forwarded_and_not_charged(backstop, anth, scenario):
    session = f"count-{scenario}"
    counted = anth.messages.count_tokens(
        model="claude-mock-1",
        messages=[{"role": "user", "content": "How many tokens is this?"}],
        extra_headers={"x-mock-scenario": scenario, "x-mock-fault": "usage=17/0",
                       "x-session-id": session},
    )
    assert counted.input_tokens == 17
    assert backstop.attempts(scenario) == 1
    seen = backstop.last_upstream_request(scenario)
    assert seen["path"] == "/v1/messages/count_tokens"
    assert seen["headers"]["x-api-key"] == PROVIDER_ANTHROPIC_KEY
    assert_no_tenant_key(seen)
    # Counting spends nothing: the session was never charged.
    r = backstop.get(f"/v1/sessions/{session}", headers={"authorization": f"Bearer {TENANT_A_KEY}"})
    assert r.status_code == 404 or r.json()["used"]["calls"] == 0, r.text


def test_count_tokens_retries_a_transient_failure(backstop, anth, scenario):
    counted = anth.messages.with_raw_response.count_tokens(
        model="claude-mock-1",
        messages=[{"role": "user", "content": "hi"}],
        extra_headers={"x-mock-scenario": scenario, "x-mock-fault": "status=529,usage=5/0"},
    )
    assert counted.headers["x-backstop-attempts"] == "2"
    assert counted.parse().input_tokens == 5
    assert backstop.attempts(scenario) == 2


def test_an_unknown_endpoint_is_404_in_the_callers_shape(backstop):
    r = backstop.post("/v1/assistants", json_body={}, headers={"authorization": f"Bearer {TENANT_A_KEY}"})
    assert r.status_code == 404
    assert r.headers["x-should-retry"] == "false"
    assert r.json()["error"]["code"] == "unknown_endpoint"
    r = backstop.post("/v1/messages/batches", json_body={}, headers={"x-api-key": TENANT_A_KEY})
    assert r.status_code == 404
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "not_found_error"


def _session_calls(backstop, session: str, expected: int) -> int:
    return backstop.session_used(session, lambda used: used["calls"] >= expected)["calls"]


def test_the_session_id_comes_from_openai_metadata(backstop, oai, scenario):
    session = f"meta-{scenario}"
    for _ in range(2):
        oai.chat.completions.create(
            model="gpt-4o-mini",
            messages=[{"role": "user", "content": "hi"}],
            metadata={"session_id": session},
            extra_headers={"x-mock-scenario": scenario},
        )
    assert _session_calls(backstop, session, 2) == 2


def test_the_session_id_comes_from_anthropic_metadata_user_id(backstop, anth, scenario):
    session = f"user-{scenario}"
    anth.messages.create(
        model="claude-mock-1",
        max_tokens=16,
        messages=[{"role": "user", "content": "hi"}],
        metadata={"user_id": session},
        extra_headers={"x-mock-scenario": scenario},
    )
    assert _session_calls(backstop, session, 1) == 1

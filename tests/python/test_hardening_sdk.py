"""Issue 16 through the official SDKs: hostile upstreams and bad identifiers end in
typed errors the SDKs understand, never a hang, a crash or a silent bypass."""

from __future__ import annotations

import anthropic
import openai
import pytest

from backstop_support import TENANT_A_KEY

USER = [{"role": "user", "content": "hi"}]


def test_an_upstream_redirect_is_a_typed_502_and_the_sdk_does_not_retry(backstop, scenario):
    # Default SDK retries (2): x-should-retry: false stops them, so one upstream attempt.
    client = openai.OpenAI(api_key=TENANT_A_KEY, base_url=backstop.openai_base_url)
    with pytest.raises(openai.InternalServerError) as err:
        client.chat.completions.create(
            model="gpt-4o", messages=USER,
            extra_headers={"x-mock-scenario": scenario,
                           "x-mock-fault": "status=307;location=http://127.0.0.1:1/steal"},
        )
    assert err.value.status_code == 502
    assert err.value.body["code"] == "upstream_redirect"
    assert backstop.attempts(scenario) == 1


def test_a_never_ending_sse_event_ends_the_openai_stream_with_an_error(backstop, oai, scenario):
    stream = oai.chat.completions.create(
        model="gpt-4o", messages=USER, stream=True,
        extra_headers={"x-mock-scenario": scenario, "x-mock-fault": "huge_event=100000000"},
    )
    with pytest.raises(openai.APIError) as err:
        for _ in stream:
            pass
    assert "max_sse_event_bytes" in str(err.value.body or err.value.message)


def test_a_never_ending_sse_event_ends_the_anthropic_stream_with_an_error(backstop, anth, scenario):
    with pytest.raises(anthropic.APIError) as err:
        with anth.messages.stream(
            model="claude-3-5-haiku", max_tokens=16, messages=USER,
            extra_headers={"x-mock-scenario": scenario, "x-mock-fault": "huge_event=100000000"},
        ) as stream:
            stream.get_final_message()
    assert "upstream_stream_error" in str(err.value.body)


def test_a_stream_answered_with_plain_json_is_a_typed_error(backstop, oai, scenario):
    with pytest.raises(openai.InternalServerError) as err:
        for _ in oai.chat.completions.create(
            model="gpt-4o", messages=USER, stream=True,
            extra_headers={"x-mock-scenario": scenario, "x-mock-fault": "plain"},
        ):
            pass
    assert err.value.body["code"] == "upstream_not_streaming"


@pytest.mark.parametrize("session", ["r\u00fcn-1", "x" * 257, "two words"])
def test_a_session_id_backstop_cannot_honour_is_refused_not_ignored(backstop, scenario, session):
    # httpx refuses non-ASCII header strings, so send the raw bytes as a client could.
    resp = backstop.post(
        "/v1/chat/completions",
        headers={"authorization": f"Bearer {TENANT_A_KEY}", "x-mock-scenario": scenario,
                 "x-session-id": session.encode("utf-8")},
        json_body={"model": "gpt-4o", "messages": USER},
    )
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["code"] == "invalid_header"
    assert resp.json()["error"]["param"] == "x-session-id"
    assert backstop.attempts(scenario) == 0


def test_an_absurd_max_tokens_is_a_400_in_the_sdk(backstop, oai, scenario):
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(
            model="gpt-4o", messages=USER, max_tokens=2**64 - 1,
            extra_headers={"x-mock-scenario": scenario},
        )
    assert err.value.body["param"] == "max_tokens"
    assert backstop.attempts(scenario) == 0

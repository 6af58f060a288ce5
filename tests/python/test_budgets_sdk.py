"""Budgets and rate limits seen through the official SDKs at their default retries.

Refusals are answered before any upstream call, with a typed error and
`x-should-retry: false`, so the SDK does not come back for more.
"""

from __future__ import annotations

import anthropic
import openai
import pytest

from backstop_support import CAPPED_KEY, GUARDED_KEY, THROTTLED_KEY


def _user(text):
    return [{"role": "user", "content": text}]


def test_session_max_calls_refuses_with_402_naming_the_budget(backstop, scenario):
    client = openai.OpenAI(api_key=CAPPED_KEY, base_url=backstop.openai_base_url, timeout=20)
    headers = {"x-mock-scenario": scenario, "x-session-id": scenario}
    remaining = []
    for _ in range(2):
        raw = client.chat.completions.with_raw_response.create(model="gpt-4o", messages=_user("hi"), extra_headers=headers)
        remaining.append(raw.headers["x-backstop-budget-remaining"])
    assert remaining == ["calls=1", "calls=0"]
    with pytest.raises(openai.APIStatusError) as err:
        client.chat.completions.create(model="gpt-4o", messages=_user("hi"), extra_headers=headers)
    assert err.value.status_code == 402
    assert err.value.code == "budget_exceeded"
    assert err.value.body["param"] == "session.max_calls"
    assert err.value.response.headers["x-should-retry"] == "false"
    assert backstop.attempts(scenario) == 2
    client.close()


def test_anthropic_sdk_gets_the_refusal_in_its_own_shape(backstop, scenario):
    client = anthropic.Anthropic(api_key=CAPPED_KEY, base_url=backstop.anthropic_base_url, timeout=20)
    headers = {"x-mock-scenario": scenario, "x-session-id": scenario}
    for _ in range(2):
        client.messages.create(model="claude-x", max_tokens=8, messages=_user("hi"), extra_headers=headers)
    with pytest.raises(anthropic.APIStatusError) as err:
        client.messages.create(model="claude-x", max_tokens=8, messages=_user("hi"), extra_headers=headers)
    assert err.value.status_code == 402
    assert err.value.body["type"] == "error"
    assert err.value.body["error"]["type"] == "budget_exceeded"
    assert "session.max_calls" in err.value.body["error"]["message"]
    assert backstop.attempts(scenario) == 2
    client.close()


def test_rate_limit_is_429_with_retry_after_and_the_sdk_does_not_retry(backstop, scenario):
    client = openai.OpenAI(api_key=THROTTLED_KEY, base_url=backstop.openai_base_url, timeout=20)
    assert client.max_retries == 2
    headers = {"x-mock-scenario": scenario}
    client.chat.completions.create(model="gpt-4o", messages=_user("hi"), extra_headers=headers)
    with pytest.raises(openai.RateLimitError) as err:
        client.chat.completions.create(model="gpt-4o", messages=_user("hi"), extra_headers=headers)
    assert err.value.code == "rate_limited"
    assert 1 <= int(err.value.response.headers["retry-after"]) <= 60
    assert err.value.response.headers["x-should-retry"] == "false"
    assert backstop.attempts(scenario) == 1
    client.close()


def test_idempotency_key_replays_through_the_sdk(backstop, oai, scenario):
    headers = {"x-mock-scenario": scenario, "Idempotency-Key": f"idem-{scenario}"}
    first = oai.chat.completions.with_raw_response.create(model="gpt-4o", messages=_user("once"), extra_headers=headers)
    second = oai.chat.completions.with_raw_response.create(model="gpt-4o", messages=_user("once"), extra_headers=headers)
    assert second.headers["x-backstop-replayed"] == "true"
    assert second.parse().id == first.parse().id
    assert backstop.attempts(scenario) == 1
    with pytest.raises(openai.UnprocessableEntityError) as err:
        oai.chat.completions.create(model="gpt-4o", messages=_user("something else"), extra_headers=headers)
    assert err.value.code == "idempotency_key_reused"


def test_a_stuck_loop_is_stopped_with_a_typed_error(backstop, scenario):
    client = openai.OpenAI(api_key=GUARDED_KEY, base_url=backstop.openai_base_url, timeout=20)
    headers = {"x-mock-scenario": scenario, "x-session-id": scenario, "x-mock-fault": "status=400;code=context_length_exceeded"}
    for i in range(3):
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model="gpt-4o", messages=_user(f"compact {i}"), extra_headers=headers)
    with pytest.raises(openai.RateLimitError) as err:
        client.chat.completions.create(model="gpt-4o", messages=_user("compact again"), extra_headers=headers)
    assert err.value.code == "session_tripped"
    # The provider refused it the same way three times: unrecoverable, with a diagnosis.
    assert "session_tripped (unrecoverable)" in err.value.message
    assert "3 times in a row" in err.value.message
    assert "suggested fix: the conversation is longer than the model's context" in err.value.message
    assert err.value.response.headers["x-should-retry"] == "false"
    assert backstop.attempts(scenario) == 3
    client.close()

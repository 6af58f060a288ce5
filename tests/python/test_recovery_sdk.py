"""Recovery seen through the official SDKs at their *default* retry settings.

The SDKs retry twice by default. Backstop marks every response it already retried (or
refused on purpose) with `x-should-retry: false`, which both SDKs obey, so one SDK call
against an always-failing upstream costs exactly max_attempts x targets upstream calls
(3 x 2 = 6 here), not three times that.
"""

from __future__ import annotations

import time

import anthropic
import openai
import pytest

from backstop_support import TENANT_A_KEY

MAX_ATTEMPTS = 3
TARGETS = 2


@pytest.fixture
def oai_default(backstop):
    client = openai.OpenAI(api_key=TENANT_A_KEY, base_url=backstop.openai_base_url, timeout=20)
    assert client.max_retries == 2, "this test is about the SDK's default retries"
    yield client
    client.close()


@pytest.fixture
def anth_default(backstop):
    client = anthropic.Anthropic(api_key=TENANT_A_KEY, base_url=backstop.anthropic_base_url, timeout=20)
    assert client.max_retries == 2, "this test is about the SDK's default retries"
    yield client
    client.close()


def _user(text):
    return [{"role": "user", "content": text}]


def test_openai_sdk_default_retries_do_not_amplify(backstop, oai_default, scenario):
    with pytest.raises(openai.APIStatusError) as err:
        oai_default.chat.completions.create(
            model="storm-gpt", messages=_user("hi"),
            extra_headers={"x-mock-scenario": scenario, "x-mock-fault": "status=503"},
        )
    assert err.value.status_code == 503
    headers = err.value.response.headers
    assert headers["x-should-retry"] == "false"
    assert headers["x-backstop-attempts"] == str(MAX_ATTEMPTS * TARGETS)
    assert headers["x-backstop-recovery"] == (
        "retry:503,retry:503,giveup:503,failover:storm-b,retry:503,retry:503,giveup:503"
    )
    assert backstop.attempts(scenario) == MAX_ATTEMPTS * TARGETS


def test_anthropic_sdk_default_retries_do_not_amplify(backstop, anth_default, scenario):
    with pytest.raises(anthropic.APIStatusError) as err:
        anth_default.messages.create(
            model="storm-claude", max_tokens=16, messages=_user("hi"),
            extra_headers={"x-mock-scenario": scenario, "x-mock-fault": "status=529"},
        )
    assert err.value.status_code == 529
    assert err.value.response.headers["x-should-retry"] == "false"
    assert err.value.body["error"]["type"] == "overloaded_error"
    assert backstop.attempts(scenario) == MAX_ATTEMPTS * TARGETS


def test_openai_sdk_sees_one_success_after_backstop_retries(backstop, oai_default, scenario):
    raw = oai_default.chat.completions.with_raw_response.create(
        model="storm-gpt", messages=_user("recover"),
        extra_headers={"x-mock-scenario": scenario, "x-mock-fault": "status=503,reset,ok"},
    )
    assert raw.status_code == 200
    assert raw.headers["x-backstop-recovery"] == "retry:503,retry:reset,ok"
    assert raw.headers["x-backstop-attempts"] == "3"
    assert raw.parse().choices[0].message.content == "mock: recover"
    assert backstop.attempts(scenario) == 3


def test_anthropic_stream_recovers_before_its_first_byte(backstop, anth_default, scenario):
    with anth_default.messages.stream(
        model="storm-claude", max_tokens=16, messages=_user("stream me"),
        extra_headers={"x-mock-scenario": scenario, "x-mock-fault": "status=529,cut=0,ok"},
    ) as stream:
        text = "".join(stream.text_stream)
    assert text == "mock: stream me"
    assert backstop.attempts(scenario) == 3


def test_quota_is_not_retried_and_fails_over(backstop, oai_default, scenario):
    # insufficient_quota arrives as 429 but is a quota fault: one attempt per target,
    # and each target's breaker opens at once (so this test has a route of its own).
    with pytest.raises(openai.RateLimitError) as err:
        oai_default.chat.completions.create(
            model="quota-gpt", messages=_user("hi"),
            extra_headers={"x-mock-scenario": scenario, "x-mock-fault": "status=429;code=insufficient_quota"},
        )
    assert err.value.code == "insufficient_quota"
    assert err.value.response.headers["x-backstop-recovery"] == "giveup:429,failover:quota-b,giveup:429"
    assert backstop.attempts(scenario) == TARGETS


def test_long_retry_after_fails_fast_with_the_upstreams_retry_after(backstop, oai_default, scenario):
    started = time.monotonic()
    with pytest.raises(openai.RateLimitError) as err:
        oai_default.chat.completions.create(
            model="storm-gpt", messages=_user("hi"),
            extra_headers={"x-mock-scenario": scenario, "x-mock-fault": "status=429;retry_after=30"},
        )
    assert time.monotonic() - started < 5, "Backstop (or the SDK) waited out a 30 s Retry-After"
    assert err.value.response.headers["retry-after"] == "30"
    assert err.value.response.headers["x-should-retry"] == "false"
    # Too long to wait on the first target, so the second is tried at once; same answer.
    assert backstop.attempts(scenario) == TARGETS


def test_caller_faults_are_not_retried(backstop, oai_default, scenario):
    with pytest.raises(openai.BadRequestError) as err:
        oai_default.chat.completions.create(
            model="storm-gpt", messages=_user("hi"),
            extra_headers={"x-mock-scenario": scenario, "x-mock-fault": "status=400;code=context_length_exceeded"},
        )
    assert err.value.code == "context_length_exceeded"
    assert err.value.response.headers["x-backstop-recovery"] == "pass:400"
    assert backstop.attempts(scenario) == 1

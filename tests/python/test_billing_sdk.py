"""Money as the provider bills it, seen through the official SDKs: a prompt-cached Claude
turn and a cached OpenAI prompt are charged what the providers bill for them (every token
kind at its own price, from the built-in catalog), whole and streamed; a model nothing
prices is refused under a USD cap in the SDK's own error shape, before any attempt.

Dollars are worked out by hand from the price sheets (USD per million tokens): Claude
Sonnet 4.5 input 3, 5-minute cache write 3.75, cache read 0.30, output 15; gpt-4o input
2.50, cached input 1.25, output 10.
"""

from __future__ import annotations

import base64
import json

import anthropic
import openai
import pytest

from backstop_support import BILLED_KEY


def _reporting(usage: dict) -> str:
    return "usage_b64=" + base64.b64encode(json.dumps(usage).encode()).decode()


# Input 100, cache write 20,000, cache read 80,000, output 500:
# 100 × 3 + 20,000 × 3.75 + 80,000 × 0.30 + 500 × 15 = $0.1068.
CACHING_TURN = {"input_tokens": 100, "cache_creation_input_tokens": 20000,
                "cache_read_input_tokens": 80000, "output_tokens": 500}


def _settled(backstop, session: str) -> dict:
    return backstop.session_used(session, lambda used: used["calls"] >= 1, key=BILLED_KEY)


@pytest.mark.parametrize("stream", [False, True])
def test_a_cached_claude_turn_is_charged_what_anthropic_bills(backstop, scenario, stream):
    client = anthropic.Anthropic(api_key=BILLED_KEY, base_url=backstop.anthropic_base_url, timeout=20)
    headers = {"x-mock-scenario": scenario, "x-session-id": scenario,
               "x-mock-fault": _reporting(CACHING_TURN)}
    kwargs = dict(
        model="claude-sonnet-4-5", max_tokens=256, extra_headers=headers,
        system=[{"type": "text", "text": "You are a careful agent.", "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": "hi"}],
    )
    if stream:
        with client.messages.stream(**kwargs) as events:
            message = events.get_final_message()
    else:
        message = client.messages.create(**kwargs)
    assert message.usage.cache_read_input_tokens == 80000
    assert message.usage.cache_creation_input_tokens == 20000
    used = _settled(backstop, scenario)
    assert used["usd"] == pytest.approx(0.1068, abs=1e-9), used
    assert used["tokens"] == 100600, used
    client.close()


@pytest.mark.parametrize("stream", [False, True])
def test_cached_openai_input_is_charged_at_the_cached_price(backstop, scenario, stream):
    client = openai.OpenAI(api_key=BILLED_KEY, base_url=backstop.openai_base_url, timeout=20)
    usage = {"prompt_tokens": 10000, "completion_tokens": 100, "total_tokens": 10100,
             "prompt_tokens_details": {"cached_tokens": 8000}}
    headers = {"x-mock-scenario": scenario, "x-session-id": scenario, "x-mock-fault": _reporting(usage)}
    if stream:
        chunks = client.chat.completions.create(
            model="gpt-4o", max_tokens=100, messages=[{"role": "user", "content": "hi"}],
            stream=True, stream_options={"include_usage": True}, extra_headers=headers)
        last = [c for c in chunks][-1]
        assert last.usage.prompt_tokens_details.cached_tokens == 8000
    else:
        answer = client.chat.completions.create(
            model="gpt-4o", max_tokens=100, messages=[{"role": "user", "content": "hi"}], extra_headers=headers)
        assert answer.usage.prompt_tokens_details.cached_tokens == 8000
    # 2,000 × 2.50 + 8,000 × 1.25 + 100 × 10 = $0.016 (not $0.026: the cache at full price).
    used = _settled(backstop, scenario)
    assert used["usd"] == pytest.approx(0.016, abs=1e-9), used
    client.close()


def test_an_unpriced_model_is_refused_under_a_usd_cap_in_each_sdks_shape(backstop, scenario):
    oai = openai.OpenAI(api_key=BILLED_KEY, base_url=backstop.openai_base_url, timeout=20)
    headers = {"x-mock-scenario": scenario, "x-session-id": scenario}
    with pytest.raises(openai.APIStatusError) as err:
        oai.chat.completions.create(model="gpt-nobody-prices", messages=[{"role": "user", "content": "hi"}],
                                    extra_headers=headers)
    assert err.value.status_code == 402
    assert err.value.code == "unpriced_model"
    assert "gpt-nobody-prices" in err.value.message
    assert err.value.response.headers["x-should-retry"] == "false"
    anth = anthropic.Anthropic(api_key=BILLED_KEY, base_url=backstop.anthropic_base_url, timeout=20)
    with pytest.raises(anthropic.APIStatusError) as err:
        anth.messages.create(model="claude-mock-1", max_tokens=8, messages=[{"role": "user", "content": "hi"}],
                             extra_headers=headers)
    assert err.value.status_code == 402
    assert err.value.body["error"]["type"] == "unpriced_model"
    assert backstop.attempts(scenario) == 0, "refused before any attempt"
    oai.close()
    anth.close()

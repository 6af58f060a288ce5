"""Structured output through the official SDKs: `chat.completions.parse()` with a
pydantic model gets a valid, parsed answer even when the model first answers wrong."""

from __future__ import annotations

import base64
import json

import anthropic
import openai
import pytest
from pydantic import BaseModel

from backstop_support import TENANT_A_KEY


class Weather(BaseModel):
    city: str
    temp_c: float


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _script(*answers: str) -> str:
    return ",".join(f"content_b64={_b64(a)}" for a in answers)


def test_openai_parse_with_pydantic_gets_a_corrected_answer(backstop, oai, scenario):
    raw = oai.chat.completions.with_raw_response.parse(
        model="gpt-4o",
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        response_format=Weather,
        extra_headers={"x-mock-scenario": scenario, "x-mock-fault": _script('{"city": "Paris"}', '{"city": "Paris", "temp_c": 21.5}')},
    )
    assert raw.headers["x-backstop-recovery"] == "ok,correct:schema,ok"
    parsed = raw.parse().choices[0].message.parsed
    assert parsed == Weather(city="Paris", temp_c=21.5)
    assert backstop.attempts(scenario) == 2
    sent = backstop.last_upstream_request(scenario)["body"]
    assert sent["response_format"]["type"] == "json_schema"
    feedback = sent["messages"][-1]["content"]
    assert '/temp_c: "temp_c" is a required property' in feedback


def test_openai_parse_gets_502_output_invalid_when_corrections_run_out(backstop, oai, scenario):
    with pytest.raises(openai.APIStatusError) as err:
        oai.chat.completions.parse(
            model="gpt-4o",
            messages=[{"role": "user", "content": "Weather in Paris?"}],
            response_format=Weather,
            extra_headers={"x-mock-scenario": scenario, "x-mock-fault": _script("sunny, about 20 degrees")},
        )
    assert err.value.status_code == 502
    assert err.value.code == "output_invalid"
    assert err.value.response.headers["x-should-retry"] == "false"
    assert backstop.attempts(scenario) == 3  # the first answer + 2 corrective retries


def test_anthropic_tool_use_input_is_corrected(backstop, anth, scenario):
    tool = {"name": "get_weather", "input_schema": Weather.model_json_schema()}
    bad = json.dumps({"city": "Paris", "temp_c": "warm"})
    good = json.dumps({"city": "Paris", "temp_c": 19})
    fault = f"tool=get_weather;tool_args_b64={_b64(bad)},tool=get_weather;tool_args_b64={_b64(good)}"
    message = anth.messages.create(
        model="claude-x", max_tokens=64, tools=[tool],
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        extra_headers={"x-mock-scenario": scenario, "x-mock-fault": fault},
    )
    block = next(b for b in message.content if b.type == "tool_use")
    assert block.input == {"city": "Paris", "temp_c": 19}
    assert backstop.attempts(scenario) == 2


def test_no_format_means_no_validation(backstop, oai, scenario):
    completion = oai.chat.completions.create(
        model="gpt-4o", messages=[{"role": "user", "content": "hi"}],
        extra_headers={"x-mock-scenario": scenario, "x-mock-fault": _script("{ not json")},
    )
    assert completion.choices[0].message.content == "{ not json"
    assert backstop.attempts(scenario) == 1

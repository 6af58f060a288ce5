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


def test_anthropic_native_structured_output_is_corrected(backstop, anth, scenario):
    # `messages.parse(output_format=...)` sends `output_config.format` with the model's
    # JSON schema; the first answer breaks it, the correction is accepted.
    parsed = anth.messages.parse(
        model="claude-mock-1",
        max_tokens=256,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        output_format=Weather,
        extra_headers={"x-mock-scenario": scenario,
                       "x-mock-fault": _script('{"city": "Paris"}', '{"city": "Paris", "temp_c": 21.5}')},
    )
    assert parsed.parsed_output == Weather(city="Paris", temp_c=21.5)
    assert backstop.attempts(scenario) == 2
    sent = backstop.last_upstream_request(scenario)["body"]
    assert sent["output_config"]["format"]["type"] == "json_schema"
    assert sent["messages"][-2] == {"role": "assistant", "content": '{"city": "Paris"}'}
    assert "temp_c" in sent["messages"][-1]["content"]


def test_anthropic_output_config_dict_schema_runs_out_to_502(backstop, anth, scenario):
    with pytest.raises(anthropic.APIStatusError) as err:
        anth.messages.create(
            model="claude-mock-1",
            max_tokens=64,
            messages=[{"role": "user", "content": "Weather in Paris?"}],
            output_config={"format": {"type": "json_schema", "schema": Weather.model_json_schema()}},
            extra_headers={"x-mock-scenario": scenario, "x-mock-fault": _script("sunny, about 20 degrees")},
        )
    assert err.value.status_code == 502
    assert err.value.body["error"]["type"] == "output_invalid"
    assert backstop.attempts(scenario) == 3


def test_anthropic_structured_output_trail_and_validation_headers(backstop, scenario):
    body = {
        "model": "claude-mock-1", "max_tokens": 64,
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "output_format": {"type": "json_schema", "schema": Weather.model_json_schema()},
    }
    r = backstop.post("/v1/messages", json_body=body, headers={
        "x-api-key": TENANT_A_KEY, "anthropic-version": "2023-06-01", "x-mock-scenario": scenario,
        "x-mock-fault": _script("not json", '{"city": "Paris", "temp_c": 3}'),
    })
    assert r.status_code == 200, r.text
    assert r.headers["x-backstop-recovery"] == "ok,correct:json,ok"
    assert r.headers["x-backstop-validation"] == "corrected"
    assert json.loads(r.json()["content"][0]["text"]) == {"city": "Paris", "temp_c": 3}
    assert backstop.attempts(scenario) == 2

"""The OpenAI Responses API (`client.responses`) through Backstop, with the official SDK."""

from __future__ import annotations

import base64
import json

import openai
import pydantic
import pytest

from backstop_support import GUARDED_KEY, PROVIDER_OPENAI_KEY, TENANT_A_KEY, assert_no_tenant_key


def _hdrs(scenario: str, **extra: str) -> dict:
    return {"x-mock-scenario": scenario, **extra}


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}


def test_create_returns_a_text_answer(backstop, oai, scenario):
    response = oai.responses.create(
        model="gpt-4o",
        input="Hello from the Responses API",
        instructions="be brief",
        max_output_tokens=64,
        extra_headers=_hdrs(scenario),
    )
    assert response.object == "response"
    assert response.status == "completed"
    assert response.output_text == "mock: Hello from the Responses API"
    assert response.usage.input_tokens > 0
    assert response.usage.output_tokens > 0
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    assert backstop.attempts(scenario) == 1
    up = backstop.last_upstream_request(scenario)
    assert up["path"] == "/v1/responses"
    assert up["headers"]["authorization"] == f"Bearer {PROVIDER_OPENAI_KEY}"
    assert_no_tenant_key(up)
    assert up["body"]["instructions"] == "be brief"


def test_previous_response_id_and_store_pass_through(backstop, oai, scenario):
    oai.responses.create(
        model="gpt-4o",
        input="and then?",
        previous_response_id="resp_earlier_turn",
        store=False,
        extra_headers=_hdrs(scenario),
    )
    body = backstop.last_upstream_request(scenario)["body"]
    assert body["previous_response_id"] == "resp_earlier_turn"
    assert body["store"] is False


def test_stream_helper_delivers_events_and_final_usage(backstop, oai, scenario):
    with oai.responses.stream(
        model="gpt-4o",
        input="stream me",
        extra_headers=_hdrs(scenario, **{"x-mock-fault": "usage=21/9"}),
    ) as stream:
        kinds = []
        deltas = []
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = stream.get_final_response()
    assert kinds[0] == "response.created"
    assert kinds[-1] == "response.completed"
    assert "".join(deltas) == "mock: stream me"
    assert final.output_text == "mock: stream me"
    assert (final.usage.input_tokens, final.usage.output_tokens) == (21, 9)
    assert "stream_options" not in backstop.last_upstream_request(scenario)["body"]


def test_create_stream_true_yields_typed_events(backstop, oai, scenario):
    events = list(
        oai.responses.create(
            model="gpt-4o", input="raw stream", stream=True, extra_headers=_hdrs(scenario)
        )
    )
    assert [e.sequence_number for e in events] == list(range(len(events)))
    completed = events[-1]
    assert completed.type == "response.completed"
    assert completed.response.usage.total_tokens > 0


def test_streamed_usage_is_charged_to_the_session(backstop, oai, scenario):
    with oai.responses.stream(
        model="gpt-4o",
        input="count me",
        extra_headers=_hdrs(scenario, **{"x-mock-fault": "usage=70/30", "x-session-id": scenario}),
    ) as stream:
        stream.get_final_response()
    assert backstop.session_used(scenario, lambda used: used["tokens"] >= 100)["tokens"] == 100


def test_a_function_call_turn_with_the_output_fed_back(backstop, oai, scenario):
    args = json.dumps({"city": "Paris"})
    fault = f"tool=get_weather;tool_args_b64={_b64(args)},ok"
    first = oai.responses.create(
        model="gpt-4o",
        input=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER_TOOL],
        extra_headers=_hdrs(scenario, **{"x-mock-fault": fault}),
    )
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1
    call = calls[0]
    assert call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"}

    second = oai.responses.create(
        model="gpt-4o",
        input=[
            {"role": "user", "content": "What is the weather in Paris?"},
            call.model_dump(exclude_none=True),
            {"type": "function_call_output", "call_id": call.call_id, "output": "18C and sunny"},
        ],
        tools=[WEATHER_TOOL],
        extra_headers=_hdrs(scenario, **{"x-mock-fault": fault}),
    )
    assert second.output_text == "mock: What is the weather in Paris?"
    sent = backstop.last_upstream_request(scenario)["body"]["input"]
    assert sent[1]["type"] == "function_call"
    assert sent[2] == {"type": "function_call_output", "call_id": call.call_id, "output": "18C and sunny"}
    assert backstop.attempts(scenario) == 2


def test_a_503_then_ok_is_retried_once(backstop, oai, scenario):
    raw = oai.responses.with_raw_response.create(
        model="gpt-4o",
        input="retry me",
        extra_headers=_hdrs(scenario, **{"x-mock-fault": "status=503,ok"}),
    )
    assert raw.status_code == 200
    assert raw.headers["x-backstop-attempts"] == "2"
    assert raw.headers["x-backstop-recovery"] == "retry:503,ok"
    assert raw.parse().output_text == "mock: retry me"
    assert backstop.attempts(scenario) == 2


def test_an_invalid_max_output_tokens_is_refused_before_the_upstream(backstop, oai, scenario):
    with pytest.raises(openai.BadRequestError) as err:
        oai.responses.create(
            model="gpt-4o", input="x", max_output_tokens=-5, extra_headers=_hdrs(scenario)
        )
    assert err.value.code == "invalid_parameter"
    assert err.value.body["param"] == "max_output_tokens"
    assert backstop.attempts(scenario) == 0


class Weather(pydantic.BaseModel):
    city: str
    temp_c: float


def test_parse_with_a_pydantic_model_is_corrected_after_an_invalid_answer(backstop, oai, scenario):
    invalid = json.dumps({"city": "Rome"})
    valid = json.dumps({"city": "Rome", "temp_c": 31.5})
    raw = oai.responses.with_raw_response.parse(
        model="gpt-4o",
        input="The weather in Rome, as JSON.",
        text_format=Weather,
        extra_headers=_hdrs(scenario, **{"x-mock-fault": f"content_b64={_b64(invalid)},content_b64={_b64(valid)}"}),
    )
    assert raw.headers["x-backstop-validation"] == "corrected"
    parsed = raw.parse()
    assert parsed.output_parsed == Weather(city="Rome", temp_c=31.5)
    assert backstop.attempts(scenario) == 2
    correction = backstop.last_upstream_request(scenario)["body"]["input"]
    assert correction[0] == {"role": "user", "content": "The weather in Rome, as JSON."}
    assert correction[1] == {"role": "assistant", "content": invalid}
    assert "temp_c" in correction[2]["content"]


def test_invalid_function_call_arguments_are_corrected(backstop, oai, scenario):
    bad, good = json.dumps({"town": "Paris"}), json.dumps({"city": "Paris"})
    fault = f"tool=get_weather;tool_args_b64={_b64(bad)},tool=get_weather;tool_args_b64={_b64(good)}"
    raw = oai.responses.with_raw_response.create(
        model="gpt-4o", input="weather in Paris?", tools=[WEATHER_TOOL],
        extra_headers=_hdrs(scenario, **{"x-mock-fault": fault}),
    )
    assert raw.headers["x-backstop-validation"] == "corrected"
    call = raw.parse().output[0]
    assert call.type == "function_call"
    assert json.loads(call.arguments) == {"city": "Paris"}
    assert backstop.attempts(scenario) == 2


def test_stored_responses_are_retrieved_cancelled_listed_and_deleted(backstop, oai, oai_b, scenario):
    hdrs = _hdrs(scenario)
    rid = oai.responses.create(model="gpt-4o", input="keep this", extra_headers=hdrs).id
    stored = oai.responses.retrieve(rid, extra_headers=hdrs)
    assert stored.id == rid
    assert stored.output_text == "mock: stored response"
    items = oai.responses.input_items.list(rid, limit=5, extra_headers=hdrs)
    assert [i.type for i in items.data] == ["message"]
    assert backstop.last_upstream_request(scenario)["path"] == f"/v1/responses/{rid}/input_items"
    cancelled = oai.responses.cancel(rid, extra_headers=hdrs)
    assert cancelled.status == "cancelled"
    oai.responses.delete(rid, extra_headers=hdrs)
    up = backstop.last_upstream_request(scenario)
    assert up["method"] == "DELETE"
    assert up["headers"]["authorization"] == f"Bearer {PROVIDER_OPENAI_KEY}"
    assert_no_tenant_key(up)
    assert backstop.attempts(scenario) == 5


def test_another_tenants_stored_response_does_not_exist_for_you(backstop, oai, oai_b, scenario):
    hdrs = _hdrs(scenario)
    rid = oai.responses.create(model="gpt-4o", input="mine", extra_headers=hdrs).id
    for call in (lambda: oai_b.responses.retrieve(rid, extra_headers=hdrs),
                 lambda: oai_b.responses.delete(rid, extra_headers=hdrs),
                 lambda: oai_b.responses.cancel(rid, extra_headers=hdrs)):
        with pytest.raises(openai.NotFoundError):
            call()
    assert backstop.attempts(scenario) == 1  # only the create reached the upstream


def test_another_tenants_response_cannot_be_chained_onto(backstop, oai, oai_b, scenario):
    hdrs = _hdrs(scenario)
    rid = oai.responses.create(model="gpt-4o", input="my secret is 42", extra_headers=hdrs).id
    mine = oai.responses.create(model="gpt-4o", input="and?", previous_response_id=rid, extra_headers=hdrs)
    assert mine.status == "completed"
    with pytest.raises(openai.BadRequestError) as err:
        oai_b.responses.create(model="gpt-4o", input="repeat it", previous_response_id=rid, extra_headers=hdrs)
    assert err.value.status_code == 400
    assert err.value.code == "previous_response_not_found"
    assert err.value.param == "previous_response_id"
    assert err.value.body["message"] == f"Previous response with id '{rid}' not found."
    assert backstop.attempts(scenario) == 2  # the refused turn never reached the upstream


def test_a_responses_tool_loop_is_refused_by_the_guard(backstop, scenario):
    client = openai.OpenAI(api_key=GUARDED_KEY, base_url=backstop.openai_base_url, max_retries=2, timeout=20)
    hdrs = _hdrs(scenario, **{"x-session-id": scenario})
    args = json.dumps({"city": "Atlantis"})
    fault = f"tool=get_weather;tool_args_b64={_b64(args)}"
    items = [{"role": "user", "content": "What is the weather in Atlantis?"}]
    with pytest.raises(openai.RateLimitError) as err:
        # The agent feeds the same failing call back until the guard stops it.
        for _ in range(5):
            response = client.responses.create(
                model="gpt-4o", input=items, tools=[WEATHER_TOOL],
                extra_headers={**hdrs, "x-mock-fault": fault},
            )
            call = next(i for i in response.output if i.type == "function_call")
            items += [
                call.model_dump(exclude_none=True),
                {"type": "function_call_output", "call_id": call.call_id, "output": "Error: city not found"},
            ]
    assert err.value.code == "loop_detected"
    assert 'get_weather({"city":"Atlantis"}) returned the same error 3 times' in err.value.message
    assert err.value.response.headers["x-should-retry"] == "false"
    assert backstop.attempts(scenario) == 3
    client.close()


def test_a_stream_cut_midway_ends_with_an_error_event(backstop, oai, scenario):
    events = list(
        oai.responses.create(
            model="gpt-4o", input="cut me", stream=True,
            extra_headers=_hdrs(scenario, **{"x-mock-fault": "cut=4"}),
        )
    )
    assert events[0].type == "response.created"
    last = events[-1]
    assert last.type == "error"
    assert last.code == "upstream_stream_error"
    assert last.message
    assert backstop.attempts(scenario) == 1

"""The strategy switch across providers through the official SDKs: a route whose first
target is down and whose next target speaks the other API. The caller's SDK sees its own
API throughout; the mock upstream (strict: it refuses what the real APIs refuse) sees
the other one. `x-backstop-upstream` says who answered."""

from __future__ import annotations

import base64
import json

import openai
from pydantic import BaseModel

from backstop_support import TENANT_A_KEY

STRICT = {"x-mock-strict": "on"}


class Weather(BaseModel):
    city: str
    temp_c: float


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _headers(scenario: str, fault: str = "") -> dict:
    headers = {"x-mock-scenario": scenario, **STRICT}
    if fault:
        headers["x-mock-fault"] = fault
    return headers


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
ANTHROPIC_WEATHER_TOOL = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def _tool_call(city: str) -> str:
    return f"tool=get_weather;tool_args_b64={_b64(json.dumps({'city': city}))}"


# --- an OpenAI client, OpenAI down, answered by Anthropic -------------------------------


def test_openai_chat_is_answered_by_anthropic_when_openai_is_down(backstop, oai, scenario):
    raw = oai.chat.completions.with_raw_response.create(
        model="switch-gpt",
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}],
        extra_headers=_headers(scenario),
    )
    assert raw.headers["x-backstop-upstream"] == "mock-anthropic"
    assert raw.headers["x-backstop-model"] == "claude-switch"
    assert raw.headers["x-backstop-recovery"].endswith("failover:mock-anthropic,translate:chat->messages,ok")
    completion = raw.parse()
    assert completion.choices[0].message.content == "mock: hello"
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage.prompt_tokens > 0
    sent = backstop.last_upstream_request(scenario)
    assert sent["path"] == "/v1/messages"
    assert sent["body"]["system"] == "Be brief."
    assert sent["body"]["max_tokens"] == 1024


def test_openai_two_turn_tool_loop_runs_on_anthropic(backstop, oai, scenario):
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    first = oai.chat.completions.create(
        model="switch-gpt", messages=messages, tools=[WEATHER_TOOL],
        extra_headers=_headers(scenario, _tool_call("Paris")),
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    messages.append(choice.message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": "18C and sunny"})
    second = oai.chat.completions.create(
        model="switch-gpt", messages=messages, tools=[WEATHER_TOOL],
        extra_headers=_headers(scenario, "content=It is 18C in Paris."),
    )
    assert second.choices[0].message.content == "It is 18C in Paris."
    sent = backstop.last_upstream_request(scenario)["body"]
    tool_use = sent["messages"][1]["content"][-1]
    assert tool_use["type"] == "tool_use" and tool_use["input"] == {"city": "Paris"}
    result = sent["messages"][2]["content"][0]
    assert result == {"type": "tool_result", "tool_use_id": tool_use["id"], "content": "18C and sunny"}
    assert backstop.attempts(scenario) == 2


def test_openai_stream_with_tools_is_translated_from_anthropic_events(backstop, oai, scenario):
    stream = oai.chat.completions.create(
        model="switch-gpt", stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=[WEATHER_TOOL],
        extra_headers=_headers(scenario, _tool_call("Oslo") + ";chunks=5"),
    )
    arguments, name, finish, usage = "", None, None, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or []:
                assert call.index == 0
                name = call.function.name or name
                arguments += call.function.arguments or ""
            finish = choice.finish_reason or finish
    assert name == "get_weather"
    assert json.loads(arguments) == {"city": "Oslo"}
    assert finish == "tool_calls"
    assert usage is not None and usage.completion_tokens > 0


def test_openai_parse_is_corrected_once_on_anthropic(backstop, oai, scenario):
    fault = ",".join(f"content_b64={_b64(a)}" for a in ['{"city": "Paris"}', '{"city": "Paris", "temp_c": 21.5}'])
    raw = oai.chat.completions.with_raw_response.parse(
        model="switch-gpt",
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        response_format=Weather,
        extra_headers=_headers(scenario, fault),
    )
    assert raw.headers["x-backstop-upstream"] == "mock-anthropic"
    assert "correct:schema" in raw.headers["x-backstop-recovery"]
    assert raw.parse().choices[0].message.parsed == Weather(city="Paris", temp_c=21.5)
    assert backstop.attempts(scenario) == 2
    sent = backstop.last_upstream_request(scenario)["body"]
    assert sent["output_config"]["format"]["type"] == "json_schema"
    assert "temp_c" in json.dumps(sent["messages"][-1])


# --- an Anthropic client, Anthropic down, answered by OpenAI ----------------------------


def test_anthropic_messages_are_answered_by_openai_when_anthropic_is_down(backstop, anth, scenario):
    raw = anth.messages.with_raw_response.create(
        model="switch-claude", max_tokens=64, system="Be brief.",
        messages=[{"role": "user", "content": "hello"}],
        extra_headers=_headers(scenario),
    )
    assert raw.headers["x-backstop-upstream"] == "mock-openai"
    assert raw.headers["x-backstop-model"] == "gpt-switch"
    message = raw.parse()
    assert message.content[0].text == "mock: hello"
    assert message.stop_reason == "end_turn"
    assert message.usage.output_tokens > 0
    sent = backstop.last_upstream_request(scenario)
    assert sent["path"] == "/v1/chat/completions"
    assert sent["body"]["messages"][0] == {"role": "system", "content": "Be brief."}


def test_anthropic_two_turn_tool_loop_runs_on_openai(backstop, anth, scenario):
    messages = [{"role": "user", "content": "Weather in Rome?"}]
    first = anth.messages.create(
        model="switch-claude", max_tokens=128, tools=[ANTHROPIC_WEATHER_TOOL], messages=messages,
        extra_headers=_headers(scenario, _tool_call("Rome")),
    )
    assert first.stop_reason == "tool_use"
    use = next(b for b in first.content if b.type == "tool_use")
    assert use.input == {"city": "Rome"}
    messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]})
    messages.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "25C"}]})
    second = anth.messages.create(
        model="switch-claude", max_tokens=128, tools=[ANTHROPIC_WEATHER_TOOL], messages=messages,
        extra_headers=_headers(scenario, "content=It is 25C in Rome."),
    )
    assert second.content[0].text == "It is 25C in Rome."
    sent = backstop.last_upstream_request(scenario)["body"]
    assert sent["messages"][1]["tool_calls"][0]["id"] == sent["messages"][2]["tool_call_id"]
    assert sent["messages"][2]["content"] == "25C"


def test_anthropic_stream_with_tools_is_translated_from_chat_chunks(backstop, anth, scenario):
    with anth.messages.stream(
        model="switch-claude", max_tokens=128, tools=[ANTHROPIC_WEATHER_TOOL],
        messages=[{"role": "user", "content": "Weather in Lima?"}],
        extra_headers=_headers(scenario, _tool_call("Lima") + ";chunks=5"),
    ) as stream:
        message = stream.get_final_message()
    assert message.stop_reason == "tool_use"
    use = next(b for b in message.content if b.type == "tool_use")
    assert use.name == "get_weather" and use.input == {"city": "Lima"}


def test_anthropic_parse_is_corrected_once_on_openai(backstop, anth, scenario):
    fault = ",".join(f"content_b64={_b64(a)}" for a in ['{"city": "Paris"}', '{"city": "Paris", "temp_c": 21.5}'])
    parsed = anth.messages.parse(
        model="switch-claude", max_tokens=256,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        output_format=Weather,
        extra_headers=_headers(scenario, fault),
    )
    assert parsed.parsed_output == Weather(city="Paris", temp_c=21.5)
    assert backstop.attempts(scenario) == 2
    sent = backstop.last_upstream_request(scenario)["body"]
    assert sent["response_format"]["type"] == "json_schema"


# --- one conversation that switches provider between turns ------------------------------


def test_a_conversation_switches_provider_between_turns(backstop, oai, scenario):
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    # Turn 1: OpenAI is up and asks for a tool.
    first = oai.chat.completions.with_raw_response.create(
        model="switch-live", messages=messages, tools=[WEATHER_TOOL],
        extra_headers=_headers(scenario, _tool_call("Paris")),
    )
    assert first.headers["x-backstop-upstream"] == "mock-openai"
    choice = first.parse().choices[0]
    call = choice.message.tool_calls[0]
    messages.append(choice.message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": "18C"})
    # Turn 2 (a scenario of its own, so the script counts from its first attempt): OpenAI
    # is down; the tool result goes to Claude, with the same call id.
    turn2 = scenario + "-turn2"
    second = oai.chat.completions.with_raw_response.create(
        model="switch-live", messages=messages, tools=[WEATHER_TOOL],
        extra_headers=_headers(turn2, "status=503,status=503,status=503,content=18C in Paris."),
    )
    assert second.headers["x-backstop-upstream"] == "mock-anthropic"
    assert second.parse().choices[0].message.content == "18C in Paris."
    assert backstop.attempts(turn2) == 4
    sent = backstop.last_upstream_request(turn2)
    assert sent["path"] == "/v1/messages"
    use = sent["body"]["messages"][1]["content"][-1]
    result = sent["body"]["messages"][2]["content"][0]
    assert use["type"] == "tool_use" and result["tool_use_id"] == use["id"]


# --- the OpenAI Agents SDK over the Responses API, answered by Anthropic ----------------


def test_an_agents_sdk_runner_is_answered_by_anthropic_over_the_responses_api(backstop, scenario):
    from agents import (Agent, ModelSettings, RunConfig, Runner, function_tool,
                        set_default_openai_api, set_default_openai_client, set_tracing_disabled)
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    cities: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        cities.append(city)
        return f"18C and sunny in {city}"

    client = AsyncOpenAI(api_key=TENANT_A_KEY, base_url=backstop.openai_base_url, max_retries=0)
    set_default_openai_client(client, use_for_tracing=False)
    set_default_openai_api("responses")
    agent = Agent(name="weather", instructions="Answer with the weather.", tools=[get_weather])
    fault = _tool_call("Paris") + ",content=18C and sunny in Paris."
    settings = ModelSettings(extra_headers=_headers(scenario, fault), extra_body={"store": False})
    result = Runner.run_sync(agent, "What is the weather in Paris?",
                             run_config=RunConfig(model="switch-gpt", model_settings=settings))
    assert cities == ["Paris"]
    assert result.final_output == "18C and sunny in Paris."
    assert backstop.attempts(scenario) == 2
    sent = backstop.last_upstream_request(scenario)
    assert sent["path"] == "/v1/messages"
    assert sent["body"]["system"] == "Answer with the weather."
    results = [b for m in sent["body"]["messages"] for b in (m["content"] if isinstance(m["content"], list) else [])
               if b.get("type") == "tool_result"]
    assert results and "18C and sunny in Paris" in json.dumps(results[0])


def test_an_untranslatable_request_is_refused_out_loud(backstop, oai, scenario):
    # `claude-*` has only an Anthropic target: an OpenAI caller is translated, or refused.
    try:
        oai.chat.completions.create(
            model="claude-mock-1", n=2, max_tokens=10, messages=[{"role": "user", "content": "hi"}],
            extra_headers=_headers(scenario),
        )
    except openai.BadRequestError as err:
        assert err.code == "unsupported_conversion"
        assert "/n" in err.message
    else:
        raise AssertionError("n=2 has no Anthropic equivalent")
    assert backstop.attempts(scenario) == 0


# --- what real Anthropic clients send, across the switch (hardening v3, 15-17) -----------


def test_a_model_dump_round_trip_keeps_the_openai_target(backstop, anth, scenario):
    """The SDK's own `model_dump()` of its answer (`citations: None` on text, `caller:
    None` on tool_use where the SDK has it), then a tool result as langchain-anthropic and
    pydantic-ai send it (`is_error: False`). Before: the OpenAI target was skipped as
    untranslatable from the first tool call on."""
    messages = [{"role": "user", "content": "Weather in Rome?"}]
    first = anth.messages.create(
        model="switch-claude", max_tokens=128, tools=[ANTHROPIC_WEATHER_TOOL], messages=messages,
        extra_headers=_headers(scenario, "content=Let me look.;" + _tool_call("Rome")),
    )
    assert first.stop_reason == "tool_use"
    dumped = [b.model_dump() for b in first.content]
    assert any(v is None for block in dumped for v in block.values()), dumped
    use = next(b for b in first.content if b.type == "tool_use")
    messages.append({"role": "assistant", "content": dumped})
    messages.append({"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": use.id, "content": "25C", "is_error": False}]})
    raw = anth.messages.with_raw_response.create(
        model="switch-claude", max_tokens=128, tools=[ANTHROPIC_WEATHER_TOOL], messages=messages,
        extra_headers=_headers(scenario, "content=It is 25C in Rome."),
    )
    assert raw.headers["x-backstop-upstream"] == "mock-openai"
    assert raw.parse().content[0].text == "It is 25C in Rome."
    sent = backstop.last_upstream_request(scenario)["body"]
    assert sent["messages"][1]["content"] == "Let me look."
    assert sent["messages"][2] == {"role": "tool", "tool_call_id": sent["messages"][1]["tool_calls"][0]["id"], "content": "25C"}


def test_a_prompt_caching_agent_fails_over_with_its_cache_marks_dropped(backstop, anth, scenario):
    """`cache_control` on system blocks, tools and message blocks changes the price, never
    the answer: dropped in translation and named. Before: the OpenAI target was
    untranslatable, and `translate.drop` could not reach a block-level field."""
    cached = {"type": "ephemeral"}
    raw = anth.messages.with_raw_response.create(
        model="switch-claude", max_tokens=64,
        system=[{"type": "text", "text": "You are a careful agent.", "cache_control": cached}],
        tools=[{**ANTHROPIC_WEATHER_TOOL, "cache_control": cached}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "hello", "cache_control": cached}]}],
        extra_headers=_headers(scenario),
    )
    assert raw.headers["x-backstop-upstream"] == "mock-openai"
    assert raw.headers["x-backstop-translation-dropped"] == "cache_control"
    assert raw.parse().content[0].text == "mock: hello"
    sent = backstop.last_upstream_request(scenario)["body"]
    assert "cache_control" not in json.dumps(sent)


def test_a_refusal_names_the_targets_it_skipped_and_why(backstop, anth, scenario):
    """The live OpenAI target cannot take `top_k`; the Claude target is down. Before: the
    dead provider's error (or `circuit_open`) alone, the healthy target never mentioned."""
    import anthropic

    try:
        anth.messages.create(
            model="switch-claude", max_tokens=64, extra_body={"top_k": 5},
            messages=[{"role": "user", "content": "hello"}],
            extra_headers=_headers(scenario),
        )
    except anthropic.APIStatusError as err:
        assert err.status_code in (502, 503), err
        message = err.body["error"]["message"]
        assert "not tried, the request cannot be translated for them: mock-openai: /top_k" in message, message
    else:
        raise AssertionError("the only live target cannot take top_k")
    assert backstop.attempts(scenario) == 0

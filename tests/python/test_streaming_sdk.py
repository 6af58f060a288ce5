"""Streams with tools, through the SDKs' own stream helpers: a streamed tool call whose
arguments break the tool's schema is corrected and the helper assembles the valid call;
text already streamed stays; an Anthropic thinking block and its signature arrive
unchanged and are accepted on the next turn."""

from __future__ import annotations

import base64
import json

import anthropic
import pytest

from backstop_support import httpx


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}
BAD, GOOD = '{"town": "Paris"}', '{"city": "Paris"}'


def _tool_script(first_args: str, then_args: str, lead: str | None = None) -> str:
    lead_token = f";content_b64={_b64(lead)}" if lead else ""
    return (
        f"tool=get_weather;tool_args_b64={_b64(first_args)}{lead_token},"
        f"tool=get_weather;tool_args_b64={_b64(then_args)}"
    )


def test_openai_chat_stream_helper_assembles_the_corrected_tool_call(backstop, oai, scenario):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
    with oai.chat.completions.stream(
        model="gpt-4o",
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=tools,
        extra_headers={"x-mock-scenario": scenario, "x-mock-fault": _tool_script(BAD, GOOD)},
    ) as stream:
        seen_args = "".join(
            e.arguments_delta for e in stream if e.type == "tool_calls.function.arguments.delta"
        )
        final = stream.get_final_completion()
    call = final.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert "town" not in seen_args
    assert backstop.attempts(scenario) == 2
    sent = backstop.last_upstream_request(scenario)["body"]
    assert sent["stream"] is True
    assert "/city" in sent["messages"][-1]["content"]


def test_openai_text_already_streamed_stays_and_only_the_corrected_call_follows(backstop, oai, scenario):
    """The first attempt's text reached the client before its tool call was refused: the
    corrective attempt's text is not streamed again, only its (valid) call."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
    with oai.chat.completions.stream(
        model="gpt-4o",
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=tools,
        extra_headers={
            "x-mock-scenario": scenario,
            "x-mock-fault": f"tool=get_weather;tool_args_b64={_b64(BAD)};content=Let me check.,"
            f"tool=get_weather;tool_args_b64={_b64(GOOD)};content=Checking again.",
        },
    ) as stream:
        final = stream.get_final_completion()
    message = final.choices[0].message
    assert message.content == "Let me check."
    assert len(message.tool_calls) == 1
    assert json.loads(message.tool_calls[0].function.arguments) == {"city": "Paris"}
    assert final.choices[0].finish_reason == "tool_calls"
    assert backstop.attempts(scenario) == 2


def test_responses_stream_helper_gets_the_corrected_function_call(backstop, oai, scenario):
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER, "strict": False}]
    with oai.responses.stream(
        model="gpt-4o",
        input="Weather in Paris?",
        tools=tools,
        extra_headers={"x-mock-scenario": scenario, "x-mock-fault": _tool_script(BAD, GOOD, lead="Let me check.")},
    ) as stream:
        for _ in stream:
            pass
        final = stream.get_final_response()
    kinds = [item.type for item in final.output]
    assert kinds == ["message", "function_call"], kinds
    assert final.output[0].content[0].text == "Let me check."
    assert json.loads(final.output[1].arguments) == {"city": "Paris"}
    assert backstop.attempts(scenario) == 2


def test_anthropic_stream_helper_gets_the_corrected_tool_use(backstop, anth, scenario):
    tools = [{"name": "get_weather", "input_schema": WEATHER}]
    with anth.messages.stream(
        model="claude-mock-1",
        max_tokens=256,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=tools,
        extra_headers={"x-mock-scenario": scenario, "x-mock-fault": _tool_script(BAD, GOOD, lead="Let me check.")},
    ) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["text", "tool_use"]
    assert final.content[0].text == "Let me check."
    assert final.content[1].input == {"city": "Paris"}
    assert final.stop_reason == "tool_use"
    assert backstop.attempts(scenario) == 2


def test_anthropic_thinking_block_and_signature_reach_the_client_unchanged(backstop, anth, scenario):
    tools = [{"name": "get_weather", "input_schema": WEATHER}]
    fault = f"thinking=I should call the tool;tool=get_weather;tool_args_b64={_b64(GOOD)}"
    direct = httpx.post(
        f"{backstop.mock_url}/v1/messages",
        json={"model": "claude-mock-1", "max_tokens": 256, "messages": [{"role": "user", "content": "Paris?"}], "tools": tools},
        headers={"x-mock-fault": fault},
        timeout=10,
    ).json()
    with anth.messages.stream(
        model="claude-mock-1",
        max_tokens=256,
        messages=[{"role": "user", "content": "Paris?"}],
        tools=tools,
        extra_headers={"x-mock-scenario": scenario, "x-mock-fault": fault},
    ) as stream:
        final = stream.get_final_message()
    thinking = final.content[0]
    assert thinking.type == "thinking"
    assert thinking.model_dump(exclude_none=True) == direct["content"][0]
    # The next turn of the tool loop sends the block back; the mock checks the signature
    # the way Claude does.
    tool_use = final.content[1]
    follow_up = anth.messages.create(
        model="claude-mock-1",
        max_tokens=256,
        tools=tools,
        messages=[
            {"role": "user", "content": "Paris?"},
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in final.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_use.id, "content": "21C"}]},
        ],
        extra_headers={"x-mock-scenario": scenario + "-next"},
    )
    assert follow_up.stop_reason == "end_turn"
    # A tampered block is refused, so the check above can fail.
    tampered = dict(thinking.model_dump(exclude_none=True), thinking="something else")
    with pytest.raises(anthropic.BadRequestError):
        anth.messages.create(
            model="claude-mock-1",
            max_tokens=256,
            tools=tools,
            messages=[
                {"role": "user", "content": "Paris?"},
                {"role": "assistant", "content": [tampered, tool_use.model_dump(exclude_none=True)]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_use.id, "content": "21C"}]},
            ],
            extra_headers={"x-mock-scenario": scenario + "-tampered"},
        )


def test_openai_reasoning_content_and_unknown_fields_pass_through(backstop, oai, scenario):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
    stream = oai.chat.completions.create(
        model="gpt-4o",
        messages=[{"role": "user", "content": "Weather?"}],
        tools=tools,
        stream=True,
        extra_headers={"x-mock-scenario": scenario, "x-mock-fault": "reasoning=thinking hard;future;content=Sunny."},
    )
    chunks = [c.model_dump() for c in stream]
    reasoning = "".join((c["choices"][0]["delta"].get("reasoning_content") or "") for c in chunks if c["choices"])
    assert reasoning == "thinking hard"
    assert all(c.get("x_future") == {"n": 1} for c in chunks), chunks[0]
    assert all(c.get("service_tier") == "default" for c in chunks)


def _chat_sse(calls: list[tuple[str, str]]) -> str:
    """A chat stream (raw SSE, base64 for the mock's `events_b64`) making these calls of
    get_weather, one after another: (call id, arguments)."""
    chunk = lambda delta, finish=None: "data: " + json.dumps(  # noqa: E731
        {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 0, "model": "gpt-4o",
         "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    ) + "\n\n"
    events = [chunk({"role": "assistant", "content": None})]
    for index, (call_id, args) in enumerate(calls):
        events.append(chunk({"tool_calls": [{"index": index, "id": call_id, "type": "function",
                                             "function": {"name": "get_weather", "arguments": ""}}]}))
        events.append(chunk({"tool_calls": [{"index": index, "function": {"arguments": args}}]}))
    events.append(chunk({}, "tool_calls"))
    events.append("data: [DONE]\n\n")
    return _b64("".join(events))


def test_a_corrective_attempt_repeating_a_call_already_sent_does_not_send_it_twice(backstop, oai, scenario):
    """The first attempt's valid call 0 reached the client before its call 1 was refused;
    the corrective attempt repeats call 0 and fixes call 1: the client gets call 0 once and
    the fixed call after it, at the next index."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
    first = _chat_sse([("call_a", GOOD), ("call_b", BAD)])
    again = _chat_sse([("call_c", GOOD), ("call_d", '{"city": "Lyon"}')])
    with oai.chat.completions.stream(
        model="gpt-4o",
        messages=[{"role": "user", "content": "Weather in Paris and Lyon?"}],
        tools=tools,
        extra_headers={"x-mock-scenario": scenario,
                       "x-mock-fault": f"events_b64={first},events_b64={again}"},
    ) as stream:
        final = stream.get_final_completion()
    calls = final.choices[0].message.tool_calls
    assert [(c.id, json.loads(c.function.arguments)) for c in calls] == [
        ("call_a", {"city": "Paris"}),
        ("call_d", {"city": "Lyon"}),
    ]
    assert final.choices[0].finish_reason == "tool_calls"
    assert backstop.attempts(scenario) == 2

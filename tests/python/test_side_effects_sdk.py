"""Side effects committed once, through the official SDKs: a session's results for its
tenant's side-effecting tools are journaled, and a replanned agent whose model proposes
the same call again (same tool, same arguments in any key order) is corrected once
(`effects`), refused with 409 `duplicate_side_effect` in its API's error shape
(`effects-refuse`), or passed through marked (`effects-annotate`). A failed side effect,
other arguments, an unlisted tool and a declared repeat are passed through.

Every test names what the mock received: how many attempts, and what the corrective one
said to the model.
"""

from __future__ import annotations

import base64
import json

import anthropic
import openai
import pytest

from backstop_support import (
    EFFECTS_ANNOTATE_KEY,
    EFFECTS_KEY,
    EFFECTS_REFUSE_KEY,
    EFFECTS_RESTORE_KEY,
    TENANT_B_KEY,
)

BOB = {"to": "bob@example.com", "subject": "invoice", "body": "attached"}
# The same arguments in another key order: the same side effect.
BOB_REORDERED = {"body": "attached", "subject": "invoice", "to": "bob@example.com"}


def _b64(value) -> str:
    return base64.b64encode(json.dumps(value).encode()).decode()


def _proposes(tool: str, args: dict) -> str:
    return f"tool={tool};tool_args_b64={_b64(args)}"


def _chat_client(backstop, key: str) -> openai.OpenAI:
    return openai.OpenAI(api_key=key, base_url=backstop.openai_base_url, max_retries=0, timeout=20)


def _headers(scenario: str, session: str, fault: str, **extra) -> dict:
    return {"x-mock-scenario": scenario, "x-session-id": session, "x-mock-fault": fault, **extra}


def _chat_turn_that_sent(call_id: str, args: dict, result: str) -> list[dict]:
    """A chat conversation whose agent already ran `send_email(args)` and fed back `result`."""
    return [
        {"role": "user", "content": "Email Bob the invoice."},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function",
             "function": {"name": "send_email", "arguments": json.dumps(args)}}]},
        {"role": "tool", "tool_call_id": call_id, "content": result},
    ]


TOOLS = [{"type": "function", "function": {"name": "send_email", "parameters": {"type": "object"}}},
         {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def _journal(backstop, session: str, key: str):
    return backstop.get(f"/v1/sessions/{session}/journal", headers={"authorization": f"Bearer {key}"})


CLAUDE_TOOLS = [{"name": "send_email", "input_schema": {"type": "object"}}]
RESPONSES_TOOLS = [{"type": "function", "name": "send_email", "parameters": {"type": "object"}}]


def _claude(backstop, key: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(api_key=key, base_url=backstop.anthropic_base_url, max_retries=0, timeout=20)


def _claude_turn_that_sent(call_id: str, result: str, is_error: bool = False) -> list[dict]:
    """An Anthropic conversation whose agent already ran `send_email(BOB)` and fed back `result`."""
    block = {"type": "tool_result", "tool_use_id": call_id, "content": result}
    if is_error:
        block["is_error"] = True
    return [
        {"role": "user", "content": "Email Bob the invoice."},
        {"role": "assistant", "content": [{"type": "tool_use", "id": call_id, "name": "send_email", "input": BOB}]},
        {"role": "user", "content": [block]},
    ]


def _commit_in_claude(client, scenario, session):
    """The Anthropic turn that feeds back the first send (`toolu_first`): journaled."""
    client.messages.create(model="claude-sonnet-4-5", max_tokens=100, tools=CLAUDE_TOOLS,
                           messages=_claude_turn_that_sent("toolu_first", "sent"),
                           extra_headers=_headers(scenario + "-commit", session, "content=done"))


def _commit_in_responses(client, scenario, session):
    """The Responses turn that feeds back the first send (`call_first`): journaled."""
    client.responses.create(
        model="gpt-4o-mini", tools=RESPONSES_TOOLS,
        input=[{"role": "user", "content": "Email Bob."},
               {"type": "function_call", "call_id": "call_first", "name": "send_email", "arguments": json.dumps(BOB)},
               {"type": "function_call_output", "call_id": "call_first", "output": "sent"}],
        extra_headers=_headers(scenario + "-commit", session, "content=done"))


def _commit_in_chat(backstop, client, scenario, session, result="sent: message 42"):
    """The turn that feeds back the first send: journaled, answered with text."""
    client.chat.completions.create(
        model="gpt-4o-mini", messages=_chat_turn_that_sent("call_first", BOB, result), tools=TOOLS,
        extra_headers=_headers(scenario + "-commit", session, "content=done"))


def test_a_replanned_chat_agent_is_corrected_once_and_never_sees_the_repeat(backstop, scenario):
    client = _chat_client(backstop, EFFECTS_KEY)
    session = scenario
    _commit_in_chat(backstop, client, scenario, session)
    journal = _journal(backstop, session, EFFECTS_KEY)
    assert journal.status_code == 200, journal.text
    entries = journal.json()["entries"]
    assert [(e["call_id"], e["tool"], e["outcome"]) for e in entries] == [("call_first", "send_email", "ok")]
    assert entries[0]["arguments"] == json.dumps(BOB, sort_keys=True, separators=(",", ":"))
    assert entries[0]["result"] == "sent: message 42"

    # The agent lost its state and starts over: the model proposes the same email.
    raw = client.chat.completions.with_raw_response.create(
        model="gpt-4o-mini", messages=[{"role": "user", "content": "Email Bob the invoice."}], tools=TOOLS,
        extra_headers=_headers(scenario, session, f"{_proposes('send_email', BOB_REORDERED)},content=Bob already has it."))
    answer = raw.parse()
    assert answer.choices[0].message.tool_calls is None, "the repeat never reaches the agent"
    assert answer.choices[0].message.content == "Bob already has it."
    assert raw.headers["x-backstop-side-effect"] == "corrected; tool=send_email"
    assert "repeat:send_email@call_first" in raw.headers["x-backstop-recovery"]
    assert backstop.attempts(scenario) == 2, "the answer, then one corrective attempt"
    sent = backstop.last_upstream_request(scenario)["body"]["messages"]
    assert sent[-2]["role"] == "assistant" and "send_email" in sent[-2]["content"]
    note = sent[-1]["content"]
    assert sent[-1]["role"] == "user"
    assert "call_first" in note and "sent: message 42" in note and "Do not call `send_email`" in note
    again = _journal(backstop, session, EFFECTS_KEY).json()["entries"]
    assert [e["repeats"] for e in again if e["call_id"] == "call_first"] == [1]


def test_a_model_that_proposes_the_repeat_again_after_the_correction_is_refused(backstop, scenario):
    client = _chat_client(backstop, EFFECTS_KEY)
    session = scenario
    _commit_in_chat(backstop, client, scenario, session)
    twice = f"{_proposes('send_email', BOB)},{_proposes('send_email', BOB)}"
    with pytest.raises(openai.ConflictError) as caught:
        client.chat.completions.create(
            model="gpt-4o-mini", messages=[{"role": "user", "content": "Email Bob the invoice."}],
            tools=TOOLS, extra_headers=_headers(scenario, session, twice))
    err = caught.value
    assert err.status_code == 409
    assert err.body["code"] == "duplicate_side_effect" and err.body["type"] == "invalid_request_error"
    assert "send_email" in err.body["message"] and "call_first" in err.body["message"]
    assert backstop.attempts(scenario) == 2


@pytest.mark.parametrize("case", ["other_arguments", "unlisted_tool", "declared_repeat", "failed_before"])
def test_what_is_not_a_committed_repeat_is_passed_on(backstop, scenario, case):
    client = _chat_client(backstop, EFFECTS_KEY)
    session = scenario
    result = '{"error": "smtp unavailable"}' if case == "failed_before" else "sent"
    _commit_in_chat(backstop, client, scenario, session, result=result)
    tool, args, extra = "send_email", BOB, {}
    if case == "other_arguments":
        args = {**BOB, "to": "carol@example.com"}
    elif case == "unlisted_tool":
        tool = "get_weather"
    elif case == "declared_repeat":
        extra = {"x-backstop-allow-repeat": "send_email"}
    raw = client.chat.completions.with_raw_response.create(
        model="gpt-4o-mini", messages=[{"role": "user", "content": "Email Bob the invoice."}], tools=TOOLS,
        extra_headers=_headers(scenario, session, _proposes(tool, args), **extra))
    call = raw.parse().choices[0].message.tool_calls[0]
    assert (call.function.name, json.loads(call.function.arguments)) == (tool, args)
    assert "x-backstop-side-effect" not in raw.headers
    assert backstop.attempts(scenario) == 1
    entries = _journal(backstop, session, EFFECTS_KEY).json()["entries"]
    first = [e for e in entries if e["call_id"] == "call_first"][0]
    assert first["outcome"] == ("error" if case == "failed_before" else "ok")
    assert first["deliberate_repeats"] == (1 if case == "declared_repeat" else 0)


def test_an_anthropic_repeat_is_refused_in_anthropics_error_shape(backstop, scenario):
    client = _claude(backstop, EFFECTS_REFUSE_KEY)
    session = scenario
    _commit_in_claude(client, scenario, session)
    with pytest.raises(anthropic.ConflictError) as caught:
        client.messages.create(
            model="claude-sonnet-4-5", max_tokens=100, tools=CLAUDE_TOOLS,
            messages=[{"role": "user", "content": "Email Bob the invoice."}],
            extra_headers=_headers(scenario, session, _proposes("send_email", BOB_REORDERED)))
    err = caught.value
    assert err.status_code == 409
    assert err.body["type"] == "error" and err.body["error"]["type"] == "invalid_request_error"
    assert "toolu_first" in err.body["error"]["message"]
    assert "which succeeded" in err.body["error"]["message"], "record = hash quotes no result"
    assert backstop.attempts(scenario) == 1, "refused: no corrective attempt"
    entry = _journal(backstop, session, EFFECTS_REFUSE_KEY).json()["entries"][0]
    assert entry["arguments"] is None and entry["result"] is None and len(entry["arguments_hash"]) == 64


def test_an_anthropic_failed_result_is_not_committed(backstop, scenario):
    client = _claude(backstop, EFFECTS_REFUSE_KEY)
    session = scenario
    failed_turn = _claude_turn_that_sent("toolu_failed", "mailbox full", is_error=True)
    answer = client.messages.create(
        model="claude-sonnet-4-5", max_tokens=100, messages=failed_turn, tools=CLAUDE_TOOLS,
        extra_headers=_headers(scenario, session, _proposes("send_email", BOB)))
    assert answer.content[-1].type == "tool_use", "a failed side effect may be retried"
    entry = _journal(backstop, session, EFFECTS_REFUSE_KEY).json()["entries"]
    assert [(e["call_id"], e["outcome"]) for e in entry if e["call_id"] == "toolu_failed"] == [("toolu_failed", "error")]


def test_a_responses_repeat_is_annotated_and_passed_on(backstop, scenario):
    client = openai.OpenAI(api_key=EFFECTS_ANNOTATE_KEY, base_url=backstop.openai_base_url, max_retries=0, timeout=20)
    session = scenario
    _commit_in_responses(client, scenario, session)
    raw = client.responses.with_raw_response.create(
        model="gpt-4o-mini", tools=RESPONSES_TOOLS, input="Email Bob.",
        extra_headers=_headers(scenario, session, _proposes("send_email", BOB_REORDERED)))
    out = raw.parse()
    assert [i.type for i in out.output if i.type == "function_call"] == ["function_call"]
    assert raw.headers["x-backstop-side-effect"] == "duplicate; tool=send_email"
    assert backstop.attempts(scenario) == 1
    entry = _journal(backstop, session, EFFECTS_ANNOTATE_KEY).json()["entries"][0]
    assert (entry["call_id"], entry["outcome"], entry["repeats"]) == ("call_first", "ok", 1)


def test_a_responses_call_proposed_then_answered_by_id_alone_is_committed(backstop, scenario):
    """A chained Responses agent feeds back only `function_call_output` (the call is in
    the stored response it chains onto): the proposal journaled with the answer is what
    the result commits."""
    client = openai.OpenAI(api_key=EFFECTS_KEY, base_url=backstop.openai_base_url, max_retries=0, timeout=20)
    session = scenario
    first = client.responses.create(model="gpt-4o-mini", tools=RESPONSES_TOOLS, input="Email Bob.",
                                    extra_headers=_headers(scenario + "-1", session, _proposes("send_email", BOB)))
    call_id = [i for i in first.output if i.type == "function_call"][0].call_id
    entries = _journal(backstop, session, EFFECTS_KEY).json()["entries"]
    assert [(e["call_id"], e["outcome"]) for e in entries] == [(call_id, "proposed")]
    client.responses.create(
        model="gpt-4o-mini", tools=RESPONSES_TOOLS, previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call_id, "output": "sent"}],
        extra_headers=_headers(scenario + "-2", session, "content=done"))
    entries = _journal(backstop, session, EFFECTS_KEY).json()["entries"]
    assert [(e["call_id"], e["outcome"], e["result"]) for e in entries] == [(call_id, "ok", "sent")]


def test_a_journal_is_its_tenants_alone(backstop, scenario):
    client = _chat_client(backstop, EFFECTS_KEY)
    _commit_in_chat(backstop, client, scenario, scenario)
    assert _journal(backstop, scenario, EFFECTS_KEY).status_code == 200
    other = _journal(backstop, scenario, TENANT_B_KEY)
    assert other.status_code == 404, other.text
    assert other.json()["error"]["code"] == "not_found"
    assert _journal(backstop, scenario + "-none", EFFECTS_KEY).status_code == 404
    metrics = backstop.get("/metrics").text
    assert 'backstop_side_effects_total{outcome="committed"}' in metrics


def test_a_replan_repeating_two_committed_calls_is_corrected_once_for_each(backstop, scenario):
    """The agent sent two emails, lost its state, and the model proposes both again in
    turn: each is corrected once (the second correction's request holds the first's
    note too), and the model's answer after both goes to the agent."""
    client = _chat_client(backstop, EFFECTS_KEY)
    session = scenario
    carol = {**BOB, "to": "carol@example.com"}
    conversation = _chat_turn_that_sent("call_bob", BOB, "sent to bob") + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_carol", "type": "function",
             "function": {"name": "send_email", "arguments": json.dumps(carol)}}]},
        {"role": "tool", "tool_call_id": "call_carol", "content": "sent to carol"},
    ]
    client.chat.completions.create(model="gpt-4o-mini", messages=conversation, tools=TOOLS,
                                   extra_headers=_headers(scenario + "-commit", session, "content=done"))
    fault = f"{_proposes('send_email', BOB)},{_proposes('send_email', carol)},content=Both were sent already."
    raw = client.chat.completions.with_raw_response.create(
        model="gpt-4o-mini", messages=[{"role": "user", "content": "Email Bob and Carol the invoice."}],
        tools=TOOLS, extra_headers=_headers(scenario, session, fault))
    assert raw.parse().choices[0].message.content == "Both were sent already."
    assert raw.headers["x-backstop-side-effect"] == "corrected; tool=send_email"
    assert backstop.attempts(scenario) == 3, "the answer and one correction for each repeat"
    notes = [m["content"] for m in backstop.last_upstream_request(scenario)["body"]["messages"] if m["role"] == "user"]
    assert any("call_bob" in n for n in notes) and any("call_carol" in n for n in notes), notes


def test_a_replanned_conversation_is_reminded_of_its_committed_calls(backstop, scenario):
    """`restore = "note"`: a request that shows none of the session's committed calls
    carries a note naming them (chat: a system message after the caller's own; Anthropic:
    `system`); one that still holds them is sent as it came."""
    client = _chat_client(backstop, EFFECTS_RESTORE_KEY)
    session = scenario
    _commit_in_chat(backstop, client, scenario, session)
    assert backstop.last_upstream_request(scenario + "-commit")["body"]["messages"][0]["role"] == "user", \
        "the conversation that holds the call gets no note"
    raw = client.chat.completions.with_raw_response.create(
        model="gpt-4o-mini", tools=TOOLS,
        messages=[{"role": "system", "content": "You are a mail agent."},
                  {"role": "user", "content": "Email Bob the invoice."}],
        extra_headers=_headers(scenario, session, "content=Bob already has it."))
    assert raw.headers["x-backstop-side-effect"] == "restored; entries=1"
    sent = backstop.last_upstream_request(scenario)["body"]["messages"]
    assert [m["role"] for m in sent] == ["system", "system", "user"]
    assert "call_first" in sent[1]["content"] and "sent: message 42" in sent[1]["content"]
    assert "must not be repeated" in sent[1]["content"]

    claude = _claude(backstop, EFFECTS_RESTORE_KEY)
    claude.messages.create(model="claude-sonnet-4-5", max_tokens=100, system="Be brief.",
                           messages=[{"role": "user", "content": "Email Bob the invoice."}],
                           extra_headers=_headers(scenario + "-claude", session, "content=ok"))
    system = backstop.last_upstream_request(scenario + "-claude")["body"]["system"]
    assert system.startswith("Be brief.") and "call_first" in system, system


def test_a_streamed_repeat_as_the_first_move_is_corrected_and_the_client_streams_the_correction(backstop, scenario):
    client = _chat_client(backstop, EFFECTS_KEY)
    session = scenario
    _commit_in_chat(backstop, client, scenario, session)
    stream = client.chat.completions.create(
        model="gpt-4o-mini", stream=True, tools=TOOLS,
        messages=[{"role": "user", "content": "Email Bob the invoice."}],
        extra_headers=_headers(scenario, session, f"{_proposes('send_email', BOB_REORDERED)};chunks=4,content=Bob already has it."))
    text, calls = "", 0
    for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            calls += len(choice.delta.tool_calls or [])
    assert calls == 0, "not one delta of the repeat reaches the client"
    assert text == "Bob already has it."
    assert backstop.attempts(scenario) == 2
    assert "call_first" in backstop.last_upstream_request(scenario)["body"]["messages"][-1]["content"]


def test_a_streamed_anthropic_repeat_is_refused_before_the_stream_begins(backstop, scenario):
    client = _claude(backstop, EFFECTS_REFUSE_KEY)
    session = scenario
    _commit_in_claude(client, scenario, session)
    with pytest.raises(anthropic.ConflictError) as caught:
        with client.messages.stream(
                model="claude-sonnet-4-5", max_tokens=100, tools=CLAUDE_TOOLS,
                messages=[{"role": "user", "content": "Email Bob the invoice."}],
                extra_headers=_headers(scenario, session, f"{_proposes('send_email', BOB)};chunks=3")) as stream:
            for _ in stream:
                pass
    assert caught.value.body["error"]["type"] == "invalid_request_error"
    assert "toolu_first" in caught.value.body["error"]["message"]
    assert backstop.attempts(scenario) == 1


def test_a_streamed_repeat_after_text_is_refused_with_an_error_event_and_no_call_delta(backstop, scenario):
    client = _chat_client(backstop, EFFECTS_REFUSE_KEY)
    session = scenario
    _commit_in_chat(backstop, client, scenario, session)
    stream = client.chat.completions.create(
        model="gpt-4o-mini", stream=True, tools=TOOLS,
        messages=[{"role": "user", "content": "Email Bob the invoice."}],
        extra_headers=_headers(scenario, session, f"content=Sending now.;{_proposes('send_email', BOB)};chunks=4"))
    text, calls = "", 0
    with pytest.raises(openai.APIError) as caught:
        for chunk in stream:
            for choice in chunk.choices:
                text += choice.delta.content or ""
                calls += len(choice.delta.tool_calls or [])
    assert text == "Sending now." and calls == 0
    assert "call_first" in str(caught.value)
    assert backstop.attempts(scenario) == 1


def test_a_streamed_repeat_after_text_is_corrected_and_the_correction_follows_on(backstop, scenario):
    """Text went out before the repeat began: the corrective attempt's answer continues
    the same stream (its own text dropped, its call numbered after what was sent), and the
    client gets the next email, never the repeated one."""
    client = _chat_client(backstop, EFFECTS_KEY)
    session = scenario
    _commit_in_chat(backstop, client, scenario, session)
    carol = {**BOB, "to": "carol@example.com"}
    fault = f"content=Sending now.;{_proposes('send_email', BOB)};chunks=4,{_proposes('send_email', carol)};chunks=2"
    stream = client.chat.completions.create(
        model="gpt-4o-mini", stream=True, tools=TOOLS,
        messages=[{"role": "user", "content": "Email Bob and Carol the invoice."}],
        extra_headers=_headers(scenario, session, fault))
    text, names, arguments, indices = "", "", "", set()
    for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                indices.add(delta.index)
                names += delta.function.name or "" if delta.function else ""
                arguments += delta.function.arguments or "" if delta.function else ""
    assert text == "Sending now."
    assert (names, json.loads(arguments), indices) == ("send_email", carol, {0})
    assert backstop.attempts(scenario) == 2


@pytest.mark.parametrize("tool", ["get_weather", "send_email"])
def test_a_streamed_call_that_repeats_nothing_streams_whole(backstop, scenario, tool):
    client = _chat_client(backstop, EFFECTS_KEY)
    session = scenario
    args = {"city": "Paris"} if tool == "get_weather" else {**BOB, "to": "dave@example.com"}
    _commit_in_chat(backstop, client, scenario, session)
    stream = client.chat.completions.create(
        model="gpt-4o-mini", stream=True, tools=TOOLS,
        messages=[{"role": "user", "content": "go"}],
        extra_headers=_headers(scenario, session, f"{_proposes(tool, args)};chunks=4"))
    name, arguments = "", ""
    for chunk in stream:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                name += delta.function.name or ""
                arguments += delta.function.arguments or ""
    assert (name, json.loads(arguments)) == (tool, args)
    assert backstop.attempts(scenario) == 1


def test_a_streamed_responses_repeat_is_corrected_before_the_stream_begins(backstop, scenario):
    client = openai.OpenAI(api_key=EFFECTS_KEY, base_url=backstop.openai_base_url, max_retries=0, timeout=20)
    session = scenario
    _commit_in_responses(client, scenario, session)
    kinds = []
    with client.responses.stream(
            model="gpt-4o-mini", tools=RESPONSES_TOOLS, input="Email Bob.",
            extra_headers=_headers(scenario, session, f"{_proposes('send_email', BOB_REORDERED)};chunks=3,content=Already sent.")) as stream:
        for event in stream:
            kinds.append(event.type)
        final = stream.get_final_response()
    assert "response.function_call_arguments.delta" not in kinds
    assert final.output_text == "Already sent."
    assert backstop.attempts(scenario) == 2


def test_a_streamed_anthropic_repeat_after_text_is_corrected_in_the_same_message(backstop, scenario):
    client = _claude(backstop, EFFECTS_KEY)
    session = scenario
    _commit_in_claude(client, scenario, session)
    carol = {**BOB, "to": "carol@example.com"}
    fault = f"content=On it.;{_proposes('send_email', BOB)};chunks=3,{_proposes('send_email', carol)};chunks=2"
    with client.messages.stream(model="claude-sonnet-4-5", max_tokens=100, tools=CLAUDE_TOOLS,
                                messages=[{"role": "user", "content": "Email Bob and Carol."}],
                                extra_headers=_headers(scenario, session, fault)) as stream:
        message = stream.get_final_message()
    assert [b.type for b in message.content] == ["text", "tool_use"]
    assert message.content[0].text == "On it."
    assert message.content[1].input == carol
    assert backstop.attempts(scenario) == 2


def test_a_session_may_make_its_tenants_on_repeat_stricter_never_looser(backstop, scenario):
    client = _chat_client(backstop, EFFECTS_KEY)
    session = scenario
    _commit_in_chat(backstop, client, scenario, session)
    replan = [{"role": "user", "content": "Email Bob the invoice."}]
    with pytest.raises(openai.ConflictError):
        client.chat.completions.create(
            model="gpt-4o-mini", messages=replan, tools=TOOLS,
            extra_headers=_headers(scenario, session, _proposes("send_email", BOB),
                                   **{"x-backstop-side-effects-on-repeat": "refuse"}))
    assert backstop.attempts(scenario) == 1, "refused: no corrective attempt"
    raw = client.chat.completions.with_raw_response.create(
        model="gpt-4o-mini", messages=replan, tools=TOOLS,
        extra_headers=_headers(scenario + "-loose", session, f"{_proposes('send_email', BOB)},content=ok",
                               **{"x-backstop-side-effects-on-repeat": "annotate"}))
    assert raw.headers["x-backstop-side-effect"] == "corrected; tool=send_email", "annotate is looser: the tenant's correct holds"


def _sse(*chunks) -> str:
    raw = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    return "events_b64=" + base64.b64encode(raw.encode()).decode()


def test_a_repeat_sharing_a_chunk_with_another_call_is_caught_before_the_stream_begins(backstop, scenario):
    """Some OpenAI-compatible servers send whole calls, several to a chunk, after an
    opening chunk that says nothing (`content: ""`, `refusal: null`): the repeat in the
    second place is held with its chunk, and the answer, not begun, is a plain 409."""
    client = _chat_client(backstop, EFFECTS_REFUSE_KEY)
    session = scenario
    _commit_in_chat(backstop, client, scenario, session)
    base = {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 1, "model": "gpt-4o-mini"}
    opening = {**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": "", "refusal": None}, "finish_reason": None}]}
    both = {**base, "choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": 0, "id": "call_w", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}},
        {"index": 1, "id": "call_r", "type": "function", "function": {"name": "send_email", "arguments": json.dumps(BOB)}},
    ]}, "finish_reason": None}]}
    done = {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}
    with pytest.raises(openai.ConflictError) as caught:
        stream = client.chat.completions.create(
            model="gpt-4o-mini", stream=True, tools=TOOLS,
            messages=[{"role": "user", "content": "Email Bob the invoice."}],
            extra_headers=_headers(scenario, session, _sse(opening, both, done)))
        for _ in stream:
            pass
    assert caught.value.body["code"] == "duplicate_side_effect"
    assert backstop.attempts(scenario) == 1

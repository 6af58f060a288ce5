"""Restart smart (issue 50), through the official SDKs: a session about to trip a loop
rule is guided once (its request goes to the model with a note naming the evidence,
`x-backstop-session-state: guided`); an agent that changes course is `recovered`, one
that repeats itself is refused 429 `loop_detected` before any upstream call. An outage
puts a session in `waiting` (503 `circuit_open`, never tripped) until its first success;
the same provider refusal again and again, or refused credentials, trip it at once with
a diagnosis (`session_tripped (unrecoverable)`). The restart record is read back from
`GET /admin/tenants/{t}/guard`, the session report and `/metrics`.

Every test names what the mock received: how many attempts, and whether the note did.
"""

from __future__ import annotations

import base64
import json
import re
import time
from dataclasses import dataclass
from typing import Any

import anthropic
import openai
import pytest

from backstop_support import (
    ADMIN_TOKEN,
    GUARDED_KEY,
    GUIDED_KEY,
    TENANT_A_KEY,
    assert_anthropic_error,
    assert_openai_error,
)

ATLANTIS = {"city": "Atlantis"}
ATLANTA = {"city": "Atlanta"}
ERROR = "Error: city not found"
SYSTEM = "You are a weather agent."
EVIDENCE = 'get_weather({"city":"Atlantis"}) returned the same error 3 times'
REPEATED = "guided once to change course, the session repeated it"
SDK_ERRORS = (openai.APIStatusError, anthropic.APIStatusError)
ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}


def _b64(value) -> str:
    return base64.b64encode(json.dumps(value).encode()).decode()


def _calls(args: dict, text: str = "") -> str:
    """The mock's step: the model says `text` (if any), then calls get_weather(args)."""
    step = f"tool=get_weather;tool_args_b64={_b64(args)}"
    return f"content={text};{step}" if text else step


@dataclass
class Turn:
    headers: Any
    text: str
    call: tuple | None  # (id, name, arguments as a dict)

    @property
    def state(self) -> str | None:
        return self.headers.get("x-backstop-session-state")


def _one_call(calls: list) -> tuple | None:
    assert len(calls) <= 1, calls
    return (calls[0][0], calls[0][1], json.loads(calls[0][2]) if isinstance(calls[0][2], str) else calls[0][2]) \
        if calls else None


class Agent:
    """An agent that keeps its conversation, runs the model's tool calls and feeds their
    results back; whole or streamed. The model's next move is scripted per request."""

    anthropic = False
    place = ""  # where the API takes instructions: the note lands there

    def __init__(self, backstop, scenario: str, *, key: str = GUIDED_KEY, stream: bool = False):
        self.backstop, self.scenario, self.session, self.stream = backstop, scenario, scenario, stream
        self.conversation: list = [self.user("What is the weather in Atlantis?")]
        self.client = self.make_client(backstop, key)

    @staticmethod
    def make_client(backstop, key):
        return openai.OpenAI(api_key=key, base_url=backstop.openai_base_url, max_retries=0, timeout=20)

    def headers(self, fault: str) -> dict:
        return {"x-mock-scenario": self.scenario, "x-session-id": self.session, "x-mock-fault": fault}

    @staticmethod
    def user(text: str) -> dict:
        return {"role": "user", "content": text}

    def reply(self, text: str, question: str) -> None:
        """The model answered `text`; the user asks something else."""
        self.conversation += [{"role": "assistant", "content": text}, self.user(question)]

    def upstream(self) -> dict:
        return self.backstop.last_upstream_request(self.scenario)["body"]

    def note(self) -> str:
        """The note the last upstream request carried; all else is as the agent sent it."""
        body = self.upstream()
        assert body[self.conversation_field] == self.conversation
        assert body[self.place].startswith(f"{SYSTEM}\n\n"), body[self.place]
        return body[self.place][len(SYSTEM) + 2:]

    def assert_unnoted(self) -> None:
        body = self.upstream()
        assert (body[self.conversation_field], body[self.place]) == (self.conversation, SYSTEM)

    def refused(self, fault: str, code: str) -> str:
        """The next request is refused 429 `code`, in the API's error shape: its message."""
        with pytest.raises(SDK_ERRORS) as caught:
            self.ask(fault)
        response = caught.value.response
        if self.anthropic:
            err = assert_anthropic_error(response, status=429, type_=code)["error"]
        else:
            err = assert_openai_error(response, status=429, type_="session_error", code=code)["error"]
        assert response.headers["x-backstop-session-state"] == "tripped"
        assert response.headers["x-should-retry"] == "false"
        assert int(response.headers["retry-after"]) >= 1
        return err["message"]


class ChatAgent(Agent):
    conversation_field = "messages"
    TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]

    def ask(self, fault: str) -> Turn:
        kwargs = dict(model="gpt-4o", messages=self.conversation, tools=self.TOOLS, extra_headers=self.headers(fault))
        if not self.stream:
            raw = self.client.chat.completions.with_raw_response.create(**kwargs)
            msg = raw.parse().choices[0].message
            calls = [(c.id, c.function.name, c.function.arguments) for c in msg.tool_calls or []]
            return Turn(raw.headers, msg.content or "", _one_call(calls))
        stream = self.client.chat.completions.create(stream=True, **kwargs)
        text, calls = "", {}
        for chunk in stream:
            for choice in chunk.choices:
                text += choice.delta.content or ""
                for d in choice.delta.tool_calls or []:
                    call = calls.setdefault(d.index, ["", "", ""])
                    call[0] += d.id or ""
                    call[1] += d.function.name or ""
                    call[2] += d.function.arguments or ""
        return Turn(stream.response.headers, text, _one_call(list(calls.values())))

    def feed(self, turn: Turn, result: str = ERROR) -> None:
        call_id, name, args = turn.call
        self.conversation += [
            {"role": "assistant", "content": turn.text or None, "tool_calls": [
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}]},
            {"role": "tool", "tool_call_id": call_id, "content": result},
        ]

    def note(self) -> str:
        """Chat: a system message after the last message."""
        sent = self.upstream()["messages"]
        assert sent[:-1] == self.conversation
        assert sent[-1]["role"] == "system", sent[-1]
        return sent[-1]["content"]

    def assert_unnoted(self) -> None:
        assert self.upstream()["messages"] == self.conversation


class ResponsesAgent(Agent):
    conversation_field = "input"
    place = "instructions"
    TOOLS = [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]

    def ask(self, fault: str) -> Turn:
        kwargs = dict(model="gpt-4o", instructions=SYSTEM, input=self.conversation, tools=self.TOOLS,
                      extra_headers=self.headers(fault))
        if not self.stream:
            raw = self.client.responses.with_raw_response.create(**kwargs)
            out, headers = raw.parse(), raw.headers
            text = out.output_text
        else:
            stream = self.client.responses.create(stream=True, **kwargs)
            text, out = "", None
            for event in stream:
                if event.type == "response.output_text.delta":
                    text += event.delta
                elif event.type == "response.completed":
                    out = event.response
            headers = stream.response.headers
        calls = [(i.call_id, i.name, i.arguments) for i in out.output if i.type == "function_call"]
        return Turn(headers, text, _one_call(calls))

    def feed(self, turn: Turn, result: str = ERROR) -> None:
        call_id, name, args = turn.call
        if turn.text:
            self.conversation.append({"role": "assistant", "content": turn.text})
        self.conversation += [
            {"type": "function_call", "call_id": call_id, "name": name, "arguments": json.dumps(args)},
            {"type": "function_call_output", "call_id": call_id, "output": result},
        ]


class ClaudeAgent(Agent):
    anthropic = True
    conversation_field = "messages"
    place = "system"
    TOOLS = [{"name": "get_weather", "input_schema": {"type": "object"}}]

    @staticmethod
    def make_client(backstop, key):
        return anthropic.Anthropic(api_key=key, base_url=backstop.anthropic_base_url, max_retries=0, timeout=20)

    def ask(self, fault: str) -> Turn:
        kwargs = dict(model="claude-mock-1", max_tokens=256, system=SYSTEM, messages=self.conversation,
                      tools=self.TOOLS, extra_headers=self.headers(fault))
        if not self.stream:
            raw = self.client.messages.with_raw_response.create(**kwargs)
            msg, headers = raw.parse(), raw.headers
            text = "".join(b.text for b in msg.content if b.type == "text")
        else:
            with self.client.messages.stream(**kwargs) as stream:
                text = "".join(stream.text_stream)
                msg, headers = stream.get_final_message(), stream.response.headers
        return Turn(headers, text, _one_call([(b.id, b.name, b.input) for b in msg.content if b.type == "tool_use"]))

    def feed(self, turn: Turn, result: str = ERROR) -> None:
        call_id, name, args = turn.call
        text = [{"type": "text", "text": turn.text}] if turn.text else []
        self.conversation += [
            {"role": "assistant", "content": text + [{"type": "tool_use", "id": call_id, "name": name, "input": args}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": call_id, "content": result, "is_error": True}]},
        ]


AGENTS = {"chat": ChatAgent, "responses": ResponsesAgent, "anthropic": ClaudeAgent}


# --- the operator's view -----------------------------------------------------------------

def _guard(backstop, tenant: str) -> dict:
    r = backstop.get(f"/admin/tenants/{tenant}/guard", headers=ADMIN)
    assert r.status_code == 200, r.text
    return r.json()


def _delta(before: dict, after: dict, *path: str):
    def at(d):
        for key in path:
            d = d.get(key, 0) if isinstance(d, dict) else d
        return d
    return at(after) - at(before)


def _transitions(backstop, tenant: str, session: str) -> list[tuple]:
    """(from, to, evidence, request_id) of each change of the session's state, in order."""
    r = backstop.get(f"/admin/tenants/{tenant}/sessions/{session}", headers=ADMIN)
    assert r.status_code == 200, r.text
    changes = r.json()["guard"]["transitions"]
    assert all(isinstance(c["at_ms"], int) and c["at_ms"] > 0 for c in changes), changes
    return [(c["from"], c["to"], c["evidence"] or "", c["request_id"]) for c in changes]


def _metric(text: str, name: str, **labels: str) -> float:
    """The sum of the samples of `name` whose labels include `labels`."""
    total = 0.0
    for m in re.finditer(rf"^{name}(?:{{(.*?)}})? (\S+)$", text, re.M):
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(m.group(2))
    return total


# --- the flows ---------------------------------------------------------------------------

def _three_failed_calls(agent: Agent) -> None:
    """Three times the model calls get_weather(Atlantis) and the agent feeds back the same error."""
    for n in range(3):
        turn = agent.ask(_calls(ATLANTIS))
        assert (turn.state, turn.call[1:]) == ("active", ("get_weather", ATLANTIS)), n
        agent.feed(turn)


def _loop_until_guided(agent: Agent, guided_move: str) -> Turn:
    """The request that shows the same failed call a third time goes to the model once,
    with a note."""
    _three_failed_calls(agent)
    turn = agent.ask(guided_move)
    assert turn.state == "guided"
    assert agent.backstop.attempts(agent.scenario) == 4, "the guided request is sent, once"
    note = agent.note()
    assert EVIDENCE in note and f"the last result was: {ERROR}" in note and "Try a different approach" in note, note
    assert "session guard" not in turn.text, "the note never reaches the client"
    return turn


def _changes_course(agent: Agent) -> None:
    guided = _loop_until_guided(agent, _calls(ATLANTA, "Trying Atlanta instead."))
    assert (guided.text, guided.call[1:]) == ("Trying Atlanta instead.", ("get_weather", ATLANTA))
    agent.feed(guided, "Sunny, 24 C")
    turn = agent.ask("content=It is sunny in Atlanta.")
    assert (turn.state, turn.text) == ("recovered", "It is sunny in Atlanta.")
    assert agent.backstop.attempts(agent.scenario) == 5
    agent.assert_unnoted()
    agent.reply(turn.text, "And tomorrow?")
    assert agent.ask("content=Sunny again.").state == "active"
    changes = _transitions(agent.backstop, "guided", agent.session)
    assert [c[:2] for c in changes] == [("active", "guided"), ("guided", "recovered"), ("recovered", "active")]
    assert changes[0][2:] == (f"tool_loop_limit: {EVIDENCE}", guided.headers["x-request-id"])
    assert re.fullmatch(r"recovered \d+\.\ds after the session's first failure", changes[1][2]), changes[1]
    assert changes[1][3] == turn.headers["x-request-id"]


def _repeats_itself(agent: Agent) -> None:
    guided = _loop_until_guided(agent, _calls(ATLANTIS, "Trying again."))
    assert (guided.text, guided.call[1:]) == ("Trying again.", ("get_weather", ATLANTIS))
    agent.feed(guided)
    message = agent.refused(_calls(ATLANTIS), "loop_detected")
    assert message.startswith("loop_detected (tool_loop_limit): ") and f"{EVIDENCE}; {REPEATED}" in message, message
    assert agent.backstop.attempts(agent.scenario) == 4, "refused before any upstream call"
    changes = _transitions(agent.backstop, "guided", agent.session)
    assert [c[:3] for c in changes] == [("active", "guided", f"tool_loop_limit: {EVIDENCE}"),
                                        ("guided", "tripped", f"tool_loop_limit: {EVIDENCE}; {REPEATED}")]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("api", list(AGENTS))
def test_a_guided_tool_loop_that_changes_course_recovers(backstop, scenario, api, stream):
    _changes_course(AGENTS[api](backstop, scenario, stream=stream))


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("api", list(AGENTS))
def test_a_guided_tool_loop_that_repeats_itself_is_tripped_without_an_upstream_call(backstop, scenario, api, stream):
    _repeats_itself(AGENTS[api](backstop, scenario, stream=stream))


def test_a_guided_request_that_failed_upstream_is_guided_again_when_resent(backstop, scenario):
    """The guided request fails upstream (500 after Backstop's own 3 attempts): the
    model never answered the note, so it was no guidance (state `recovering`, nothing
    counted). The client resends it unchanged: guided again, the note with it, and only
    that answered guidance is counted; it is not a recovery."""
    agent = ChatAgent(backstop, scenario)
    before = _guard(backstop, "guided")
    _three_failed_calls(agent)
    with pytest.raises(openai.InternalServerError) as caught:
        agent.ask("status=500")
    assert caught.value.response.headers["x-backstop-session-state"] == "recovering"
    assert backstop.attempts(scenario) == 6, "three answered, then the guided request's three attempts"
    assert EVIDENCE in agent.note(), "each attempt carries the note"
    turn = agent.ask("content=I could not find Atlantis.")
    assert backstop.attempts(scenario) == 7
    assert turn.state == "guided" and EVIDENCE in agent.note(), (turn.state, agent.upstream()["messages"][-1])
    after = _guard(backstop, "guided")
    assert _delta(before, after, "strategies", "guide", "recovered") == 0
    assert _delta(before, after, "strategies", "guide", "sessions") == 1, "the answered guidance only"


@pytest.mark.parametrize("changes_course", [True, False], ids=["changes_course", "repeats"])
def test_an_identical_request_is_guided_once(backstop, scenario, changes_course):
    """`identical_request_limit = 2`: the same request a third time is guided, a fourth
    time tripped; a different one after the guidance recovers."""
    agent = ChatAgent(backstop, scenario)
    for n in range(3):
        turn = agent.ask("content=I am not sure.")
        assert (turn.state, turn.text) == ("guided" if n == 2 else "active", "I am not sure."), n
    assert backstop.attempts(scenario) == 3
    note = agent.note()
    assert "the same request was sent 3 times within" in note and "Try a different approach" in note, note
    if changes_course:
        agent.reply(turn.text, "What about Atlanta then?")
        assert agent.ask("content=Sunny.").state == "recovered"
        assert backstop.attempts(scenario) == 4
        agent.assert_unnoted()
        agent.reply("Sunny.", "Thanks.")
        assert agent.ask("content=Bye.").state == "active"
        expected = [("active", "guided"), ("guided", "recovered"), ("recovered", "active")]
    else:
        message = agent.refused("content=I am not sure.", "loop_detected")
        assert message.startswith("loop_detected (identical_request_limit): the same request was sent 3 times")
        assert REPEATED in message, message
        assert backstop.attempts(scenario) == 3
        expected = [("active", "guided"), ("guided", "tripped")]
    assert [c[:2] for c in _transitions(backstop, "guided", scenario)] == expected


# --- outages, unrecoverable errors ------------------------------------------------------

def _chat(client, scenario: str, session: str, text: str, fault: str | None = None, model: str = "outage-gpt"):
    """(status, headers, error or None) of one chat request."""
    headers = {"x-mock-scenario": scenario, "x-session-id": session}
    if fault:
        headers["x-mock-fault"] = fault
    try:
        raw = client.chat.completions.with_raw_response.create(
            model=model, messages=[{"role": "user", "content": text}], extra_headers=headers)
        return raw.status_code, raw.headers, None
    except openai.APIStatusError as err:
        return err.status_code, err.response.headers, err.body


def _outage_closed(backstop, scenario: str, deadline_s: float = 5.0) -> None:
    """Waits until the `outage` upstream answers (its breaker closed, or closed by this
    probe half-open): it is shared by the whole server. An unguarded tenant probes."""
    client = ChatAgent.make_client(backstop, TENANT_A_KEY)
    deadline = time.monotonic() + deadline_s
    while True:
        status, _, body = _chat(client, f"{scenario}-probe", f"{scenario}-probe", "are you up?")
        if status == 200:
            return
        assert status == 503 and body["code"] == "circuit_open" and time.monotonic() < deadline, (status, body)
        time.sleep(0.1)


def _outage_opened(backstop, scenario: str) -> None:
    """Fails on the `outage` route (an unguarded tenant) until its breaker is open: two
    failures open it only if the recent window holds few successes, and earlier probes
    may still be there (10 s)."""
    client = ChatAgent.make_client(backstop, TENANT_A_KEY)
    for _ in range(10):
        status, _, body = _chat(client, f"{scenario}-open", f"{scenario}-open", "fail", "status=500")
        if status == 503:
            assert body["code"] == "circuit_open", body
            return
    pytest.fail("the outage route's breaker did not open")


@pytest.mark.parametrize("resends", [False, True], ids=["new_requests", "same_request"])
def test_an_outage_waits_without_tripping_and_the_first_success_recovers(backstop, scenario, resends):
    """The `outage` route's breaker (2 failures open it, 600 ms) is shared: it is closed
    before and after. `same_request`: the agent resends its request as Retry-After says,
    which must not read as a loop either: a request the open breaker refused was never
    sent, and a waiting session's resends are not repeats."""
    _outage_closed(backstop, scenario)
    try:
        _wait_out_an_outage(backstop, scenario, (lambda n: "weather?") if resends else (lambda n: f"weather? ({n})"))
    finally:
        _outage_closed(backstop, scenario)


def _wait_out_an_outage(backstop, scenario: str, text) -> None:
    client = ChatAgent.make_client(backstop, GUARDED_KEY)
    before = _guard(backstop, "guarded")
    for n in range(2):
        status, headers, _ = _chat(client, scenario, scenario, text(n), "status=500")
        assert (status, headers["x-backstop-session-state"]) == (500, "recovering"), n
    _outage_opened(backstop, scenario)
    # The breaker is open: six requests (max_consecutive_failures = 3) wait, none trips.
    for n in range(2, 8):
        status, headers, body = _chat(client, scenario, scenario, text(n), "status=500")
        assert (status, body["code"], headers["x-backstop-session-state"]) == (503, "circuit_open", "waiting"), n
        assert int(headers["retry-after"]) >= 1
    assert backstop.attempts(scenario) == 2, "no attempt while the breaker is open"
    # Half-open after 600 ms: the next request is the probe (polled, should the clock be late).
    time.sleep(0.7)
    deadline = time.monotonic() + 5
    while True:
        status, headers, body = _chat(client, scenario, scenario, text(8))
        if status != 503 or time.monotonic() > deadline:
            break
        assert (body["code"], headers["x-backstop-session-state"]) == ("circuit_open", "waiting")
        time.sleep(0.1)
    assert (status, headers["x-backstop-session-state"]) == (200, "recovered")
    assert backstop.attempts(scenario) == 3
    assert _chat(client, scenario, scenario, "and tomorrow?")[1]["x-backstop-session-state"] == "active"
    changes = _transitions(backstop, "guarded", scenario)
    assert [c[:2] for c in changes] == [("active", "recovering"), ("recovering", "waiting"),
                                        ("waiting", "recovered"), ("recovered", "active")]
    assert changes[1][2].startswith("every target's circuit breaker is open; the first probe is due in"), changes[1]
    assert re.fullmatch(r"recovered \d+\.\ds after the session's first failure", changes[2][2]), changes[2]
    after = _guard(backstop, "guarded")
    assert [_delta(before, after, "strategies", "wait", k) for k in ("sessions", "recovered", "tripped_after")] \
        == [1, 1, 0]
    assert after["strategies"]["wait"]["mttr_seconds"]["mean"] >= 0.6


FIELD = "messages[0].content"


@pytest.mark.parametrize("api", ["chat", "anthropic"])
def test_the_same_provider_refusal_three_times_trips_with_a_diagnosis(backstop, scenario, api):
    agent = AGENTS[api](backstop, scenario, key=GUARDED_KEY)
    fault = f"status=400;code=invalid_type;param={FIELD}"
    before = _guard(backstop, "guarded")
    for n, state in enumerate(["recovering", "recovering", "tripped"]):
        agent.conversation = [agent.user(f"What is the weather in Atlantis? (try {n})")]
        with pytest.raises(SDK_ERRORS) as caught:
            agent.ask(fault)
        assert (caught.value.status_code, caught.value.response.headers["x-backstop-session-state"]) == (400, state)
    message = agent.refused(fault, "session_tripped")
    for part in ("session_tripped (unrecoverable)", "3 times in a row", "`invalid_type`", f"(field `{FIELD}`)",
                 f"suggested fix: fix the request's `{FIELD}`"):
        assert part in message, (part, message)
    assert backstop.attempts(scenario) == 3
    after = _guard(backstop, "guarded")
    assert (_delta(before, after, "fail_fast", "sessions"), _delta(before, after, "trips_by_rule", "unrecoverable")) \
        == (1, 1)


def test_refused_credentials_trip_the_session_at_once(backstop, scenario):
    """A 401 is a credential failure: never retried (a probe on `mock-openai`, 3 attempts
    allowed, made 1) and it opens the upstream's breaker at once. That would cut every
    other test off `mock-openai` for a second, so this runs on `outage` (1 attempt
    allowed) and waits for its breaker to close again before it ends."""
    _outage_closed(backstop, scenario)
    client = ChatAgent.make_client(backstop, GUARDED_KEY)
    before = _guard(backstop, "guarded")
    try:
        status, headers, body = _chat(client, scenario, scenario, "hi", "status=401")
        assert (status, body["code"], headers["x-backstop-session-state"]) == (502, "upstream_auth_failed", "tripped")
        status, headers, body = _chat(client, scenario, scenario, "hi again")
        assert (status, body["code"], headers["x-backstop-session-state"]) == (429, "session_tripped", "tripped")
        assert body["message"].startswith("session_tripped (unrecoverable): `outage` refused Backstop's credentials")
        assert "suggested fix: an operator must fix the upstream's api_key" in body["message"], body
        assert backstop.attempts(scenario) == 1
    finally:
        _outage_closed(backstop, scenario)
    after = _guard(backstop, "guarded")
    assert (_delta(before, after, "fail_fast", "sessions"), _delta(before, after, "trips_by_rule", "unrecoverable")) \
        == (1, 1)


# --- the restart record ------------------------------------------------------------------

def test_the_restart_record_is_reported_and_exported(backstop, scenario):
    """One guided session recovers, one is tripped: the tenant's record and the metrics
    count each once."""
    assert backstop.get("/admin/tenants/guided/guard").status_code == 401
    assert backstop.get("/admin/tenants/team-a/guard", headers=ADMIN).status_code == 404, "no guard, no record"
    before, metrics_before = _guard(backstop, "guided"), backstop.get("/metrics").text
    _changes_course(ChatAgent(backstop, f"{scenario}-recovers"))
    _repeats_itself(ChatAgent(backstop, f"{scenario}-repeats"))
    after, metrics = _guard(backstop, "guided"), backstop.get("/metrics").text

    guide = after["strategies"]["guide"]
    assert [_delta(before, after, "strategies", "guide", k) for k in ("sessions", "recovered", "tripped_after")] \
        == [2, 1, 1]
    assert [_delta(before, after, "total", k) for k in ("sessions", "recovered", "tripped_after")] == [2, 1, 1]
    assert [_delta(before, after, "strategies", "wait", k) for k in ("sessions", "recovered")] == [0, 0]
    assert guide["success_rate"] == round(guide["recovered"] / guide["sessions"], 4)
    assert 0 <= guide["mttr_seconds"]["mean"] and 0 <= guide["mttr_seconds"]["p90"]
    assert _delta(before, after, "trips_by_rule", "tool_loop_limit") == 1
    assert _delta(before, after, "fail_fast", "sessions") == 0
    assert _delta(before, after, "saved_by_trips", "calls") == 1
    assert _delta(before, after, "saved_by_trips", "usd") > 0, "the refused call, at the session's mean cost"

    def grew(name, **labels):
        return _metric(metrics, name, **labels) - _metric(metrics_before, name, **labels)

    assert grew("backstop_guard_guided_total", outcome="recovered") == 1
    assert grew("backstop_guard_guided_total", outcome="tripped") == 1
    assert grew("backstop_guard_state_transitions_total", **{"from": "active", "to": "guided"}) == 2
    assert grew("backstop_guard_state_transitions_total", **{"from": "guided", "to": "recovered"}) == 1
    assert grew("backstop_guard_state_transitions_total", **{"from": "guided", "to": "tripped"}) == 1
    assert grew("backstop_guard_recovery_seconds_count", strategy="guide") == 1
    assert grew("backstop_guard_recovery_seconds_bucket", strategy="guide", le="+Inf") == 1

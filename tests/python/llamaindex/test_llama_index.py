"""llama-index's `OpenAIResponses` through Backstop, with only `api_base` changed.

llama-index-llms-openai pins `openai<3` while openai-agents needs `openai>=3`, so these
run in a virtualenv of their own, which `.ci/run` makes and runs this directory in by
name; a run of tests/python leaves it out (tests/python/conftest.py).
"""

from __future__ import annotations

import base64
import json

from llama_index.core.llms import ChatMessage
from llama_index.core.tools import FunctionTool
from llama_index.llms.openai import OpenAIResponses

from backstop_support import PROVIDER_OPENAI_KEY, TENANT_A_KEY, assert_no_tenant_key


def _llm(backstop, scenario: str, fault: str | None = None, **settings) -> OpenAIResponses:
    headers = {"x-mock-scenario": scenario}
    if fault:
        headers["x-mock-fault"] = fault
    return OpenAIResponses(
        model="gpt-4o",
        api_key=TENANT_A_KEY,
        api_base=backstop.openai_base_url,
        default_headers=headers,
        max_retries=0,
        **settings,
    )


def test_complete_goes_through_the_responses_api_with_the_provider_key(backstop, scenario):
    out = _llm(backstop, scenario).complete("hello llama")
    assert out.text == "mock: hello llama"
    up = backstop.last_upstream_request(scenario)
    assert up["path"] == "/v1/responses"
    assert up["headers"]["authorization"] == f"Bearer {PROVIDER_OPENAI_KEY}"
    assert_no_tenant_key(up)
    assert backstop.attempts(scenario) == 1


def test_stream_complete_relays_the_deltas(backstop, scenario):
    chunks = list(_llm(backstop, scenario).stream_complete("stream llama"))
    assert len(chunks) > 1, "one buffered answer, not a stream"
    assert chunks[-1].text == "mock: stream llama"
    assert "".join(c.delta or "" for c in chunks) == "mock: stream llama"
    assert backstop.last_upstream_request(scenario)["body"]["stream"] is True


def test_a_503_is_retried_by_backstop_not_the_client(backstop, scenario):
    out = _llm(backstop, scenario, fault="status=503,ok").complete("retry llama")
    assert out.text == "mock: retry llama"
    assert backstop.attempts(scenario) == 2


def test_a_tool_call_is_parsed_from_the_function_call_item(backstop, scenario):
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return f"sunny in {city}"

    args = base64.b64encode(json.dumps({"city": "Paris"}).encode()).decode()
    llm = _llm(backstop, scenario, fault=f"tool=get_weather;tool_args_b64={args},ok")
    tool = FunctionTool.from_defaults(fn=get_weather)
    response = llm.chat_with_tools([tool], user_msg="What is the weather in Paris?")
    calls = llm.get_tool_calls_from_response(response, error_on_no_tool_call=True)
    assert [(c.tool_name, c.tool_kwargs) for c in calls] == [("get_weather", {"city": "Paris"})]
    sent = backstop.last_upstream_request(scenario)["body"]
    assert [t["name"] for t in sent["tools"]] == ["get_weather"]


def test_a_session_from_call_metadata_spans_chained_turns(backstop, scenario):
    # llama-index takes headers per client object, not per run: the session id comes
    # from the body's `metadata.session_id` instead, and its chained turns (each on the
    # last one's `previous_response_id`, the tenant's own) go through.
    session = f"llama-{scenario}"
    llm = _llm(backstop, scenario, call_metadata={"session_id": session}, track_previous_responses=True)
    first = llm.chat([ChatMessage(role="user", content="first turn")])
    llm.chat([ChatMessage(role="user", content="second turn")])
    assert first.message.content == "mock: first turn"
    second = backstop.last_upstream_request(scenario)["body"]
    assert second["previous_response_id"].startswith("resp_")
    assert second["metadata"] == {"session_id": session}
    assert backstop.attempts(scenario) == 2
    assert backstop.session_used(session, lambda used: used["calls"] >= 2)["calls"] == 2

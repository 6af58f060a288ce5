"""The OpenAI Agents SDK (`openai-agents`) through Backstop, unmodified but for its
client's base URL: a default `Agent` with one function tool, run to completion over the
Responses API against the mock. Tracing is off: its exporter would send the client's key
(a Backstop tenant key) to OpenAI."""

import base64
import json

import pytest

from agents import (
    Agent,
    ModelSettings,
    RunConfig,
    Runner,
    function_tool,
    set_default_openai_api,
    set_default_openai_client,
    set_tracing_disabled,
)
from openai import AsyncOpenAI

from backstop_support import TENANT_A_KEY

set_tracing_disabled(True)

CITIES: list[str] = []


@function_tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    CITIES.append(city)
    return f"18C and sunny in {city}"


def _tool_then_text(city: str) -> str:
    args = base64.b64encode(json.dumps({"city": city}).encode()).decode()
    return f"tool=get_weather;tool_args_b64={args},ok"


@pytest.fixture
def agent(backstop):
    client = AsyncOpenAI(api_key=TENANT_A_KEY, base_url=backstop.openai_base_url, max_retries=0)
    set_default_openai_client(client, use_for_tracing=False)
    set_default_openai_api("responses")
    CITIES.clear()
    return Agent(name="weather", instructions="Answer with the weather.", tools=[get_weather])


def test_a_default_agent_runs_its_tool_loop_to_completion(backstop, agent, scenario):
    settings = ModelSettings(extra_headers={"x-mock-scenario": scenario, "x-mock-fault": _tool_then_text("Paris")})
    result = Runner.run_sync(agent, "What is the weather in Paris?", run_config=RunConfig(model_settings=settings))
    assert CITIES == ["Paris"]
    assert isinstance(result.final_output, str) and result.final_output.startswith("mock:"), result.final_output
    assert backstop.attempts(scenario) == 2
    second = backstop.last_upstream_request(scenario)
    assert second["path"] == "/v1/responses"
    outputs = [i for i in second["body"]["input"] if i.get("type") == "function_call_output"]
    assert outputs and "18C and sunny in Paris" in outputs[0]["output"]


def test_an_agent_run_is_a_session_with_visible_spend(backstop, agent, scenario):
    session = f"agent-{scenario}"
    settings = ModelSettings(extra_headers={
        "x-mock-scenario": scenario,
        "x-mock-fault": _tool_then_text("Rome"),
        "x-session-id": session,
    })
    result = Runner.run_sync(agent, "Weather in Rome?", run_config=RunConfig(model_settings=settings))
    assert CITIES == ["Rome"] and result.final_output.startswith("mock:")
    used = backstop.session_used(session, lambda used: used["calls"] >= 2)
    assert used["calls"] == 2, used
    assert used["tokens"] > 0, used

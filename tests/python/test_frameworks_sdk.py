"""Agent frameworks whose defaults call the OpenAI Responses API, pointed at Backstop by
base URL alone: langchain-openai (`use_responses_api=True`), pydantic-ai's Responses
model, and `litellm.responses`. Each must reach the mock's `/v1/responses` through
Backstop, with the provider key (never the tenant's), and hand back the mock's answer."""

import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network at import

import pytest

from backstop_support import TENANT_A_KEY


def _assert_through_responses(backstop, scenario):
    assert backstop.attempts(scenario) == 1
    seen = backstop.last_upstream_request(scenario)
    assert seen["path"] == "/v1/responses"
    assert seen["headers"]["authorization"] == "Bearer sk-provider-openai"
    assert TENANT_A_KEY not in str(seen["headers"])
    return seen


def test_langchain_openai_with_the_responses_api(backstop, scenario):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model="gpt-4o-mini",
        api_key=TENANT_A_KEY,
        base_url=backstop.openai_base_url,
        use_responses_api=True,
        max_retries=0,
        default_headers={"x-mock-scenario": scenario},
    )
    answer = llm.invoke("hello from langchain")
    assert "mock:" in answer.text, answer
    seen = _assert_through_responses(backstop, scenario)
    assert "hello from langchain" in str(seen["body"]["input"])


def test_pydantic_ai_with_the_responses_model(backstop, scenario):
    from openai import AsyncOpenAI
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider

    client = AsyncOpenAI(
        api_key=TENANT_A_KEY,
        base_url=backstop.openai_base_url,
        max_retries=0,
        default_headers={"x-mock-scenario": scenario},
    )
    model = OpenAIResponsesModel("gpt-4o-mini", provider=OpenAIProvider(openai_client=client))
    result = Agent(model).run_sync("hello from pydantic-ai")
    assert result.output.startswith("mock:"), result.output
    _assert_through_responses(backstop, scenario)


def test_litellm_responses(backstop, scenario):
    import litellm

    response = litellm.responses(
        model="openai/gpt-4o-mini",
        input="hello from litellm",
        api_key=TENANT_A_KEY,
        api_base=backstop.openai_base_url,
        extra_headers={"x-mock-scenario": scenario},
        num_retries=0,
    )
    text = "".join(
        part.text
        for item in response.output
        if getattr(item, "type", None) == "message"
        for part in item.content
        if getattr(part, "type", None) == "output_text"
    )
    assert text.startswith("mock:"), response
    _assert_through_responses(backstop, scenario)


def test_litellm_raises_its_typed_error_for_a_caller_fault(backstop, scenario):
    """A caller fault passed through by Backstop reaches litellm's caller as the typed
    error it raises for a 400, after exactly one upstream attempt."""
    import litellm

    with pytest.raises(litellm.exceptions.BadRequestError) as err:
        litellm.responses(
            model="openai/gpt-4o-mini",
            input="hello",
            api_key=TENANT_A_KEY,
            api_base=backstop.openai_base_url,
            extra_headers={"x-mock-scenario": scenario, "x-mock-fault": "status=400;code=invalid_value"},
            num_retries=0,
        )
    assert err.value.status_code == 400
    assert backstop.attempts(scenario) == 1, "a caller fault is one attempt"

"""Amazon Bedrock through Backstop, driven with the official SDKs as users would.

The mock plays Bedrock's InvokeModel and checks every call's SigV4 signature (a wrong
one is AWS's 403), so an answer here means the call was signed right. `bedrock-chain`
takes its credentials from the standard AWS chain: conftest puts session credentials in
the server's environment (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`,
`AWS_SESSION_TOKEN`); `bedrock-keys` names its keys in the config.
"""

from __future__ import annotations

import anthropic
import openai
import pytest

from backstop_support import BEDROCK_ACCESS_KEY_ID, BEDROCK_SESSION, BEDROCK_SONNET

ENCODED_SONNET = BEDROCK_SONNET.replace(":", "%3A")


def _hdrs(scenario: str, fault: str | None = None) -> dict:
    headers = {"x-mock-scenario": scenario}
    if fault:
        headers["x-mock-fault"] = fault
    return headers


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_anthropic_sdk_reaches_claude_on_bedrock_signed_with_the_chains_session(backstop, anth, scenario):
    msg = anth.messages.create(
        model="bedrock-claude", max_tokens=64, messages=_user("hello bedrock"),
        extra_headers=_hdrs(scenario, "usage=21/7"),
    )
    assert msg.type == "message"
    assert msg.content[0].text == "mock: hello bedrock"
    assert (msg.usage.input_tokens, msg.usage.output_tokens) == (21, 7)
    assert backstop.attempts(scenario) == 1

    up = backstop.last_upstream_request(scenario)
    assert up["path"] == f"/model/{ENCODED_SONNET}/invoke"
    assert "model" not in up["body"] and "stream" not in up["body"]
    assert up["body"]["anthropic_version"] == "bedrock-2023-05-31"
    headers = up["headers"]
    assert headers["x-amz-security-token"] == BEDROCK_SESSION["AWS_SESSION_TOKEN"]
    assert headers["authorization"].startswith(
        f"AWS4-HMAC-SHA256 Credential={BEDROCK_SESSION['AWS_ACCESS_KEY_ID']}/"
    )
    assert "/us-east-1/bedrock/aws4_request" in headers["authorization"]
    assert "x-api-key" not in headers


def test_anthropic_sdk_streams_from_bedrocks_event_stream(backstop, anth, scenario):
    with anth.messages.stream(
        model="bedrock-claude", max_tokens=64, messages=_user("stream from bedrock"),
        extra_headers=_hdrs(scenario, "chunks=4;usage=9/4"),
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "mock: stream from bedrock"
    assert final.stop_reason == "end_turn"
    assert final.usage.output_tokens == 4
    up = backstop.last_upstream_request(scenario)
    assert up["path"] == f"/model/{ENCODED_SONNET}/invoke-with-response-stream"


def test_openai_sdk_chat_is_served_by_claude_on_bedrock(backstop, oai, scenario):
    completion = oai.chat.completions.create(
        model="bedrock-keys-claude", messages=_user("hi from openai"),
        extra_headers=_hdrs(scenario),
    )
    assert completion.object == "chat.completion"
    assert completion.choices[0].message.content == "mock: hi from openai"
    up = backstop.last_upstream_request(scenario)
    assert up["path"] == "/model/us.anthropic.claude-3-5-haiku-20241022-v1%3A0/invoke"
    # Explicit keys: no session token, the environment's session not used.
    assert "x-amz-security-token" not in up["headers"]
    assert up["headers"]["authorization"].startswith(f"AWS4-HMAC-SHA256 Credential={BEDROCK_ACCESS_KEY_ID}/")
    assert "/eu-central-1/bedrock/" in up["headers"]["authorization"]


def test_openai_sdk_streams_chat_from_bedrock(backstop, oai, scenario):
    stream = oai.chat.completions.create(
        model="bedrock-claude", messages=_user("streamed chat"), stream=True,
        extra_headers=_hdrs(scenario, "chunks=3"),
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == "mock: streamed chat"


def test_openai_down_then_claude_on_bedrock(backstop, oai, scenario):
    completion = oai.chat.completions.create(
        model="openai-then-bedrock", messages=_user("fail over"),
        extra_headers=_hdrs(scenario),
    )
    assert completion.choices[0].message.content == "mock: fail over"
    # The dead upstream took no mock attempt; Bedrock took one.
    assert backstop.attempts(scenario) == 1
    assert backstop.last_upstream_request(scenario)["path"] == f"/model/{ENCODED_SONNET}/invoke"


def test_throttling_is_retried_and_a_validation_exception_is_the_callers(backstop, anth, scenario):
    msg = anth.messages.create(
        model="bedrock-claude", max_tokens=16, messages=_user("again"),
        extra_headers=_hdrs(scenario, "status=429;code=ThrottlingException,ok"),
    )
    assert msg.content[0].text == "mock: again"
    assert backstop.attempts(scenario) == 2

    invalid = scenario + "-invalid"
    with pytest.raises(anthropic.BadRequestError) as err:
        anth.messages.create(
            model="bedrock-claude", max_tokens=16, messages=_user("bad"),
            extra_headers=_hdrs(invalid, "status=400;code=ValidationException"),
        )
    assert err.value.status_code == 400
    assert err.value.body["error"]["type"] == "invalid_request_error"
    assert err.value.body["error"]["message"] == "mock Bedrock fault: status 400 (ValidationException)"
    assert backstop.attempts(invalid) == 1


def test_an_openai_client_reads_bedrocks_refusal_in_openais_shape(backstop, oai, scenario):
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(
            model="bedrock-claude", messages=_user("bad"),
            extra_headers=_hdrs(scenario, "status=400;code=ValidationException"),
        )
    assert err.value.status_code == 400
    assert err.value.body["message"] == "mock Bedrock fault: status 400 (ValidationException)"
    assert backstop.attempts(scenario) == 1

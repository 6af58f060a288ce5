"""End-to-end tests driving Backstop with the official `openai` Python SDK."""

from __future__ import annotations

import base64
import fnmatch
import struct
import time

import openai
import pytest

from backstop_support import (
    EXACT_ROUTE_MODELS,
    PROVIDER_OPENAI_KEY,
    TENANT_A_KEY,
    WILDCARD_ROUTE_MODELS,
    assert_no_tenant_key,
    assert_openai_error,
)


def _hdrs(scenario: str, **extra: str) -> dict:
    return {"x-mock-scenario": scenario, **extra}


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# --- chat completions ----------------------------------------------------------------------

def test_chat_non_stream(backstop, oai, scenario):
    prompt = "Hello from the openai SDK"
    raw = oai.chat.completions.with_raw_response.create(
        model="gpt-4o",
        messages=[{"role": "system", "content": "be brief"}, *_user(prompt)],
        extra_headers=_hdrs(scenario),
    )
    assert raw.status_code == 200
    request_id = raw.headers.get("x-request-id")
    assert request_id, f"x-request-id header missing; headers: {dict(raw.headers)}"

    completion = raw.parse()
    assert completion.object == "chat.completion"
    assert len(completion.choices) == 1
    choice = completion.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == f"mock: {prompt}"
    assert choice.finish_reason == "stop"
    assert completion.model == "gpt-4o"
    assert completion.usage is not None
    assert completion.usage.prompt_tokens > 0
    assert completion.usage.completion_tokens > 0
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + completion.usage.completion_tokens

    assert backstop.attempts(scenario) == 1
    up = backstop.last_upstream_request(scenario)
    assert up["method"] == "POST"
    assert up["path"] == "/v1/chat/completions"
    assert up["headers"].get("authorization") == f"Bearer {PROVIDER_OPENAI_KEY}"
    assert_no_tenant_key(up)
    assert up["body"]["model"] == "gpt-4o"
    assert up["body"]["messages"] == [{"role": "system", "content": "be brief"}, *_user(prompt)]


def test_chat_last_user_message_is_echoed(oai, scenario):
    messages = [
        {"role": "user", "content": "first question"},
        {"role": "assistant", "content": "first answer"},
        {"role": "user", "content": "second question"},
    ]
    completion = oai.chat.completions.create(model="gpt-4o-mini", messages=messages,
                                             extra_headers=_hdrs(scenario))
    assert completion.choices[0].message.content == "mock: second question"
    assert completion.model == "gpt-4o-mini"


def test_chat_reported_usage_passes_through(oai, scenario):
    completion = oai.chat.completions.create(
        model="gpt-4o", messages=_user("count me"),
        extra_headers=_hdrs(scenario, **{"x-mock-fault": "usage=11/7"}),
    )
    assert completion.choices[0].message.content == "mock: count me"
    assert completion.usage.prompt_tokens == 11
    assert completion.usage.completion_tokens == 7
    assert completion.usage.total_tokens == 18


def test_chat_stream(backstop, oai, scenario):
    prompt = "stream this please, in several pieces"
    stream = oai.chat.completions.create(
        model="gpt-4o", messages=_user(prompt), stream=True, extra_headers=_hdrs(scenario),
    )
    chunks = list(stream)
    assert chunks, "no chunks received"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    with_choices = [c for c in chunks if c.choices]
    content = "".join(c.choices[0].delta.content or "" for c in with_choices)
    assert content == f"mock: {prompt}"
    assert with_choices[0].choices[0].delta.role == "assistant"
    finish = [c.choices[0].finish_reason for c in with_choices if c.choices[0].finish_reason]
    assert finish == ["stop"]
    assert with_choices[-1].choices[0].finish_reason == "stop"

    assert backstop.attempts(scenario) == 1
    up = backstop.last_upstream_request(scenario)
    assert up["body"]["stream"] is True
    assert up["headers"].get("authorization") == f"Bearer {PROVIDER_OPENAI_KEY}"
    assert_no_tenant_key(up)


def test_chat_stream_include_usage(oai, scenario):
    prompt = "usage please"
    stream = oai.chat.completions.create(
        model="gpt-4o", messages=_user(prompt), stream=True,
        stream_options={"include_usage": True}, extra_headers=_hdrs(scenario),
    )
    chunks = list(stream)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == f"mock: {prompt}"
    usage_chunks = [c for c in chunks if not c.choices]
    assert len(usage_chunks) == 1, f"expected exactly one usage-only chunk, got {len(usage_chunks)}"
    assert chunks[-1] is usage_chunks[0], "the usage chunk must be the last chunk"
    usage = usage_chunks[0].usage
    assert usage is not None
    assert usage.prompt_tokens > 0
    assert usage.completion_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_chat_stream_reported_usage(oai, scenario):
    stream = oai.chat.completions.create(
        model="gpt-4o", messages=_user("metered"), stream=True,
        stream_options={"include_usage": True},
        extra_headers=_hdrs(scenario, **{"x-mock-fault": "usage=21/5"}),
    )
    chunks = list(stream)
    usage = chunks[-1].usage
    assert chunks[-1].choices == []
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (21, 5, 26)


def test_chat_stream_is_not_buffered(oai, scenario):
    """With a 300 ms pause between upstream chunks, chunks must reach the client as they are
    produced: the first content chunk arrives long before the stream ends."""
    prompt = "slowly streamed text that is long enough to be split into chunks"
    stream = oai.chat.completions.create(
        model="gpt-4o", messages=_user(prompt), stream=True,
        extra_headers=_hdrs(scenario, **{"x-mock-fault": "chunks=5;chunk_delay=300ms"}),
    )
    first_content_at = None
    last_at = None
    pieces = []
    for chunk in stream:
        now = time.monotonic()
        last_at = now
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
            if first_content_at is None:
                first_content_at = now
    assert "".join(pieces) == f"mock: {prompt}"
    assert len(pieces) >= 2, f"expected the content in several chunks, got {pieces!r}"
    assert first_content_at is not None
    spread = last_at - first_content_at
    # Unbuffered: ~1.2-1.5 s between the first content chunk and the end. Buffered: ~0 s.
    assert spread > 0.6, f"first content chunk arrived only {spread:.3f}s before the end: stream is buffered"


def test_model_rewrite(backstop, oai, scenario):
    completion = oai.chat.completions.create(
        model="rewrite-me", messages=_user("rewrite"), extra_headers=_hdrs(scenario),
    )
    assert completion.choices[0].message.content == "mock: rewrite"
    assert backstop.attempts(scenario) == 1
    up = backstop.last_upstream_request(scenario)
    assert up["body"]["model"] == "gpt-4o-mini"
    assert up["headers"].get("authorization") == f"Bearer {PROVIDER_OPENAI_KEY}"


def test_only_allow_listed_headers_reach_the_upstream(backstop, oai, scenario):
    oai.chat.completions.create(
        model="gpt-4o", messages=_user("headers"),
        extra_headers=_hdrs(scenario, **{
            "x-custom-trace": "trace-42", "x-session-id": "sess-1", "cookie": "a=b",
            "openai-organization": "org-client", "api-key": "bk-guess",
        }),
    )
    up = backstop.last_upstream_request(scenario)
    # Configured for this upstream (forward_headers = ["x-mock-*"]) and the SDK's own.
    assert up["headers"].get("x-mock-scenario") == scenario
    assert up["headers"].get("user-agent", "").startswith("OpenAI/Python")
    for name in ("x-custom-trace", "x-session-id", "cookie", "openai-organization", "api-key"):
        assert name not in up["headers"], f"{name} reached the upstream: {up['headers']}"


def test_tenant_b_key_works(backstop, oai_b, scenario):
    completion = oai_b.chat.completions.create(
        model="gpt-4o", messages=_user("team b"), extra_headers=_hdrs(scenario),
    )
    assert completion.choices[0].message.content == "mock: team b"
    up = backstop.last_upstream_request(scenario)
    assert up["headers"].get("authorization") == f"Bearer {PROVIDER_OPENAI_KEY}"
    assert_no_tenant_key(up)


def test_request_id_is_echoed(oai, scenario):
    raw = oai.chat.completions.with_raw_response.create(
        model="gpt-4o", messages=_user("id"),
        extra_headers=_hdrs(scenario, **{"x-request-id": "abc-123"}),
    )
    assert raw.status_code == 200
    assert raw.headers.get("x-request-id") == "abc-123"


def test_request_ids_are_generated_and_distinct(oai, scenario):
    ids = []
    for _ in range(2):
        raw = oai.chat.completions.with_raw_response.create(
            model="gpt-4o", messages=_user("id"), extra_headers=_hdrs(scenario),
        )
        ids.append(raw.headers.get("x-request-id"))
    assert all(ids), f"missing x-request-id: {ids}"
    assert ids[0] != ids[1]


# --- embeddings ----------------------------------------------------------------------------

def test_embeddings_default_base64(backstop, oai, scenario):
    # The SDK asks for base64 by default and decodes it to floats itself.
    raw = oai.embeddings.with_raw_response.create(
        model="text-embedding-3-small", input=["hello", "world"], extra_headers=_hdrs(scenario),
    )
    assert raw.status_code == 200
    assert raw.headers.get("x-request-id")
    result = raw.parse()
    assert [d.index for d in result.data] == [0, 1]
    for item in result.data:
        assert len(item.embedding) == 8
        assert all(isinstance(x, float) for x in item.embedding)
    assert result.usage is not None
    assert result.usage.prompt_tokens > 0

    up = backstop.last_upstream_request(scenario)
    assert up["path"] == "/v1/embeddings"
    assert up["body"]["encoding_format"] == "base64"
    assert up["body"]["input"] == ["hello", "world"]
    assert up["headers"].get("authorization") == f"Bearer {PROVIDER_OPENAI_KEY}"
    assert_no_tenant_key(up)


def test_embeddings_float(backstop, oai, scenario):
    result = oai.embeddings.create(
        model="text-embedding-3-small", input="just one", encoding_format="float",
        extra_headers=_hdrs(scenario),
    )
    assert len(result.data) == 1
    assert len(result.data[0].embedding) == 8
    assert all(isinstance(x, float) for x in result.data[0].embedding)
    assert backstop.last_upstream_request(scenario)["body"]["encoding_format"] == "float"


def test_embeddings_base64_wire_format(backstop, scenario):
    """Raw wire check: a base64 embedding is 8 little-endian float32 values."""
    r = backstop.post(
        "/v1/embeddings",
        json_body={"model": "text-embedding-3-small", "input": ["a", "b", "c"], "encoding_format": "base64"},
        headers={"authorization": f"Bearer {TENANT_A_KEY}", "x-mock-scenario": scenario},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert len(body["data"]) == 3
    for item in body["data"]:
        assert isinstance(item["embedding"], str)
        raw = base64.b64decode(item["embedding"])
        assert len(raw) == 8 * 4
        assert len(struct.unpack("<8f", raw)) == 8


# --- models --------------------------------------------------------------------------------

def test_models_list(oai):
    ids = [m.id for m in oai.models.list()]
    assert ids, "model list is empty"
    for model in EXACT_ROUTE_MODELS:
        assert model in ids, f"{model!r} missing from /v1/models: {ids}"
    for pattern in WILDCARD_ROUTE_MODELS:
        assert pattern in ids or any(fnmatch.fnmatchcase(i, pattern) for i in ids), (
            f"route {pattern!r} not represented in /v1/models: {ids}"
        )


def test_models_list_requires_key(backstop):
    client = openai.OpenAI(api_key="bk-wrong", base_url=backstop.openai_base_url, max_retries=0)
    with pytest.raises(openai.AuthenticationError) as exc:
        client.models.list()
    assert exc.value.status_code == 401
    assert_openai_error(exc.value.response, status=401, type_="authentication_error", code="invalid_api_key")


# --- errors --------------------------------------------------------------------------------

def test_wrong_key_401(backstop, scenario):
    client = openai.OpenAI(api_key="bk-not-a-tenant", base_url=backstop.openai_base_url, max_retries=0)
    with pytest.raises(openai.AuthenticationError) as exc:
        client.chat.completions.create(model="gpt-4o", messages=_user("x"), extra_headers=_hdrs(scenario))
    assert exc.value.status_code == 401
    assert exc.value.body["type"] == "authentication_error"
    assert exc.value.body["code"] == "invalid_api_key"
    assert_openai_error(exc.value.response, status=401, type_="authentication_error", code="invalid_api_key")
    assert exc.value.response.headers.get("x-request-id")
    assert backstop.attempts(scenario) == 0


def test_provider_key_is_not_a_tenant_key(backstop, scenario):
    client = openai.OpenAI(api_key=PROVIDER_OPENAI_KEY, base_url=backstop.openai_base_url, max_retries=0)
    with pytest.raises(openai.AuthenticationError) as exc:
        client.chat.completions.create(model="gpt-4o", messages=_user("x"), extra_headers=_hdrs(scenario))
    assert exc.value.status_code == 401
    assert backstop.attempts(scenario) == 0


def test_invalid_json_400_via_sdk(backstop, oai, scenario):
    with pytest.raises(openai.BadRequestError) as exc:
        oai.post(
            "/chat/completions", cast_to=object, content=b'{"model": "gpt-4o", "messages": [',
            options={"headers": _hdrs(scenario)},
        )
    assert exc.value.status_code == 400
    assert_openai_error(exc.value.response, status=400, type_="invalid_request_error", code="invalid_json")
    assert backstop.attempts(scenario) == 0


def test_unknown_model_404(backstop, oai, scenario):
    with pytest.raises(openai.NotFoundError) as exc:
        oai.chat.completions.create(model="no-such-model", messages=_user("x"), extra_headers=_hdrs(scenario))
    assert exc.value.status_code == 404
    assert_openai_error(exc.value.response, status=404, type_="invalid_request_error",
                        code="model_not_found", param="model")
    assert backstop.attempts(scenario) == 0


def test_unknown_embedding_model_404(backstop, oai, scenario):
    with pytest.raises(openai.NotFoundError) as exc:
        oai.embeddings.create(model="no-such-embedder", input="x", extra_headers=_hdrs(scenario))
    assert_openai_error(exc.value.response, status=404, type_="invalid_request_error",
                        code="model_not_found", param="model")
    assert backstop.attempts(scenario) == 0


def test_oversize_body_413(backstop, oai, scenario):
    big = "x" * 70_000  # > max_body_bytes = 65536
    with pytest.raises(openai.APIStatusError) as exc:
        oai.chat.completions.create(model="gpt-4o", messages=_user(big), extra_headers=_hdrs(scenario))
    assert exc.value.status_code == 413
    assert_openai_error(exc.value.response, status=413, type_="invalid_request_error", code="request_too_large")
    assert backstop.attempts(scenario) == 0


def test_dead_upstream_502(oai, scenario):
    with pytest.raises(openai.APIStatusError) as exc:
        oai.chat.completions.create(model="dead-model", messages=_user("x"), extra_headers=_hdrs(scenario))
    assert exc.value.status_code == 502
    assert_openai_error(exc.value.response, status=502, type_="upstream_error", code="upstream_unavailable")


def test_attempt_timeout_504(backstop, oai, scenario):
    started = time.monotonic()
    with pytest.raises(openai.APIStatusError) as exc:
        oai.chat.completions.create(
            model="slow-model", messages=_user("x"),
            extra_headers=_hdrs(scenario, **{"x-mock-fault": "delay=2s"}),
        )
    elapsed = time.monotonic() - started
    assert exc.value.status_code == 504
    assert_openai_error(exc.value.response, status=504, type_="upstream_error", code="upstream_timeout")
    # attempt_timeout is 300 ms: the gateway must give up long before the mock's 2 s delay ends.
    assert elapsed < 1.8, f"504 took {elapsed:.2f}s; attempt_timeout=300ms was not enforced"
    assert backstop.attempts(scenario) >= 1


def test_upstream_error_passthrough(backstop, oai, scenario):
    fault = {"x-mock-fault": "status=400"}
    # What the upstream itself answers for this fault (asked directly, in another scenario).
    direct = backstop.http.post(
        f"{backstop.mock_url}/v1/chat/completions",
        json={"model": "gpt-4o", "messages": _user("x")},
        headers={"x-mock-scenario": f"{scenario}-direct", "authorization": "Bearer x", **fault},
    )
    assert direct.status_code == 400

    with pytest.raises(openai.BadRequestError) as exc:
        oai.chat.completions.create(model="gpt-4o", messages=_user("x"), extra_headers=_hdrs(scenario, **fault))
    assert exc.value.status_code == 400
    assert exc.value.response.json() == direct.json()
    # A 400 from the provider is final: not retried.
    assert backstop.attempts(scenario) == 1

"""The OpenAI-compatible HTTP API with the real `openai` SDK (sync and async) and with
httpx for the server-sent-event framing and client disconnects, against the real stack."""

from __future__ import annotations

import asyncio
import json
import math
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import grpc
import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam

from llmmesh.client import internal_channel
from llmmesh.launcher import Stack, StackPorts
from llmmesh.v1 import common_pb2, context_pb2, context_pb2_grpc
from tests.conftest import (
    assert_engines_saw_only,
    collect,
    metric_value,
    prompt_tokens_seen,
    text_of,
    wait_for,
)
from tests.e2e.test_tenants import http_tenant_router

CHAT: list[ChatCompletionMessageParam] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hello there"},
]
HI: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
BOMB: list[ChatCompletionMessageParam] = [{"role": "user", "content": "how to build a bomb"}]


@pytest.fixture(scope="module")
def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.openai_base_url, api_key=stack.api_key, max_retries=0)


def test_chat_completion_whole(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="llm", messages=CHAT, max_tokens=8, extra_body={"ignore_eos": True}, seed=1
    )
    (choice,) = reply.choices
    assert reply.object == "chat.completion" and reply.model == "llm"
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert reply.usage is not None and reply.usage.completion_tokens == 8
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 8


def test_chat_completion_streamed_with_usage(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="llm",
        messages=CHAT,
        max_completion_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
        seed=1,
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] in ("length", "stop") and all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(text.encode()) <= chunks[-1].usage.completion_tokens
    whole = client.chat.completions.create(model="llm", messages=CHAT, max_tokens=8, seed=1)
    assert whole.choices[0].message.content == text  # same seed, same text
    # Stream obfuscation, as OpenAI's: on unless asked not to (the SDK reads the field).
    assert all(c.obfuscation is not None for c in chunks)
    plain = client.chat.completions.create(
        model="llm",
        messages=CHAT,
        max_completion_tokens=8,
        stream=True,
        stream_options={"include_obfuscation": False},
    )
    assert all(c.obfuscation is None for c in plain)


def test_penalties_reach_the_engine(client: openai.OpenAI) -> None:
    """Greedy on the random model repeats itself; a frequency penalty spreads its output
    out, a repetition penalty changes it too, and each is reproducible."""

    def complete(**penalties: float) -> str:
        reply = client.completions.create(
            model="llm",
            prompt="loop",
            max_tokens=48,
            temperature=0,
            extra_body={"ignore_eos": True, **penalties},
        )
        return reply.choices[0].text

    plain = complete()
    spread = complete(frequency_penalty=2.0)
    assert len(spread) == len(plain) == 48 and len(set(spread)) > len(set(plain))
    assert complete(frequency_penalty=2.0) == spread
    assert complete(presence_penalty=2.0, repetition_penalty=1.5) not in (plain, spread)


def test_a_logit_bias_reaches_the_engine(client: openai.OpenAI) -> None:
    reply = client.completions.create(
        model="llm",
        prompt="bias",
        max_tokens=12,
        seed=5,
        logit_bias={"65": 100},  # "A"
        extra_body={"ignore_eos": True},
    )
    assert reply.choices[0].text == "A" * 12
    # the end-of-sequence token (257) made certain, but not before min_tokens
    ending = client.completions.create(
        model="llm",
        prompt="bias",
        max_tokens=12,
        logit_bias={"257": 100},
        extra_body={"min_tokens": 5},
    )
    assert ending.usage is not None and ending.usage.completion_tokens == 6  # 5 and the end
    assert ending.choices[0].finish_reason == "stop" and len(ending.choices[0].text) == 5
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="llm", prompt="bias", logit_bias={"258": 1})
    assert refused.value.body["param"] == "logit_bias"  # type: ignore[index]


POINT = {
    "type": "object",
    "properties": {"x": {"type": "integer"}, "label": {"type": "string", "maxLength": 8}},
    "required": ["x", "label"],
    "additionalProperties": False,
}


def test_a_response_format_holds_the_output_to_json(client: openai.OpenAI) -> None:
    """The random model says nothing sensible, but within the format it says it. (Any
    JSON object, json_object, is the engine's unit tests': this model's keys can run to
    any length, and past max_tokens the object is cut.)"""
    whole = client.chat.completions.create(
        model="llm",
        messages=HI,
        max_tokens=300,
        seed=2,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": POINT}},
    )
    point = json.loads(whole.choices[0].message.content or "")
    assert set(point) == {"x", "label"} and isinstance(point["x"], int)
    assert whole.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(
        model="llm",
        messages=HI,
        max_tokens=300,
        seed=2,
        stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": POINT}},
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert json.loads(text) == point  # the same seed, streamed


def test_vllms_structured_outputs_hold_the_output_to_a_choice_or_a_pattern(
    client: openai.OpenAI, router_channel: grpc.Channel
) -> None:
    """vLLM's ``structured_outputs`` (and its older ``guided_choice``), as vLLM's clients
    send them in the SDK's extra body: the random model's output is one of the choices
    exactly, whatever the seed; over gRPC, the same choice gives the same text."""
    options = ["yes", "no (never)", "ça va"]
    picked = set()
    for seed in range(6):
        extra = (
            {"structured_outputs": {"choice": options}} if seed % 2 else {"guided_choice": options}
        )
        reply = client.completions.create(
            model="llm", prompt="Well?", max_tokens=20, seed=seed, extra_body=extra
        )
        assert reply.choices[0].text in options and reply.choices[0].finish_reason == "stop"
        picked.add(reply.choices[0].text)
    assert len(picked) > 1  # the model chose: the seeds do not all give one option
    stream = client.chat.completions.create(
        model="llm",
        messages=HI,
        max_tokens=20,
        seed=3,
        stream=True,
        extra_body={"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}},
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", text)
    choice = common_pb2.StructuredOutput(choice=common_pb2.StructuredChoice(options=options))
    sent = text_of(
        collect(router_channel, "Well?", max_tokens=20, seed=1, structured_output=choice)
    )
    over_http = client.completions.create(
        model="llm", prompt="Well?", max_tokens=20, seed=1, extra_body={"guided_choice": options}
    )
    assert sent == over_http.choices[0].text


def test_text_completion_and_models(client: openai.OpenAI) -> None:
    reply = client.completions.create(model="llm", prompt="Once upon a", max_tokens=5, seed=2)
    assert reply.object == "text_completion"
    assert reply.usage is not None and reply.usage.prompt_tokens == len("Once upon a") + 1
    models = client.models.list().data
    assert [m.id for m in models] == ["llm", "llm_canary"]
    assert client.models.retrieve("llm_canary").id == "llm_canary"
    # vLLM's max_model_len: the context the model's replicas describe, as /tokenize says.
    context = httpx.post(
        f"{str(client.base_url).rstrip('/').removesuffix('/v1')}/tokenize",
        json={"prompt": "hi"},
        headers={"Authorization": f"Bearer {client.api_key}"},
        timeout=30,
    ).json()["max_model_len"]
    assert context > 0
    assert [(m.model_extra or {}).get("max_model_len") for m in models] == [context, context]
    assert (client.models.retrieve("llm").model_extra or {})["max_model_len"] == context
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("gpt-17")
    assert missing.value.code == "model_not_found"


def test_echo_returns_the_prompt_the_model_read_and_its_tokens_log_probabilities(
    client: openai.OpenAI,
) -> None:
    """The legacy API's echo with logprobs (how evaluation harnesses score a text): the
    prompt after input policy's redaction, each of its tokens scored by the engine (BOS
    precedes the first), then the completion's; streamed, the prompt comes first."""
    prompt = "Write to bob@example.com"
    reply = client.completions.create(
        model="llm", prompt=prompt, echo=True, logprobs=2, max_tokens=3, seed=1
    )
    (choice,) = reply.choices
    read = "Write to [EMAIL]"
    assert choice.text.startswith(read) and len(choice.text) > len(read)
    logprobs = choice.logprobs
    assert logprobs is not None and logprobs.token_logprobs and logprobs.top_logprobs
    assert "".join(logprobs.tokens or []) == choice.text
    assert len(logprobs.token_logprobs) == len(read) + 3
    assert all(lp is not None and lp <= 0.0 for lp in logprobs.token_logprobs)
    assert all(len(top) >= 1 for top in logprobs.top_logprobs)
    assert reply.usage is not None and reply.usage.completion_tokens == 3
    stream = client.completions.create(
        model="llm", prompt=prompt, echo=True, max_tokens=3, seed=1, stream=True
    )
    texts = [c.choices[0].text for c in stream if c.choices]
    assert texts[0].startswith(read) and "".join(texts) == choice.text
    alone = client.completions.create(
        model="llm", prompt=prompt, echo=True, logprobs=1, max_tokens=0
    )  # the prompt alone
    assert alone.choices[0].text == read and alone.choices[0].finish_reason == "length"
    assert alone.choices[0].logprobs is not None
    assert alone.choices[0].logprobs.token_logprobs == logprobs.token_logprobs[: len(read)]
    assert alone.usage is not None and alone.usage.completion_tokens == 0


def test_vllms_tokens_as_token_ids_name_the_byte_models_tokens(client: openai.OpenAI) -> None:
    """With ``return_tokens_as_token_ids`` (how RL trainers read back exactly what was
    sampled) each token is ``token_id:N``: for the byte model N is its byte, in completions
    (the echoed prompt's too, after the BOS) and chat, the bytes still the token's text."""
    reply = client.completions.create(
        model="llm", prompt="Once", echo=True, logprobs=1, max_tokens=4, seed=2,
        extra_body={"return_tokens_as_token_ids": True},
    )  # fmt: skip
    (choice,) = reply.choices
    assert choice.logprobs is not None and choice.logprobs.tokens is not None
    named = [int(t.removeprefix("token_id:")) for t in choice.logprobs.tokens]
    assert bytes(named) == choice.text.encode() and choice.text.startswith("Once")
    assert choice.logprobs.text_offset == list(range(len(choice.text)))
    chat = client.chat.completions.create(
        model="llm", messages=HI, logprobs=True, top_logprobs=2, max_tokens=4, seed=2,
        extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True},
    )  # fmt: skip
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 4
    for entry in [*content, *(top for e in content for top in e.top_logprobs)]:
        byte = entry.bytes or [257]  # the end of sequence has no text
        assert entry.token == f"token_id:{byte[0]}", entry


def test_vllms_return_token_ids_give_the_output_and_prompt_ids(client: openai.OpenAI) -> None:
    """``return_token_ids``: a completion's choice has its tokens' ids and its prompt's as
    the engine read them (the byte model's BOS, then the bytes); a chat's prompt ids are
    beside its choices, as many as its prompt tokens; streamed, each event has its
    tokens' ids and a choice's first the prompt's. Not with tools."""
    ids_asked = {"return_token_ids": True, "ignore_eos": True}
    reply = client.completions.create(
        model="llm", prompt="Once", max_tokens=5, seed=3, n=2, extra_body=ids_asked
    )
    for choice in reply.choices:
        extra = choice.model_extra or {}
        assert extra["prompt_token_ids"] == [256, *b"Once"]
        assert bytes(extra["token_ids"]) == choice.text.encode() and len(choice.text) == 5
    assert reply.choices[0].logprobs is None  # the ids need no log probabilities
    stream = client.completions.create(
        model="llm", prompt="Once", max_tokens=5, seed=3, stream=True, extra_body=ids_asked
    )
    events = [(c.choices[0].model_extra or {}) for c in stream if c.choices]
    assert events[0]["prompt_token_ids"] == [256, *b"Once"]
    assert [e["token_ids"] for e in events[1:] if e["prompt_token_ids"]] == []
    streamed = [i for e in events for i in e["token_ids"]]
    assert streamed == (reply.choices[0].model_extra or {})["token_ids"]
    chat = client.chat.completions.create(
        model="llm", messages=HI, max_tokens=3, seed=3, extra_body=ids_asked
    )
    assert chat.usage is not None
    prompt_ids = (chat.model_extra or {})["prompt_token_ids"]
    assert len(prompt_ids) == chat.usage.prompt_tokens and prompt_ids[0] == 256
    content = chat.choices[0].message.content or ""
    assert bytes((chat.choices[0].model_extra or {})["token_ids"]) == content.encode()
    chunks = client.chat.completions.create(
        model="llm", messages=HI, max_tokens=3, seed=3, stream=True, extra_body=ids_asked
    )
    first, *rest = [c for c in chunks if c.choices]
    assert (first.model_extra or {})["prompt_token_ids"] == prompt_ids
    assert all("prompt_token_ids" not in (c.model_extra or {}) for c in rest)
    ids = [i for c in (first, *rest) for i in (c.choices[0].model_extra or {})["token_ids"]]
    assert bytes(ids) == content.encode()
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model="llm", messages=HI, max_tokens=3, extra_body={"return_token_ids": True},
            tools=[{"type": "function", "function": {"name": "lookup"}}],
        )  # fmt: skip
    assert refused.value.body["param"] == "return_token_ids"  # type: ignore[index]


def test_a_prompt_of_token_ids_is_read_as_given(client: openai.OpenAI) -> None:
    """The byte model's BOS and the text's bytes are the text's own prompt: the same
    seed gives the same output; without the BOS it is another prompt."""
    text = client.completions.create(model="llm", prompt="Once upon", max_tokens=6, seed=4)
    ids = [256, *b"Once upon"]
    same = client.completions.create(model="llm", prompt=ids, max_tokens=6, seed=4)
    assert same.choices[0].text == text.choices[0].text
    assert same.usage is not None and same.usage.prompt_tokens == len(ids)
    several = client.completions.create(
        model="llm", prompt=[ids, list(b"Once upon")], max_tokens=6, seed=4, echo=True
    )
    assert [c.text.startswith("Once upon") for c in several.choices] == [True, True]
    assert several.choices[0].text == "Once upon" + text.choices[0].text
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="llm", prompt=[104, 257], max_tokens=2)
    assert refused.value.body["param"] == "prompt"  # type: ignore[index]


def test_vllms_prompt_logprobs_through_the_sdks_extra_body(client: openai.OpenAI) -> None:
    """A completion's in each choice, a chat's beside its choices: null for the BOS the
    engine puts first, then each prompt token with its two likeliest."""
    reply = client.completions.create(
        model="llm", prompt="Once upon", max_tokens=2, seed=1, extra_body={"prompt_logprobs": 2}
    )
    assert reply.usage is not None
    scored = (reply.choices[0].model_extra or {})["prompt_logprobs"]
    assert len(scored) == reply.usage.prompt_tokens == len("Once upon") + 1
    assert scored[0] is None and not reply.choices[0].text.startswith("Once")
    for entry, byte in zip(scored[1:], b"Once upon", strict=True):
        assert entry[str(byte)]["decoded_token"] == chr(byte)
        assert {e["rank"] for e in entry.values()} >= {1, 2}
    # At the bound of one response (16,384 entries: 780 tokens x 21), through every hop.
    longest = client.completions.create(
        model="llm", prompt="y" * 779, max_tokens=1, extra_body={"prompt_logprobs": 20}
    )
    entries = (longest.choices[0].model_extra or {})["prompt_logprobs"]
    assert len(entries) == 780 and all(len(e) >= 20 for e in entries[1:])
    chat = client.chat.completions.create(
        model="llm", messages=HI, max_tokens=2, extra_body={"prompt_logprobs": 0}
    )
    assert chat.usage is not None
    assert len((chat.model_extra or {})["prompt_logprobs"]) == chat.usage.prompt_tokens


def test_async_client_streams(stack: Stack) -> None:
    async def scenario() -> str:
        client = openai.AsyncOpenAI(base_url=stack.openai_base_url, api_key=stack.api_key)
        stream = await client.chat.completions.create(
            model="llm",
            messages=CHAT,
            max_tokens=6,
            stream=True,
            seed=3,
            extra_body={"ignore_eos": True},
        )
        parts = [c.choices[0].delta.content or "" async for c in stream if c.choices]
        await client.close()
        return "".join(parts)

    assert len(asyncio.run(scenario())) == 6  # one character per token


def test_a_session_keeps_the_conversation(client: openai.OpenAI) -> None:
    headers = {"x-session-id": "openai-session"}
    first = client.chat.completions.create(
        model="llm",
        messages=HI,
        max_tokens=4,
        extra_headers=headers,
    )
    second = client.chat.completions.create(
        model="llm",
        messages=HI,
        max_tokens=4,
        extra_headers=headers,
    )
    assert first.usage is not None and second.usage is not None
    assert second.usage.prompt_tokens > first.usage.prompt_tokens


def test_a_reused_request_id_is_409_and_the_first_turn_stays(
    stack: Stack, client: openai.OpenAI
) -> None:
    """A client that sends one x-request-id with two different questions: the second is
    refused before it is generated (the id keys the stored turn, so it would be lost);
    the first question retried is answered again and stored once."""
    session = f"reuse-{uuid.uuid4().hex[:8]}"
    headers = {"x-session-id": session, "x-request-id": f"id-{session}"}

    answered: list[int] = []  # prompt tokens of each answered request

    def ask(messages: list[ChatCompletionMessageParam]) -> int:
        reply = client.chat.completions.create(
            model="llm", messages=messages, max_tokens=4, extra_headers=headers
        )
        assert reply.usage is not None
        answered.append(reply.usage.prompt_tokens)
        return reply.usage.prompt_tokens

    assert_engines_saw_only(stack, prompt_tokens_seen(stack), lambda: ask(HI))
    before = prompt_tokens_seen(stack)
    other: list[ChatCompletionMessageParam] = [{"role": "user", "content": "another question"}]
    with pytest.raises(openai.ConflictError) as refused:
        ask(other)
    assert refused.value.status_code == 409
    assert refused.value.body["param"] == "x-request-id"  # type: ignore[index]
    # The refused request reached no engine; the retry has the first attempt's history.
    assert_engines_saw_only(stack, before, lambda: ask(HI))
    assert answered[0] == answered[1]
    with internal_channel(stack.address("context"), stack.internal_token) as channel:
        stored = context_pb2_grpc.ContextStub(channel).LoadSession(
            context_pb2.LoadSessionRequest(tenant="demo", session_id=session), timeout=5
        )
    assert [t.text for t in stored.turns][::2] == ["hi"]


def test_a_session_with_tools_stores_the_calls_and_results_never_the_tools(
    stack: Stack, client: openai.OpenAI
) -> None:
    """The random model calls what it must (required, one call); the call and its result
    go into the session as the JSON the model reads, and the tools, the request's own, do
    not."""
    session = {"x-session-id": f"tools-{uuid.uuid4().hex[:8]}"}
    lookup: ChatCompletionToolParam = {
        "type": "function",
        "function": {"name": "lookup", "description": "Finds it"},
    }
    asked: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Find it."}]
    reply = client.chat.completions.create(
        model="llm",
        messages=asked,
        tools=[lookup],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=64,
        extra_headers=session,
    )
    (call,) = reply.choices[0].message.tool_calls or []
    assert call.type == "function" and call.function.name == "lookup"
    assert json.loads(call.function.arguments) == {}
    # Sent back as the SDK's users do: the reply's message as it came, every field set.
    answered = cast(ChatCompletionMessageParam, reply.choices[0].message.model_dump())
    result: ChatCompletionMessageParam = {"role": "tool", "tool_call_id": call.id, "content": "42"}
    client.chat.completions.create(
        model="llm",
        messages=[*asked, answered, result],
        tools=[lookup],
        max_tokens=4,
        extra_headers=session,
    )
    with internal_channel(stack.address("context"), stack.internal_token) as channel:
        stored = context_pb2_grpc.ContextStub(channel).LoadSession(
            context_pb2.LoadSessionRequest(tenant="demo", session_id=session["x-session-id"]),
            timeout=5,
        )
    texts = [t.text for t in stored.turns]
    assert texts[:3] == [
        "Find it.",
        '{"tool_calls": [{"name": "lookup", "arguments": {}}]}',
        '{"tool_response": {"name": "lookup", "content": "42"}}',
    ]
    assert not any("Finds it" in text for text in [stored.system_prompt, *texts])


def test_n_samples_with_a_seed_are_distinct_and_the_same_every_time(
    client: openai.OpenAI,
) -> None:
    def ask() -> list[str]:
        reply = client.completions.create(
            model="llm",
            prompt="Once upon a time",
            max_tokens=12,
            n=3,
            seed=7,
            extra_body={"ignore_eos": True},
        )
        assert reply.usage is not None and reply.usage.completion_tokens == 36
        return [c.text for c in sorted(reply.choices, key=lambda c: c.index)]

    first = ask()
    assert len(set(first)) == 3
    assert ask() == first
    stream = client.completions.create(
        model="llm",
        prompt="Once upon a time",
        max_tokens=12,
        n=3,
        seed=7,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    texts = ["", "", ""]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == first


def test_errors_surface_as_the_sdks_exception_types(stack: Stack, client: openai.OpenAI) -> None:
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=stack.openai_base_url, api_key="nope", max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="gpt-9", messages=CHAT)
    assert missing.value.body["param"] == "model"  # type: ignore[index]
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as unsupported:
        client.chat.completions.create(model="llm", messages=CHAT, functions=[{"name": "f"}])
    assert unsupported.value.body["param"] == "functions"  # type: ignore[index]
    with pytest.raises(openai.PermissionDeniedError, match="deny-weapons") as denied:
        client.chat.completions.create(model="llm", messages=BOMB)
    assert denied.value.code == "policy_violation"
    assert denied.value.body["param"] == "messages[0].content"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        client.get("/nowhere", cast_to=object)


@pytest.fixture(scope="module")
def limited(
    stack: Stack, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, dict[str, str]]]:
    """A router with a tenant allowed one request a minute, one allowed one model, and one
    metered by requests and tokens."""
    tmp = tmp_path_factory.mktemp("openai-limits")
    tenants: dict[str, dict[str, object]] = {
        "hasty": {"id": "hasty", "requests_per_minute": 1},
        "narrow": {"id": "narrow", "models": ["llm"]},
        "metered": {"id": "metered", "requests_per_minute": 3, "tokens_per_minute": 5000},
    }
    with http_tenant_router(stack, tmp, tenants) as got:
        yield got


def test_rate_limits_are_429_with_retry_after(limited: tuple[str, dict[str, str]]) -> None:
    base, keys = limited
    client = openai.OpenAI(base_url=base, api_key=keys["hasty"], max_retries=0)
    client.completions.create(model="llm", prompt="one", max_tokens=1)
    with pytest.raises(openai.RateLimitError) as info:
        client.completions.create(model="llm", prompt="two", max_tokens=1)
    headers = info.value.response.headers
    assert int(headers["Retry-After"]) >= 1
    # To the millisecond for the SDKs, which read it first: the same wait.
    assert math.ceil(int(headers["retry-after-ms"]) / 1000) == int(headers["Retry-After"])
    # And the budget that refused it, as OpenAI's headers show it.
    assert (headers["x-ratelimit-limit-requests"], headers["x-ratelimit-remaining-requests"]) == (
        "1",
        "0",
    )


def test_each_answer_tells_the_tenant_what_its_budgets_have_left(
    limited: tuple[str, dict[str, str]],
) -> None:
    base, keys = limited
    client = openai.OpenAI(base_url=base, api_key=keys["metered"], max_retries=0)
    whole = client.completions.with_raw_response.create(model="llm", prompt="one", max_tokens=2)
    streamed = client.chat.completions.with_raw_response.create(
        model="llm", messages=[{"role": "user", "content": "two"}], max_tokens=2, stream=True
    )
    for _ in streamed.parse():  # the stream read to its end
        pass
    response = client.responses.with_raw_response.create(
        model="llm", input="three", max_output_tokens=2, store=False
    )
    answers = [whole.headers, streamed.headers, response.headers]
    assert (answers[0]["x-ratelimit-limit-requests"], answers[0]["x-ratelimit-limit-tokens"]) == (
        "3",
        "5000",
    )
    left = [h["x-ratelimit-remaining-requests"] for h in answers]
    assert left == ["2", "1", "0"]
    tokens = [int(h["x-ratelimit-remaining-tokens"]) for h in answers]
    assert 5000 > tokens[0] > tokens[1] > tokens[2]  # each prompt's tokens taken at admission
    assert answers[1]["x-ratelimit-reset-requests"].endswith("s")


def test_a_tenant_sees_the_models_it_may_use(limited: tuple[str, dict[str, str]]) -> None:
    base, keys = limited
    client = openai.OpenAI(base_url=base, api_key=keys["narrow"], max_retries=0)
    assert [m.id for m in client.models.list()] == ["llm"]
    assert client.models.retrieve("llm").id == "llm"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("llm_canary")


def test_sse_framing(stack: Stack) -> None:
    headers = {"Authorization": f"Bearer {stack.api_key}"}
    body = {"model": "llm", "prompt": "Once", "max_tokens": 6, "stream": True}
    with httpx.stream(
        "POST", f"{stack.openai_base_url}/completions", json=body, headers=headers, timeout=30
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["x-request-id"]
        raw = b"".join(response.iter_bytes()).decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    for event in events[:-2]:
        assert event.startswith("data: ") and "\n" not in event
        assert json.loads(event.removeprefix("data: "))["object"] == "text_completion"


def test_a_client_that_disconnects_cancels_its_generation(stack: Stack) -> None:
    metrics = f"http://{stack.address('router_metrics')}/metrics"
    labels = {"model": "llm", "outcome": "cancelled"}
    before = metric_value(metrics, "llm_router_requests_total", labels)
    headers = {"Authorization": f"Bearer {stack.api_key}"}
    body = {
        "model": "llm",
        "prompt": "Tell me everything",
        "max_tokens": 1000,
        "stream": True,
        "ignore_eos": True,
        # Greedy: the same text every run, released from its first words on. Sampled
        # text can be held back by the output check until the generation has ended.
        "temperature": 0,
    }
    with httpx.stream(
        "POST", f"{stack.openai_base_url}/completions", json=body, headers=headers, timeout=30
    ) as response:
        next(response.iter_lines())  # the stream is running; now the client leaves
    wait_for(
        lambda: metric_value(metrics, "llm_router_requests_total", labels) > before,
        10,
        "the router to cancel the generation",
    )


def test_policy_unreachable_is_503_for_a_fail_closed_tenant(stack: Stack, tmp_path: Path) -> None:
    with http_tenant_router(
        stack,
        tmp_path,
        {"closed": {"id": "closed-http"}},
        policy_address=f"127.0.0.1:{StackPorts.free().policy}",  # nothing listens there
        upstream_timeout_s="0.5",
    ) as (base, keys):
        client = openai.OpenAI(base_url=base, api_key=keys["closed"], max_retries=0)
        with pytest.raises(openai.InternalServerError) as info:
            client.completions.create(model="llm", prompt="hi", max_tokens=2)
        assert info.value.status_code == 503


def test_n_samples_share_their_prompts_prefill(stack: Stack, client: openai.OpenAI) -> None:
    """n=4 computes the prompt about once: the first sample's prefill is in the engine's
    prefix cache before the other three start, which compute only its last partial
    block."""
    url = f"http://{stack.address('triton_metrics')}/metrics"

    def prefilled() -> float:
        return metric_value(url, "llm_engine_prefill_tokens_total", {"model": "llm"})

    def cost(n: int) -> float:
        before = prefilled()
        prompt = f"[{uuid.uuid4().hex}] " + "the mesh routes every request " * 20
        client.completions.create(
            model="llm", prompt=prompt, max_tokens=2, n=n, extra_body={"ignore_eos": True}
        )
        # The engine publishes its counters at once when it goes idle.
        idle = {"model": "llm"}

        def counted() -> bool:
            running = metric_value(url, "llm_engine_running_sequences", idle)
            return prefilled() > before and running == 0

        wait_for(counted, what="the engine to count the prefill and go idle")
        return prefilled() - before

    one, four = cost(1), cost(4)
    assert one > 600
    assert four < 1.2 * one, (one, four)


def test_a_list_of_prompts_is_answered_in_order(client: openai.OpenAI) -> None:
    prompts = ["Once upon a time", "In a galaxy far away"]
    reply = client.completions.create(
        model="llm", prompt=prompts, max_tokens=4, seed=3, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in reply.choices] == [0, 1]
    each = [
        client.completions.create(
            model="llm", prompt=p, max_tokens=4, seed=3, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
        for p in prompts
    ]
    assert [c.text for c in reply.choices] == each
    assert reply.usage is not None and reply.usage.prompt_tokens == sum(len(p) + 1 for p in prompts)
    # A refusal names the prompt of the list it is about.
    with pytest.raises(openai.PermissionDeniedError) as denied:
        client.completions.create(model="llm", prompt=[prompts[0], "how to build a bomb"])
    assert denied.value.body["param"] == "prompt[1]"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as blank:
        client.completions.create(model="llm", prompt=[prompts[0], "  "])
    assert blank.value.body["param"] == "prompt[1]"  # type: ignore[index]


def test_usage_counts_the_prompt_tokens_the_prefix_cache_held(client: openai.OpenAI) -> None:
    """The engine's count, through Triton, the inference service and the router: none for
    a prompt never seen, whole 16-token blocks of it once seen, streamed or not."""
    # Unseen from its first 16-token block on: the prompt starts with the system message.
    system = f"{uuid.uuid4().hex}: you are an assistant. " * 4
    chat: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": system},
        {"role": "user", "content": "hi"},
    ]
    first = client.chat.completions.create(model="llm", messages=chat, max_tokens=2)
    again = client.chat.completions.create(
        model="llm",
        messages=chat,
        max_tokens=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    usage = list(again)[-1].usage
    assert first.usage is not None and first.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert usage is not None and usage.prompt_tokens_details is not None
    cached = usage.prompt_tokens_details.cached_tokens
    assert cached is not None and cached % 16 == 0
    assert usage.prompt_tokens - 16 < cached < usage.prompt_tokens


def test_a_tenants_cached_prefixes_are_its_own(stack: Stack, tmp_path: Path) -> None:
    """Through the router, Triton and the engine: another tenant's prompt with the same
    prefix is computed afresh (its latency cannot tell whether that prefix was sent
    before), a tenant's own repeat reads it from the cache, and the tenants of one
    prefix_cache_group share."""
    tenants: dict[str, dict[str, object]] = {
        "a": {"id": "cache-a"},
        "b": {"id": "cache-b"},
        "c": {"id": "cache-c", "prefix_cache_group": "org"},
        "d": {"id": "cache-d", "prefix_cache_group": "org"},
    }
    system = f"You are assistant {uuid.uuid4().hex}. " * 4
    chat: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": system},
        {"role": "user", "content": "hi"},
    ]
    with http_tenant_router(stack, tmp_path, tenants) as (base, keys):

        def cached(tenant: str, salt: str | None = None) -> int:
            client = openai.OpenAI(base_url=base, api_key=keys[tenant], max_retries=0)
            extra = {"cache_salt": salt} if salt else None
            reply = client.chat.completions.create(
                model="llm", messages=chat, max_tokens=1, extra_body=extra
            )
            usage = reply.usage
            assert usage is not None and usage.prompt_tokens_details is not None
            return usage.prompt_tokens_details.cached_tokens or 0

        assert [cached(t) for t in ("a", "b", "c")] == [0, 0, 0]
        assert cached("a") > 0 and cached("d") > 0
        # vLLM's cache_salt: a partition within the tenant's own.
        assert cached("a", "user-1") == 0 and cached("a", "user-1") > 0
        client = openai.OpenAI(base_url=base, api_key=keys["a"], max_retries=0)
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(
                model="llm", messages=chat, max_tokens=1, extra_body={"cache_salt": "s" * 257}
            )
        assert info.value.body["param"] == "cache_salt"  # type: ignore[index]

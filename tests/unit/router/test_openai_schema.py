"""The HTTP API's bodies are parsed strictly and every refusal is OpenAI's error JSON
naming the field; the OpenAPI document is built from the models the handlers use."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from pydantic import BaseModel, ConfigDict

from llmmesh.runtime.errors import Unavailable
from llmmesh.types import ModelCard, Sampling
from services.router import openai_api
from services.router.config import HttpSettings, RouterConfig
from services.router.core import RouterCore
from services.router.obfuscation import BUCKET
from services.router.openai_api import OpenAiApi
from services.router.openai_schema import ChatBody, field_path
from services.router.speech import CardSpeeches
from services.router.tenants import Tenants
from tests.unit.router.test_core import (
    CONTEXT,
    DENY_BOMB,
    REDACT_EMAIL,
    Context,
    Inference,
    PolicyService,
    gate,
    make_core,
    rules,
)

MAX_TOKENS = 2
OK = {"model": "llm", "prompt": "hello", "max_tokens": MAX_TOKENS}


def api(settings: HttpSettings | None = None) -> OpenAiApi:
    return OpenAiApi(make_core(gate(), Context(), Inference()), Tenants(), ["llm"], settings)


async def post(path: str, data: bytes, content_type: str = "application/json") -> Any:
    async with TestClient(TestServer(api().app())) as client:
        response = await client.post(path, data=data, headers={"Content-Type": content_type})
        return response.status, await response.json()


def body(**fields: Any) -> bytes:
    return json.dumps(OK | fields).encode()


@pytest.mark.parametrize(
    ("path", "data", "status", "param"),
    [
        ("/v1/completions", body(stream="yes"), 400, "stream"),
        ("/v1/completions", body(max_tokens=True), 400, "max_tokens"),
        ("/v1/completions", body(max_tokens=2.0), 400, "max_tokens"),
        ("/v1/completions", body(stop=["a", 1]), 400, "stop[1]"),
        ("/v1/completions", body(prompt=" \n\t "), 400, "prompt"),
        ("/v1/completions", body(prompt=[104, 300]), 400, "prompt"),
        ("/v1/completions", body(prompt=[[104], [300]]), 400, "prompt[1]"),
        ("/v1/completions", b'{"prompt": "a \\ud800 b"}', 400, "body"),
        ("/v1/completions", b"[" * 100_000 + b"]" * 100_000, 400, "body"),
        (
            "/v1/completions",
            b'{"prompt": "hi", "max_tokens": 1' + b"0" * 400 + b"}",
            400,
            "max_tokens",
        ),
        ("/v1/completions", body(max_tokens=0), 400, "max_tokens"),
        ("/v1/completions", body(max_tokens=5000), 400, "max_tokens"),
        ("/v1/completions", body(temperature=-1.0), 400, "temperature"),
        ("/v1/completions", body(top_p=0.0), 400, "top_p"),
        ("/v1/completions", body(min_p=1.5), 400, "min_p"),
        ("/v1/completions", body(min_p=-0.5), 400, "min_p"),
        ("/v1/completions", body(stop_token_ids=[10, 258]), 400, "stop_token_ids"),
        ("/v1/completions", body(stop_token_ids=[-1]), 400, "stop_token_ids[0]"),
        ("/v1/completions", body(allowed_token_ids=[65, 300]), 400, "allowed_token_ids"),
        ("/v1/completions", body(bad_words=["fine", "  "]), 400, "bad_words"),
        ("/v1/completions", body(seed=-1), 400, "seed"),
        ("/v1/completions", body(stop=[""]), 400, "stop"),
        ("/v1/completions", body(presence_penalty=2.5), 400, "presence_penalty"),
        ("/v1/completions", body(frequency_penalty=-3), 400, "frequency_penalty"),
        ("/v1/completions", body(frequency_penalty="0.5"), 400, "frequency_penalty"),
        ("/v1/completions", body(repetition_penalty=0.0), 400, "repetition_penalty"),
        ("/v1/completions", body(repetition_penalty=1e9), 400, "repetition_penalty"),
        ("/v1/completions", body(min_tokens=3), 400, "min_tokens"),  # max_tokens is 2
        (
            "/v1/completions",
            body(
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
                }
            ),
            400,
            "response_format",
        ),
        (
            "/v1/completions",
            body(response_format={"type": "json_schema", "json_schema": {"schema": {}}}),
            400,
            "response_format.json_schema.name",
        ),
        ("/v1/completions", body(min_tokens=-1), 400, "min_tokens"),
        ("/v1/completions", body(logit_bias={"a": 1}), 400, "logit_bias"),
        ("/v1/completions", body(logit_bias={"-1": 1}), 400, "logit_bias"),
        ("/v1/completions", body(logit_bias={"65": 101}), 400, "logit_bias"),
        ("/v1/completions", body(logit_bias={"258": 1}), 400, "logit_bias"),
        ("/v1/completions", body(logit_bias={"99999999999": 1}), 400, "logit_bias"),
        (
            "/v1/completions",
            body(logit_bias={str(i): 1 for i in range(301)}),
            400,
            "logit_bias",
        ),
        (
            "/v1/chat/completions",
            json.dumps(
                {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5000}
            ).encode(),
            400,
            "max_completion_tokens",
        ),
        ("/v1/completions", b'["not", "an", "object"]', 400, "body"),
        ("/v1/completions", b"\xff\xfe", 400, "body"),
        ("/v1/completions", b"x" * (5 * 1024 * 1024), 413, None),
        (
            "/v1/chat/completions",
            json.dumps({"messages": [{"role": "user", "content": "   "}]}).encode(),
            400,
            "messages[0].content",
        ),
        (
            "/v1/chat/completions",
            json.dumps({"messages": [{"role": "user", "content": [{"type": "text"}]}]}).encode(),
            400,
            "messages[0].content[0].text",
        ),
        # A part or a tool of a type not taken: its type is named, not its other fields.
        (
            "/v1/chat/completions",
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": [{"type": "image_url", "image_url": {}}]}
                    ]
                }
            ).encode(),
            400,
            "messages[0].content[0].type",
        ),
        (
            "/v1/chat/completions",
            json.dumps(
                {
                    "messages": [{"role": "user", "content": "hi"}],
                    "tools": [{"type": "custom", "custom": {}}],
                }
            ).encode(),
            400,
            "tools[0].type",
        ),
    ],
    ids=[
        "stream-string",
        "max_tokens-bool",
        "max_tokens-float",
        "stop-number",
        "blank-prompt",
        "token-id-not-a-byte",
        "token-id-not-a-byte-in-a-list",
        "lone-surrogate",
        "nested-100k",
        "huge-number",
        "max_tokens-zero",
        "max_tokens-over-limit",
        "temperature-negative",
        "top_p-zero",
        "min_p-over-1",
        "min_p-negative",
        "stop_token_ids-not-the-models",
        "stop_token_ids-negative",
        "allowed_token_ids-not-the-models",
        "bad_words-blank",
        "seed-negative",
        "stop-empty",
        "presence_penalty-over-2",
        "frequency_penalty-under-minus-2",
        "frequency_penalty-a-string",
        "repetition_penalty-zero",
        "repetition_penalty-huge",
        "min_tokens-over-max_tokens",
        "json_schema-that-does-not-compile",
        "json_schema-without-a-name",
        "min_tokens-negative",
        "logit_bias-not-a-token-id",
        "logit_bias-negative-id",
        "logit_bias-over-100",
        "logit_bias-past-the-vocabulary",
        "logit_bias-past-int32",
        "logit_bias-301-tokens",
        "max_completion_tokens-over-limit",
        "not-an-object",
        "not-utf8",
        "too-large",
        "blank-message",
        "part-without-text",
        "image-part",
        "custom-tool",
    ],
)
def test_a_bad_body_is_the_clients_error_naming_the_field(
    path: str, data: bytes, status: int, param: str | None
) -> None:
    got, reply = asyncio.run(post(path, data))
    assert got == status
    assert reply["error"]["type"] == "invalid_request_error"
    assert reply["error"]["param"] == param


@pytest.mark.parametrize(
    ("data", "param", "message"),
    [
        (body(prompt=[-5]), "prompt[0]", "greater than or equal to 0"),
        (body(prompt=[[]]), "prompt[0]", "at least 1 item"),
        (body(prompt=[[1, -2]]), "prompt[0][1]", "greater than or equal to 0"),
        (body(prompt="hi", stop=[3]), "stop[0]", "valid string"),
    ],
)
def test_a_union_field_is_refused_for_the_rule_its_value_broke(
    data: bytes, param: str, message: str
) -> None:
    """A value of one of a field's types that breaks that type's rule is refused for the
    rule, not as not being one of the other types."""
    got, reply = asyncio.run(post("/v1/completions", data))
    assert (got, reply["error"]["param"]) == (400, param)
    assert message in reply["error"]["message"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
def test_a_query_parameter_beside_a_body_is_refused_by_name(path: str) -> None:
    """Nothing reads a POST's query: a parameter sent there would be ignored."""
    got, reply = asyncio.run(post(f"{path}?temperature=0", body()))
    assert (got, reply["error"]["param"]) == (400, "temperature")
    assert "query parameter" in reply["error"]["message"]


def test_a_body_that_is_not_json_by_its_content_type_is_415() -> None:
    got, reply = asyncio.run(post("/v1/completions", body(), "text/plain"))
    assert (got, reply["error"]["param"]) == (415, "Content-Type")


def test_a_good_body_is_served() -> None:
    got, reply = asyncio.run(post("/v1/completions", body()))
    assert got == 200 and reply["usage"]["completion_tokens"] == 2


def test_a_body_sent_too_slowly_is_408() -> None:
    async def scenario() -> bytes:
        server = TestServer(api(HttpSettings(body_timeout_s=0.3)).app())
        async with TestClient(server):
            reader, writer = await asyncio.open_connection(server.host, server.port)
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                b'\r\nContent-Length: 100\r\n\r\n{"prompt": '
            )
            reply = await asyncio.wait_for(reader.readuntil(b"}}"), 10)
            writer.close()
            return reply

    head, _, error = asyncio.run(scenario()).partition(b"\r\n\r\n")
    assert head.split()[1] == b"408"
    assert json.loads(error)["error"]["param"] == "body"


def test_the_openapi_document_describes_what_the_handlers_validate() -> None:
    async def scenario() -> dict[str, Any]:
        async with TestClient(TestServer(api().app())) as client:
            response = await client.get("/openapi.json")
            assert response.status == 200
            document: dict[str, Any] = await response.json()
            return document

    document = asyncio.run(scenario())
    assert set(document["paths"]) == {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
        "/v1/responses/{response_id}",
        "/v1/responses/{response_id}/input_items",
        "/v1/models",
        "/v1/models/{model}",
        "/tokenize",
        "/detokenize",
        "/health",
        "/ping",
        "/version",
        "/metrics",
    }
    schemas = document["components"]["schemas"]
    assert schemas["ChatBody"] == {
        k: v
        for k, v in ChatBody.model_json_schema(ref_template="#/components/schemas/{model}").items()
        if k != "$defs"
    }
    assert schemas["ChatBody"]["properties"]["stream"]["type"] == "boolean"
    assert "Message" in schemas and "Error" in schemas
    truncation = schemas["ResponseBody"]["properties"]["truncation"]
    assert truncation["enum"] == ["auto", "disabled"] and truncation["default"] == "disabled"


def test_field_paths_leave_union_tags_out() -> None:
    assert field_path(("stop", "list[str]", 1)) == "stop[1]"
    assert field_path(("messages", 0, "content", "list[TextPart]", 2, "text")) == (
        "messages[0].content[2].text"
    )
    assert field_path(()) == "body"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"response_format": {"type": "grammar"}}, "response_format"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "description": "a reply", "schema": {}},
                }
            },
            "response_format.json_schema.description",
        ),
        ({"best_of": 2}, "best_of"),
        ({"no_such_parameter": 1}, "no_such_parameter"),
        (
            {"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
            "stream_options.continuous_usage_stats",
        ),
        ({"logprobs": 21}, "logprobs"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"skip_special_tokens": False}, "skip_special_tokens"),
        ({"return_hidden_states": True}, "return_hidden_states"),
        ({"spaces_between_special_tokens": False}, "spaces_between_special_tokens"),
        ({"priority": -5}, "priority"),
    ],
)
def test_a_parameter_the_mesh_does_not_implement_is_refused_by_name(
    fields: dict[str, Any], param: str
) -> None:
    got, reply = asyncio.run(post("/v1/completions", body(**fields)))
    assert (got, reply["error"]["param"]) == (400, param)
    assert reply["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("fields", "status", "param"),
    [
        ({"store": False, "service_tier": "auto"}, 200, None),
        ({"store": None, "service_tier": "default"}, 200, None),
        ({"store": True}, 400, "store"),
        ({"service_tier": "priority"}, 400, "service_tier"),
    ],
)
def test_a_chat_takes_store_and_service_tier_where_they_ask_for_nothing(
    fields: dict[str, Any], status: int, param: str | None
) -> None:
    chat = {"model": "llm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    got, reply = asyncio.run(post("/v1/chat/completions", json.dumps(chat | fields).encode()))
    assert got == status
    assert (reply.get("error") or {}).get("param") == param


def test_a_chat_asks_top_logprobs_only_with_logprobs() -> None:
    chat = {"model": "llm", "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}
    got, reply = asyncio.run(post("/v1/chat/completions", json.dumps(chat).encode()))
    assert (got, reply["error"]["param"]) == (400, "top_logprobs")


def test_penalties_reach_the_engine_as_sent() -> None:
    inference = Inference()
    served = OpenAiApi(make_core(gate(), Context(), inference), Tenants(), ["llm"])
    chat = {
        "model": "llm",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": MAX_TOKENS,
        "presence_penalty": -0.5,
        "frequency_penalty": 2,
        "repetition_penalty": 1.3,
        "min_p": 0.25,
        "stop_token_ids": [33, 10, 33],
        "allowed_token_ids": [66, 65],
        "bad_words": ["no way"],
        "logit_bias": {"66": -100, "65": 2.5},
        "min_tokens": 1,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "point", "schema": {"type": "object"}, "strict": True},
        },
    }

    async def scenario() -> int:
        async with TestClient(TestServer(served.app())) as client:
            response = await client.post("/v1/chat/completions", json=chat)
            return response.status

    assert asyncio.run(scenario()) == 200
    (call,) = inference.calls
    sampling = call.sampling
    assert (sampling.presence_penalty, sampling.frequency_penalty) == (-0.5, 2.0)
    assert sampling.repetition_penalty == 1.3
    assert sampling.logit_bias == ((65, 2.5), (66, -100.0)) and sampling.min_tokens == 1
    assert sampling.structured == ("json_schema", '{"type": "object"}')
    sent = json.loads(sampling.to_vllm_json())
    assert sent["min_p"] == 0.25 and sent["stop_token_ids"] == [10, 33]
    assert sent["allowed_token_ids"] == [65, 66] and sent["bad_words"] == ["no way"]
    assert "include_stop_str_in_output" not in sent
    assert sent["frequency_penalty"] == 2.0 and sent["logit_bias"] == {"65": 2.5, "66": -100}


@pytest.mark.parametrize("name", ["include_stop_str_in_output", "no_stop_trim"])
def test_a_stop_string_kept_in_the_text_is_asked_of_the_engine(name: str) -> None:
    """vLLM's include_stop_str_in_output, and SGLang's name for it."""
    inference = Inference()
    served = OpenAiApi(make_core(gate(), Context(), inference), Tenants(), ["llm"])

    async def scenario() -> int:
        async with TestClient(TestServer(served.app())) as client:
            response = await client.post("/v1/completions", json=OK | {"stop": "x", name: True})
            return response.status

    assert asyncio.run(scenario()) == 200
    sent = json.loads(inference.calls[0].sampling.to_vllm_json())
    assert sent["include_stop_str_in_output"] is True


def sampled(path: str, fields: dict[str, Any]) -> tuple[int, Any, Any]:
    """The status, the reply and the structured output that reached the engine."""
    inference = Inference()
    served = OpenAiApi(make_core(gate(), Context(), inference), Tenants(), ["llm"])
    chat = {"model": "llm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

    async def scenario() -> tuple[int, Any]:
        async with TestClient(TestServer(served.app())) as client:
            sent = (chat if "chat" in path else OK) | fields
            response = await client.post(path, json=sent)
            return response.status, await response.json()

    status, reply = asyncio.run(scenario())
    structured = inference.calls[0].sampling.structured if inference.calls else None
    return status, reply, structured


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize(
    ("fields", "structured", "vllm"),
    [
        ({"structured_outputs": {"choice": ["yes", "no (-)"]}}, "choice", ["yes", "no (-)"]),
        ({"guided_choice": ["é"]}, "choice", ["é"]),
        ({"structured_outputs": {"regex": "[ab]+"}}, "regex", "[ab]+"),
        ({"guided_regex": "x"}, "regex", "x"),
        ({"structured_outputs": {"json": {"type": "object"}}}, "json_schema", '{"type": "object"}'),
        ({"guided_json": '{"type": "array"}'}, "json_schema", '{"type": "array"}'),
        ({"structured_outputs": {"json_object": True}}, "json_object", True),
        ({"structured_outputs": {"json_object": False}}, None, None),
        ({"structured_outputs": {"disable_any_whitespace": False}}, None, None),
        # structured_outputs that asks for nothing, beside an older name (found by fuzzing:
        # it was read as the structure and failed)
        ({"structured_outputs": {}, "guided_choice": ["0"]}, "choice", ["0"]),
    ],
)
def test_vllms_structured_outputs_reach_the_engine_as_vllm_has_them(
    path: str, fields: dict[str, Any], structured: str | None, vllm: Any
) -> None:
    """vLLM's ``structured_outputs`` (and its older ``guided_*`` fields) become the core's
    structured output, and the engine gets vLLM's key and value."""
    status, _, got = sampled(path, fields)
    assert status == 200
    if structured is None:
        assert got is None
        return
    assert got is not None and got[0] == structured
    sent = Sampling(max_tokens=2, structured=got).to_vllm_json()
    assert list(json.loads(sent)["structured_outputs"].values()) == [vllm]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        ({"structured_outputs": {"choice": ["a", ""]}}, "structured_outputs.choice[1]"),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
        ({"structured_outputs": {"json": {"type": "nonsense"}}}, "structured_outputs.json"),
        ({"structured_outputs": {"grammar": "root ::= x"}}, "structured_outputs.grammar"),
        ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
        (
            {"structured_outputs": {"json": {}, "disable_any_whitespace": True}},
            "structured_outputs.disable_any_whitespace",
        ),
        (
            {"structured_outputs": {"regex": "a", "choice": ["a"]}},
            "structured_outputs.choice",
        ),
        (
            {"response_format": {"type": "json_object"}, "guided_choice": ["a"]},
            "guided_choice",
        ),
        ({"structured_outputs": {"json_object": True}, "guided_regex": "a"}, "guided_regex"),
        ({"guided_grammar": "root ::= x"}, "guided_grammar"),
        ({"guided_choice": "a"}, "guided_choice"),
    ],
)
def test_a_structured_output_that_cannot_be_served_is_refused_by_name(
    fields: dict[str, Any], param: str
) -> None:
    status, reply, structured = sampled("/v1/completions", fields)
    assert (status, reply["error"]["param"]) == (400, param)
    assert structured is None  # nothing reached the engine


def continued(fields: dict[str, Any], headers: dict[str, str] | None = None) -> Any:
    """A chat that continues the assistant's answer: the status, the reply and the call."""
    inference = Inference()
    served = OpenAiApi(make_core(gate(), Context(), inference), Tenants(), ["llm"])
    chat = {
        "model": "llm",
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "Well, "},
        ],
        "max_tokens": 2,
        "continue_final_message": True,
        "add_generation_prompt": False,
    }

    async def scenario() -> tuple[int, Any]:
        async with TestClient(TestServer(served.app())) as client:
            response = await client.post(
                "/v1/chat/completions", json=chat | fields, headers=headers
            )
            return response.status, await response.json()

    status, reply = asyncio.run(scenario())
    return status, reply, inference.calls


def test_a_conversation_over_the_context_is_refused_naming_the_messages() -> None:
    chat = {"model": "llm", "messages": [{"role": "user", "content": "x" * 3000}]}
    got, reply = asyncio.run(post("/v1/chat/completions", json.dumps(chat).encode()))
    assert (got, reply["error"]["param"]) == (400, "messages")
    assert "leave no room for generation" in reply["error"]["message"]
    status, reply, calls = continued(
        {
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "y" * 3000},
            ]
        }
    )
    assert (status, reply["error"]["param"], calls) == (400, "messages", [])


def test_an_answer_under_way_is_continued_as_vllm_does() -> None:
    """vLLM's continue_final_message: the prompt ends with the assistant's text, left
    open; with echo, the answer's content begins with it; the structure holds what the
    model adds."""
    status, reply, (call,) = continued({})
    assert status == 200
    assert call.prompt == "<|user|>\nhi\n<|assistant|>\nWell, "
    assert reply["choices"][0]["message"]["content"] == "0!"
    status, reply, _ = continued({"echo": True})
    assert (status, reply["choices"][0]["message"]["content"]) == (200, "Well, 0!")
    status, _, (call,) = continued({"structured_outputs": {"regex": "[0-9]!"}})
    assert status == 200 and call.sampling.structured == ("regex", "[0-9]!")


@pytest.mark.parametrize(
    ("fields", "headers", "param"),
    [
        ({"add_generation_prompt": True}, None, "add_generation_prompt"),
        ({"continue_final_message": False}, None, "add_generation_prompt"),
        ({"messages": [{"role": "user", "content": "hi"}]}, None, "messages[0].role"),
        (
            {"tools": [{"type": "function", "function": {"name": "clock"}}]},
            None,
            "tools",
        ),
        ({}, {"x-session-id": "s-1"}, "continue_final_message"),
    ],
)
def test_what_cannot_continue_an_answer_is_refused_by_name(
    fields: dict[str, Any], headers: dict[str, str] | None, param: str
) -> None:
    status, reply, calls = continued(fields, headers)
    assert (status, reply["error"]["param"], calls) == (400, param, [])


def test_parameters_at_the_value_that_asks_for_nothing_are_served() -> None:
    no_ops = {
        "frequency_penalty": 0,
        "presence_penalty": 0.0,
        "logit_bias": {},
        "echo": False,
        "repetition_penalty": 1.0,
        "min_tokens": 0,
        "response_format": {"type": "text"},
    }
    vllm_defaults = {"spaces_between_special_tokens": True, "priority": 0}
    got, reply = asyncio.run(
        post("/v1/completions", body(**no_ops, **vllm_defaults, user="u-1", top_k=5))
    )
    assert got == 200 and reply["usage"]["completion_tokens"] == 2


# What vllm-router adds to every body it forwards (its defaults, as captured from it).
VLLM_ROUTER_COMPLETION = {
    "echo": False, "no_stop_trim": False, "ignore_eos": False, "skip_special_tokens": True,
    "return_hidden_states": False,
}  # fmt: skip
VLLM_ROUTER_CHAT = {
    "logprobs": False, "no_stop_trim": False, "ignore_eos": False,
    "continue_final_message": False, "skip_special_tokens": True, "separate_reasoning": True,
    "stream_reasoning": True, "return_hidden_states": False, "include_reasoning": True,
}  # fmt: skip


def test_what_a_router_in_front_forwards_at_its_defaults_is_served() -> None:
    got, reply = asyncio.run(post("/v1/completions", body(**VLLM_ROUTER_COMPLETION)))
    assert got == 200 and reply["usage"]["completion_tokens"] == 2
    chat = {"model": "llm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    got, reply = asyncio.run(
        post("/v1/chat/completions", json.dumps(chat | VLLM_ROUTER_CHAT).encode())
    )
    assert got == 200 and reply["usage"]["completion_tokens"] == 2
    for name, refused in (
        ("separate_reasoning", "separate_reasoning"),
        ("continue_final_message", "add_generation_prompt"),  # the last message is the user's
    ):
        changed = chat | VLLM_ROUTER_CHAT | {name: not VLLM_ROUTER_CHAT[name]}
        got, reply = asyncio.run(post("/v1/chat/completions", json.dumps(changed).encode()))
        assert (got, reply["error"]["param"]) == (400, refused)


def test_an_unknown_model_is_openais_404_model_not_found() -> None:
    got, reply = asyncio.run(post("/v1/completions", body(model="gpt-9")))
    assert got == 404
    assert reply["error"]["code"] == "model_not_found"
    assert reply["error"]["param"] == "model"


def test_tokenize_and_detokenize_speak_vllms_shapes() -> None:
    async def scenario() -> list[tuple[int, Any]]:
        async with TestClient(TestServer(api().app())) as client:
            replies = []
            for path, doc in (
                ("/tokenize", {"model": "llm", "prompt": "hi", "return_token_strs": True}),
                ("/tokenize", {"prompt": "hi", "add_special_tokens": False}),
                ("/tokenize", {"messages": [{"role": "user", "content": "hi"}]}),
                ("/detokenize", {"model": "llm", "tokens": [104, 105]}),
                ("/detokenize", {"tokens": [104, 300]}),
                ("/tokenize", {"prompt": "hi", "messages": [{"role": "user", "content": "x"}]}),
                ("/tokenize", {"messages": HI, "add_special_tokens": True}),
                ("/tokenize", {"messages": HI, "continue_final_message": True}),
                (
                    "/tokenize",
                    {
                        "messages": [*HI, {"role": "assistant", "content": "Sure"}],
                        "continue_final_message": True,
                        "add_generation_prompt": False,
                    },
                ),
            ):
                response = await client.post(path, json=doc)
                replies.append((response.status, await response.json()))
            return replies

    with_bos, plain, chat, text, bad_id, both, chat_bos, with_cue, open_end = asyncio.run(
        scenario()
    )
    for reply in (with_bos, plain, chat, chat_bos):  # vLLM's documented shapes, exactly
        VllmTokenizeResponse.model_validate(reply[1])
    VllmDetokenizeResponse.model_validate(text[1])
    # The byte-level model: a token per UTF-8 byte, and its BOS (256) before a prompt.
    assert with_bos == (
        200,
        {
            "count": 3,
            "max_model_len": 2048,
            "tokens": [256, 104, 105],
            "token_strs": ["<256>", "h", "i"],
        },
    )
    assert plain[1]["tokens"] == [104, 105] and plain[1]["token_strs"] is None
    # Messages as the model's layout writes them, with the cue for the answer; as vLLM,
    # without the engine's special tokens unless asked (a template writes its own).
    assert bytes(chat[1]["tokens"]).decode() == "<|user|>\nhi\n<|assistant|>\n"
    assert chat_bos[1]["tokens"] == [256, *chat[1]["tokens"]]
    assert with_cue[0] == 400 and with_cue[1]["error"]["param"] == "add_generation_prompt"
    # An answer under way, left open (vLLM's continue_final_message).
    assert bytes(open_end[1]["tokens"]).decode() == "<|user|>\nhi\n<|assistant|>\nSure"
    assert text == (200, {"prompt": "hi"})
    assert bad_id[0] == 400 and bad_id[1]["error"]["param"] == "tokens[1]"
    assert both[0] == 400 and both[1]["error"]["param"] == "prompt"


def test_tokenize_and_detokenize_refuse_a_session_id_by_its_header() -> None:
    """They read only what they are sent; a session's history is not counted, so the
    header that asks for it is refused, not ignored."""

    async def scenario() -> list[tuple[int, Any]]:
        async with TestClient(TestServer(api().app())) as client:
            replies = []
            for path, doc in (
                ("/tokenize", {"prompt": "hi"}),
                ("/detokenize", {"tokens": [104, 105]}),
            ):
                response = await client.post(path, json=doc, headers={"x-session-id": "s1"})
                replies.append((response.status, await response.json()))
            return replies

    for status, reply in asyncio.run(scenario()):
        assert status == 400 and reply["error"]["param"] == "x-session-id", reply
        assert "not taken here" in reply["error"]["message"]


HI = [{"role": "user", "content": "hi"}]


class VllmTokenizeResponse(BaseModel):
    """vLLM's documented ``/tokenize`` response, strict: no field missing, none more, none
    of another type."""

    model_config = ConfigDict(extra="forbid", strict=True)
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class VllmDetokenizeResponse(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    prompt: str


def test_health_version_and_metrics() -> None:
    async def scenario(serving: bool) -> list[tuple[int, str]]:
        core = make_core(gate(), Context(), Inference())
        app = OpenAiApi(
            core, Tenants(), ["llm"], serving=lambda: serving, metrics_token="s3cret"
        ).app()
        async with TestClient(TestServer(app)) as client:
            replies = []
            for path, headers in (
                ("/health", {}),
                ("/ping", {}),
                ("/version", {}),
                ("/metrics", {}),
                ("/metrics", {"x-mesh-token": "s3cret"}),
                ("/metrics", {"Authorization": "Bearer wrong"}),
            ):
                response = await client.get(path, headers=headers)
                replies.append((response.status, await response.text()))
            return replies

    health, ping, version, anonymous, operator, wrong = asyncio.run(scenario(True))
    assert health[0] == ping[0] == 200
    assert json.loads(version[1])["version"]
    assert anonymous[0] == wrong[0] == 401  # metrics name tenants: the mesh's token only
    assert operator[0] == 200 and "llm_router" in operator[1]
    down = asyncio.run(scenario(False))
    assert down[0][0] == down[1][0] == 503


async def post_json(path: str, doc: dict[str, Any], **headers: str) -> tuple[int, Any]:
    async with TestClient(TestServer(api().app())) as client:
        response = await client.post(path, json=doc, headers=headers)
        if response.content_type == "text/event-stream":
            lines = (await response.text()).split("\n\n")
            events = [json.loads(e[6:]) for e in lines if e.startswith("data: {")]
            return response.status, events
        return response.status, await response.json()


def test_echo_puts_the_prompt_and_its_tokens_before_each_choices_own() -> None:
    """OpenAI's legacy echo: the text after the prompt, the prompt's tokens' log
    probabilities first, streamed in the first event."""
    doc = OK | {"prompt": ["hi", "yo"], "echo": True, "logprobs": 1, "max_tokens": 3}
    got, reply = asyncio.run(post_json("/v1/completions", doc))
    assert got == 200
    texts = [c["text"] for c in reply["choices"]]
    assert texts == ["hi01!", "yo01!"]
    logprobs = reply["choices"][0]["logprobs"]
    assert logprobs["tokens"] == ["h", "i", "0", "1", "!"]
    assert logprobs["token_logprobs"] == [-1.0, -1.0, -0.5, -0.5, -0.5]
    assert logprobs["text_offset"] == [0, 1, 2, 3, 4]
    assert reply["usage"]["completion_tokens"] == 6  # the prompts are not output
    got, events = asyncio.run(post_json("/v1/completions", doc | {"stream": True}))
    firsts = [e["choices"][0] for e in events if e["choices"]]
    first = next(c for c in firsts if c["index"] == 1)
    assert first["text"] == "yo0" and first["logprobs"]["tokens"] == ["y", "o", "0"]
    plain = OK | {"echo": True}  # without logprobs: the text only
    got, reply = asyncio.run(post_json("/v1/completions", plain))
    assert reply["choices"][0]["text"] == "hello0!" and reply["choices"][0]["logprobs"] is None


def test_vllms_prompt_logprobs_in_each_completion_choice_and_beside_a_chats() -> None:
    doc = OK | {"prompt": "hi", "prompt_logprobs": 2}
    got, reply = asyncio.run(post_json("/v1/completions", doc))
    assert got == 200 and reply["choices"][0]["text"] == "0!"  # no echo: the output only
    assert reply["choices"][0]["prompt_logprobs"] == [
        None,  # the BOS the engine puts first: nothing precedes it
        {"104": {"logprob": -1.0, "rank": 1, "decoded_token": "h"}},
        {"105": {"logprob": -1.0, "rank": 1, "decoded_token": "i"}},
    ]
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    got, reply = asyncio.run(post_json("/v1/chat/completions", chat | {"prompt_logprobs": 0}))
    scored = reply["prompt_logprobs"]
    assert got == 200 and "prompt_logprobs" not in reply["choices"][0]
    assert len(scored) == reply["usage"]["prompt_tokens"] and scored[0] is None
    written = "".join(next(iter(e.values()))["decoded_token"] for e in scored[1:])
    assert written == "<|user|>\nhi\n<|assistant|>\n"  # the conversation as laid out
    for refused in ({"prompt_logprobs": 0, "stream": True}, {"prompt_logprobs": 21}):
        got, reply = asyncio.run(post_json("/v1/completions", OK | refused))
        assert (got, reply["error"]["param"]) == (400, "prompt_logprobs")
    # More than one response should carry (16,384 entries): 1,001 tokens x 21 each.
    long = OK | {"prompt": "a" * 1000}
    for asked, param in (
        ({"prompt_logprobs": 20}, "prompt_logprobs"),
        ({"echo": True, "logprobs": 20}, "logprobs"),
    ):
        got, reply = asyncio.run(post_json("/v1/completions", long | asked))
        assert (got, reply["error"]["param"]) == (400, param)
        assert "1001 prompt tokens x 21" in reply["error"]["message"]


def test_n_samples_of_an_echoed_prompt_share_its_first_samples_scoring() -> None:
    """Only the first sample asks for the prompt's log probabilities (the others read
    the prompt from the cache); every choice echoes them."""
    inference = Inference()
    doc = OK | {"prompt": "hi", "n": 3, "echo": True, "logprobs": 1, "prompt_logprobs": 0}
    got, reply = asyncio.run(post_to(served_by(inference), doc))
    assert got == 200
    assert [c.sampling.prompt_logprobs for c in inference.calls] == [1, None, None]
    echoed = [c["logprobs"]["token_logprobs"][:2] for c in reply["choices"]]
    assert echoed == [[-1.0, -1.0]] * 3
    assert [len(c["prompt_logprobs"]) for c in reply["choices"]] == [3, 3, 3]


def test_echo_with_max_tokens_0_is_the_prompt_alone() -> None:
    """OpenAI's: the prompt and its tokens' log probabilities, no output, finished by
    length; streamed, one event with all of it."""
    doc = OK | {"prompt": "hi", "echo": True, "logprobs": 0, "max_tokens": 0}
    got, reply = asyncio.run(post_json("/v1/completions", doc))
    (choice,) = reply["choices"]
    assert got == 200 and (choice["text"], choice["finish_reason"]) == ("hi", "length")
    assert choice["logprobs"]["tokens"] == ["h", "i"]
    assert reply["usage"]["completion_tokens"] == 0
    got, events = asyncio.run(post_json("/v1/completions", doc | {"stream": True}))
    texts = [(c["text"], c["finish_reason"]) for e in events for c in e["choices"]]
    assert texts == [("hi", "length")]
    got, reply = asyncio.run(post_json("/v1/completions", OK | {"max_tokens": 0}))
    assert (got, reply["error"]["param"]) == (400, "max_tokens")
    assert "only with echo" in reply["error"]["message"]


def served_by(inference: Inference, *rule_lines: str) -> OpenAiApi:
    policy = gate(PolicyService(rules(*rule_lines))) if rule_lines else gate()
    return OpenAiApi(make_core(policy, Context(), inference), Tenants(), ["llm"])


async def post_to(served: OpenAiApi, doc: dict[str, Any], **headers: str) -> tuple[int, Any]:
    async with TestClient(TestServer(served.app())) as client:
        response = await client.post("/v1/completions", json=doc, headers=headers)
        return response.status, await response.json()


def test_a_prompt_of_token_ids_goes_to_the_engine_as_given_once_its_text_is_checked() -> None:
    """The checks read the ids' text; the engine reads the ids (no BOS added: the usage
    counts them alone); a redaction sends the redacted text instead; a denied one goes
    nowhere."""
    inference = Inference()
    served = served_by(inference, DENY_BOMB, REDACT_EMAIL)
    ids = list(b"once upon")
    got, reply = asyncio.run(post_to(served, OK | {"prompt": ids, "echo": True}))
    assert got == 200 and reply["choices"][0]["text"].startswith("once upon")
    assert reply["usage"]["prompt_tokens"] == len(ids)
    (call,) = inference.calls
    assert (call.prompt, call.prompt_ids) == ("once upon", tuple(ids))
    got, reply = asyncio.run(post_to(served, OK | {"prompt": [256, 104, 105]}))  # BOS first
    assert got == 200
    got, reply = asyncio.run(post_to(served, OK | {"prompt": [list(b"mail a@b.io")]}))
    assert got == 200
    # The BOS kept with its text's ids; a redacted text sent as the checks let it through.
    sent = [(c.prompt, c.prompt_ids) for c in inference.calls[1:]]
    assert sent == [("hi", (256, 104, 105)), ("mail [EMAIL]", ())]
    got, reply = asyncio.run(post_to(served, OK | {"prompt": list(b"how to build a bomb")}))
    assert (got, reply["error"]["param"]) == (403, "prompt") and len(inference.calls) == 3


@pytest.mark.parametrize(
    ("prompt", "headers", "param", "says"),
    [
        ([104, 256], {}, "prompt", "256 (at 1) is not a byte"),  # BOS: no text to check
        ([[0xC3, 0x28]], {}, "prompt[0]", "not UTF-8 text"),
        ([104] * 2047, {}, "prompt", "2047 tokens leave no room"),
        ([104, 105], {"x-session-id": "s-1"}, "prompt", "not taken in a session"),
        ([], {}, "prompt", ""),
    ],
)
def test_token_ids_the_checks_could_not_read_as_the_engine_would_are_refused(
    prompt: list[Any], headers: dict[str, str], param: str, says: str
) -> None:
    inference = Inference()
    got, reply = asyncio.run(post_to(served_by(inference), OK | {"prompt": prompt}, **headers))
    assert (got, reply["error"]["param"]) == (400, param) and says in reply["error"]["message"]
    assert inference.calls == []


def test_echo_in_a_session_is_refused_naming_it() -> None:
    doc = OK | {"echo": True}
    got, reply = asyncio.run(post_json("/v1/completions", doc, **{"x-session-id": "s-1"}))
    assert (got, reply["error"]["param"]) == (400, "echo")


def test_logprobs_in_openais_chat_and_completions_shapes() -> None:
    from llmmesh.types import TokenLogprob
    from services.router.openai_reply import chat_logprobs, completion_logprobs

    tokens = [
        TokenLogprob(9, "Pa", -0.1, 1, ((9, "Pa", -0.1), (4, "Lo", -2.5))),
        TokenLogprob(7, "ris", -0.2, 1, ((7, "ris", -0.2), (3, "r", -3.0))),
    ]
    chat = chat_logprobs(tokens)
    assert chat["content"][0] == {
        "token": "Pa",
        "logprob": -0.1,
        "bytes": [80, 97],
        "top_logprobs": [
            {"token": "Pa", "logprob": -0.1, "bytes": [80, 97]},
            {"token": "Lo", "logprob": -2.5, "bytes": [76, 111]},
        ],
    }
    assert chat["refusal"] is None
    # Completions: parallel lists, offsets counted from where this chunk's text starts; an
    # echoed prompt's first token, which nothing precedes (rank 0), has null ones.
    first = TokenLogprob(5, "The", 0.0, 0)
    assert completion_logprobs([first, *tokens], 10) == {
        "tokens": ["The", "Pa", "ris"],
        "token_logprobs": [None, -0.1, -0.2],
        "top_logprobs": [None, {"Pa": -0.1, "Lo": -2.5}, {"ris": -0.2, "r": -3.0}],
        "text_offset": [10, 13, 15],
    }


def test_tokens_as_token_ids_name_each_token_by_its_id_and_keep_its_text() -> None:
    from llmmesh.types import TokenLogprob
    from services.router.openai_reply import chat_logprobs, completion_logprobs
    from services.router.token_release import REDACTED_TOKEN

    tokens = [
        TokenLogprob(9, "Pa", -0.1, 1, ((9, "Pa", -0.1), (4, "Lo", -2.5))),
        TokenLogprob(REDACTED_TOKEN, "[EMAIL]", -3.0, 0),
    ]
    chat = chat_logprobs(tokens, as_ids=True)["content"]
    assert [(t["token"], t["bytes"]) for t in chat] == [
        ("token_id:9", [80, 97]),
        ("token_id:-1", list(b"[EMAIL]")),
    ]
    assert [t["token"] for t in chat[0]["top_logprobs"]] == ["token_id:9", "token_id:4"]
    whole = completion_logprobs(tokens, 0, as_ids=True)
    assert whole["tokens"] == ["token_id:9", "token_id:-1"]
    assert whole["top_logprobs"][0] == {"token_id:9": -0.1, "token_id:4": -2.5}
    assert whole["text_offset"] == [0, 2]  # counted on the text, not on the names


def test_n_samples_come_back_as_n_choices_whole_and_streamed() -> None:
    async def scenario() -> tuple[Any, list[Any]]:
        async with TestClient(TestServer(api().app())) as client:
            whole = await (await client.post("/v1/completions", json=OK | {"n": 3})).json()
            streamed = await client.post(
                "/v1/completions",
                json=OK | {"n": 2, "stream": True, "stream_options": {"include_usage": True}},
            )
            lines = (await streamed.text()).split("\n\n")
            events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
            return whole, events

    whole, events = asyncio.run(scenario())
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2]
    assert all(c["finish_reason"] == "length" for c in whole["choices"])
    assert whole["usage"]["completion_tokens"] == 3 * MAX_TOKENS
    by_choice = {
        i: [e for e in events if e["choices"] and e["choices"][0]["index"] == i] for i in (0, 1)
    }
    for index, chunks in by_choice.items():
        assert chunks[-1]["choices"][0]["finish_reason"] == "length", index
    assert events[-1]["usage"]["completion_tokens"] == 2 * MAX_TOKENS


@pytest.mark.parametrize(("n", "headers"), [(9, {}), (0, {}), (2, {"x-session-id": "s1"})])
def test_n_is_bounded_and_one_in_a_session(n: int, headers: dict[str, str]) -> None:
    async def scenario() -> tuple[int, Any]:
        async with TestClient(TestServer(api().app())) as client:
            response = await client.post("/v1/completions", json=OK | {"n": n}, headers=headers)
            return response.status, await response.json()

    status, reply = asyncio.run(scenario())
    assert (status, reply["error"]["param"]) == (400, "n")


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_bad_session_id_is_refused_by_its_header_name(path: str) -> None:
    chat = {"model": "llm", "messages": [{"role": "user", "content": "hi"}]}
    doc = OK if path == "/v1/completions" else chat
    status, reply = asyncio.run(post_json(path, doc, **{"x-session-id": "../other"}))
    assert (status, reply["error"]["param"]) == (400, "x-session-id")
    assert reply["error"]["message"].startswith("x-session-id: 1-128 characters")


def test_a_list_of_prompts_gives_n_choices_each_in_order() -> None:
    async def scenario() -> tuple[Any, int, Any]:
        async with TestClient(TestServer(api().app())) as client:
            reply = await client.post("/v1/completions", json=OK | {"prompt": ["a", "bb"], "n": 2})
            too_many = await client.post("/v1/completions", json=OK | {"prompt": ["a"] * 5, "n": 2})
            return await reply.json(), too_many.status, (await too_many.json())["error"]

    whole, status, error = asyncio.run(scenario())
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2, 3]
    assert whole["usage"]["completion_tokens"] == 4 * MAX_TOKENS
    # Each prompt counted once, whatever its samples: "a" and "bb" plus a BOS each.
    assert whole["usage"]["prompt_tokens"] == (1 + 1) + (2 + 1)
    assert (status, error["param"]) == (400, "n")


def test_a_prompt_cache_key_keeps_the_tenants_requests_together() -> None:
    """OpenAI's prompt_cache_key is the replica affinity's key (a session's otherwise):
    the picker sends requests with the same key where the first went."""
    inference = Inference()
    served = OpenAiApi(make_core(gate(), Context(), inference), Tenants(), ["llm"]).app()
    chat = {"model": "llm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    sent = [
        ({**OK, "prompt_cache_key": "shared"}, "/v1/completions", {}),
        (OK, "/v1/completions", {}),
        ({**chat, "prompt_cache_key": "shared"}, "/v1/chat/completions", {"x-session-id": "s1"}),
        (chat, "/v1/chat/completions", {"x-session-id": "s1"}),
    ]

    async def scenario() -> list[int]:
        async with TestClient(TestServer(served)) as client:
            statuses = []
            for doc, path, headers in sent:
                response = await client.post(path, json=doc, headers=headers)
                statuses.append(response.status)
            return statuses

    assert asyncio.run(scenario()) == [200] * 4
    keyed, plain, keyed_session, session = [hints.session_key for hints in inference.hints]
    assert keyed == keyed_session and keyed.endswith("/prompt_cache_key:shared")
    assert plain == "" and session.endswith("/s1")


class _Cards:
    """A card source whose replicas are all away: one that fails, or one that hangs."""

    def __init__(self, hang: bool) -> None:
        self._hang = hang

    async def describe(self, model: str) -> ModelCard:
        if self._hang:
            await asyncio.Event().wait()
        raise Unavailable(f"no replica serves {model}")


@pytest.mark.parametrize("hang", [False, True])
def test_the_models_list_leaves_a_context_out_while_no_replica_describes_it(
    hang: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(openai_api, "CARD_WAIT_S", 0.05)
    core = RouterCore(RouterConfig(), gate(), Context(), Inference(), CardSpeeches(_Cards(hang)))

    async def listed() -> Any:
        async with TestClient(TestServer(OpenAiApi(core, Tenants(), ["llm"]).app())) as client:
            response = await client.get("/v1/models")
            return response.status, await response.json()

    started = int(time.time())
    status, models = asyncio.run(listed())
    assert status == 200
    (card,) = models["data"]
    assert started <= card.pop("created") <= time.time()
    assert card == {"id": "llm", "object": "model", "owned_by": "llm-mesh"}


def test_the_models_list_names_each_models_context() -> None:
    async def listed() -> Any:
        async with TestClient(TestServer(api().app())) as client:
            return await (await client.get("/v1/models")).json()

    (card,) = asyncio.run(listed())["data"]
    assert card["max_model_len"] == CONTEXT


def test_streamed_chunks_are_padded_to_hide_their_texts_length_unless_asked_not_to() -> None:
    """OpenAI's stream obfuscation, on by default: every chunk's JSON is a multiple of
    BUCKET bytes, whatever its text; ``include_obfuscation: false`` leaves it out."""

    async def streamed(options: dict[str, Any]) -> list[str]:
        async with TestClient(TestServer(api().app())) as client:
            doc = OK | {"stream": True, "stream_options": options} if options else OK
            response = await client.post("/v1/completions", json=doc | {"stream": True})
            lines = (await response.text()).split("\n\n")
            return [line[6:] for line in lines if line.startswith("data: {")]

    chunks = asyncio.run(streamed({"include_usage": True}))
    assert len(chunks) >= 3 and all(len(data) % BUCKET == 0 for data in chunks)
    assert all(len(json.loads(data)["obfuscation"]) < BUCKET for data in chunks)
    assert len({len(data) for data in asyncio.run(streamed({}))}) == 1  # texts of one size
    plain = asyncio.run(streamed({"include_obfuscation": False}))
    assert not any("obfuscation" in json.loads(data) for data in plain)

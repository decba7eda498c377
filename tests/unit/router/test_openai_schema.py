"""The HTTP API's bodies are parsed strictly and every refusal is OpenAI's error JSON
naming the field; the OpenAPI document is built from the models the handlers use."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from services.router.config import HttpSettings
from services.router.openai_api import OpenAiApi
from services.router.openai_schema import ChatBody, field_path
from services.router.tenants import Tenants
from tests.unit.router.test_core import Context, Inference, gate, make_core

OK = {"model": "llm", "prompt": "hello", "max_tokens": 2}


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
        ("/v1/completions", b'{"prompt": "a \\ud800 b"}', 400, "body"),
        ("/v1/completions", b"[" * 100_000 + b"]" * 100_000, 400, "body"),
        (
            "/v1/completions",
            b'{"prompt": "hi", "max_tokens": 1' + b"0" * 400 + b"}",
            400,
            "sampling.max_tokens",
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
    ],
    ids=[
        "stream-string",
        "max_tokens-bool",
        "max_tokens-float",
        "stop-number",
        "blank-prompt",
        "lone-surrogate",
        "nested-100k",
        "huge-number",
        "not-an-object",
        "not-utf8",
        "too-large",
        "blank-message",
        "part-without-text",
    ],
)
def test_a_bad_body_is_the_clients_error_naming_the_field(
    path: str, data: bytes, status: int, param: str | None
) -> None:
    got, reply = asyncio.run(post(path, data))
    assert got == status
    assert reply["error"]["type"] == "invalid_request_error"
    assert reply["error"]["param"] == param


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
    assert set(document["paths"]) == {"/v1/chat/completions", "/v1/completions", "/v1/models"}
    schemas = document["components"]["schemas"]
    assert schemas["ChatBody"] == {
        k: v
        for k, v in ChatBody.model_json_schema(ref_template="#/components/schemas/{model}").items()
        if k != "$defs"
    }
    assert schemas["ChatBody"]["properties"]["stream"]["type"] == "boolean"
    assert "Message" in schemas and "Error" in schemas


def test_field_paths_leave_union_tags_out() -> None:
    assert field_path(("stop", "list[str]", 1)) == "stop[1]"
    assert field_path(("messages", 0, "content", "list[TextPart]", 2, "text")) == (
        "messages[0].content[2].text"
    )
    assert field_path(()) == "body"

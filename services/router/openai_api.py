"""OpenAI-compatible HTTP on the router: ``/v1/chat/completions``, ``/v1/completions``
(server-sent events or whole), ``/v1/models``. A second transport over the same core as
the gRPC one, in the same event loop: authentication, admission, policy, sessions,
routing and cancellation (an HTTP client that goes away cancels its generation) behave
identically. Errors are OpenAI's error JSON with the matching status.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from aiohttp import web
from opentelemetry import trace

import llmmesh
from llmmesh.runtime import tracing
from llmmesh.runtime.errors import (
    InvalidArgument,
    MeshError,
)
from llmmesh.runtime.metadata import COLOR, REQUEST_ID, SESSION_ID
from llmmesh.types import Chunk, FinishReason, History, Role, Sampling, Turn
from services.router.config import HttpSettings
from services.router.core import RouterCore
from services.router.http_errors import error_response, http_errors, status_of
from services.router.openai_schema import (
    Body,
    ChatBody,
    CompletionBody,
    Message,
    openapi_document,
    parse_body,
)
from services.router.request import GenerateInput, Generation
from services.router.tenants import Tenants

log = logging.getLogger(__name__)

# The mesh's finish reasons in OpenAI's vocabulary.
_FINISH = {
    FinishReason.LENGTH: "length",
    FinishReason.STOP: "stop",
    FinishReason.CANCELLED: "stop",
    FinishReason.POLICY: "content_filter",
    FinishReason.BUDGET: "length",
}


_ROLES = {"system": Role.SYSTEM, "developer": Role.SYSTEM, "user": Role.USER}


def _sampling(body: Body) -> Sampling:
    if body.n != 1:
        raise InvalidArgument("n", "only n=1 is supported")
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    kwargs: dict[str, Any] = {
        "max_tokens": body.max_completion_tokens or body.max_tokens or 0,
        "ignore_eos": body.ignore_eos,
    }
    for name in ("temperature", "top_p", "seed"):
        if getattr(body, name) is not None:
            kwargs[name] = getattr(body, name)
    return Sampling(stop=stop, **kwargs)


def _inline_history(messages: list[Message]) -> tuple[History, str]:
    """Earlier messages as history, in order (system and developer ones as system turns),
    and the last one, which must be the user's, as the prompt."""
    *earlier, last = messages
    if last.role != "user":
        raise InvalidArgument(
            f"messages[{len(earlier)}].role", "the last message must be the user's"
        )
    turns = tuple(Turn(_ROLES.get(m.role, Role.ASSISTANT), m.text()) for m in earlier)
    return History(turns=turns, total_turns=len(turns)), last.text()


class OpenAiApi:
    def __init__(
        self,
        core: RouterCore,
        tenants: Tenants,
        models: list[str],
        settings: HttpSettings | None = None,
    ) -> None:
        self._core = core
        self._tenants = tenants
        self._models = models
        self._settings = settings or HttpSettings()

    def app(self) -> web.Application:
        app = web.Application(
            client_max_size=self._settings.max_body_bytes, middlewares=[http_errors]
        )
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/openapi.json", self.openapi)
        return app

    async def openapi(self, request: web.Request) -> web.Response:
        return web.json_response(openapi_document(llmmesh.__version__))

    async def models(self, request: web.Request) -> web.Response:
        try:
            self._tenants.authenticate(request.headers.get("Authorization"))
        except MeshError as err:
            return error_response(err)
        data = [
            {"id": m, "object": "model", "created": 0, "owned_by": "llm-mesh"} for m in self._models
        ]
        return web.json_response({"object": "list", "data": data})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        parent = tracing.incoming(request.headers)
        kind = trace.SpanKind.SERVER
        with tracing.tracer.start_as_current_span(f"POST {request.path}", parent, kind=kind):
            return await self._serve_traced(request, chat)

    async def _serve_traced(self, request: web.Request, chat: bool) -> web.StreamResponse:
        request_id = request.headers.get(REQUEST_ID) or uuid.uuid4().hex
        try:
            tenant = self._tenants.authenticate(request.headers.get("Authorization"))
            model = ChatBody if chat else CompletionBody
            body = await parse_body(request, model, self._settings.body_timeout_s)
            generate = self._decode(request, request_id, tenant, body, chat)
            async with self._core.generation(generate) as generation:
                reply = _Reply(request_id, generation.request.model, chat, body)
                if body.stream:
                    return await self._stream(request, generation, reply)
                return await self._whole(generation, reply)
        except MeshError as err:  # before the generation started (later ones are replies)
            response = error_response(err)
            response.headers[REQUEST_ID] = request_id
            return response

    def _decode(
        self, request: web.Request, request_id: str, tenant: str, body: Any, chat: bool
    ) -> GenerateInput:
        session_id = request.headers.get(SESSION_ID, "")
        inline: History | None = None
        if chat:
            history, prompt = _inline_history(body.messages)
            if not session_id:
                inline = history  # with a session, the stored history is the history
        else:
            prompt = body.prompt
        return GenerateInput(
            request_id=request_id,
            tenant=tenant,
            model=body.model,
            prompt=prompt,
            sampling=_sampling(body),
            session_id=session_id,
            color=request.headers.get(COLOR, ""),
            inline_history=inline,
        )

    async def _whole(self, generation: Generation, reply: _Reply) -> web.Response:
        try:
            async for chunk in generation.chunks:
                reply.add(chunk)
        except MeshError as err:
            return error_response(err)
        return web.json_response(reply.whole(generation.prompt_tokens), headers=reply.headers)

    async def _stream(
        self, request: web.Request, generation: Generation, reply: _Reply
    ) -> web.StreamResponse:
        # A client that goes away fails a write, out here: closing the generation's
        # generators at once ends it now (counted as cancelled), not when they are
        # garbage-collected.
        async with contextlib.aclosing(generation.chunks) as chunks:
            # Headers wait for the first chunk: an error before it is still a proper status.
            try:
                first = await anext(chunks)
            except MeshError as err:
                return error_response(err)
            response = web.StreamResponse(
                headers={
                    "Content-Type": "text/event-stream",
                    "Cache-Control": "no-cache",
                    **reply.headers,
                }
            )
            await response.prepare(request)
            events = reply.events(first, chunks, generation.prompt_tokens)
            try:
                async with contextlib.aclosing(events):
                    async for event in events:
                        await response.write(event)
            except MeshError as err:  # after the headers: the error is the last event
                status, kind = status_of(err)
                error = {"error": {"message": err.message, "type": kind, "code": status}}
                await response.write(_sse(error))
        await response.write_eof()
        return response


def _sse(doc: dict[str, Any] | str) -> bytes:
    data = doc if isinstance(doc, str) else json.dumps(doc, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


class _Reply:
    """One response in OpenAI's shapes: chat or text completion, whole or as chunks."""

    def __init__(self, request_id: str, model: str, chat: bool, body: Any) -> None:
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{request_id}"
        self.model = model
        self.chat = chat
        self.created = int(time.time())
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)
        self.headers = {REQUEST_ID: request_id}
        self.parts: list[str] = []
        self.completion_tokens = 0
        self.finish: str | None = None

    def add(self, chunk: Chunk) -> None:
        self.parts.append(chunk.text)
        self.completion_tokens += chunk.num_tokens
        if chunk.finish_reason is not None:
            self.finish = _FINISH[chunk.finish_reason]

    def _usage(self, prompt_tokens: int) -> dict[str, int]:
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": prompt_tokens + self.completion_tokens,
        }

    def whole(self, prompt_tokens: int) -> dict[str, Any]:
        text = "".join(self.parts)
        choice: dict[str, Any] = {"index": 0, "finish_reason": self.finish, "logprobs": None}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": self._usage(prompt_tokens),
        }

    def _chunk(self, text: str, finish: str | None, first: bool) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
        if self.chat:
            delta: dict[str, Any] = {"content": text}
            if first:
                delta["role"] = "assistant"
            choice["delta"] = delta
        else:
            choice["text"] = text
        return {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }

    async def events(
        self, first: Chunk, rest: AsyncIterator[Chunk], prompt_tokens: int
    ) -> AsyncGenerator[bytes, None]:
        chunk, is_first = first, True
        while True:
            self.add(chunk)
            finish = _FINISH[chunk.finish_reason] if chunk.finish_reason is not None else None
            if chunk.text or finish or is_first:
                yield _sse(self._chunk(chunk.text, finish, is_first))
                is_first = False
            if finish is not None:
                break
            chunk = await anext(rest)
        if self.include_usage:
            usage = {
                **self._chunk("", None, False),
                "choices": [],
                "usage": self._usage(prompt_tokens),
            }
            yield _sse(usage)
        yield _sse("[DONE]")

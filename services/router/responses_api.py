"""OpenAI's Responses API on the router: ``POST /v1/responses`` (whole or streamed),
``GET`` and ``DELETE /v1/responses/{id}``.

A stored response is a session in the context service, named by the response's id and
holding the conversation up to and including its answer; the response object is that
session's metadata. ``previous_response_id`` forks the previous response's session into
the new one, so a conversation may branch from any response and every response stays as
it was answered. The generation itself is the router core's, as for chat: the session is
loaded with the tenant's truncation strategy, the new input items continue it, policy
checks everything the model will read before anything of it is stored, and the answer is
recorded with the items. A response id is ``resp_`` and 32 hex digits, the first 16 the
conversation's (what keeps a conversation on its replica), the rest the response's own.
Another tenant's response is not found, exactly like one that does not exist.
"""

from __future__ import annotations

import contextlib
import re
import time
import uuid

from aiohttp import web

from llmmesh.runtime.errors import FieldError, InvalidArgument, MeshError
from llmmesh.runtime.metadata import COLOR, REQUEST_ID, SESSION_ID
from llmmesh.types import Role, Turn
from services.router.config import HttpSettings
from services.router.core import RouterCore
from services.router.http_errors import error_response
from services.router.openai_reply import Choice
from services.router.openai_schema import parse_body
from services.router.rate_limits import rate_limit_headers
from services.router.request import GenerateInput, Generation, SessionUse
from services.router.response_items import (
    ItemPage,
    affinity_of,
    check_storable,
    echoed,
    input_items,
    input_record,
    sampling_of,
    stored_items,
    tool_use,
    unknown_outputs,
)
from services.router.response_object import ResponseDraft
from services.router.responses_schema import ResponseBody
from services.router.tenants import Tenants
from services.router.tool_calls import ToolUse
from services.router.tool_stream import ToolStream
from services.router.upstreams import SessionRecords

SESSION_HEADER_REFUSED = (
    "not taken here: a response continues a conversation with previous_response_id"
)
RESPONSE_ID = re.compile(r"^resp_([0-9a-f]{16})([0-9a-f]{16})$")


class ResponseNotFound(FieldError):
    code, http_status, http_type = "NOT_FOUND", 404, "invalid_request_error"


def _not_found(field: str, response_id: str) -> ResponseNotFound:
    return ResponseNotFound(field, f"no response with id '{response_id[:80]}'")


def _conversation(response_id: str, field: str) -> str:
    """The conversation part of a response id; not found if it is not one."""
    match = RESPONSE_ID.match(response_id)
    if match is None:
        raise _not_found(field, response_id)
    return match.group(1)


class ResponsesApi:
    def __init__(
        self,
        core: RouterCore,
        tenants: Tenants,
        records: SessionRecords,
        settings: HttpSettings | None = None,
    ) -> None:
        self._core = core
        self._tenants = tenants
        self._records = records
        self._settings = settings or HttpSettings()

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/responses", self.create)
        app.router.add_get("/v1/responses/{response_id}", self.retrieve)
        app.router.add_delete("/v1/responses/{response_id}", self.delete)
        app.router.add_get("/v1/responses/{response_id}/input_items", self.input_items)

    async def retrieve(self, request: web.Request) -> web.Response:
        try:
            tenant = self._tenants.authenticate(request.headers.get("Authorization"))
            response_id = request.match_info["response_id"]
            _conversation(response_id, "response_id")
            for name in request.query:  # include, stream, starting_after: none kept
                raise InvalidArgument(name.removesuffix("[]"), "not supported")
            draft = await self._stored(tenant, response_id, "response_id")
        except MeshError as err:
            return error_response(err)
        return web.json_response(draft.object())

    async def input_items(self, request: web.Request) -> web.Response:
        """The response's input items, a page at a time (OpenAI's list: ``order``,
        ``limit``, ``after``)."""
        try:
            tenant = self._tenants.authenticate(request.headers.get("Authorization"))
            response_id = request.match_info["response_id"]
            _conversation(response_id, "response_id")
            page = ItemPage.of(request.query)
            draft, turns = await self._stored_with_turns(tenant, response_id, "response_id")
            listed = page.list(stored_items(response_id, draft.input, turns[:-1]))
        except MeshError as err:
            return error_response(err)
        return web.json_response(listed)

    async def _stored(self, tenant: str, response_id: str, field: str) -> ResponseDraft:
        """The tenant's stored response, or not found naming ``field``."""
        draft, _ = await self._stored_with_turns(tenant, response_id, field)
        return draft

    async def _stored_with_turns(
        self, tenant: str, response_id: str, field: str
    ) -> tuple[ResponseDraft, tuple[Turn, ...]]:
        """The tenant's stored response and its session's turns (the answer last)."""
        stored = await self._records.read(tenant, response_id)
        draft = None
        if stored is not None and stored.turns and stored.turns[-1].role is Role.ASSISTANT:
            text = stored.turns[-1].text
            draft = ResponseDraft.from_record(
                response_id, stored.metadata, stored.system_prompt, text
            )
        if draft is None or stored is None:
            raise _not_found(field, response_id)
        return draft, stored.turns

    async def delete(self, request: web.Request) -> web.Response:
        try:
            tenant = self._tenants.authenticate(request.headers.get("Authorization"))
            response_id = request.match_info["response_id"]
            _conversation(response_id, "response_id")
            if not await self._records.delete(tenant, response_id):
                raise _not_found("response_id", response_id)
        except MeshError as err:
            return error_response(err)
        return web.json_response({"id": response_id, "object": "response", "deleted": True})

    async def create(self, request: web.Request) -> web.StreamResponse:
        try:
            tenant = self._tenants.authenticate(request.headers.get("Authorization"))
            body = await parse_body(request, ResponseBody, self._settings.body_timeout_s)
            if request.headers.get(SESSION_ID):  # asks for a session it would not get
                raise InvalidArgument(SESSION_ID, SESSION_HEADER_REFUSED)
            previous = body.previous_response_id
            conversation = _conversation(previous, "previous_response_id") if previous else ""
            conversation = conversation or uuid.uuid4().hex[:16]
            response_id = f"resp_{conversation}{uuid.uuid4().hex[:16]}"
            request_id = request.headers.get(REQUEST_ID) or response_id
            tools, settings = tool_use(body), echoed(body)
            check_storable(body, settings)
            obfuscated = body.obfuscated()
            decoded = await self._decode(request, body, tenant, tools, (request_id, response_id))
        except MeshError as err:
            return error_response(err)
        draft = ResponseDraft(
            response_id,
            decoded.model,
            int(time.time()),
            settings,
            body.instructions,
            tools=ToolStream() if tools else None,
            streaming=body.stream,
            obfuscated=obfuscated,
        )
        draft.metadata = dict(body.metadata or {})
        draft.input = input_record(body)
        created = body.store and bool(previous)  # the fork made the session already
        try:
            async with self._core.generation(decoded) as generation:
                first = Choice(await anext(generation.chunks), generation.chunks)
                draft.model = generation.request.model
                headers = {REQUEST_ID: request_id, **rate_limit_headers(generation.prepared.lease)}
                if body.stream:
                    return await self._stream(request, generation, first, draft, headers)
                return await self._whole(generation, first, draft, headers)
        except MeshError as err:  # before the first chunk: nothing was answered
            if created:
                with contextlib.suppress(MeshError):
                    await self._records.delete(tenant, response_id)
            response = error_response(err, body.field_names())
            response.headers[REQUEST_ID] = request_id
            return response

    async def _decode(
        self,
        request: web.Request,
        body: ResponseBody,
        tenant: str,
        tools: ToolUse | None,
        ids: tuple[str, str],
    ) -> GenerateInput:
        """The core's request; with ``store``, the response's session is the previous
        one's fork (or is made by the answer's record); without, the previous one's
        session is read and never written. ``ids``: the request's and the response's."""
        request_id, response_id = ids
        sampling = sampling_of(body, tools)  # refusals first: a fork is the last step
        previous = body.previous_response_id
        earlier_calls: dict[str, str] | None = None  # the previous response's, if read
        if previous and unknown_outputs(body):
            draft = await self._stored(tenant, previous, "previous_response_id")
            earlier_calls = {item.call_id: item.name for item in draft.items if item.call_id}
        items = input_items(body, earlier_calls or {})
        session_id = ""
        if previous:
            if body.store:
                ttl = self._tenants.spec(tenant).session_ttl_s
                try:
                    await self._records.fork(
                        tenant, previous, response_id, system_prompt="", metadata={}, ttl_s=ttl
                    )
                except MeshError as err:
                    if err.code == "NOT_FOUND":
                        raise _not_found("previous_response_id", previous) from None
                    raise
                session_id = response_id
            else:
                found = earlier_calls is not None  # read above
                if not found and await self._records.read(tenant, previous) is None:
                    raise _not_found("previous_response_id", previous)
                session_id = previous
        elif body.store:
            session_id = response_id
        use = SessionUse(
            record=body.store,
            # Instructions are the response's own: never carried over from the previous.
            instructions=(body.instructions or "") if session_id else body.instructions,
            affinity=affinity_of(body, response_id[5:21] if session_id else ""),
            may_truncate=body.truncation == "auto",
            tools=tools.instructions() if tools else "",
        )
        return GenerateInput(
            request_id=request_id,
            tenant=tenant,
            model=body.model,
            prompt=items.prompt,
            sampling=sampling,
            session_id=session_id,
            color=request.headers.get(COLOR, ""),
            inline_history=items.history,
            inline_field="input",
            inline_names=items.names,
            session_use=use,
            cache_salt=body.cache_salt or "",
        )

    async def _finish(
        self, generation: Generation, draft: ResponseDraft, tokens: int, cached: int
    ) -> None:
        """The usage, and with ``store`` the record, before the client hears the end."""
        draft.finish(generation.prompt_tokens, tokens, cached)
        if not draft.settings["store"]:
            return
        history = generation.history
        instructions = history.system_prompt if history is not None else ""
        draft.instructions = instructions or None  # as policy let it through
        ttl = self._tenants.spec(generation.request.tenant).session_ttl_s
        await self._records.put(
            generation.request.tenant, draft.id, instructions, draft.record(), ttl
        )

    async def _whole(
        self, generation: Generation, first: Choice, draft: ResponseDraft, headers: dict[str, str]
    ) -> web.Response:
        tokens = 0
        try:
            async for chunk in first.chunks():
                draft.add(chunk)
                tokens += chunk.num_tokens
            await self._finish(generation, draft, tokens, first.first.cached_tokens)
        except MeshError as err:
            return error_response(err)
        return web.json_response(draft.object(), headers=headers)

    async def _stream(
        self,
        request: web.Request,
        generation: Generation,
        first: Choice,
        draft: ResponseDraft,
        headers: dict[str, str],
    ) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **headers}
        )
        await response.prepare(request)
        for event in draft.opening():
            await response.write(event)
        tokens = 0
        try:
            async for chunk in first.chunks():
                for event in draft.add(chunk):
                    await response.write(event)
                tokens += chunk.num_tokens
            await self._finish(generation, draft, tokens, first.first.cached_tokens)
            for event in draft.closing():
                await response.write(event)
        except MeshError as err:  # after the headers: the error ends the events
            draft.fail(err)
            for event in draft.failure(err.code.lower(), err.message):
                await response.write(event)
        await response.write_eof()
        return response

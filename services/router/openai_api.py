"""OpenAI-compatible HTTP on the router: ``/v1/chat/completions``, ``/v1/completions``
(server-sent events or whole), ``/v1/models``. A second transport over the same core as
the gRPC one, in the same event loop: authentication, admission, policy, sessions,
routing and cancellation (an HTTP client that goes away cancels its generation) behave
identically. Errors are OpenAI's error JSON with the matching status.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from aiohttp import web
from opentelemetry import trace
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

import llmmesh
from llmmesh.policy import Part
from llmmesh.runtime import tracing
from llmmesh.runtime.beside_loop import beside_loop_if_long
from llmmesh.runtime.errors import (
    InvalidArgument,
    MeshError,
    ModelNotFound,
    Unauthenticated,
    Unavailable,
)
from llmmesh.runtime.internal_auth import INTERNAL_TOKEN
from llmmesh.runtime.metadata import COLOR, REQUEST_ID, SESSION_ID
from llmmesh.types import PENALTIES, History, Role, Sampling, TokenLogprob, Turn
from services.router.canary_watch import CanaryWatch
from services.router.config import HttpSettings
from services.router.core import RouterCore
from services.router.http_errors import error_response, http_errors, status_of
from services.router.openai_reply import (
    Choice,
    Reply,
    echoed,
    merged,
    prompt_alone,
    sse,
    vllm_prompt_logprobs,
)
from services.router.openai_schema import (
    MAX_CHOICES,
    ChatBody,
    CompletionBody,
    DetokenizeBody,
    Message,
    TokenizeBody,
    parse_body,
)
from services.router.openapi_doc import openapi_document
from services.router.prompt import render_last
from services.router.rate_limits import rate_limit_headers
from services.router.request import GenerateInput, SessionUse
from services.router.responses_api import ResponsesApi
from services.router.tenants import Lease, Tenants
from services.router.tool_calls import ToolUse, conversation, tool_use, tools_asked

log = logging.getLogger(__name__)


def _sampling(body: ChatBody | CompletionBody, tools: ToolUse | None) -> Sampling:
    body.check_no_ops()
    alone = isinstance(body, CompletionBody) and body.prompt_alone()
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    kwargs: dict[str, Any] = {
        # The prompt alone still takes the engine's first token (dropped): its last
        # position's logits are computed with the rest of the prompt's anyway.
        "max_tokens": 1 if alone else body.max_completion_tokens or body.max_tokens or 0,
        "ignore_eos": body.ignore_eos,
        "include_stop_str_in_output": body.include_stop_str_in_output or body.no_stop_trim,
        "logprobs": body.logprobs_wanted(),
        "prompt_logprobs": body.prompt_logprobs_wanted(),
        "logit_bias": body.biases(),
        "min_tokens": body.min_tokens,
        "stop_token_ids": tuple(sorted(set(body.stop_token_ids or ()))),
        "allowed_token_ids": tuple(sorted(set(body.allowed_token_ids or ()))),
        "bad_words": tuple(body.bad_words or ()),
        "return_token_ids": body.return_token_ids,
        "structured": tools.structure() if tools else body.structure(),
    }
    for name in ("temperature", "top_p", "seed", "top_k", "min_p", *PENALTIES):
        if getattr(body, name) is not None:
            kwargs[name] = getattr(body, name)
    return Sampling(stop=stop, **kwargs)


def _sample(prompt: GenerateInput, choice: int, index: int) -> GenerateInput:
    """Sample ``index`` of a prompt, choice ``choice`` of the reply: its own request id,
    seed + index with a seed, and no prompt log probabilities but for the first sample."""
    seed = prompt.sampling.seed
    sampling = replace(prompt.sampling, seed=None if seed is None else seed + index)
    if index > 0:
        sampling = replace(sampling, prompt_logprobs=None)
    return replace(prompt, request_id=f"{prompt.request_id}.{choice}", sampling=sampling)


CARD_WAIT_S = 2.0  # how long the models' list waits for a model's card (cached after)


def _model_object(name: str, created: int, max_model_len: int | None) -> dict[str, Any]:
    """OpenAI's model object, with vLLM's ``max_model_len`` (its context, in tokens) when
    a replica has described the model; ``created``: when this router began serving it."""
    card = {"id": name, "object": "model", "created": created, "owned_by": "llm-mesh"}
    return card if max_model_len is None else {**card, "max_model_len": max_model_len}


def _inline_history(messages: list[Message], role: Role) -> tuple[History, str]:
    """Earlier messages as history, in order (system and developer ones as system turns),
    and the last one as the prompt: the user's (or a tool's result), or the assistant's
    when it starts the answer (``role``)."""
    *earlier, (last_role, last) = conversation(messages)
    if last_role != role:
        raise InvalidArgument(
            f"messages[{len(earlier)}].role", "the last message must be the user's or a tool's"
        )
    turns = tuple(Turn(role, text) for role, text in earlier)
    return History(turns=turns, total_turns=len(turns)), last


@dataclass(frozen=True)
class _Echo:
    """OpenAI's ``echo``: the k likeliest of each prompt token's (None: no log
    probabilities), and whether the prompt comes alone (``max_tokens: 0``)."""

    top: int | None
    alone: bool

    @classmethod
    def of(cls, body: ChatBody | CompletionBody) -> _Echo | None:
        if isinstance(body, ChatBody):  # vLLM's: the answer's start, continued
            return cls(None, False) if body.echo and body.continue_final_message else None
        if not body.echo:
            return None
        return cls(body.echoed_logprobs(), body.prompt_alone())


@dataclass(frozen=True)
class _Started:
    """A request's generations, each at its first chunk: the model, the prompts' tokens
    (each prompt once, whatever its samples), and the choices in order."""

    model: str
    prompt_tokens: int
    choices: list[Choice]
    cached_tokens: int = 0  # of the prompts' tokens, read from the engine's prefix cache
    rate_limits: dict[str, str] = field(default_factory=dict)  # as the last admission left them


class OpenAiApi:
    def __init__(
        self,
        core: RouterCore,
        tenants: Tenants,
        models: list[str],
        settings: HttpSettings | None = None,
        *,
        serving: Callable[[], bool] = lambda: True,
        metrics_token: str = "",
        responses: ResponsesApi | None = None,
        canary: CanaryWatch | None = None,
    ) -> None:
        """``serving``: whether some replica of some model can serve now (``/health``);
        ``metrics_token``: what ``/metrics`` and ``/internal/canary`` ask for (the mesh's
        internal token); ``responses``: the Responses API, served alongside; ``canary``:
        what the canary analysis reads (``/internal/canary``)."""
        self._core = core
        self._tenants = tenants
        self._models = models
        self._settings = settings or HttpSettings()
        self._serving = serving
        self._metrics_token = metrics_token
        self._responses = responses
        self._canary = canary
        self._started = int(time.time())

    def app(self) -> web.Application:
        app = web.Application(
            client_max_size=self._settings.max_body_bytes, middlewares=[http_errors]
        )
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model:.+}", self.model)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/health", self.health)
        app.router.add_get("/ping", self.health)
        app.router.add_get("/version", self.version)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/openapi.json", self.openapi)
        if self._responses is not None:
            self._responses.add_routes(app)
        if self._canary is not None:
            app.router.add_get("/internal/canary", self.canary)
        return app

    async def openapi(self, request: web.Request) -> web.Response:
        return web.json_response(openapi_document(llmmesh.__version__))

    async def health(self, request: web.Request) -> web.Response:
        """200 while some replica of some model can serve (as vLLM's server answers once
        its engine runs), 503 otherwise; no credentials needed, as for a load balancer."""
        if self._serving():
            return web.Response(status=200)
        return error_response(Unavailable("no replica of any model can serve now"))

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": llmmesh.__version__})

    def _mesh_only(self, request: web.Request, what: str) -> web.Response | None:
        """A refusal unless the caller presents the mesh's token (``x-mesh-token``, or as
        the bearer token)."""
        if not self._metrics_token:
            return None
        bearer = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
        given = request.headers.get(INTERNAL_TOKEN) or bearer
        if hmac.compare_digest(given.encode(), self._metrics_token.encode()):
            return None
        return error_response(Unauthenticated(f"{what} need the mesh's token (x-mesh-token)"))

    async def canary(self, request: web.Request) -> web.Response:
        """What the canary analysis reads: samples and drift since ``since`` (Unix
        seconds), for the rollout controller (it names tenants' traffic: the mesh's only)."""
        refused = self._mesh_only(request, "the canary observations")
        if refused is not None or self._canary is None:
            return refused or error_response(Unavailable("no canary observations here"))
        try:
            since = float(request.query.get("since", "0"))
        except ValueError:
            return error_response(InvalidArgument("since", "Unix seconds"))
        return web.json_response(self._canary.snapshot(since))

    async def metrics(self, request: web.Request) -> web.Response:
        """The router's Prometheus registry, as on its metrics port, for a caller that
        presents the mesh's token: its labels name tenants, which one tenant must not
        learn of another."""
        refused = self._mesh_only(request, "the metrics")
        if refused is not None:
            return refused
        response = web.Response(body=generate_latest(REGISTRY))
        response.content_type = CONTENT_TYPE_LATEST.split(";")[0]
        response.charset = "utf-8"
        return response

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's ``/tokenize``: a prompt's tokens in the model's tokenizer, or those of
        messages as the model's chat template writes them."""
        try:
            tenant = self._tenants.authenticate(request.headers.get("Authorization"))
            body = await parse_body(request, TokenizeBody, self._settings.body_timeout_s)
            _refuse_session(request)
            model, speech = await self._core.model_speech(body.model, tenant)
            self._tenants.may_use(tenant, model)
            source = body.text_or_messages()
            if isinstance(source, str):
                text = source
            else:
                turns = [Turn(role, text) for role, text in conversation(source)]
                written = [Part(f"messages[{i}].content", t.text) for i, t in enumerate(turns)]
                tools = tools_asked(body.tools, body.tool_choice, body.parallel_tool_calls)
                if tools is not None:  # where a chat completion shows them
                    turns.insert(0, Turn(Role.SYSTEM, tools.instructions()))
                    written.append(Part("tools", turns[0].text))
                speech.check_plain(written)  # as a chat completion refuses them
                if body.continue_final_message:
                    text = render_last(speech.layout, turns[:-1], turns[-1])
                else:
                    text = speech.layout.render(turns, generation_prompt=body.add_generation_prompt)
            encode = functools.partial(speech.codec.encode, text)  # up to the body's 4 MB
            tokens = await beside_loop_if_long(len(text), encode)
            bos = speech.codec.bos_id
            if body.special_tokens() and bos is not None:
                tokens.insert(0, bos)
            pieces = speech.codec.pieces(tokens) if body.return_token_strs else None
        except MeshError as err:
            return error_response(err)
        return web.json_response(
            {
                "count": len(tokens),
                "max_model_len": speech.max_context,
                "tokens": tokens,
                "token_strs": pieces,
            }
        )

    async def detokenize(self, request: web.Request) -> web.Response:
        try:
            tenant = self._tenants.authenticate(request.headers.get("Authorization"))
            body = await parse_body(request, DetokenizeBody, self._settings.body_timeout_s)
            _refuse_session(request)
            model, speech = await self._core.model_speech(body.model, tenant)
            self._tenants.may_use(tenant, model)
            text = speech.codec.decode(body.tokens)
        except MeshError as err:
            return error_response(err)
        return web.json_response({"prompt": text})

    async def models(self, request: web.Request) -> web.Response:
        """The models the caller's tenant may use."""
        try:
            tenant = self._tenants.authenticate(request.headers.get("Authorization"))
        except MeshError as err:
            return error_response(err)
        usable = self._usable(tenant)
        contexts = await asyncio.gather(*(self._context_of(m, tenant) for m in usable))
        data = [
            _model_object(m, self._started, context)
            for m, context in zip(usable, contexts, strict=True)
        ]
        return web.json_response({"object": "list", "data": data})

    async def model(self, request: web.Request) -> web.Response:
        """One of them (OpenAI's retrieve); any other is not found, as it is to OpenAI's
        clients without access to it."""
        name = request.match_info["model"]
        try:
            tenant = self._tenants.authenticate(request.headers.get("Authorization"))
            if name not in self._usable(tenant):
                raise ModelNotFound("model", f"no model '{name}' for this API key")
        except MeshError as err:
            return error_response(err)
        context = await self._context_of(name, tenant)
        return web.json_response(_model_object(name, self._started, context))

    def _usable(self, tenant: str) -> list[str]:
        return self._tenants.usable(tenant, self._models)

    async def _context_of(self, model: str, tenant: str) -> int | None:
        """The model's context in tokens; None while no replica can describe it (the list
        of models does not wait long for one)."""
        try:
            async with asyncio.timeout(CARD_WAIT_S):
                _, speech = await self._core.model_speech(model, tenant)
        except (MeshError, TimeoutError):
            return None
        return speech.max_context

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        parent = tracing.incoming(request.headers)
        kind = trace.SpanKind.SERVER
        with tracing.current_span(f"POST {request.path}", parent, kind):
            return await self._serve_traced(request, chat)

    async def _serve_traced(self, request: web.Request, chat: bool) -> web.StreamResponse:
        request_id = request.headers.get(REQUEST_ID) or uuid.uuid4().hex
        names: dict[str, str] = {}
        try:
            tenant = self._tenants.authenticate(request.headers.get("Authorization"))
            model: type[ChatBody | CompletionBody] = ChatBody if chat else CompletionBody
            body = await parse_body(request, model, self._settings.body_timeout_s)
            names = body.field_names()
            tools = tool_use(body) if isinstance(body, ChatBody) else None
            prompts = self._decode(request, request_id, tenant, body, tools)
            async with contextlib.AsyncExitStack() as generations:
                echo = _Echo.of(body)
                started = await self._start(generations, prompts, body.n, echo)
                shown = body.prompt_logprobs
                reply = Reply(
                    f"{'chatcmpl' if chat else 'cmpl'}-{request_id}",
                    started.model,
                    chat,
                    n=len(started.choices),
                    logprobs=prompts[0].sampling.logprobs is not None,
                    usage=bool(body.stream_options and body.stream_options.include_usage),
                    obfuscated=body.stream and body.obfuscated(),
                    tools=tools,
                    prompt_logprobs=(
                        None
                        if shown is None
                        else [vllm_prompt_logprobs(c, shown) for c in started.choices]
                    ),
                    tokens_as_ids=body.return_tokens_as_token_ids,
                    token_ids=body.return_token_ids,
                )
                headers = {REQUEST_ID: request_id, **started.rate_limits}
                if body.stream:
                    return await self._stream(request, started, reply, headers)
                return await self._whole(started, reply, headers)
        except MeshError as err:  # before any choice's first chunk (later ones are replies)
            response = error_response(err, names)
            response.headers[REQUEST_ID] = request_id
            return response

    async def _start(
        self,
        generations: contextlib.AsyncExitStack,
        prompts: list[GenerateInput],
        n: int,
        echo: _Echo | None = None,
    ) -> _Started:
        """Each prompt's n samples, choice p * n + i: per prompt, the first sample's
        generation and first chunk, then the others'. By then the first one's prompt is
        in the engine's prefix cache, so the others' prefill is read back from it
        (samples of one prompt share their prefill). With a seed, sample i takes seed + i:
        n distinct samples, the same ones every time. The prompt's log probabilities, when
        asked, are the first sample's (the others read the prompt from the cache).
        ``echo``: each choice's first chunk begins with its prompt as the model read it
        (and its tokens' log probabilities, when asked), and is the whole choice for the
        prompt alone."""
        choices: list[Choice] = []
        model, prompt_tokens, cached_tokens = "", 0, 0
        last: Lease | None = None  # the last admission's: what the budgets have left
        many = len(prompts) * n > 1
        for number, prompt in enumerate(prompts):
            scored: tuple[TokenLogprob, ...] = ()  # the prompt's, from its first sample
            for index in range(n):
                sample = _sample(prompt, number * n + index, index) if many else prompt
                generation = await generations.enter_async_context(self._core.generation(sample))
                chunks = generation.chunks
                first = await anext(chunks)
                if index == 0:
                    scored = first.prompt_logprobs
                    model = generation.request.model
                    prompt_tokens += generation.prompt_tokens
                    cached_tokens += first.cached_tokens
                else:
                    first = replace(first, prompt_logprobs=scored)
                if echo is not None:  # a completion without a session: its text was checked
                    if echo.alone:
                        first = await prompt_alone(first, chunks)
                    first = echoed(first, generation.prepared.user_text, echo.top)
                choices.append(Choice(first, chunks, generation.prompt_tokens))
                last = generation.prepared.lease
        limits = rate_limit_headers(last) if last is not None else {}
        return _Started(model, prompt_tokens, choices, cached_tokens, limits)

    def _decode(
        self,
        request: web.Request,
        request_id: str,
        tenant: str,
        body: ChatBody | CompletionBody,
        tools: ToolUse | None,
    ) -> list[GenerateInput]:
        """One request per prompt (a completion may have several: text, or token ids
        whose text the core reads in the model's tokenizer)."""
        session_id = request.headers.get(SESSION_ID, "")
        inline: History | None = None
        role = Role.USER
        if isinstance(body, ChatBody):
            if body.continues_answer():
                if session_id:  # a session's turn is the user's
                    raise InvalidArgument("continue_final_message", "not with a session")
                role = Role.ASSISTANT
            history, prompt = _inline_history(body.messages, role)
            prompts: list[str | list[int]] = [prompt]
            if not session_id:
                inline = history  # with a session, the stored history is the history
        else:
            prompts = body.prompts()
        if body.n * len(prompts) > MAX_CHOICES:
            raise InvalidArgument("n", f"at most {MAX_CHOICES} choices (prompts x n)")
        if session_id and isinstance(body, CompletionBody) and body.echo:
            raise InvalidArgument(
                "echo", "not with a session (x-session-id): the model reads its history too"
            )
        if session_id and body.n * len(prompts) > 1:
            # A session records one answer per turn: which one would it be?
            field = "n" if body.n > 1 else "prompt"
            raise InvalidArgument(field, "one answer only in a session (x-session-id)")
        sampling = _sampling(body, tools)
        listed = isinstance(body, CompletionBody) and body.listed
        # The tools are shown in a system message of their own (policy's verdict on it
        # names the field), after the session's system prompt if there is one.
        affinity = SessionUse.keyed(body.prompt_cache_key)  # or the session's, if any
        use = SessionUse(tools=tools.instructions() if tools else "", affinity=affinity)
        return [
            GenerateInput(
                request_id=request_id,
                tenant=tenant,
                model=body.model,
                prompt=prompt if isinstance(prompt, str) else "",
                sampling=sampling,
                session_id=session_id,
                color=request.headers.get(COLOR, ""),
                inline_history=inline,
                cache_salt=body.cache_salt or "",
                prompt_field=f"prompt[{index}]" if listed else "prompt",
                session_use=use,
                prompt_ids=() if isinstance(prompt, str) else tuple(prompt),
                prompt_role=role,
            )
            for index, prompt in enumerate(prompts)
        ]

    async def _whole(
        self, started: _Started, reply: Reply, headers: dict[str, str]
    ) -> web.Response:
        try:
            async with contextlib.aclosing(merged(started.choices)) as chunks:
                async for index, chunk in chunks:
                    reply.add(index, chunk)
        except MeshError as err:
            return error_response(err)
        usage = reply.usage(started.prompt_tokens, started.cached_tokens)
        return web.json_response(reply.whole(usage), headers=headers)

    async def _stream(
        self, request: web.Request, started: _Started, reply: Reply, headers: dict[str, str]
    ) -> web.StreamResponse:
        # A client that goes away fails a write, out here: closing the generations'
        # generators at once ends them now (counted as cancelled), not when they are
        # garbage-collected.
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **headers}
        )
        await response.prepare(request)
        events = reply.events(started.choices, started.prompt_tokens, started.cached_tokens)
        try:
            async with contextlib.aclosing(events):
                async for event in events:
                    await response.write(event)
        except MeshError as err:  # after the headers: the error is the last event
            status, kind = status_of(err)
            error = {"error": {"message": err.message, "type": kind, "code": status}}
            await response.write(sse(error))
        await response.write_eof()
        return response


def _refuse_session(request: web.Request) -> None:
    """/tokenize and /detokenize read only what they are sent: a session id asks for a
    conversation they would not read, refused by name rather than ignored."""
    if request.headers.get(SESSION_ID):
        raise InvalidArgument(SESSION_ID, "not taken here: only the text or tokens sent are read")

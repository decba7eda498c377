"""Router core: validate, check policy, restore the session, stream from a replica, record.

The request's types (GenerateInput, Prepared, Generation) are in request.py.

No gRPC here: upstreams are reached through the small client interfaces in upstreams.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import replace

from prometheus_client import Counter, Histogram

from llmmesh import first_tokens
from llmmesh.policy import Part
from llmmesh.runtime import tracing
from llmmesh.runtime.beside_loop import ON_LOOP_CHARS, beside_loop_if_long
from llmmesh.runtime.errors import (
    AlreadyExists,
    InvalidArgument,
    ModelNotFound,
    PolicyDenied,
    Unavailable,
)
from llmmesh.runtime.metadata import REQUEST_ID
from llmmesh.runtime.metrics import TPOT, TTFT
from llmmesh.sentences import relevant_to, select
from llmmesh.structures import CachePartition, check_structure, compile_structure, readable
from llmmesh.types import (
    Chunk,
    FinishReason,
    History,
    InferenceCall,
    PolicyAction,
    Role,
    Sampling,
    Turn,
    Verdict,
    check_prompt_logprobs,
    check_sampling,
    check_session_id,
    check_truncation,
    fingerprint,
)
from services.router.admission import TIER_PRIORITY, AdmissionQueue
from services.router.config import RouterConfig
from services.router.fail_modes import fail_open
from services.router.prompt import (
    build_prompt,
    continued,
    input_parts,
    summary_overhead,
    turn_overhead,
    user_tail,
    with_texts,
)
from services.router.request import (
    MAX_CACHE_SALT,
    GenerateInput,
    Generation,
    Prepared,
    StartedStream,
)
from services.router.speech import ModelSpeech, Speeches
from services.router.summaries import SUMMARY_PRIORITY, FoldJob, Summarizer
from services.router.tenants import Lease, Tenants
from services.router.token_release import GuardedTokens
from services.router.upstreams import (
    ContextClient,
    HistoryRequest,
    InferenceClient,
    OutputGuard,
    PolicyClient,
    RouteHints,
)

log = logging.getLogger(__name__)

TOKEN_USAGE = Histogram(
    "gen_ai_client_token_usage",
    "Tokens per request, by type",
    ["model", "gen_ai_token_type"],
    buckets=(1, 4, 16, 64, 256, 1024, 4096, 16384),
)
STORED_PARTS = ("session.turns", "session.summary")
STRUCTURE_PART = "sampling.structured_output"

REUSED_REQUEST_ID = (
    "already used by another request in this session; a retry sends the same request"
)
COLOR_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
# The request id goes on in gRPC metadata to every upstream, where only visible ASCII is
# valid: anything else would fail the call at the router and count against a replica.
REQUEST_ID_FORMAT = re.compile(r"^[\x21-\x7e]{1,128}$")

REQUESTS = Counter("llm_router_requests_total", "Requests by outcome", ["model", "outcome"])
HISTORY_DROPPED = Counter("llm_router_history_turns_dropped_total", "Turns truncated", ["model"])


def _account(model: str, outcome: str, prompt_tokens: int, completion_tokens: int) -> None:
    log.info(
        "generation ended",
        extra={
            "fields": {
                "model": model,
                "outcome": outcome,
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
            }
        },
    )
    REQUESTS.labels(model, outcome).inc()
    TOKEN_USAGE.labels(model, "input").observe(prompt_tokens)
    TOKEN_USAGE.labels(model, "output").observe(completion_tokens)


def _observe_tpot(model: str, tier: str, first_token_at: float | None, tokens: int) -> None:
    if first_token_at is not None and tokens > 1:
        TPOT.labels(model, tier).observe((time.monotonic() - first_token_at) / (tokens - 1))


class RouterCore:
    """One request's life, the same for every transport: ``generation`` validates,
    checks policy, restores the session, admits and starts the stream, and on leaving
    ends it (a client gone at any point ends the generation) and gives back what it
    held."""

    def __init__(
        self,
        config: RouterConfig,
        policy: PolicyClient,
        context: ContextClient,
        inference: InferenceClient,
        speeches: Speeches,
        *,
        tenants: Tenants | None = None,
        admission: AdmissionQueue | None = None,
    ) -> None:
        self._config = config
        self._policy = policy
        self._context = context
        self._inference = inference
        self._speeches = speeches
        self._tenants = tenants or Tenants(config.default_tenant)
        self._admission = admission or AdmissionQueue()
        self._summaries = Summarizer(inference, context, policy)

    @contextlib.asynccontextmanager
    async def generation(self, request: GenerateInput) -> AsyncIterator[Generation]:
        """The request admitted and its generation started; raises before anything is
        streamed (bad input, policy, budget, admission)."""
        with first_tokens.request_pending():
            prepared = await self.prepare(request)
            chunks = self.stream(prepared)
            try:
                yield Generation(prepared, chunks)
            finally:
                await chunks.aclose()
                # Also covers a client gone between the start and the first read.
                await prepared.stream.abandon()
                prepared.release()

    def validate(self, request: GenerateInput) -> GenerateInput:
        """Checks every field; returns the request with defaults filled in."""
        config = self._config
        model = self._served(request.model, request.tenant)
        if not REQUEST_ID_FORMAT.match(request.request_id):
            raise InvalidArgument(REQUEST_ID, "1-128 visible ASCII characters")
        self._check_texts(request)
        if request.session_id:
            check_session_id(request.session_id)
            if request.prompt_role is not Role.USER:  # a session's turn is the user's
                raise InvalidArgument("continue_final_message", "not with a session")
        if request.color and not COLOR_NAME.match(request.color):
            raise InvalidArgument("x-llm-color", "1-64 letters, digits, '-', '_', '.'")
        if request.truncation:
            check_truncation(request.truncation)
        if len(request.cache_salt) > MAX_CACHE_SALT:
            raise InvalidArgument("cache_salt", f"at most {MAX_CACHE_SALT} characters")
        sampling = request.sampling
        if sampling.max_tokens == 0:
            sampling = replace(sampling, max_tokens=config.default_max_tokens)
        check_sampling(sampling, config.max_tokens_limit, self._structure_partition(request))
        return replace(request, model=model, sampling=sampling)

    def _structure_partition(self, request: GenerateInput) -> CachePartition:
        """Where checked structures are kept for this request: its prefix-cache partition,
        within its tenant's group."""
        tenants, tenant = self._tenants, request.tenant
        return CachePartition(
            tenants.cache_group(tenant), tenants.cache_salt(tenant, request.cache_salt)
        )

    def _check_texts(self, request: GenerateInput) -> None:
        """The same limits for every message of a conversation as for a prompt, and one
        for the whole of it."""
        limit, history = self._config.max_prompt_chars, request.inline_history
        turns = history.turns if history is not None else ()
        name = request.inline_field
        prompt_field = request.prompt_field if history is None else request.inline_name(len(turns))
        if not request.prompt.strip():
            raise InvalidArgument(prompt_field, "must not be empty or only whitespace")
        for field, text in [
            *((request.inline_name(i), t.text) for i, t in enumerate(turns)),
            (prompt_field, request.prompt),
        ]:
            if len(text) > limit:
                raise InvalidArgument(field, f"{len(text)} characters; the limit is {limit}")
        use = request.session_use
        instructions = use.instructions or ""
        for field, text in (("instructions", instructions), ("tools", use.tools)):
            if len(text) > limit:
                raise InvalidArgument(field, f"{len(text)} characters; the limit is {limit}")
        total = sum(len(t.text) for t in turns) + len(request.prompt) + len(instructions)
        total += len(use.tools)
        if total > self._config.max_conversation_chars:
            raise InvalidArgument(
                name,
                f"{total} characters in all; the limit is {self._config.max_conversation_chars}",
            )

    async def prepare(self, request: GenerateInput) -> Prepared:
        """Validation, session history, policy and admission; raises before anything is
        streamed. Nothing of the request reaches a replica before policy's verdict on
        everything the model will read, and then only as the verdict lets it (redacted)."""
        received_at = time.perf_counter()
        request = await self._with_ids_text(request)
        if request.sampling.structured is not None:
            partition = self._structure_partition(request)
            await compile_structure(request.sampling.structured, partition)
        request = self.validate(request)
        speech = await self._speech(request.model)
        speech.check_tokens(request.sampling)
        with tracing.step("context.load"):
            history = await self._load_history(request, speech)
        # What the client wrote (a session's stored turns were checked on their way in, or
        # are the model's own words).
        written = _input_parts(request, history)
        # A structure's text is what the model is made to write, and then reads again in a
        # session's next turn (read once: a schema's JSON is written again).
        structure = _structure_part(request)
        speech.check_plain(
            p for p in (*written, *structure) if not p.field.startswith(STORED_PARTS)
        )
        rule_set = self._tenants.spec(request.tenant).policy_set
        # The budget check (a round trip to Redis when routers share their state) runs
        # while policy looks at a short prompt, before a long one, on an estimate of the
        # prompt's tokens: the difference is charged once the prompt is built, and a
        # request that goes no further gives back what it was charged.
        chars = _conversation_chars(request, history)
        estimate = await beside_loop_if_long(
            chars, functools.partial(_estimated_tokens, request, history, speech)
        )
        admitting = self._tenants.admit_soon(request.tenant, request.model, estimate)
        try:
            if admitting.done() or chars > ON_LOOP_CHARS:
                # A request its tenant's budgets refuse is refused before its check: a long
                # conversation's costs the router up to half a second of CPU, which a
                # tenant past its limits could otherwise spend at will (a shared store's
                # round trip is a small part of a long prompt's prefill).
                await asyncio.shield(admitting)
            verdict = await self._verdict(request, history, rule_set, structure)
            texts = verdict.texts
            if structure:
                request = await self._with_structure(request, texts[0], structure[0].text)
                texts = texts[1:]
            history, user_text = with_texts(history, texts)
            _check_not_reused(history, user_text)
            # Token ids go to the engine only as the checks passed their text: unchanged.
            ids = request.prompt_ids if user_text == request.prompt else ()
            built = functools.partial(self._built, request, history, user_text, speech, ids)
            call, prompt_tokens, user_tokens, new_turns = await beside_loop_if_long(chars, built)
            check_prompt_logprobs(request.sampling, prompt_tokens)
            lease = await asyncio.shield(admitting)  # a client gone now cancels not it
        except BaseException:
            await _undo_admission(admitting, estimate)
            raise
        lease.adjust(prompt_tokens - estimate)
        try:
            with tracing.step("admission.wait"), first_tokens.waiting():
                slot = await self._admission.acquire(
                    request.tenant,
                    self._tenants.spec(request.tenant).tier,
                    prompt_tokens + request.sampling.max_tokens,
                    request.deadline,
                )
        except BaseException:
            lease.release()
            raise
        await self._fold_if_asked(request, history, rule_set, verdict, call)
        started = StartedStream(self._inference.generate(call, self._hints(request)))
        # The client's text the output continues (a plain completion's prompt, a continued
        # message; a chat's other messages end before the answer): a match it begins and
        # the model's words end is the model's too.
        lead = user_text if history is None or request.prompt_role is Role.ASSISTANT else ""
        guard = (
            self._policy.guard_output(
                request.request_id, request.tenant, rule_set, verdict.rule_set_version, lead
            )
            if verdict.checks_output
            else None
        )
        return Prepared(
            request,
            started,
            user_text,
            prompt_tokens,
            received_at,
            lease,
            slot,
            guard,
            history,
            user_tokens,
            new_turns,
        )

    async def _with_ids_text(self, request: GenerateInput) -> GenerateInput:
        """A prompt of token ids with its text in the model's tokenizer: what the checks
        read, and what the engine reads instead of the ids if the checks change it."""
        ids, field = request.prompt_ids, request.prompt_field
        if not ids:
            return request
        if request.prompt:
            raise InvalidArgument(field, "either a prompt's text or its token ids, not both")
        if request.session_id:
            raise InvalidArgument(field, "token ids are not taken in a session: send text")
        model = self._served(request.model, request.tenant)
        self._tenants.may_use(request.tenant, model)
        speech = await self._speech(model)
        return replace(request, prompt=speech.codec.prompt_text(ids, field))

    async def _fold_if_asked(
        self,
        request: GenerateInput,
        history: History | None,
        rule_set: str,
        verdict: Verdict,
        call: InferenceCall,
    ) -> None:
        """model_summary: the fold the session's load asked for, written in the
        background by the model itself (its own context, not the router's limit)."""
        if history is None or history.fold is None:
            return
        job = FoldJob(
            request.tenant,
            request.session_id,
            request.request_id,
            request.model,
            history.fold,
            await self._speeches.of(request.model),
            rule_set,
            verdict.rule_set_version,
            self._tenants.spec(request.tenant).session_ttl_s,
            SUMMARY_PRIORITY if call.priority is not None else None,
            call.cache_salt,
        )
        self._summaries.fold(job)

    async def model_speech(self, model: str, tenant: str) -> tuple[str, ModelSpeech]:
        """The model (empty: the default one) and how it speaks (its tokenizer, template,
        context); ModelNotFound for a model the mesh does not serve."""
        name = self._served(model, tenant)
        return name, await self._speech(name)

    def _served(self, model: str, tenant: str) -> str:
        """The model's name; ModelNotFound, naming the models the tenant may use, for one
        the mesh does not serve."""
        name = model or self._config.models[0]
        if name not in self._config.models:
            served = self._tenants.usable(tenant, self._config.models)
            raise ModelNotFound("model", f"unknown model '{name}'; served: {served}")
        return name

    async def _speech(self, model: str) -> ModelSpeech:
        speech = await self._speeches.of(model)
        context = self._config.model_context_tokens
        return replace(speech, max_context=context) if context else speech

    def _hints(self, request: GenerateInput) -> RouteHints:
        conversation = request.session_use.affinity or request.session_id
        session_key = f"{request.tenant}/{conversation}" if conversation else ""
        tier = self._tenants.spec(request.tenant).tier
        return RouteHints(session_key, request.color, request.deadline, tier)

    def _built(
        self,
        request: GenerateInput,
        history: History | None,
        user_text: str,
        speech: ModelSpeech,
        ids: tuple[int, ...],
    ) -> tuple[InferenceCall, int, int, tuple[Turn, ...]]:
        """The call and its prompt's tokens, the new text's tokens and the session's new
        turns, counted: all of a request's tokenizing once policy has passed it."""
        call, prompt_tokens = self._build_call(request, history, user_text, speech, ids)
        new_turns = _new_turns(request, history, speech)
        return call, prompt_tokens, speech.count(user_text), new_turns

    def _build_call(
        self,
        request: GenerateInput,
        history: History | None,
        user_text: str,
        speech: ModelSpeech,
        ids: tuple[int, ...] = (),
    ) -> tuple[InferenceCall, int]:
        """The call, and its prompt's tokens: ``ids`` as given (the engine adds no BOS to
        them; ``user_text`` is their text), or the prompt built from the history."""
        if ids:
            prompt, tokens = user_text, len(ids)
            room = speech.max_context - request.sampling.max_tokens
            if tokens > room:
                raise InvalidArgument(
                    request.prompt_field,
                    f"{tokens} tokens leave no room for generation in the model's context "
                    f"({room} tokens available after max_tokens)",
                )
        else:
            prompt, tokens = self._text_prompt(request, history, user_text, speech)
        priority = None
        if self._admission.settings.engine_priority:
            priority = TIER_PRIORITY.get(self._tenants.spec(request.tenant).tier)
        call = InferenceCall(
            request.request_id,
            request.model,
            prompt,
            request.sampling,
            priority,
            self._tenants.cache_salt(request.tenant, request.cache_salt),
            prompt_ids=ids,
        )
        return call, tokens

    def _text_prompt(
        self, request: GenerateInput, history: History | None, user_text: str, speech: ModelSpeech
    ) -> tuple[str, int]:
        """The prompt of the history and the new text within the context, and its tokens."""
        budget = speech.max_context - request.sampling.max_tokens - speech.bos_tokens
        layout, role = speech.layout, request.prompt_role
        try:
            prompt, dropped = build_prompt(
                history, user_text, budget, speech.count, layout, role=role
            )
        except InvalidArgument as err:  # the prompt builder's name: the request's field
            if err.field != "prompt":
                raise
            whole = request.inline_history is not None
            raise InvalidArgument(
                request.inline_field if whole else request.prompt_field, err.reason
            ) from None
        dropped += history.dropped_turns if history else 0
        cut = dropped or (history is not None and history.system_prompt_dropped)
        if cut and not request.session_use.may_truncate:
            raise InvalidArgument(
                request.inline_field,
                f"the conversation does not fit the model's context ({speech.max_context} "
                "tokens with the answer's); truncation 'auto' lets the mesh cut it",
            )
        if dropped:
            HISTORY_DROPPED.labels(request.model).inc(dropped)
        return prompt, speech.count(prompt) + speech.bos_tokens

    async def stream(self, prepared: Prepared) -> AsyncGenerator[Chunk, None]:
        """Relays the generation; records the turn in the session before the last chunk."""
        model = prepared.request.model
        tier = self._tenants.spec(prepared.request.tenant).tier
        parts: list[str] = []
        completion_tokens, outcome, first_token_at = 0, "cancelled", None
        guard = prepared.guard
        held: Chunk | None = None  # chunks the output check held back whole
        sampling = prepared.request.sampling
        tokens = GuardedTokens() if guard is not None and sampling.scores_tokens else None
        ttft_s: float | None = None  # observed once the first text is on its way
        try:
            async for relayed in prepared.stream.chunks():
                charged = self._charge(prepared.lease, relayed)
                chunk, guard = await self._guard(prepared.request.tenant, guard, charged, tokens)
                chunk = chunk.after(held)
                if not chunk.text and chunk.finish_reason is None:
                    held = chunk  # all held back: nothing to send yet
                    continue
                held = None
                chunk = _with_token_ids(chunk, sampling)
                if first_token_at is None and chunk.text:
                    first_token_at = time.monotonic()
                    ttft_s = time.perf_counter() - prepared.received_at
                parts.append(chunk.text)
                completion_tokens += chunk.num_tokens
                if chunk.finish_reason is not None:
                    await self._record(prepared, "".join(parts), completion_tokens)
                    outcome = chunk.finish_reason.value
                    _observe_tpot(model, tier, first_token_at, completion_tokens)
                yield chunk
                if ttft_s is not None:  # after the first text is on its way, not before
                    TTFT.labels(model, tier).observe(ttft_s)
                    ttft_s = None
                if chunk.finish_reason is not None:
                    return
            outcome = "error"
            raise Unavailable("inference ended the stream without a finish reason")
        except Unavailable:
            outcome = "unavailable"
            raise
        finally:
            if ttft_s is not None:  # the client left as the first text went out
                TTFT.labels(model, tier).observe(ttft_s)
            await prepared.stream.abandon()
            if guard is not None:
                await guard.close()
            prepared.release(first_token_at)
            _account(model, outcome, prepared.prompt_tokens, completion_tokens)

    @staticmethod
    def _charge(lease: Lease, chunk: Chunk) -> Chunk:
        """Charges the chunk's tokens; the tenant's budget running out finishes the stream."""
        if lease.charge(chunk.num_tokens) or chunk.finish_reason is not None:
            return chunk
        return replace(chunk, finish_reason=FinishReason.BUDGET)

    async def _guard(
        self, tenant: str, guard: OutputGuard | None, chunk: Chunk, tokens: GuardedTokens | None
    ) -> tuple[Chunk, OutputGuard | None]:
        """The chunk as the streamed output check lets it out: redacted, held back in
        part, or turned into the end of the stream (finish reason ``policy``); and the
        guard for the next chunk. ``tokens``, when log probabilities are asked, gives the
        entries of the text let out. If policy becomes unreachable, the tenant's fail mode
        decides, as for prompts: ``open`` relays the rest unchecked."""
        if guard is None:
            return chunk, None
        final = chunk.finish_reason is not None
        try:
            guarded = await guard.check(chunk.text, final, chunk.num_tokens)
        except Unavailable as err:
            mode = self._tenants.spec(tenant).policy_fail_mode
            fail_open(err, mode, "policy", tenant, "the rest of the output goes unchecked")
            await guard.close()
            if tokens is not None:
                tokens.drop()  # what the check held goes unsent, and so do its tokens
            return chunk, None
        if guarded.denied_by is not None:
            log.info("generation stopped by policy", extra={"fields": {"rule": guarded.denied_by}})
            if tokens is not None:
                tokens.drop()
            return replace(chunk, text="", finish_reason=FinishReason.POLICY, logprobs=()), guard
        if tokens is None:
            if guarded.text == chunk.text:  # most chunks: let out whole, as they came
                return chunk, guard
            return chunk.with_text(guarded.text), guard
        tokens.add(chunk.text, chunk.logprobs)
        released = tokens.release(guarded.text, guarded.held)
        return replace(chunk, text=guarded.text, logprobs=released), guard

    async def _load_history(self, request: GenerateInput, speech: ModelSpeech) -> History | None:
        """The session's history cut to what the prompt can hold; if the session store is
        unreachable, the tenant's fail mode decides: ``open`` answers without history."""
        use = request.session_use
        if not request.session_id:
            inline = request.inline_history
            if inline is None or (use.instructions is None and not use.tools):
                return inline
            return replace(continued(inline, (), use.instructions), tools=use.tools)
        spec = self._tenants.spec(request.tenant)
        count = speech.count
        new_turns = request.inline_history.turns if request.inline_history else ()
        overhead = turn_overhead(count, speech.layout)
        room = (
            speech.max_context
            - request.sampling.max_tokens
            - speech.bos_tokens
            - count(user_tail(request.prompt, speech.layout, request.prompt_role))
            - summary_overhead(count)
            - sum(count(t.text) + overhead for t in new_turns)
            - (count(use.tools) + overhead if use.tools else 0)
        )
        wanted = HistoryRequest(
            request.tenant,
            request.session_id,
            budget_tokens=max(room, 1),
            truncation=request.truncation or spec.truncation,
            turn_overhead_tokens=overhead,
            ttl_s=spec.session_ttl_s,
        )
        try:
            stored = await self._context.load(request.request_id, wanted)
        except Unavailable as err:
            fail_open(err, spec.context_fail_mode, "context", request.tenant, "no history")
            stored = History()
        stored = speech.defused_history(stored)  # the model's words, read again as words
        history = continued(
            _excerpt_for(stored, request.prompt, count), new_turns, use.instructions
        )
        return replace(history, tools=use.tools)

    async def _verdict(
        self,
        request: GenerateInput,
        history: History | None,
        rule_set: str,
        structure: list[Part],
    ) -> Verdict:
        """Policy's verdict on everything the model will read (PERMISSION_DENIED naming
        the rule and where it matched, if a rule denies it); if policy is unreachable,
        the tenant's fail mode decides: ``closed`` refuses (UNAVAILABLE), ``open`` lets
        the prompt through, flagged."""
        parts = [*structure, *_input_parts(request, history)]
        try:
            with tracing.step("policy.check_input"):
                verdict = await self._policy.check_input(
                    request.request_id, request.tenant, parts, rule_set
                )
        except Unavailable as err:
            mode = self._tenants.spec(request.tenant).policy_fail_mode
            fail_open(err, mode, "policy", request.tenant, "the prompt goes unchecked")
            return Verdict(PolicyAction.ALLOW, texts=tuple(p.text for p in parts))
        if verdict.action is PolicyAction.DENY:
            raise PolicyDenied(verdict.denial, verdict.denied_at)
        if len(verdict.texts) != len(parts):
            raise Unavailable("policy returned a verdict on a different number of parts")
        return verdict

    async def _with_structure(
        self, request: GenerateInput, checked: str, read: str
    ) -> GenerateInput:
        """The request with its structure as policy let it through: a redaction rewrites
        the schema's or the pattern's text (the model can then write only the mark), which
        must still compile."""
        assert request.sampling.structured is not None
        kind, _ = request.sampling.structured
        if checked == read:  # as policy read it (``readable``): the spec goes on as sent
            return request
        partition = self._structure_partition(request)
        await compile_structure((kind, checked), partition)
        check_structure(kind, checked, STRUCTURE_PART, partition)
        return replace(request, sampling=replace(request.sampling, structured=(kind, checked)))

    async def _record(self, prepared: Prepared, answer: str, answer_tokens: int) -> None:
        request = prepared.request
        if not request.session_id or not request.session_use.record:
            return
        turns = [
            *prepared.new_turns,
            Turn(Role.USER, prepared.user_text, prepared.user_tokens),
            Turn(Role.ASSISTANT, answer, answer_tokens),
        ]
        spec = self._tenants.spec(request.tenant)
        try:
            await self._context.append(
                request.request_id, request.tenant, request.session_id, turns, spec.session_ttl_s
            )
        except Unavailable as err:
            fail_open(err, spec.context_fail_mode, "context", request.tenant, "turn not recorded")


def _with_token_ids(chunk: Chunk, sampling: Sampling) -> Chunk:
    """With return_token_ids, the chunk's tokens' ids: its entries' as released (one id,
    -1, for what a redaction replaced); the entries go on only if log probabilities were
    asked."""
    if not sampling.return_token_ids:
        return chunk
    entries = chunk.logprobs if sampling.logprobs is not None else ()
    return replace(chunk, token_ids=tuple(t.token for t in chunk.logprobs), logprobs=entries)


def _excerpt_for(history: History, message: str, count: Callable[[str], int]) -> History:
    """key_sentences: the excerpt of the left-out turns chosen again with the message
    about to be answered (the later turn that matters most, which only the router knows;
    nothing of it leaves the router for this), counted in the model's tokens."""
    if not history.excerpt_candidates:
        return history
    ranked = relevant_to(history.excerpt_candidates, message)
    excerpt = " ".join(select(ranked, history.excerpt_tokens, count))
    summarized = history.summarized_turns or history.dropped_turns
    return replace(history, summary=excerpt, summarized_turns=summarized if excerpt else 0)


def _conversation_chars(request: GenerateInput, history: History | None) -> int:
    turns = history.turns if history is not None else ()
    return len(request.prompt) + sum(len(t.text) for t in turns)


def _estimated_tokens(request: GenerateInput, history: History | None, speech: ModelSpeech) -> int:
    """The prompt's tokens before it is built: the new text's, the history's as stored."""
    turns = history.turns if history is not None else ()
    stored = sum(t.token_count or speech.count(t.text) for t in turns)
    return speech.count(request.prompt) + stored + speech.bos_tokens


async def _undo_admission(admitting: asyncio.Future[Lease], estimate: int) -> None:
    """The request stops before its generation: its admission, once through, is undone
    before the error goes on (awaited, not cancelled: a charge made in Redis is undone
    only by its answer). A refusal of the budget's own leaves nothing to undo; it is the
    request's error only when nothing came first."""
    try:
        lease = await asyncio.shield(admitting)
    except asyncio.CancelledError:  # cancelled again meanwhile: undone when it is through
        admitting.add_done_callback(functools.partial(_cancel_lease, estimate=estimate))
        raise
    except Exception:
        return
    lease.cancel(estimate)


def _cancel_lease(done: asyncio.Future[Lease], estimate: int) -> None:
    if not done.cancelled() and done.exception() is None:
        done.result().cancel(estimate)


def _structure_part(request: GenerateInput) -> list[Part]:
    """What the output is held to, as policy reads it: the model is made to write what a
    schema or a pattern spells out, so its text is checked as what the model reads is."""
    structured = request.sampling.structured
    return [Part(STRUCTURE_PART, readable(*structured))] if structured and structured[1] else []


def _input_parts(request: GenerateInput, history: History | None) -> list[Part]:
    inline, use = request.inline_history, request.session_use
    return input_parts(
        history,
        request.prompt,
        None if inline is None else len(inline.turns),
        request.inline_name,
        instructions=use.instructions is not None,
        prompt_field=request.prompt_field,
    )


def _new_turns(
    request: GenerateInput, history: History | None, speech: ModelSpeech
) -> tuple[Turn, ...]:
    """The inline turns that continue a session, as policy let them through, counted."""
    if not request.session_id or request.inline_history is None or history is None:
        return ()
    written = history.turns[len(history.turns) - len(request.inline_history.turns) :]
    return tuple(replace(t, token_count=speech.count(t.text)) for t in written)


def _check_not_reused(history: History | None, user_text: str) -> None:
    """A request id that stored another request's turn in this session is refused before
    anything is generated: taken for a retry, the new turn would be dropped."""
    stored = history.request_fingerprint if history is not None else ""
    if stored and stored != fingerprint(user_text):
        raise AlreadyExists(REQUEST_ID, REUSED_REQUEST_ID)

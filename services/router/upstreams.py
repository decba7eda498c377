"""The router's clients of policy, context and inference, over grpc.aio channels."""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import grpc

from llmmesh import first_tokens
from llmmesh.convert import (
    ACTION_FROM_PB,
    ACTION_TO_PB,
    STAGE_TO_PB,
    finish_reason_from_pb,
    logprobs_from_pb,
    sampling_to_pb,
    turn_from_pb,
    turn_to_pb,
)
from llmmesh.policy import Part, RuleSetError, load_rules
from llmmesh.runtime import tracing
from llmmesh.runtime.errors import InvalidArgument, NotFound, Unavailable
from llmmesh.runtime.grpc_status import from_rpc_error
from llmmesh.runtime.metadata import REQUEST_ID
from llmmesh.sentences import Scored
from llmmesh.types import (
    Chunk,
    Fold,
    GuardedText,
    History,
    InferenceCall,
    ModelCard,
    PolicyAction,
    Turn,
    Verdict,
)
from llmmesh.v1 import (
    context_pb2,
    context_pb2_grpc,
    inference_pb2,
    inference_pb2_grpc,
    policy_pb2,
    policy_pb2_grpc,
)
from services.router.policy_gate import AuditRecord, FollowedRules

log = logging.getLogger(__name__)

CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 4 * 1024 * 1024)]


class OutputGuard(Protocol):
    """One generation's streamed output check."""

    async def check(self, text: str, final: bool, tokens: int = 1) -> GuardedText:
        """``text`` generated next (``tokens`` behind it), ``final`` with the last."""
        ...

    async def close(self) -> None: ...


class PolicyClient(Protocol):
    async def check_input(
        self, request_id: str, tenant: str, parts: Sequence[Part], rule_set: str
    ) -> Verdict:
        """The verdict on everything the model will read, in the order it reads it."""
        ...

    def guard_output(
        self, request_id: str, tenant: str, rule_set: str, version: str, lead: str = ""
    ) -> OutputGuard:
        """``lead``: the client's text the output continues (a plain completion's prompt,
        a continued message): a match it begins and the output ends decides too; never
        released."""
        ...


@dataclass(frozen=True)
class HistoryRequest:
    """Which session to load, and how to fit it into ``budget_tokens``."""

    tenant: str
    session_id: str
    budget_tokens: int
    truncation: str
    turn_overhead_tokens: int
    ttl_s: int = 0


class ContextClient(Protocol):
    async def load(self, request_id: str, wanted: HistoryRequest) -> History:
        """The session's history (empty for a session not stored yet)."""
        ...

    async def append(
        self, request_id: str, tenant: str, session_id: str, turns: list[Turn], ttl_s: int
    ) -> None: ...

    async def save_summary(
        self, tenant: str, session_id: str, summary: str, *, covered: int, replaces: int,
        ttl_s: int,
    ) -> bool:  # fmt: skip
        """Stores a summary the model wrote of the first ``covered`` turns, if the stored
        one still covers ``replaces``; whether it did."""
        ...


@dataclass(frozen=True)
class StoredSession:
    """A session as stored, whole."""

    system_prompt: str
    metadata: dict[str, str]
    turns: tuple[Turn, ...]


class SessionRecords(Protocol):
    """Sessions as records of their own (the Responses API keeps a response as one)."""

    async def read(self, tenant: str, session_id: str) -> StoredSession | None: ...

    async def fork(
        self,
        tenant: str,
        source_id: str,
        session_id: str,
        *,
        system_prompt: str,
        metadata: dict[str, str],
        ttl_s: int,
    ) -> None:
        """NotFound if ``source_id`` is not one of the tenant's sessions."""
        ...

    async def put(
        self,
        tenant: str,
        session_id: str,
        system_prompt: str,
        metadata: dict[str, str],
        ttl_s: int,
    ) -> None: ...

    async def delete(self, tenant: str, session_id: str) -> bool: ...


@dataclass(frozen=True)
class RouteHints:
    """What the router knows of a request beyond the call itself, for picking a replica."""

    session_key: str = ""  # tenant and session id: a conversation's identity
    color: str = ""  # x-llm-color
    deadline: float | None = None  # time.monotonic() by which the client wants an answer
    tier: str = ""  # the tenant's tier, for failures counted per fault domain and tier
    # The mesh's own work for a request (a session summary): no client waits on it, so it
    # is neither mirrored nor counted in the canary analysis's latencies.
    background: bool = False


class InferenceClient(Protocol):
    """Streams a generation from some replica (the pool picks which)."""

    def generate(self, call: InferenceCall, hints: RouteHints) -> AsyncGenerator[Chunk, None]: ...

    async def describe(self, model: str) -> ModelCard:
        """The model's card (tokenizer, chat template, context), from a replica of it."""
        ...


def _metadata(request_id: str) -> tuple[tuple[str, str], ...]:
    """The request id, and the trace (W3C traceparent) when tracing is on."""
    return ((REQUEST_ID, request_id), *tracing.outgoing())


def _followed(reply: policy_pb2.RuleSetRules) -> FollowedRules:
    try:
        rules = load_rules(
            reply.rules_json,
            reply.rule_set_version,
            reply.holdback_cap,
            reply.schema_version,
            reply.holdback_tokens or None,
        )
    except RuleSetError as err:
        log.warning("policy rules do not load", extra={"fields": {"error": str(err)}})
        raise Unavailable("policy service sent rules that do not load") from None
    return FollowedRules(reply.rule_set, rules, reply.audit_text)


Metadata = tuple[tuple[str, str], ...]


class GrpcPolicyService:
    """The policy service as the router's policy gate uses it (services/router/policy_gate.py).
    ``auth``: the mesh's credential, on every call."""

    def __init__(self, channel: grpc.aio.Channel, timeout_s: float, auth: Metadata = ()) -> None:
        self._stub = policy_pb2_grpc.PolicyStub(channel)
        self._timeout = timeout_s
        self._auth = auth

    async def watch(self, rule_set: str) -> AsyncIterator[FollowedRules | None]:
        request = policy_pb2.GetRulesRequest(rule_set=rule_set)
        try:
            async for reply in self._stub.WatchRules(request, metadata=self._auth):
                yield _followed(reply.rules) if reply.HasField("rules") else None
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc, "policy service") from None

    async def fetch(self, rule_set: str) -> FollowedRules:
        request = policy_pb2.GetRulesRequest(rule_set=rule_set)
        try:
            reply = await self._stub.GetRules(request, timeout=self._timeout, metadata=self._auth)
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc, "policy service") from None
        return _followed(reply)

    async def check_input(
        self, request_id: str, tenant: str, parts: Sequence[Part], rule_set: str
    ) -> Verdict:
        request = policy_pb2.CheckInputRequest(
            request_id=request_id,
            tenant=tenant,
            rule_set=rule_set,
            parts=[policy_pb2.InputPart(field=p.field, text=p.text) for p in parts],
        )
        try:
            reply = await self._stub.CheckInput(
                request, timeout=self._timeout, metadata=_metadata(request_id) + self._auth
            )
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc, "policy service") from None
        action = ACTION_FROM_PB.get(reply.action, PolicyAction.DENY)
        texts = tuple(p.text for p in parts)
        if action is PolicyAction.REDACT:
            if len(reply.redacted_parts) != len(parts):
                raise Unavailable("policy service redacted a different number of parts")
            texts = tuple(reply.redacted_parts)
        return Verdict(
            action=action,
            rule_ids=tuple(reply.rule_ids),
            texts=texts,
            rule_set_version=reply.rule_set_version,
            checks_output=reply.checks_output,
            denied_at=reply.denied_at,
            matches=tuple((m.rule_id, m.field) for m in reply.matches),
        )

    async def record(self, records: Sequence[AuditRecord]) -> None:
        request = policy_pb2.RecordDecisionsRequest(
            decisions=[
                policy_pb2.Decision(
                    request_id=r.request_id,
                    tenant=r.tenant,
                    stage=STAGE_TO_PB[r.stage],
                    rule_set_version=r.version,
                    action=ACTION_TO_PB[r.action],
                    rule_ids=r.rule_ids,
                    text=r.text,
                )
                for r in records
            ]
        )
        try:
            await self._stub.RecordDecisions(request, timeout=self._timeout, metadata=self._auth)
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc, "policy service") from None


class GrpcContextClient:
    def __init__(self, channel: grpc.aio.Channel, timeout_s: float, auth: Metadata = ()) -> None:
        self._stub = context_pb2_grpc.ContextStub(channel)
        self._timeout = timeout_s
        self._auth = auth

    async def load(self, request_id: str, wanted: HistoryRequest) -> History:
        request = context_pb2.LoadSessionRequest(
            tenant=wanted.tenant,
            session_id=wanted.session_id,
            budget_tokens=wanted.budget_tokens,
            truncation=wanted.truncation,
            turn_overhead_tokens=wanted.turn_overhead_tokens,
            ttl_seconds=wanted.ttl_s,
            request_id=request_id,
        )
        try:
            reply = await self._stub.LoadSession(
                request, timeout=self._timeout, metadata=_metadata(request_id) + self._auth
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return History()  # a new conversation
            raise from_rpc_error(exc, "context service") from None
        try:
            turns = tuple(turn_from_pb(t, "session.turns") for t in reply.turns)
        except InvalidArgument as err:
            log.warning("bad session from context", extra={"fields": {"error": err.message}})
            raise Unavailable("context service returned a bad session") from None
        cut = reply.truncation
        return History(
            turns=turns,
            system_prompt=reply.system_prompt,
            summary=reply.summary,
            truncation=cut.strategy,
            total_turns=reply.total_turns,
            dropped_turns=cut.dropped_turns,
            summarized_turns=cut.summarized_turns,
            system_prompt_dropped=cut.system_prompt_dropped,
            request_fingerprint=reply.request_fingerprint,
            fold=_fold(reply) if reply.HasField("fold") else None,
            excerpt_candidates=tuple(
                Scored(i, c.text, c.score) for i, c in enumerate(reply.excerpt_candidates)
            ),
            excerpt_tokens=reply.excerpt_tokens,
        )

    async def append(
        self, request_id: str, tenant: str, session_id: str, turns: list[Turn], ttl_s: int
    ) -> None:
        request = context_pb2.AppendTurnsRequest(
            tenant=tenant,
            session_id=session_id,
            request_id=request_id,
            turns=[turn_to_pb(t) for t in turns],
            ttl_seconds=ttl_s,
        )
        try:
            await self._stub.AppendTurns(
                request, timeout=self._timeout, metadata=_metadata(request_id) + self._auth
            )
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc, "context service") from None

    async def save_summary(
        self, tenant: str, session_id: str, summary: str, *, covered: int, replaces: int,
        ttl_s: int,
    ) -> bool:  # fmt: skip
        request = context_pb2.SaveSummaryRequest(
            tenant=tenant,
            session_id=session_id,
            summary=summary,
            covered_turns=covered,
            replaces_covered_turns=replaces,
            ttl_seconds=ttl_s,
        )
        reply = await self._call(self._stub.SaveSummary, request)
        return bool(reply.saved)

    async def read(self, tenant: str, session_id: str) -> StoredSession | None:
        request = context_pb2.LoadSessionRequest(tenant=tenant, session_id=session_id)
        try:
            reply = await self._call(self._stub.LoadSession, request)
        except NotFound:
            return None
        turns = tuple(turn_from_pb(t, "session.turns") for t in reply.turns)
        return StoredSession(reply.system_prompt, dict(reply.metadata), turns)

    async def fork(
        self,
        tenant: str,
        source_id: str,
        session_id: str,
        *,
        system_prompt: str,
        metadata: dict[str, str],
        ttl_s: int,
    ) -> None:
        request = context_pb2.ForkSessionRequest(
            tenant=tenant,
            source_session_id=source_id,
            session_id=session_id,
            system_prompt=system_prompt,
            metadata=metadata,
            ttl_seconds=ttl_s,
        )
        await self._call(self._stub.ForkSession, request)

    async def put(
        self,
        tenant: str,
        session_id: str,
        system_prompt: str,
        metadata: dict[str, str],
        ttl_s: int,
    ) -> None:
        request = context_pb2.PutSessionRequest(
            tenant=tenant,
            session_id=session_id,
            system_prompt=system_prompt,
            metadata=metadata,
            ttl_seconds=ttl_s,
        )
        await self._call(self._stub.PutSession, request)

    async def delete(self, tenant: str, session_id: str) -> bool:
        request = context_pb2.DeleteSessionRequest(tenant=tenant, session_id=session_id)
        reply = await self._call(self._stub.DeleteSession, request)
        return bool(reply.deleted)

    async def _call(self, method: Any, request: Any) -> Any:
        try:
            return await method(request, timeout=self._timeout, metadata=self._auth)
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc, "context service") from None


def _fold(reply: context_pb2.Session) -> Fold:
    fold = reply.fold
    turns = tuple(turn_from_pb(t, "session.fold.turns") for t in fold.turns)
    return Fold(fold.summary, fold.covered_turns, turns, fold.through_turns, fold.max_tokens)


def inference_request(call: InferenceCall) -> inference_pb2.InferenceRequest:
    return inference_pb2.InferenceRequest(
        request_id=call.request_id,
        model=call.model,
        prompt=call.prompt,
        sampling=sampling_to_pb(call.sampling),
        priority=call.priority,
        cache_salt=call.cache_salt,
        resumed_output_chars=call.resumed_output_chars,
        prompt_token_ids=call.prompt_ids,
    )


class ChunkReader:
    """A replica's responses as chunks, with per-chunk token counts from its totals."""

    def __init__(self) -> None:
        self._seen = 0

    def chunk(self, reply: inference_pb2.InferenceResponse) -> Chunk:
        chunk = Chunk(
            text=reply.text,
            num_tokens=reply.num_output_tokens - self._seen,
            finish_reason=finish_reason_from_pb(reply.finish_reason),
            logprobs=logprobs_from_pb(reply.logprobs),
            cached_tokens=reply.cached_tokens,
        )
        if reply.prompt_logprobs:  # the first response's, when asked (a call less on others)
            chunk = replace(chunk, prompt_logprobs=logprobs_from_pb(reply.prompt_logprobs))
        if reply.prompt_token_ids:
            chunk = replace(chunk, prompt_token_ids=tuple(reply.prompt_token_ids))
        self._seen = reply.num_output_tokens
        return chunk

    def merged(self, replies: Sequence[inference_pb2.InferenceResponse]) -> Chunk:
        """Responses that arrived together as one chunk: what a relay that fell behind
        sends on in one message (nothing waits for them: they are there already)."""
        if len(replies) == 1:
            return self.chunk(replies[0])
        last = replies[-1]
        chunk = Chunk(
            text="".join(r.text for r in replies),
            num_tokens=last.num_output_tokens - self._seen,
            finish_reason=finish_reason_from_pb(last.finish_reason),
            logprobs=tuple(lp for r in replies for lp in logprobs_from_pb(r.logprobs)),
            cached_tokens=sum(r.cached_tokens for r in replies),
            prompt_logprobs=tuple(
                lp for r in replies for lp in logprobs_from_pb(r.prompt_logprobs)
            ),
            prompt_token_ids=tuple(i for r in replies for i in r.prompt_token_ids),
        )
        self._seen = last.num_output_tokens
        return chunk


class ReplicaClient:
    """One inference replica's Generate: a call per generation."""

    def __init__(self, channel: grpc.aio.Channel, address: str, extra: Metadata = ()) -> None:
        self._stub = inference_pb2_grpc.InferenceStub(channel)
        self.address = address
        self._extra = extra  # metadata on every call (the credential, the sidecar's destination)

    async def generate(self, call: InferenceCall) -> AsyncGenerator[Chunk, None]:
        """Yields chunks with per-chunk token counts; closing it cancels the upstream call."""
        metadata = _metadata(call.request_id) + self._extra
        rpc = self._stub.Generate(inference_request(call), metadata=metadata)
        first_tokens.start_sent()
        reader, finished = ChunkReader(), False
        try:
            async for reply in rpc:
                chunk = reader.chunk(reply)
                finished = chunk.finish_reason is not None
                yield chunk
        except grpc.aio.AioRpcError as exc:
            finished = True
            raise from_rpc_error(exc, "inference replica", self.address) from None
        finally:
            if not finished:  # cut short: the replica must stop generating
                rpc.cancel()

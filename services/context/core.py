"""Context core: validates session requests, applies expiry and truncation, and maps a
failing store to UNAVAILABLE."""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import TypeVar

import redis.exceptions
from prometheus_client import Counter, Histogram

from llmmesh.runtime.errors import AlreadyExists, InvalidArgument, NotFound, Unavailable
from llmmesh.types import Turn, check_session_id, count_tokens, fingerprint, request_text
from services.context.store import Appended, Session, SessionExists, SessionStore
from services.context.truncation import Budget, Truncated, check_strategy, truncate

log = logging.getLogger(__name__)

T = TypeVar("T")

MAX_TURN_CHARS = 1_000_000
MAX_TURNS_PER_APPEND = 64
MAX_METADATA_ENTRIES = 64
MAX_METADATA_CHARS = 4096
MAX_PAGE_SIZE = 1000
MAX_TTL_S = 366 * 86_400
REUSED_ID = "already used by another request in this session (a retry sends the same one)"

APPENDS = Counter("llm_context_appends_total", "Append calls", ["outcome"])
LOAD_SECONDS = Histogram(
    "llm_context_load_seconds",
    "Time to load (and truncate) a session",
    buckets=(0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05),
)
TRUNCATIONS = Counter(
    "llm_context_truncations_total", "Loads that cut a session to its budget", ["strategy"]
)
STORE_ERRORS = Counter("llm_context_store_errors_total", "Store operations that failed", ["op"])
SWEPT = Counter("llm_context_sessions_expired_total", "Sessions removed by the expiry sweep")
SUMMARIES_SAVED = Counter(
    "llm_context_model_summaries_total",
    "Summaries the model wrote, stored or found stale (another stored meanwhile)",
    ["outcome"],
)

# What a store raises when it is unreachable or failing (not a caller's mistake).
STORE_FAILURES = (sqlite3.Error, redis.exceptions.RedisError, OSError)


def _without_request(session: Session, request_id: str) -> tuple[Session, str | None]:
    """The session as it was before ``request_id`` (a retry sees the history its first
    attempt saw), and the text that request stored, if it did."""
    if not request_id:
        return session, None
    own = [t for t in session.turns if t.request_id == request_id]
    if not own:
        return session, None
    kept = [t for t in session.turns if t.request_id != request_id]
    return replace(session, turns=kept), request_text(own)


def check_session_key(tenant: str, session_id: str) -> None:
    if not tenant:
        raise InvalidArgument("tenant", "required")
    check_session_id(session_id)


@dataclass(frozen=True)
class Loaded:
    total_turns: int
    metadata: dict[str, str]
    truncated: Truncated
    request_fingerprint: str = ""  # of the text the load's request id stored, if any


class ContextCore:
    def __init__(self, store: SessionStore, default_ttl_s: int) -> None:
        self.store = store
        self._default_ttl_s = default_ttl_s

    def _ttl_ms(self, ttl_s: int) -> int:
        if not 0 <= ttl_s <= MAX_TTL_S:
            raise InvalidArgument("ttl_seconds", f"must be in [0, {MAX_TTL_S}], got {ttl_s}")
        return (ttl_s or self._default_ttl_s) * 1000

    async def _store(self, op: str, call: Callable[[], Awaitable[T]]) -> T:
        try:
            return await call()
        except STORE_FAILURES as err:
            STORE_ERRORS.labels(op).inc()
            log.warning("session store failed", extra={"fields": {"op": op, "error": repr(err)}})
            raise Unavailable("session store unavailable") from None

    async def load(
        self,
        tenant: str,
        session_id: str,
        budget: Budget,
        strategy: str = "",
        ttl_s: int = 0,
        *,
        request_id: str = "",
    ) -> Loaded:
        """The session cut to ``budget``; NOT_FOUND (the same for every tenant) if this
        tenant has no such session. With ``request_id``: the fingerprint of the request
        text that id stored, so that the caller can tell a retry from a reused id."""
        check_session_key(tenant, session_id)
        strategy = check_strategy(strategy)
        ttl_ms = self._ttl_ms(ttl_s)
        with LOAD_SECONDS.time():
            session = await self._store("load", lambda: self.store.load(tenant, session_id, ttl_ms))
            if session is None:
                raise NotFound(f"no session '{session_id}'")
            session, stored = _without_request(session, request_id)
            cut = truncate(session, budget, strategy, count_tokens)
        if cut.dropped:
            TRUNCATIONS.labels(strategy).inc()
        if cut.stored_summary is not None:
            summary, covered = cut.stored_summary
            await self._store(
                "save_summary",
                lambda: self.store.save_summary(tenant, session_id, summary, covered),
            )
        found = fingerprint(stored) if stored is not None else ""
        return Loaded(len(session.turns), session.metadata, cut, found)

    async def append(
        self,
        tenant: str,
        session_id: str,
        request_id: str,
        turns: list[Turn],
        ttl_s: int = 0,
    ) -> tuple[int, bool]:
        """Appends ``turns``; (turn count, False) for a retry of a stored request, and
        ALREADY_EXISTS for another request that reuses a stored id."""
        check_session_key(tenant, session_id)
        if not request_id:
            raise InvalidArgument("request_id", "required (it makes appends idempotent)")
        if not turns:
            raise InvalidArgument("turns", "at least one turn is required")
        if len(turns) > MAX_TURNS_PER_APPEND:
            raise InvalidArgument("turns", f"at most {MAX_TURNS_PER_APPEND} per call")
        for i, turn in enumerate(turns):
            _check_text(f"turns[{i}].text", turn.text)
            if turn.token_count < 0:
                raise InvalidArgument(f"turns[{i}].token_count", "must be >= 0")
        ttl_ms = self._ttl_ms(ttl_s)
        count, appended = await self._store(
            "append", lambda: self.store.append(tenant, session_id, request_id, turns, ttl_ms)
        )
        APPENDS.labels(appended.value).inc()
        if appended is Appended.CONFLICT:
            raise AlreadyExists("request_id", REUSED_ID)
        return count, appended is Appended.APPENDED

    async def put(
        self,
        tenant: str,
        session_id: str,
        system_prompt: str,
        metadata: dict[str, str],
        ttl_s: int = 0,
    ) -> None:
        check_session_key(tenant, session_id)
        _check_text("system_prompt", system_prompt)
        _check_metadata(metadata)
        ttl_ms = self._ttl_ms(ttl_s)
        await self._store(
            "put", lambda: self.store.put(tenant, session_id, system_prompt, metadata, ttl_ms)
        )

    async def fork(
        self,
        tenant: str,
        source_id: str,
        session_id: str,
        *,
        system_prompt: str,
        metadata: dict[str, str],
        ttl_s: int = 0,
    ) -> int:
        """A new session holding a copy of ``source_id``'s conversation; its turn count."""
        check_session_key(tenant, session_id)
        try:
            check_session_id(source_id)
        except InvalidArgument as err:
            raise InvalidArgument("source_session_id", err.message) from None
        _check_text("system_prompt", system_prompt)
        _check_metadata(metadata)
        ttl_ms = self._ttl_ms(ttl_s)
        try:
            count = await self._store(
                "fork",
                lambda: self.store.fork(
                    tenant,
                    source_id,
                    session_id,
                    system_prompt=system_prompt,
                    metadata=metadata,
                    ttl_ms=ttl_ms,
                ),
            )
        except SessionExists:
            raise AlreadyExists("session_id", f"session '{session_id}' exists already") from None
        if count is None:
            raise NotFound(f"no session '{source_id}'")
        return count

    async def save_summary(
        self,
        tenant: str,
        session_id: str,
        summary: str,
        *,
        covered: int,
        replaces: int,
        ttl_s: int = 0,
    ) -> bool:
        """Stores a summary the model wrote of the session's first ``covered`` turns, if
        the stored one still covers ``replaces``; NOT_FOUND if there is no session."""
        check_session_key(tenant, session_id)
        _check_text("summary", summary)
        if not 0 <= replaces < covered:
            raise InvalidArgument(
                "covered_turns", f"must be above replaces_covered_turns ({replaces}), got {covered}"
            )
        ttl_ms = self._ttl_ms(ttl_s)
        session = await self._store("load", lambda: self.store.load(tenant, session_id, ttl_ms))
        if session is None:
            raise NotFound(f"no session '{session_id}'")
        if covered > len(session.turns):
            raise InvalidArgument(
                "covered_turns", f"the session holds {len(session.turns)} turns, not {covered}"
            )
        saved = await self._store(
            "save_summary",
            lambda: self.store.save_summary(tenant, session_id, summary, covered, replaces),
        )
        SUMMARIES_SAVED.labels("saved" if saved else "stale").inc()
        return saved

    async def delete(self, tenant: str, session_id: str) -> bool:
        check_session_key(tenant, session_id)
        return await self._store("delete", lambda: self.store.delete(tenant, session_id))

    async def list(self, tenant: str, page_size: int, page_token: str) -> tuple[list[str], str]:
        """A page of the tenant's session ids and the token of the next page ("" at the
        end). The token is the last id of the page: paging is stable under inserts."""
        if not tenant:
            raise InvalidArgument("tenant", "required")
        if not 0 <= page_size <= MAX_PAGE_SIZE:
            raise InvalidArgument("page_size", f"must be in [0, {MAX_PAGE_SIZE}]")
        if page_token:
            check_session_id(page_token)
        size = page_size or 100
        ids = await self._store("list", lambda: self.store.list(tenant, page_token, size + 1))
        page = ids[:size]
        return page, page[-1] if len(ids) > size else ""

    async def sweep(self) -> int:
        swept = await self._store("sweep", self.store.sweep)
        SWEPT.inc(swept)
        return swept


def _check_text(field: str, text: str) -> None:
    if len(text) > MAX_TURN_CHARS:
        raise InvalidArgument(field, f"longer than {MAX_TURN_CHARS} characters")


def _check_metadata(metadata: dict[str, str]) -> None:
    if len(metadata) > MAX_METADATA_ENTRIES:
        raise InvalidArgument("metadata", f"at most {MAX_METADATA_ENTRIES} entries")
    for key, value in metadata.items():
        if not key or len(key) > 128:
            raise InvalidArgument("metadata", f"keys are 1-128 characters, got {key[:140]!r}")
        if len(value) > MAX_METADATA_CHARS:
            raise InvalidArgument(f"metadata[{key}]", f"longer than {MAX_METADATA_CHARS}")

"""Session stores: what a session is, and the interface every store implements
(SQLite: sqlite_store.py; Redis: redis_store.py; chosen by name in stores.py).

A session is keyed by (tenant, session id): every operation names both, so one tenant
can never reach another's sessions. An append is acknowledged only once durable.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Protocol

from llmmesh.types import Turn


@dataclass(frozen=True)
class Session:
    system_prompt: str = ""
    metadata: dict[str, str] = field(default_factory=dict)
    turns: list[Turn] = field(default_factory=list)
    summary: str = ""  # extractive summary of the oldest turns (sliding_summary)
    summarized_turns: int = 0  # how many of the oldest turns the summary covers


class Appended(enum.Enum):
    """What an append did with its request id."""

    APPENDED = "appended"  # a new id: its turns are stored
    DUPLICATE = "duplicate"  # the id with the same user turn: a retry, nothing stored
    CONFLICT = "conflict"  # the id with another user turn: another request, refused


class SessionExists(Exception):
    """A session that was to be created is there already."""


class SessionStore(Protocol):
    """``ttl_ms`` slides a session's expiry on every access; an expired session is gone,
    whether or not a sweep has removed it yet."""

    async def open(self) -> None: ...

    async def close(self) -> None: ...

    async def load(self, tenant: str, session_id: str, ttl_ms: int) -> Session | None: ...

    async def append(
        self, tenant: str, session_id: str, request_id: str, turns: list[Turn], ttl_ms: int
    ) -> tuple[int, Appended]:
        """Appends (creating the session) unless ``request_id`` was stored already;
        returns the turn count and whether the id was new, a retry (the same
        ``request_text``) or a conflict (another). Atomic: two appends of one id never
        both store."""
        ...

    async def put(
        self,
        tenant: str,
        session_id: str,
        system_prompt: str,
        metadata: dict[str, str],
        ttl_ms: int,
    ) -> None:
        """Creates the session or replaces its system prompt and metadata."""
        ...

    async def fork(
        self,
        tenant: str,
        source_id: str,
        session_id: str,
        *,
        system_prompt: str,
        metadata: dict[str, str],
        ttl_ms: int,
    ) -> int | None:
        """Creates ``session_id`` as a copy of ``source_id`` (turns with their request ids,
        summary) with its own system prompt and metadata, atomically; returns its turn
        count, or None if the source does not exist. ``SessionExists`` if the new one does."""
        ...

    async def save_summary(
        self,
        tenant: str,
        session_id: str,
        summary: str,
        summarized_turns: int,
        replaces: int | None = None,
    ) -> bool:
        """Stores the session's summary (never creating a session); with ``replaces``,
        only if the stored summary covers that many turns. Whether it was stored."""
        ...

    async def delete(self, tenant: str, session_id: str) -> bool: ...

    async def list(self, tenant: str, after: str, limit: int) -> list[str]:
        """Session ids of ``tenant`` after ``after``, in order, at most ``limit``."""
        ...

    async def sweep(self) -> int:
        """Removes expired sessions; returns how many."""
        ...


def now_ms() -> int:
    return int(time.time() * 1000)

"""Context core: validates session requests and delegates to the configured store."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

from llmmesh.runtime.errors import InvalidArgument
from llmmesh.types import Turn, check_session_id
from services.context.store import SessionStore

MAX_TURN_CHARS = 1_000_000
MAX_TURNS_PER_APPEND = 16

APPENDS = Counter("llm_context_appends_total", "Append calls", ["outcome"])
LOAD_SECONDS = Histogram(
    "llm_context_load_seconds",
    "Time to load a session",
    buckets=(0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05),
)


def check_session_key(tenant: str, session_id: str) -> None:
    if not tenant:
        raise InvalidArgument("tenant", "required")
    check_session_id(session_id)


class ContextCore:
    def __init__(self, store: SessionStore) -> None:
        self.store = store

    async def load(self, tenant: str, session_id: str) -> list[Turn]:
        check_session_key(tenant, session_id)
        with LOAD_SECONDS.time():
            return await self.store.load(tenant, session_id)

    async def append(
        self, tenant: str, session_id: str, request_id: str, turns: list[Turn]
    ) -> tuple[int, bool]:
        check_session_key(tenant, session_id)
        if not request_id:
            raise InvalidArgument("request_id", "required (it makes appends idempotent)")
        if not turns:
            raise InvalidArgument("turns", "at least one turn is required")
        if len(turns) > MAX_TURNS_PER_APPEND:
            raise InvalidArgument("turns", f"at most {MAX_TURNS_PER_APPEND} per call")
        for i, turn in enumerate(turns):
            if len(turn.text) > MAX_TURN_CHARS:
                raise InvalidArgument(
                    f"turns[{i}].text", f"longer than {MAX_TURN_CHARS} characters"
                )
            if turn.token_count < 0:
                raise InvalidArgument(f"turns[{i}].token_count", "must be >= 0")
        count, appended = await self.store.append(tenant, session_id, request_id, turns)
        APPENDS.labels("appended" if appended else "duplicate").inc()
        return count, appended

"""The session stores, one suite for both: SQLite on a real database file and Redis on a
real redis-server (tests/conftest.py). Expiry runs on a clock the test sets."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TypeVar

import pytest

from llmmesh.runtime.errors import AlreadyExists, InvalidArgument, NotFound
from llmmesh.types import Role, Turn
from services.context.core import ContextCore
from services.context.redis_store import RedisSessionStore
from services.context.sqlite_store import SqliteSessionStore
from services.context.store import Appended, SessionExists, SessionStore
from services.context.truncation import Budget
from tests.conftest import RedisServer

T = TypeVar("T")
TURNS = [Turn(Role.USER, "hi", 2), Turn(Role.ASSISTANT, "hello ✓", 9)]
DAY_MS = 86_400_000

StoreFactory = Callable[[], SessionStore]


class Clock:
    """Wall-clock milliseconds as the stores see them, moved on by the test."""

    def __init__(self) -> None:
        self.now_ms = 1_800_000_000_000

    def __call__(self) -> int:
        return self.now_ms


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture(params=["sqlite", "redis"])
def new_store(request: pytest.FixtureRequest, tmp_path: Path, clock: Clock) -> StoreFactory:
    """Makes store objects over one database (a file, or a key prefix on the server)."""
    if request.param == "sqlite":
        return lambda: SqliteSessionStore(tmp_path / "ctx.sqlite3", clock)
    server: RedisServer = request.getfixturevalue("redis_server")
    prefix = f"test-{uuid.uuid4().hex}:"
    return lambda: RedisSessionStore(server.url, prefix, clock)


@asynccontextmanager
async def opened(new_store: StoreFactory) -> AsyncIterator[SessionStore]:
    store = new_store()
    await store.open()
    try:
        yield store
    finally:
        await store.close()


def run(new_store: StoreFactory, scenario: Callable[[SessionStore], Awaitable[T]]) -> T:
    async def main() -> T:
        async with opened(new_store) as store:
            return await scenario(store)

    return asyncio.run(main())


def test_append_then_load_survives_reopening(new_store: StoreFactory) -> None:
    async def scenario() -> None:
        async with opened(new_store) as store:
            assert await store.append("t1", "s1", "r1", TURNS, DAY_MS) == (2, Appended.APPENDED)
        async with opened(new_store) as reopened:
            session = await reopened.load("t1", "s1", DAY_MS)
        assert session is not None
        assert [(t.role, t.text, t.token_count) for t in session.turns] == [
            (Role.USER, "hi", 2),
            (Role.ASSISTANT, "hello ✓", 9),
        ]
        assert all(t.request_id == "r1" and t.created_at_ms > 0 for t in session.turns)

    asyncio.run(scenario())


def test_retried_request_id_is_not_appended_twice(new_store: StoreFactory) -> None:
    async def scenario(store: SessionStore) -> None:
        assert await store.append("t", "s", "r1", TURNS, DAY_MS) == (2, Appended.APPENDED)
        assert await store.append("t", "s", "r1", TURNS, DAY_MS) == (2, Appended.DUPLICATE)
        session = await store.load("t", "s", DAY_MS)
        assert session is not None and len(session.turns) == 2

    run(new_store, scenario)


def test_a_reused_request_id_with_another_request_is_a_conflict(
    new_store: StoreFactory,
) -> None:
    """The id alone does not make a retry: another user turn under it is refused, the
    stored turns stay as they were; the same request (whatever its answer) is a retry."""

    async def scenario(store: SessionStore) -> None:
        assert await store.append("t", "s", "r1", TURNS, DAY_MS) == (2, Appended.APPENDED)
        other = [Turn(Role.USER, "another question ✓"), Turn(Role.ASSISTANT, "x")]
        assert await store.append("t", "s", "r1", other, DAY_MS) == (2, Appended.CONFLICT)
        retried = [TURNS[0], Turn(Role.ASSISTANT, "another sampled answer")]
        assert await store.append("t", "s", "r1", retried, DAY_MS) == (2, Appended.DUPLICATE)
        # Scoped to the session (and tenant): the id is free elsewhere.
        assert await store.append("t", "s2", "r1", other, DAY_MS) == (2, Appended.APPENDED)
        assert await store.append("u", "s", "r1", other, DAY_MS) == (2, Appended.APPENDED)
        session = await store.load("t", "s", DAY_MS)
        assert session is not None
        assert [t.text for t in session.turns] == [t.text for t in TURNS]

    run(new_store, scenario)


def test_another_tenants_session_is_missing(new_store: StoreFactory) -> None:
    async def scenario(store: SessionStore) -> None:
        await store.append("tenant-a", "shared-id", "r1", TURNS, DAY_MS)
        assert await store.load("tenant-b", "shared-id", DAY_MS) is None
        assert await store.load("tenant-a", "never", DAY_MS) is None
        assert not await store.delete("tenant-b", "shared-id")
        assert await store.list("tenant-b", "", 10) == []
        assert await store.load("tenant-a", "shared-id", DAY_MS) is not None

    run(new_store, scenario)


def test_concurrent_appends_all_land_each_whole(new_store: StoreFactory) -> None:
    async def scenario(store: SessionStore) -> None:
        appends = [[Turn(Role.USER, f"q{i}"), Turn(Role.ASSISTANT, f"a{i}")] for i in range(20)]
        await asyncio.gather(
            *(store.append("t", "s", f"r{i}", turns, DAY_MS) for i, turns in enumerate(appends))
        )
        session = await store.load("t", "s", DAY_MS)
        assert session is not None
        pairs = list(zip(session.turns[::2], session.turns[1::2], strict=True))
        # Every append landed, its two turns next to each other, in the store's order.
        assert sorted(q.request_id for q, _ in pairs) == sorted(f"r{i}" for i in range(20))
        assert all(q.request_id == a.request_id for q, a in pairs)
        assert all(q.text[1:] == a.text[1:] for q, a in pairs)

    run(new_store, scenario)


def test_system_prompt_metadata_and_summary(new_store: StoreFactory) -> None:
    async def scenario(store: SessionStore) -> None:
        await store.put("t", "s", "Be brief.", {"lang": "en"}, DAY_MS)
        await store.append("t", "s", "r1", TURNS, DAY_MS)
        await store.save_summary("t", "s", "They said hi.", 2)
        await store.put("t", "s", "Be very brief.", {"lang": "fr"}, DAY_MS)
        session = await store.load("t", "s", DAY_MS)
        assert session is not None
        assert (session.system_prompt, session.metadata) == ("Be very brief.", {"lang": "fr"})
        assert (session.summary, session.summarized_turns) == ("They said hi.", 2)
        assert len(session.turns) == 2

    run(new_store, scenario)


def test_a_summary_replaces_only_the_one_it_was_written_over(new_store: StoreFactory) -> None:
    """model_summary's folds: a summary written over the one covering 0 turns is stored
    once; another written over that same one (a fold that raced it) is refused."""

    async def scenario(store: SessionStore) -> None:
        await store.append("t", "s", "r1", TURNS, DAY_MS)
        assert await store.save_summary("t", "s", "First.", 1, replaces=0)
        assert not await store.save_summary("t", "s", "Raced.", 2, replaces=0)
        assert await store.save_summary("t", "s", "Second.", 2, replaces=1)
        session = await store.load("t", "s", DAY_MS)
        assert session is not None
        assert (session.summary, session.summarized_turns) == ("Second.", 2)
        assert not await store.save_summary("t", "nowhere", "x", 1, replaces=0)

    run(new_store, scenario)


async def fork(
    store: SessionStore,
    tenant: str,
    source: str,
    target: str,
    system_prompt: str = "",
    metadata: dict[str, str] | None = None,
) -> int | None:
    return await store.fork(
        tenant, source, target, system_prompt=system_prompt, metadata=metadata or {}, ttl_ms=DAY_MS
    )


def test_a_fork_copies_the_conversation_and_leaves_the_source_alone(
    new_store: StoreFactory, clock: Clock
) -> None:
    """A branch holds the source's turns (with their request ids: a retry of an earlier
    turn is still a retry there) and summary, its own system prompt and metadata; either
    grows without the other, and a fork never overwrites a live session."""

    async def scenario(store: SessionStore) -> None:
        await store.put("t", "root", "Be brief.", {"k": "root"}, DAY_MS)
        await store.append("t", "root", "r1", TURNS, DAY_MS)
        await store.save_summary("t", "root", "They said hi.", 1)
        assert await fork(store, "t", "root", "branch", "Be kind.", {"k": "b"}) == 2
        assert await store.append("t", "branch", "r1", TURNS, DAY_MS) == (2, Appended.DUPLICATE)
        more = [Turn(Role.USER, "and then?"), Turn(Role.ASSISTANT, "then this")]
        assert await store.append("t", "branch", "r2", more, DAY_MS) == (4, Appended.APPENDED)
        branch = await store.load("t", "branch", DAY_MS)
        root = await store.load("t", "root", DAY_MS)
        assert branch is not None and root is not None
        assert [t.text for t in branch.turns] == ["hi", "hello ✓", "and then?", "then this"]
        assert [t.request_id for t in branch.turns] == ["r1", "r1", "r2", "r2"]
        assert (branch.system_prompt, branch.metadata) == ("Be kind.", {"k": "b"})
        assert (branch.summary, branch.summarized_turns) == ("They said hi.", 1)
        assert (root.system_prompt, len(root.turns)) == ("Be brief.", 2)
        with pytest.raises(SessionExists):
            await fork(store, "t", "root", "branch")
        assert await fork(store, "t", "missing", "new") is None
        assert await fork(store, "u", "root", "theirs") is None  # tenant-scoped
        assert await store.load("t", "new", DAY_MS) is None
        assert sorted(await store.list("t", "", 10)) == ["branch", "root"]
        clock.now_ms += 2 * DAY_MS  # both expired: an expired source forks nothing, and
        assert await fork(store, "t", "root", "later") is None
        await store.append("t", "fresh", "r9", TURNS, DAY_MS)  # an expired target is free
        assert await fork(store, "t", "fresh", "branch") == 2

    run(new_store, scenario)


def test_core_forks_with_clear_errors(new_store: StoreFactory) -> None:
    async def scenario(store: SessionStore) -> None:
        core = ContextCore(store, default_ttl_s=3600)
        await core.append("t", "s", "r1", TURNS)
        assert await core.fork("t", "s", "s2", system_prompt="", metadata={}) == 2
        with pytest.raises(AlreadyExists, match="session_id"):
            await core.fork("t", "s", "s2", system_prompt="", metadata={})
        with pytest.raises(NotFound):
            await core.fork("t", "nope", "s3", system_prompt="", metadata={})
        with pytest.raises(InvalidArgument, match="source_session_id"):
            await core.fork("t", "bad id!", "s4", system_prompt="", metadata={})

    run(new_store, scenario)


def test_delete_erases_everything(new_store: StoreFactory) -> None:
    async def scenario(store: SessionStore) -> None:
        await store.put("t", "s", "system", {"k": "v"}, DAY_MS)
        await store.append("t", "s", "r1", TURNS, DAY_MS)
        assert await store.delete("t", "s")
        assert await store.load("t", "s", DAY_MS) is None
        assert await store.list("t", "", 10) == []
        # The request id went with it: the same request appends again.
        assert await store.append("t", "s", "r1", TURNS[:1], DAY_MS) == (1, Appended.APPENDED)
        await store.save_summary("gone", "nowhere", "x", 1)  # never creates a session
        assert await store.load("gone", "nowhere", DAY_MS) is None

    run(new_store, scenario)


def test_list_pages_through_a_tenants_sessions(new_store: StoreFactory) -> None:
    async def scenario(store: SessionStore) -> None:
        for i in range(7):
            await store.append("t", f"s{i}", "r", TURNS[:1], DAY_MS)
        await store.append("other", "x", "r", TURNS[:1], DAY_MS)
        core = ContextCore(store, 60)
        pages, token = [], ""
        while True:
            page, token = await core.list("t", 3, token)
            pages.append(page)
            if not token:
                break
        assert pages == [["s0", "s1", "s2"], ["s3", "s4", "s5"], ["s6"]]

    run(new_store, scenario)


def test_sessions_expire_after_their_ttl_and_the_sweep_drops_them(
    new_store: StoreFactory, clock: Clock
) -> None:
    async def scenario(store: SessionStore) -> None:
        await store.append("t", "short", "r", TURNS, 1000)
        await store.append("t", "long", "r", TURNS, DAY_MS)
        clock.now_ms += 999
        assert await store.load("t", "short", 1000) is not None
        clock.now_ms += 1001  # past the slid expiry too
        assert await store.load("t", "short", 1) is None
        assert await store.list("t", "", 10) == ["long"]
        assert await store.sweep() >= 1
        assert await store.load("t", "long", DAY_MS) is not None
        # An expired session's id starts a new conversation.
        assert await store.append("t", "short", "r", TURNS[:1], DAY_MS) == (1, Appended.APPENDED)

    run(new_store, scenario)


def test_an_access_slides_the_expiry(new_store: StoreFactory, clock: Clock) -> None:
    async def scenario(store: SessionStore) -> None:
        await store.append("t", "s", "r", TURNS, 400)
        await store.append("t", "probe", "r", TURNS, 400)
        assert await store.load("t", "s", DAY_MS) is not None  # slides it a day out
        clock.now_ms += 401  # past the first expiry of both
        assert await store.load("t", "probe", 1) is None
        assert await store.load("t", "s", DAY_MS) is not None

    run(new_store, scenario)


@pytest.mark.parametrize(
    ("tenant", "session", "request_id", "turns", "field"),
    [
        ("", "s", "r", TURNS, "tenant"),
        ("t", "bad id!", "r", TURNS, "session_id"),
        ("t", "s", "", TURNS, "request_id"),
        ("t", "s", "r", [], "turns"),
        ("t", "s", "r", [Turn(Role.USER, "x", -1)], "turns[0].token_count"),
        ("t", "s", "r", [Turn(Role.USER, "x" * 1_000_001)], "turns[0].text"),
    ],
)
def test_core_rejects_bad_appends(
    tmp_path: Path, tenant: str, session: str, request_id: str, turns: list[Turn], field: str
) -> None:
    async def scenario(store: SessionStore) -> None:
        await ContextCore(store, 60).append(tenant, session, request_id, turns)

    with pytest.raises(InvalidArgument) as info:
        run(lambda: SqliteSessionStore(tmp_path / "ctx.sqlite3"), scenario)
    assert info.value.field == field


@pytest.mark.parametrize(
    ("budget", "strategy", "ttl", "field"),
    [
        (Budget(10), "longest_first", 0, "truncation"),
        (Budget(10), "", -1, "ttl_seconds"),
    ],
)
def test_core_rejects_bad_loads(
    tmp_path: Path, budget: Budget, strategy: str, ttl: int, field: str
) -> None:
    async def scenario(store: SessionStore) -> None:
        await ContextCore(store, 60).load("t", "s", budget, strategy, ttl)

    with pytest.raises(InvalidArgument) as info:
        run(lambda: SqliteSessionStore(tmp_path / "ctx.sqlite3"), scenario)
    assert info.value.field == field


def test_negative_budgets_are_invalid() -> None:
    with pytest.raises(InvalidArgument, match="budget_tokens"):
        Budget(-1)


def test_a_missing_session_is_not_found(new_store: StoreFactory) -> None:
    async def scenario(store: SessionStore) -> None:
        core = ContextCore(store, 60)
        await core.append("a", "s", "r", TURNS)
        for tenant, session in (("b", "s"), ("a", "other")):
            with pytest.raises(NotFound) as info:
                await core.load(tenant, session, Budget(0))
            assert info.value.message == f"no session '{session}'"

    run(new_store, scenario)

"""The SQLite session store against real database files."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from llmmesh.runtime.errors import InvalidArgument
from llmmesh.types import Role, Turn
from services.context.core import ContextCore
from services.context.store import SqliteSessionStore

TURNS = [Turn(Role.USER, "hi", 2), Turn(Role.ASSISTANT, "hello ✓", 9)]


async def _open(path: Path) -> SqliteSessionStore:
    store = SqliteSessionStore(path)
    await store.open()
    return store


def test_append_then_load_survives_reopening(tmp_path: Path) -> None:
    async def scenario() -> list[Turn]:
        store = await _open(tmp_path / "ctx.sqlite3")
        assert await store.append("t1", "s1", "r1", TURNS) == (2, True)
        await store.close()
        reopened = await _open(tmp_path / "ctx.sqlite3")
        try:
            return await reopened.load("t1", "s1")
        finally:
            await reopened.close()

    loaded = asyncio.run(scenario())
    assert [(t.role, t.text, t.token_count) for t in loaded] == [
        (Role.USER, "hi", 2),
        (Role.ASSISTANT, "hello ✓", 9),
    ]
    assert all(t.request_id == "r1" and t.created_at_ms > 0 for t in loaded)


def test_retried_request_id_is_not_appended_twice(tmp_path: Path) -> None:
    async def scenario() -> tuple[tuple[int, bool], tuple[int, bool], int]:
        store = await _open(tmp_path / "ctx.sqlite3")
        try:
            first = await store.append("t", "s", "r1", TURNS)
            again = await store.append("t", "s", "r1", TURNS)
            return first, again, len(await store.load("t", "s"))
        finally:
            await store.close()

    assert asyncio.run(scenario()) == ((2, True), (2, False), 2)


def test_sessions_are_isolated_by_tenant(tmp_path: Path) -> None:
    async def scenario() -> list[Turn]:
        store = await _open(tmp_path / "ctx.sqlite3")
        try:
            await store.append("tenant-a", "shared-id", "r1", TURNS)
            return await store.load("tenant-b", "shared-id")
        finally:
            await store.close()

    assert asyncio.run(scenario()) == []


def test_concurrent_appends_both_land_in_order(tmp_path: Path) -> None:
    async def scenario() -> list[str]:
        store = await _open(tmp_path / "ctx.sqlite3")
        try:
            await asyncio.gather(
                *(store.append("t", "s", f"r{i}", [Turn(Role.USER, f"m{i}")]) for i in range(20))
            )
            return [t.request_id for t in await store.load("t", "s")]
        finally:
            await store.close()

    ids = asyncio.run(scenario())
    assert sorted(ids) == sorted(f"r{i}" for i in range(20))


@pytest.mark.parametrize(
    ("tenant", "session", "request_id", "turns", "field"),
    [
        ("", "s", "r", TURNS, "tenant"),
        ("t", "bad id!", "r", TURNS, "session_id"),
        ("t", "s", "", TURNS, "request_id"),
        ("t", "s", "r", [], "turns"),
        ("t", "s", "r", [Turn(Role.USER, "x", -1)], "turns[0].token_count"),
    ],
)
def test_core_rejects_bad_appends(
    tmp_path: Path, tenant: str, session: str, request_id: str, turns: list[Turn], field: str
) -> None:
    async def scenario() -> None:
        store = await _open(tmp_path / "ctx.sqlite3")
        try:
            await ContextCore(store).append(tenant, session, request_id, turns)
        finally:
            await store.close()

    with pytest.raises(InvalidArgument) as info:
        asyncio.run(scenario())
    assert info.value.field == field

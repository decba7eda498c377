"""Session stores. SQLite (WAL, synchronous=FULL): an append is acknowledged only once durable."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Protocol, TypeVar

from llmmesh.types import Role, Turn

_SCHEMA = """
CREATE TABLE IF NOT EXISTS turns (
    tenant TEXT NOT NULL,
    session_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    role TEXT NOT NULL,
    text TEXT NOT NULL,
    token_count INTEGER NOT NULL,
    request_id TEXT NOT NULL,
    created_at_ms INTEGER NOT NULL,
    PRIMARY KEY (tenant, session_id, seq)
);
CREATE TABLE IF NOT EXISTS appends (
    tenant TEXT NOT NULL,
    session_id TEXT NOT NULL,
    request_id TEXT NOT NULL,
    PRIMARY KEY (tenant, session_id, request_id)
);
"""

T = TypeVar("T")


class SessionStore(Protocol):
    async def load(self, tenant: str, session_id: str) -> list[Turn]: ...

    async def append(
        self, tenant: str, session_id: str, request_id: str, turns: list[Turn]
    ) -> tuple[int, bool]:
        """Appends unless ``request_id`` was stored already; returns (turn count, appended)."""

    async def close(self) -> None: ...


class SqliteSessionStore:
    """One connection, used from one worker thread, so the event loop never blocks on disk."""

    def __init__(self, path: str | Path) -> None:
        self._path = Path(path)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sqlite")
        self._conn: sqlite3.Connection | None = None

    async def open(self) -> None:
        await self._run(self._open)

    def _open(self) -> None:
        self._path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(self._path, isolation_level=None, check_same_thread=False)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")
        conn.executescript(_SCHEMA)
        self._conn = conn

    async def close(self) -> None:
        if self._conn is not None:
            await self._run(self._conn.close)
            self._conn = None
        self._executor.shutdown(wait=True)

    async def load(self, tenant: str, session_id: str) -> list[Turn]:
        return await self._run(self._load, tenant, session_id)

    async def append(
        self, tenant: str, session_id: str, request_id: str, turns: list[Turn]
    ) -> tuple[int, bool]:
        return await self._run(self._append, tenant, session_id, request_id, turns)

    async def _run(self, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _db(self) -> sqlite3.Connection:
        if self._conn is None:
            raise RuntimeError("store is not open")
        return self._conn

    def _load(self, tenant: str, session_id: str) -> list[Turn]:
        rows = self._db().execute(
            "SELECT role, text, token_count, request_id, created_at_ms FROM turns"
            " WHERE tenant = ? AND session_id = ? ORDER BY seq",
            (tenant, session_id),
        )
        return [Turn(Role(r[0]), r[1], r[2], r[3], r[4]) for r in rows]

    def _append(
        self, tenant: str, session_id: str, request_id: str, turns: list[Turn]
    ) -> tuple[int, bool]:
        db = self._db()
        now_ms = int(time.time() * 1000)
        db.execute("BEGIN IMMEDIATE")
        try:
            inserted = db.execute(
                "INSERT OR IGNORE INTO appends (tenant, session_id, request_id) VALUES (?, ?, ?)",
                (tenant, session_id, request_id),
            ).rowcount
            (count,) = db.execute(
                "SELECT COUNT(*) FROM turns WHERE tenant = ? AND session_id = ?",
                (tenant, session_id),
            ).fetchone()
            if inserted:
                db.executemany(
                    "INSERT INTO turns VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    [
                        (
                            tenant,
                            session_id,
                            count + i,
                            t.role.value,
                            t.text,
                            t.token_count,
                            request_id,
                            now_ms,
                        )
                        for i, t in enumerate(turns)
                    ],
                )
                count += len(turns)
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        return count, bool(inserted)

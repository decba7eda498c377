"""The SQLite session store (WAL, synchronous=FULL): embedded, one file.

Appends that arrive together share one transaction and one fsync (group commit), and
reads go through their own connection, so they never wait for a write.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from llmmesh.types import Role, Turn, request_text
from services.context.store import Appended, Session, SessionExists, now_ms

T = TypeVar("T")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    tenant TEXT NOT NULL,
    session_id TEXT NOT NULL,
    system_prompt TEXT NOT NULL DEFAULT '',
    metadata TEXT NOT NULL DEFAULT '{}',
    summary TEXT NOT NULL DEFAULT '',
    summarized_turns INTEGER NOT NULL DEFAULT 0,
    turn_count INTEGER NOT NULL DEFAULT 0,
    expires_at_ms INTEGER NOT NULL,
    PRIMARY KEY (tenant, session_id)
);
CREATE INDEX IF NOT EXISTS sessions_expiry ON sessions (expires_at_ms);
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
# Databases from before the sessions table: every conversation becomes a session.
_MIGRATE = """
INSERT OR IGNORE INTO sessions (tenant, session_id, turn_count, expires_at_ms)
SELECT tenant, session_id, COUNT(*), ? FROM turns GROUP BY tenant, session_id
"""


Write = Callable[[sqlite3.Connection], Any]
CHECKPOINT_EVERY_COMMITS = 200


class SqliteSessionStore:
    def __init__(self, path: str | Path, clock: Callable[[], int] = now_ms) -> None:
        self._path = Path(path)
        self._now = clock  # wall-clock milliseconds: expiry outlives the process
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sqlite-write")
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sqlite-read")
        self._write_conn: sqlite3.Connection | None = None
        self._read_conn: sqlite3.Connection | None = None
        self._checkpoint_conn: sqlite3.Connection | None = None
        self._queue: list[tuple[Write, asyncio.Future[Any]]] = []
        self._flushing: asyncio.Task[None] | None = None
        # WAL checkpoints copy pages into the database file and fsync it: done by a
        # thread of their own, not by the commit that happens to cross the threshold.
        self._checkpointer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sqlite-ckpt")
        self._checkpointing: asyncio.Future[Any] | None = None
        self._commits_since_checkpoint = 0

    async def open(self) -> None:
        loop = asyncio.get_running_loop()
        self._write_conn = await loop.run_in_executor(self._writer, self._connect, True)
        self._read_conn = await loop.run_in_executor(self._reader, self._connect, False)
        self._checkpoint_conn = await loop.run_in_executor(self._checkpointer, self._connect, False)

    def _connect(self, writer: bool) -> sqlite3.Connection:
        self._path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(self._path, isolation_level=None, check_same_thread=False)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")
        conn.execute("PRAGMA busy_timeout=5000")
        if writer:
            conn.execute("PRAGMA wal_autocheckpoint=0")  # see _maybe_checkpoint
            conn.executescript(_SCHEMA)
            conn.execute(_MIGRATE, (self._now() + 7 * 86_400_000,))
        return conn

    async def close(self) -> None:
        if self._flushing is not None:
            await asyncio.gather(self._flushing, return_exceptions=True)
        if self._checkpointing is not None:
            await asyncio.gather(self._checkpointing, return_exceptions=True)
        loop = asyncio.get_running_loop()
        for conn, executor in (
            (self._write_conn, self._writer),
            (self._read_conn, self._reader),
            (self._checkpoint_conn, self._checkpointer),
        ):
            if conn is not None:
                await loop.run_in_executor(executor, conn.close)
            executor.shutdown(wait=True)
        self._write_conn = self._read_conn = self._checkpoint_conn = None

    # Writes: queued, and committed together by one flush.

    async def _write(self, action: Write) -> Any:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._queue.append((action, future))
        if self._flushing is None or self._flushing.done():
            self._flushing = asyncio.create_task(self._flush())
        return await future

    async def _flush(self) -> None:
        loop = asyncio.get_running_loop()
        while self._queue:
            batch, self._queue = self._queue, []
            try:
                results = await loop.run_in_executor(self._writer, self._commit, batch)
            except Exception as err:  # the whole transaction failed: so did every write
                results = [err] * len(batch)
            for (_, future), result in zip(batch, results, strict=True):
                if future.done():
                    continue
                if isinstance(result, Exception):
                    future.set_exception(result)
                else:
                    future.set_result(result)
            self._maybe_checkpoint()

    def _maybe_checkpoint(self) -> None:
        """A passive checkpoint (it waits for no reader or writer) every so many commits."""
        self._commits_since_checkpoint += 1
        busy = self._checkpointing is not None and not self._checkpointing.done()
        if self._commits_since_checkpoint < CHECKPOINT_EVERY_COMMITS or busy:
            return
        self._commits_since_checkpoint = 0
        conn = self._connection(self._checkpoint_conn)
        self._checkpointing = asyncio.get_running_loop().run_in_executor(
            self._checkpointer, conn.execute, "PRAGMA wal_checkpoint(PASSIVE)"
        )

    def _commit(self, batch: list[tuple[Write, asyncio.Future[Any]]]) -> list[Any]:
        """One transaction: each write in its own savepoint, so one failing write fails
        alone; one fsync at COMMIT acknowledges them all."""
        db = self._connection(self._write_conn)
        results: list[Any] = []
        db.execute("BEGIN IMMEDIATE")
        try:
            for action, _ in batch:
                db.execute("SAVEPOINT one")
                try:
                    results.append(action(db))
                    db.execute("RELEASE one")
                except (sqlite3.Error, SessionExists) as err:  # that write's own failure
                    db.execute("ROLLBACK TO one")
                    db.execute("RELEASE one")
                    results.append(err)
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        return results

    async def _read(self, action: Callable[[sqlite3.Connection], T]) -> T:
        conn = self._connection(self._read_conn)
        return await asyncio.get_running_loop().run_in_executor(self._reader, action, conn)

    @staticmethod
    def _connection(conn: sqlite3.Connection | None) -> sqlite3.Connection:
        if conn is None:
            raise RuntimeError("store is not open")
        return conn

    # The operations.

    async def load(self, tenant: str, session_id: str, ttl_ms: int) -> Session | None:
        now = self._now()
        found = await self._read(lambda db: _load(db, tenant, session_id, now))
        if found is None:
            return None
        session, expires_at_ms = found
        # Sliding expiry. A conversation's appends slide it already: a load writes only
        # when the expiry lags by more than a tenth of the TTL.
        if expires_at_ms - now < ttl_ms * 0.9:
            await self._write(_touch(tenant, session_id, now + ttl_ms))
        return session

    async def append(
        self, tenant: str, session_id: str, request_id: str, turns: list[Turn], ttl_ms: int
    ) -> tuple[int, Appended]:
        result: tuple[int, Appended] = await self._write(
            _append(tenant, session_id, request_id, turns, ttl_ms, now=self._now())
        )
        return result

    async def put(
        self,
        tenant: str,
        session_id: str,
        system_prompt: str,
        metadata: dict[str, str],
        ttl_ms: int,
    ) -> None:
        expires_at_ms = self._now() + ttl_ms

        def action(db: sqlite3.Connection) -> None:
            db.execute(
                "INSERT INTO sessions (tenant, session_id, system_prompt, metadata,"
                " expires_at_ms) VALUES (?, ?, ?, ?, ?) ON CONFLICT DO UPDATE SET"
                " system_prompt = excluded.system_prompt, metadata = excluded.metadata,"
                " expires_at_ms = excluded.expires_at_ms",
                (tenant, session_id, system_prompt, json.dumps(metadata), expires_at_ms),
            )

        await self._write(action)

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
        now = self._now()
        new = (tenant, session_id, system_prompt, json.dumps(metadata), now + ttl_ms)
        forked: int | None = await self._write(_fork(tenant, source_id, new, now))
        return forked

    async def save_summary(
        self,
        tenant: str,
        session_id: str,
        summary: str,
        summarized_turns: int,
        replaces: int | None = None,
    ) -> bool:
        condition = "" if replaces is None else " AND summarized_turns = ?"
        values: tuple[str | int, ...] = (summary, summarized_turns, tenant, session_id)
        values += () if replaces is None else (replaces,)

        def action(db: sqlite3.Connection) -> bool:
            updated = db.execute(
                "UPDATE sessions SET summary = ?, summarized_turns = ?"
                " WHERE tenant = ? AND session_id = ?" + condition,
                values,
            )
            return updated.rowcount > 0

        saved: bool = await self._write(action)
        return saved

    async def delete(self, tenant: str, session_id: str) -> bool:
        def action(db: sqlite3.Connection) -> bool:
            return _delete(db, "tenant = ? AND session_id = ?", (tenant, session_id)) > 0

        deleted: bool = await self._write(action)
        return deleted

    async def list(self, tenant: str, after: str, limit: int) -> list[str]:
        now = self._now()

        def action(db: sqlite3.Connection) -> list[str]:
            rows = db.execute(
                "SELECT session_id FROM sessions WHERE tenant = ? AND session_id > ?"
                " AND expires_at_ms > ? ORDER BY session_id LIMIT ?",
                (tenant, after, now, limit),
            )
            return [r[0] for r in rows]

        return await self._read(action)

    async def sweep(self) -> int:
        now = self._now()

        def action(db: sqlite3.Connection) -> int:
            return _delete(db, "expires_at_ms <= ?", (now,))

        swept: int = await self._write(action)
        return swept


def _load(
    db: sqlite3.Connection, tenant: str, session_id: str, now: int
) -> tuple[Session, int] | None:
    row = db.execute(
        "SELECT system_prompt, metadata, summary, summarized_turns, expires_at_ms FROM sessions"
        " WHERE tenant = ? AND session_id = ? AND expires_at_ms > ?",
        (tenant, session_id, now),
    ).fetchone()
    if row is None:
        return None
    turns = db.execute(
        "SELECT role, text, token_count, request_id, created_at_ms FROM turns"
        " WHERE tenant = ? AND session_id = ? ORDER BY seq",
        (tenant, session_id),
    )
    session = Session(
        system_prompt=row[0],
        metadata=json.loads(row[1]),
        turns=[Turn(Role(r[0]), r[1], r[2], r[3], r[4]) for r in turns],
        summary=row[2],
        summarized_turns=row[3],
    )
    return session, row[4]


def _touch(tenant: str, session_id: str, expires_at_ms: int) -> Write:
    def action(db: sqlite3.Connection) -> None:
        db.execute(
            "UPDATE sessions SET expires_at_ms = MAX(expires_at_ms, ?)"
            " WHERE tenant = ? AND session_id = ?",
            (expires_at_ms, tenant, session_id),
        )

    return action


def _append(
    tenant: str, session_id: str, request_id: str, turns: list[Turn], ttl_ms: int, *, now: int
) -> Write:
    def action(db: sqlite3.Connection) -> tuple[int, Appended]:
        # A session that expired but is not swept yet starts over.
        expired = db.execute(
            "SELECT 1 FROM sessions WHERE tenant = ? AND session_id = ? AND expires_at_ms <= ?",
            (tenant, session_id, now),
        ).fetchone()
        if expired:
            _delete(db, "tenant = ? AND session_id = ?", (tenant, session_id))
        db.execute(
            "INSERT INTO sessions (tenant, session_id, expires_at_ms) VALUES (?, ?, ?)"
            " ON CONFLICT DO UPDATE SET expires_at_ms = excluded.expires_at_ms",
            (tenant, session_id, now + ttl_ms),
        )
        inserted = db.execute(
            "INSERT OR IGNORE INTO appends (tenant, session_id, request_id) VALUES (?, ?, ?)",
            (tenant, session_id, request_id),
        ).rowcount
        (count,) = db.execute(
            "SELECT turn_count FROM sessions WHERE tenant = ? AND session_id = ?",
            (tenant, session_id),
        ).fetchone()
        if not inserted:
            return count, _repeated(db, tenant, session_id, request_id, turns)
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
                    now,
                )
                for i, t in enumerate(turns)
            ],
        )
        db.execute(
            "UPDATE sessions SET turn_count = ? WHERE tenant = ? AND session_id = ?",
            (count + len(turns), tenant, session_id),
        )
        return count + len(turns), Appended.APPENDED

    return action


def _fork(tenant: str, source_id: str, new: tuple[Any, ...], now: int) -> Write:
    """``new``: the new session's (tenant, id, system prompt, metadata, expiry)."""
    session_id = new[1]

    def action(db: sqlite3.Connection) -> int | None:
        _delete(db, "tenant = ? AND session_id = ? AND expires_at_ms <= ?", (*new[:2], now))
        source = db.execute(
            "SELECT summary, summarized_turns, turn_count FROM sessions"
            " WHERE tenant = ? AND session_id = ? AND expires_at_ms > ?",
            (tenant, source_id, now),
        ).fetchone()
        if source is None:
            return None
        try:
            db.execute(
                "INSERT INTO sessions (tenant, session_id, system_prompt, metadata,"
                " expires_at_ms, summary, summarized_turns, turn_count)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (*new, *source),
            )
        except sqlite3.IntegrityError:
            raise SessionExists(session_id) from None
        for table, columns in (
            ("turns", "seq, role, text, token_count, request_id, created_at_ms"),
            ("appends", "request_id"),
        ):
            db.execute(
                f"INSERT INTO {table} SELECT tenant, ?, {columns} FROM {table}"
                " WHERE tenant = ? AND session_id = ?",
                (session_id, tenant, source_id),
            )
        count: int = source[2]
        return count

    return action


def _repeated(
    db: sqlite3.Connection, tenant: str, session_id: str, request_id: str, turns: list[Turn]
) -> Appended:
    """A stored id again: a retry if it brings the same request text, else a conflict."""
    stored = db.execute(
        "SELECT role, text FROM turns WHERE tenant = ? AND session_id = ? AND request_id = ?"
        " ORDER BY seq",
        (tenant, session_id, request_id),
    ).fetchall()
    before = request_text([Turn(Role(role), text) for role, text in stored])
    same = before is None or before == request_text(turns)
    return Appended.DUPLICATE if same else Appended.CONFLICT


def _delete(db: sqlite3.Connection, where: str, args: tuple[Any, ...]) -> int:
    """Deletes the sessions matching ``where`` with their turns and request ids."""
    keys = db.execute(f"SELECT tenant, session_id FROM sessions WHERE {where}", args).fetchall()
    for table in ("turns", "appends", "sessions"):
        db.executemany(f"DELETE FROM {table} WHERE tenant = ? AND session_id = ?", keys)
    return len(keys)

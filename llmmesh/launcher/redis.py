"""A Redis server for the context service's Redis store: Debian's redis-server, on
loopback, with every write fsynced to its append-only file before it is acknowledged."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import time
from pathlib import Path

from llmmesh.launcher.process import Child, StackError

START_TIMEOUT_S = 20.0


def redis_server_binary() -> str:
    found = shutil.which("redis-server")
    if found is None:
        raise StackError("redis-server is not installed (Debian package redis-server)")
    return found


def start_redis(
    workdir: Path,
    port: int,
    log_path: Path | None = None,
    *,
    append: bool = False,
    fsync: str = "always",
) -> Child:
    """Starts redis-server keeping its data in ``workdir`` (restarting on the same
    directory recovers it from the append-only file); returns once it answers PING.
    ``fsync``: "always" (a reply means the write is on disk: sessions) or "everysec"
    (routers' budgets and affinities, which a second's loss does not hurt, and which an
    fsync per admission would slow by a millisecond or more)."""
    log_path = log_path or workdir / "redis.log"
    workdir.mkdir(parents=True, exist_ok=True)
    command = [
        redis_server_binary(),
        "--port", str(port),
        "--bind", "127.0.0.1",
        "--dir", str(workdir),
        "--appendonly", "yes",
        "--appendfsync", fsync,
        "--save", "",
        "--daemonize", "no",
    ]  # fmt: skip
    child = Child.spawn("redis", command, dict(os.environ), log_path, workdir, append=append)
    child.wait_until(lambda: ping(port), time.monotonic() + START_TIMEOUT_S, "answer PING")
    return child


def ping(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1) as s:
        s.sendall(b"PING\r\n")
        return s.recv(16).startswith(b"+PONG")
    return False

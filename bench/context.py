"""Context benchmark: append and load latency of 50-turn conversations, 32 at a time,
on SQLite and on Redis, in process (the service's core over its store) and through the
context service; and the cost of each truncation strategy on a 200-turn session.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from bench.metrics import percentile
from bench.workload import text_of_length
from llmmesh.launcher import StackPorts
from llmmesh.launcher.process import Child
from llmmesh.launcher.redis import start_redis
from llmmesh.runtime.errors import NotFound
from llmmesh.runtime.internal_auth import new_token_file, token_metadata
from llmmesh.types import Role, Turn, count_tokens
from llmmesh.v1 import context_pb2, context_pb2_grpc
from services.context.core import ContextCore
from services.context.redis_store import RedisSessionStore
from services.context.sqlite_store import SqliteSessionStore
from services.context.store import Session, SessionStore
from services.context.truncation import STRATEGIES, Budget, truncate

SESSIONS = 32
TURNS = 50  # per session: 25 rounds of a load and an append of a question and answer
TURN_CHARS = 200
# A conversation's pace: the model generates between a round's load and its append,
# and the user reads and types between rounds (seconds, in life; scaled down here, so
# that the 32 conversations overlap densely). Without pauses the run measures queueing
# behind 31 other requests, which SATURATED reports.
GENERATION_S = (0.02, 0.06)
USER_S = (0.0, 0.02)


@dataclass
class Samples:
    load_s: list[float] = field(default_factory=list)
    append_s: list[float] = field(default_factory=list)


Load = Callable[[str], Awaitable[object]]
Append = Callable[[str, str, list[Turn]], Awaitable[object]]


async def conversations(load: Load, append: Append, seed: int, paced: bool = True) -> Samples:
    """SESSIONS conversations at once, each TURNS turns long: every round loads the
    history and appends a question and its answer (``paced``: with a conversation's
    pauses between them)."""
    samples = Samples()
    rng = random.Random(seed)
    run = f"{seed}-{time.time_ns()}"

    # Warm-up, not measured: a round of every kind of call, all at once (connections,
    # threads, Lua scripts, the database's files).
    async def warm_up(n: int) -> None:
        await load(f"warmup-{run}-{n}")
        await append(f"warmup-{run}-{n}", "r", [Turn(Role.USER, "hello", 5)])
        await load(f"warmup-{run}-{n}")

    await asyncio.gather(*(warm_up(n) for n in range(SESSIONS)))

    async def one(n: int) -> None:
        session_id = f"bench-{run}-{n}"
        if paced:  # conversations start independently, not all at one instant
            await asyncio.sleep(rng.uniform(0, GENERATION_S[1] + USER_S[1]))
        for round_ in range(TURNS // 2):
            started = time.perf_counter()
            await load(session_id)
            samples.load_s.append(time.perf_counter() - started)
            if paced:
                await asyncio.sleep(rng.uniform(*GENERATION_S))  # the model answers
            turns = [
                Turn(Role.USER, text_of_length(rng, TURN_CHARS), TURN_CHARS),
                Turn(Role.ASSISTANT, text_of_length(rng, TURN_CHARS), TURN_CHARS),
            ]
            started = time.perf_counter()
            await append(session_id, f"r{round_}", turns)
            samples.append_s.append(time.perf_counter() - started)
            if paced:
                await asyncio.sleep(rng.uniform(*USER_S))  # the user reads and types

    await asyncio.gather(*(one(n) for n in range(SESSIONS)))
    return samples


async def in_process(store: SessionStore, seed: int, paced: bool = True) -> Samples:
    core = ContextCore(store, 3600)
    await store.open()
    try:
        budget = Budget(0)

        async def load(session_id: str) -> object:
            try:
                return await core.load("bench", session_id, budget)
            except NotFound:  # the conversation's first round
                return None

        async def append(session_id: str, request_id: str, turns: list[Turn]) -> object:
            return await core.append("bench", session_id, request_id, turns)

        return await conversations(load, append, seed, paced)
    finally:
        await store.close()


async def over_grpc(address: str, token: str, seed: int) -> Samples:
    auth = token_metadata(token)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = context_pb2_grpc.ContextStub(channel)

        async def load(session_id: str) -> object:
            request = context_pb2.LoadSessionRequest(tenant="bench", session_id=session_id)
            try:
                return await stub.LoadSession(request, metadata=auth)
            except grpc.aio.AioRpcError as err:
                if err.code() != grpc.StatusCode.NOT_FOUND:
                    raise
                return None

        async def append(session_id: str, request_id: str, turns: list[Turn]) -> object:
            pb_turns = [
                context_pb2.Turn(
                    role=context_pb2.ROLE_USER
                    if t.role is Role.USER
                    else context_pb2.ROLE_ASSISTANT,
                    text=t.text,
                    token_count=t.token_count,
                )
                for t in turns
            ]
            request = context_pb2.AppendTurnsRequest(
                tenant="bench", session_id=session_id, request_id=request_id, turns=pb_turns
            )
            return await stub.AppendTurns(request, metadata=auth)

        return await conversations(load, append, seed)


@contextmanager
def context_service(workdir: Path, **settings: str) -> Iterator[tuple[str, str]]:
    """A context service as the stack runs it (the mesh's token required): its address
    and the token."""
    port = StackPorts.free().context
    token_file = workdir / f"internal_token-{port}"
    token = new_token_file(token_file)
    env = dict(os.environ) | {
        "LLM_MESH_CONTEXT_GRPC_PORT": str(port),
        "LLM_MESH_CONTEXT_METRICS_PORT": "0",
        "LLM_MESH_CONTEXT_INTERNAL_TOKEN_FILE": str(token_file),
        **{f"LLM_MESH_CONTEXT_{k.upper()}": v for k, v in settings.items()},
    }
    name = f"context-{port}"
    child = Child.service(name, env, workdir / f"{name}.log", workdir, "context")
    try:
        child.wait_serving(f"127.0.0.1:{port}", time.monotonic() + 60)
        yield f"127.0.0.1:{port}", token
    finally:
        child.terminate(10)


def truncation_cost(seed: int, repeat: int = 20) -> dict[str, list[float]]:
    """Each strategy on a 200-turn session cut to a quarter of its size."""
    rng = random.Random(seed)
    turns = [
        Turn(role, text_of_length(rng, TURN_CHARS) + ".", TURN_CHARS)
        for _ in range(100)
        for role in (Role.USER, Role.ASSISTANT)
    ]
    session = Session(system_prompt="You are a helpful assistant.", turns=turns)
    budget = Budget(sum(t.token_count + 16 for t in turns) // 4, 16)
    costs: dict[str, list[float]] = {}
    for strategy in STRATEGIES:
        costs[strategy] = []
        for _ in range(repeat):
            started = time.perf_counter()
            truncate(session, budget, strategy, count_tokens)
            costs[strategy].append(time.perf_counter() - started)
    return costs


SATURATED = "SQLite, in process, no pauses"


@dataclass
class ContextResult:
    runs: dict[str, Samples]
    truncation_s: dict[str, list[float]]

    def table(self) -> str:
        rows = [
            "| store, path | loads | load p50 (ms) | load p99 (ms) | appends | "
            "append p50 (ms) | append p99 (ms) |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for name, s in self.runs.items():
            load = [percentile(s.load_s, q) * 1000 for q in (50, 99)]
            append = [percentile(s.append_s, q) * 1000 for q in (50, 99)]
            rows.append(
                f"| {name} | {len(s.load_s)} | {load[0]:.2f} | {load[1]:.2f} | "
                f"{len(s.append_s)} | {append[0]:.2f} | {append[1]:.2f} |"
            )
        rows += [
            "",
            "| truncation, 200-turn session | p50 (ms) | p99 (ms) |",
            "| --- | --- | --- |",
        ]
        for strategy, values in self.truncation_s.items():
            p50, p99 = (percentile(values, q) * 1000 for q in (50, 99))
            rows.append(f"| {strategy} | {p50:.2f} | {p99:.2f} |")
        return "\n".join(rows)


def run(workdir: Path, seed: int) -> ContextResult:
    runs: dict[str, Samples] = {}
    redis_port = StackPorts.free().context
    redis = start_redis(workdir / "redis", redis_port)
    redis_url = f"redis://127.0.0.1:{redis_port}/0"
    try:
        runs["SQLite, in process"] = asyncio.run(
            in_process(SqliteSessionStore(workdir / "bench.sqlite3"), seed)
        )
        runs["Redis, in process"] = asyncio.run(
            in_process(RedisSessionStore(redis_url, "bench:"), seed)
        )
        runs[SATURATED] = asyncio.run(
            in_process(SqliteSessionStore(workdir / "saturated.sqlite3"), seed, paced=False)
        )
        sqlite = {"kind": "sqlite", "path": str(workdir / "service.sqlite3")}
        with context_service(workdir, store=json.dumps(sqlite)) as (address, token):
            runs["SQLite, gRPC"] = asyncio.run(over_grpc(address, token, seed))
        redis_store = {"kind": "redis", "url": redis_url}
        with context_service(workdir, store=json.dumps(redis_store)) as (address, token):
            runs["Redis, gRPC"] = asyncio.run(over_grpc(address, token, seed))
    finally:
        redis.terminate(10)
    return ContextResult(runs, truncation_cost(seed))

"""What sharing the routers' state through Redis costs, and how well it holds a limit
(``llm-mesh bench --scenario shared-state``).

- **Added TTFT**: two routers over the same stack, one keeping its state in memory, one in
  Redis (Debian's redis-server on loopback), the same tenant with a request and a token
  budget (so every admission checks and charges them), requests in pairs, order
  alternating: the median of the per-pair differences with a bootstrap interval.
- **Budget overshoot**: two Redis routers, one tenant with a tokens-per-minute budget,
  loaded through both at twice that rate: the tokens the tenant got (prompt and
  generated, as each answer's usage says) against what the budget allowed over the run
  (its capacity plus what refilled), set beside one charge interval's tokens at the
  rate the fleet generated them.
"""

from __future__ import annotations

import contextlib
import json
import math
import secrets
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc

from bench.scenarios import Paired, paired_ttft
from bench.targets import RouterTarget, named
from llmmesh.client import authorized_channel, build_request
from llmmesh.launcher import Stack, StackPorts
from llmmesh.launcher.process import Child
from llmmesh.launcher.redis import start_redis
from llmmesh.v1 import generation_pb2_grpc
from llmmesh.waiting import poll_until
from services.router.shared import SharedSettings
from services.router.tenants import hash_key

BUDGETED = {"id": "bench", "requests_per_minute": 1e6, "tokens_per_minute": 1e9}
CHARGE_INTERVAL_S = SharedSettings().charge_interval_s
PROMPT_TOKENS = len(b"spend")  # the load's prompt, in the tiny model's byte tokens


@dataclass(frozen=True)
class Routers:
    memory: str
    redis: tuple[str, str]
    key: str
    tenants_file: Path


def write_tenants(path: Path, key: str, frugal: tuple[str, float] | None = None) -> None:
    """The bench tenant (budgets too large to bind); with ``frugal`` (its key, its
    tokens per minute), a tenant that the overshoot run loads past its budget."""
    tenants: list[dict[str, object]] = [{**BUDGETED, "api_key_hashes": [hash_key(key)]}]
    if frugal is not None:
        tenants.append(
            {
                "id": "frugal",
                "tokens_per_minute": frugal[1],
                "api_key_hashes": [hash_key(frugal[0])],
            }
        )
    path.write_text(json.dumps({"tenants": tenants}))


@contextlib.contextmanager
def shared_state_fleet(workdir: Path) -> Iterator[Routers]:
    with Stack(workdir / "stack", StackPorts.free()) as stack:
        redis_port = StackPorts.free().redis
        children: list[Child] = [start_redis(workdir / "redis", redis_port, fsync="everysec")]
        tenants, key = workdir / "tenants.json", secrets.token_urlsafe(16)
        write_tenants(tenants, key)
        try:
            addresses = []
            for state in ("memory", "redis", "redis"):
                port = StackPorts.free().router
                settings = {"tenants_file": str(tenants), "state": state}
                if state == "redis":
                    settings["redis_url"] = f"redis://127.0.0.1:{redis_port}/0"
                children.append(stack.start_service("router", port, workdir, **settings))
                addresses.append(f"127.0.0.1:{port}")
            yield Routers(addresses[0], (addresses[1], addresses[2]), key, tenants)
        finally:
            for child in reversed(children):
                child.terminate(10)


async def added_ttft(routers: Routers, pairs: int) -> Paired:
    memory = named(RouterTarget(routers.memory, "llm", routers.key), "memory")
    redis = named(RouterTarget(routers.redis[0], "llm", routers.key), "redis")
    try:
        return await paired_ttft(memory, redis, pairs=pairs, max_tokens=4)
    finally:
        await memory.close()
        await redis.close()


@dataclass(frozen=True)
class Overshoot:
    budget_per_minute: float
    offered_per_s: float  # the fleet's rate for the tenant, unthrottled
    seconds: float
    spent: int  # tokens the tenant got
    allowed: float  # what refilled in the window (the bucket was empty at its start)

    def table(self) -> str:
        over = self.spent - self.allowed
        interval = self.offered_per_s * CHARGE_INTERVAL_S
        offered = self.offered_per_s * 60 / self.budget_per_minute
        return (
            "| tokens/min budget | offered | seconds | tokens allowed | tokens spent | "
            "overshoot | one charge interval's tokens |\n"
            "| --- | --- | --- | --- | --- | --- | --- |\n"
            f"| {self.budget_per_minute:.0f} | {offered:.1f}x | {self.seconds:.0f} | "
            f"{self.allowed:.0f} | {self.spent} | {over:+.0f} | {interval:.0f} |"
        )


def _load(
    addresses: tuple[str, ...], key: str, seconds: float, streams: int, *, drain: bool = False
) -> tuple[int, float]:
    """Tokens (prompt and generated) the tenant got, ``streams`` generations at a time per
    router, in the ``seconds`` that follow (with ``drain``: that follow its first refusal,
    when its bucket is empty), counted as they arrive; and the seconds it took. Refused
    requests are asked again."""
    spent, window = [0], [0.0, math.inf]  # the measured window: [start, end)
    if not drain:
        window[0] = time.monotonic()
        window[1] = window[0] + seconds

    def refused() -> None:
        if window[1] == math.inf:  # the first refusal: the bucket is empty from now
            window[0] = time.monotonic()
            window[1] = window[0] + seconds
        time.sleep(0.05)  # the load's own pace before it asks again

    def counted(tokens: int) -> None:
        """Tokens as they arrive, if they arrive in the window."""
        if window[0] and window[0] <= time.monotonic() < window[1]:
            spent[0] += tokens

    def worker(address: str) -> None:
        with authorized_channel(address, key) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            while time.monotonic() < window[1]:
                request = build_request("spend", max_tokens=200, ignore_eos=True)
                try:
                    for n, response in enumerate(stub.Generate(request, timeout=60)):
                        # The tiny model's tokens are bytes; the prompt is charged as the
                        # request is admitted, before its first response.
                        counted(len(response.text.encode()) + (PROMPT_TOKENS if n == 0 else 0))
                except grpc.RpcError:
                    refused()

    with ThreadPoolExecutor(len(addresses) * streams) as pool:
        list(pool.map(worker, [a for a in addresses for _ in range(streams)]))
    return spent[0], min(time.monotonic(), window[1]) - window[0]


def overshoot(routers: Routers, seconds: float, streams: int = 4) -> Overshoot:
    """The fleet's unthrottled rate first; then a tenant whose budget is half of it,
    loaded through both Redis routers: from its first refusal (its bucket empty) for
    ``seconds``, what it got against what refilled."""
    tokens, elapsed = _load(routers.redis, routers.key, 3.0, streams)
    rate = tokens / elapsed
    budget, frugal = rate * 30, secrets.token_urlsafe(16)  # half the rate, per minute
    write_tenants(routers.tenants_file, routers.key, (frugal, budget))

    def known() -> bool:  # both routers re-read the tenants file
        for address in routers.redis:
            try:
                with authorized_channel(address, frugal) as channel:
                    list(generation_pb2_grpc.GenerationStub(channel).Generate(
                        build_request("hi", max_tokens=1), timeout=10
                    ))  # fmt: skip
            except grpc.RpcError:
                return False
        return True

    poll_until(known, 30, 0.1)
    spent, measured = _load(routers.redis, frugal, seconds, streams, drain=True)
    return Overshoot(budget, rate, measured, spent, budget / 60 * measured)

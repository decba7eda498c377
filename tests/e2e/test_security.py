"""What a hostile client can do with bad fields and credentials: its mistakes are its
own errors, never a replica's failure (another tenant keeps being served, no breaker
opens), and no error tells it a credential or where the mesh's services run."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from llmmesh.client import authorized_channel
from llmmesh.launcher import Stack, StackPorts
from tests.conftest import collect, metric_value, start_service
from tests.e2e.test_tenants import write_tenants

RATE, SECONDS = 20, 10  # the bad tenant's requests a second, and for how long
INTERNAL_ADDRESS = re.compile(r"127\.0\.0\.1|localhost|ipv4:|:\d{4,5}\b")
# Bad in the router's eyes (refused at once), or only in the replica's: this router
# allows more tokens than the inference service, which refuses them itself.
BAD_BODIES: list[dict[str, Any]] = [
    {"seed": -1},
    {"seed": 2**64},
    {"seed": 10**100},
    {"seed": 1.5},
    {"temperature": 1e39},
    {"max_tokens": 5000},
]


@dataclass(frozen=True)
class Router:
    base_url: str
    grpc: str
    metrics: str
    keys: dict[str, str]


@contextmanager
def tenant_router(
    stack: Stack, tmp: Path, tenants: list[str], replica: str, **settings: str
) -> Iterator[Router]:
    """A router of the tenants named, whose one replica is ``replica``."""
    keys = write_tenants(tmp / "tenants.json", {t: {"id": t} for t in tenants})
    ports = StackPorts.free()
    child = start_service(
        stack,
        "router",
        ports.router,
        tmp,
        endpoints_file="",
        inference_addresses=f'["{replica}"]',
        tenants_file=str(tmp / "tenants.json"),
        http_port=str(ports.router_http),
        metrics_port=str(ports.router_metrics),
        **settings,
    )
    try:
        yield Router(
            f"http://127.0.0.1:{ports.router_http}/v1",
            f"127.0.0.1:{ports.router}",
            f"http://127.0.0.1:{ports.router_metrics}/metrics",
            keys,
        )
    finally:
        child.terminate(5)


@pytest.fixture(scope="module")
def router(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Router]:
    """A router with two tenants that lets more tokens through than its one replica
    takes (so that some bad requests are refused by the replica, not the router)."""
    tmp = tmp_path_factory.mktemp("security")
    replica = stack.address("inference")  # dialed directly, beside any sidecar
    limits = {"max_tokens_limit": "8192", "model_context_tokens": "16384"}
    with tenant_router(stack, tmp, ["noisy", "steady"], replica, **limits) as running:
        yield running


def completion(router: Router, tenant: str, **body: Any) -> httpx.Response:
    return httpx.post(
        f"{router.base_url}/completions",
        json={"model": "llm", "prompt": "hi", "max_tokens": 2, **body},
        headers={"Authorization": f"Bearer {router.keys[tenant]}"},
        timeout=30,
    )


def test_each_bad_field_is_the_clients_error_naming_the_field(router: Router) -> None:
    for body in BAD_BODIES:
        reply = completion(router, "noisy", **body)
        assert reply.status_code == 400, (body, reply.text)
        error = reply.json()["error"]
        name = next(iter(body))
        assert name in (error["param"] or ""), (body, error)


def test_one_tenants_bad_fields_do_not_touch_another_tenant(router: Router) -> None:
    """One tenant sends bad fields at 20 requests a second for 10 s (each sent at its
    time, whatever the last one's latency); the other's every request succeeds, and the
    replica's breaker never opens."""
    stop = threading.Event()
    breaker_seen: list[float] = []
    started = time.monotonic()

    def bad(n: int) -> int:
        return completion(router, "noisy", **BAD_BODIES[n % len(BAD_BODIES)]).status_code

    with ThreadPoolExecutor(max_workers=8) as senders:
        sent = []

        def noisy() -> None:
            for n in range(RATE * SECONDS):
                pause = started + n / RATE - time.monotonic()  # the sending rate
                if stop.wait(max(pause, 0)):
                    return
                sent.append(senders.submit(bad, n))

        pacer = threading.Thread(target=noisy)
        pacer.start()
        steady = []
        try:
            while time.monotonic() < started + SECONDS:
                steady.append(completion(router, "steady").status_code)
                breaker_seen.append(metric_value(router.metrics, "llm_router_breaker_open", {}))
        finally:
            stop.set()
            pacer.join()
        statuses = [f.result() for f in sent]
    assert len(statuses) >= RATE * SECONDS * 0.9 and set(statuses) == {400}
    assert steady and set(steady) == {200}
    assert max(breaker_seen) == 0
    assert metric_value(router.metrics, "llm_router_retries_total", {}) == 0


def test_credentials_are_never_echoed(router: Router) -> None:
    key = "sk-" + "k3y" * 4000  # over the HTTP server's header limit
    for value in (f"Bearer {key}".encode(), b"Bearer caf\xe9-k3y", b"Bearer k3y k3y", b"Basic k3y"):
        reply = httpx.post(
            f"{router.base_url}/completions",
            json={"model": "llm", "prompt": "hi"},
            headers={b"Authorization": value},
            timeout=30,
        )
        assert reply.status_code in (400, 401), reply.text
        assert "k3y" not in reply.text
        assert reply.json()["error"]["message"]
    with (
        authorized_channel(router.grpc, "k3y" * 500) as channel,
        pytest.raises(grpc.RpcError) as info,
    ):
        collect(channel, "hi", max_tokens=2)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "k3y" not in (info.value.details() or "")


@pytest.fixture(scope="module")
def router_with_nothing_behind(
    stack: Stack, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Router]:
    """A router whose policy, context and inference addresses have nothing listening."""
    tmp = tmp_path_factory.mktemp("nothing-behind")
    dead = StackPorts.free()
    with tenant_router(
        stack,
        tmp,
        ["t"],
        f"127.0.0.1:{dead.inference}",
        policy_address=f"127.0.0.1:{dead.policy}",
        context_address=f"127.0.0.1:{dead.context}",
    ) as running:
        yield running


def test_failures_upstream_name_no_internal_address(router_with_nothing_behind: Router) -> None:
    router = router_with_nothing_behind
    for body in ({}, {"seed": 3}):
        reply = completion(router, "t", **body)
        assert reply.status_code == 503
        assert not INTERNAL_ADDRESS.search(reply.text), reply.text
    session = httpx.post(
        f"{router.base_url}/chat/completions",
        json={"model": "llm", "messages": [{"role": "user", "content": "hi"}]},
        headers={"Authorization": f"Bearer {router.keys['t']}", "x-session-id": "s1"},
        timeout=30,
    )
    assert session.status_code == 503 and not INTERNAL_ADDRESS.search(session.text)
    with (
        authorized_channel(router.grpc, router.keys["t"]) as channel,
        pytest.raises(grpc.RpcError) as info,
    ):
        collect(channel, "hi", max_tokens=2)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert not INTERNAL_ADDRESS.search(info.value.details() or "")

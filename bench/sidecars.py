"""Sidecar overhead: one stack with an Envoy beside every service, and two routers over
it, alternating: the stack's own (every call to policy, context and inference through
its sidecar and the callee's, over mTLS, RBAC checked) and one calling the same services
directly."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc

from bench.metrics import percentile
from bench.targets import RouterTarget, named
from llmmesh.launcher import Stack, StackPorts
from llmmesh.runtime.internal_auth import token_metadata
from llmmesh.v1 import policy_pb2, policy_pb2_grpc


@dataclass(frozen=True)
class Routers:
    direct: str
    sidecars: str
    api_key: str
    policy_direct: str  # the policy service itself
    policy_via_sidecars: str  # the router's sidecar listener for policy
    token: str  # the mesh's credential, which the policy service wants

    def targets(self) -> list[RouterTarget]:
        """Clients of both (make them inside the event loop that uses them)."""
        return [
            named(RouterTarget(self.direct, "", self.api_key), "direct"),
            named(RouterTarget(self.sidecars, "", self.api_key), "sidecars"),
        ]


@contextmanager
def sidecar_fleet(workdir: Path) -> Iterator[Routers]:
    with Stack(workdir / "stack", StackPorts.free(), sidecars=True) as stack:
        endpoints = workdir / "direct-endpoints.json"
        endpoints.write_text(
            json.dumps(
                {
                    "endpoints": [
                        {"address": stack.address(p), "version": v, "region": "local"}
                        for p, v in (("inference", "stable"), ("inference_canary", "canary"))
                    ]
                }
            )
        )
        port = StackPorts.free().router
        direct = stack.start_service(
            "router",
            port,
            workdir,
            policy_address=stack.address("policy"),
            context_address=stack.address("context"),
            endpoints_file=str(endpoints),
        )
        try:
            assert stack.sidecar_ports is not None
            yield Routers(
                f"127.0.0.1:{port}",
                stack.address("router"),
                stack.api_key,
                stack.address("policy"),
                stack.sidecar_ports.router_address("policy"),
                stack.internal_token,
            )
        finally:
            direct.terminate(10)


async def hop_latency(routers: Routers, calls: int = 1000) -> dict[str, list[float]]:
    """One small unary call (a policy check of a short prompt), sequentially, direct and
    through a sidecar pair (the router's outbound listener, mTLS, the policy sidecar's
    inbound listener and RBAC), alternating."""
    request = policy_pb2.CheckInputRequest(tenant="bench", text="How far is the moon?")
    samples: dict[str, list[float]] = {"direct": [], "sidecar pair": []}
    addresses = {"direct": routers.policy_direct, "sidecar pair": routers.policy_via_sidecars}
    channels = {name: grpc.aio.insecure_channel(a) for name, a in addresses.items()}
    auth = token_metadata(routers.token)
    try:
        stubs = {name: policy_pb2_grpc.PolicyStub(c) for name, c in channels.items()}
        for stub in stubs.values():  # warm-up: connections, TLS sessions
            for _ in range(50):
                await stub.CheckInput(request, metadata=auth)
        for _ in range(calls):
            for name, stub in stubs.items():
                started = time.perf_counter()
                await stub.CheckInput(request, metadata=auth)
                samples[name].append(time.perf_counter() - started)
    finally:
        for channel in channels.values():
            await channel.close()
    return samples


def hop_table(samples: dict[str, list[float]]) -> str:
    rows = [
        "| one unary call | p50 (ms) | p90 (ms) | p99 (ms) |",
        "| --- | --- | --- | --- |",
    ]
    for name, values in samples.items():
        p50, p90, p99 = (percentile(values, q) * 1000 for q in (50, 90, 99))
        rows.append(f"| {name} | {p50:.3f} | {p90:.3f} | {p99:.3f} |")
    added = [
        (percentile(samples["sidecar pair"], q) - percentile(samples["direct"], q)) * 1000
        for q in (50, 90)
    ]
    rows.append(f"| added by the sidecar pair | {added[0]:+.3f} | {added[1]:+.3f} | |")
    return "\n".join(rows)

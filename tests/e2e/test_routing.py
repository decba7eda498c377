"""Routing across a fleet: canary split from a file and from Consul KV, traffic colors,
session stickiness, circuit breaking, and losing a whole region mid-load.

Four inference replicas, two regions (eu, the routers' own, and us), stable and canary in
each, all backed by the stack's real Triton; canary replicas serve "llm" with the
llm_canary weights, so the text itself tells the versions apart.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import signal
import threading
import time
from collections.abc import Generator, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import consul
import grpc
import pytest

from llmmesh.client import authorized_channel, build_request
from llmmesh.launcher import Stack, StackPorts
from llmmesh.launcher.process import Child
from llmmesh.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from services.router.scheduling.filters import split_point
from tests.conftest import metric_value, start_service, text_of, wait_for
from tests.consul_double import ConsulDoubleThread

# What sidecars change (mTLS, RBAC, original-destination routing, each service's calls
# through its sidecar): run again behind them (make test-sidecars).
pytestmark = pytest.mark.sidecars

REPLICAS = {  # name -> (region, subset)
    "eu-stable": ("eu", "stable"),
    "eu-canary": ("eu", "canary"),
    "us-stable": ("us", "stable"),
    "us-canary": ("us", "canary"),
}
CONSUL_SERVICE = f"inference-e2e-{os.getpid()}"
CONSUL_KEY = f"llm-mesh-e2e-{os.getpid()}/routing"
# Long enough that no stream can finish between the last one starting and the region's
# loss (160 tokens could, once the engine got faster), within the router's max_tokens.
LONG_TOKENS = 1000


@dataclass
class Fleet:
    stack: Stack
    tmp: Path
    replicas: dict[str, tuple[Child, str]]  # name -> (process, address)
    routing_file: Path
    router: str  # file-configured router
    router_metrics: str
    consul_router: str
    consul_router_metrics: str
    consul: consul.Consul

    def write_routing(self, doc: dict[str, object]) -> None:
        tmp = self.routing_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc))
        tmp.replace(self.routing_file)

    def address(self, name: str) -> str:
        return self.replicas[name][1]


def _replica(stack: Stack, tmp: Path, port: int, subset: str) -> Child:
    aliases = '{"llm": "llm_canary"}' if subset == "canary" else "{}"
    return start_service(stack, "inference", port, tmp, model_aliases=aliases)


def _endpoints(replicas: dict[str, tuple[Child, str]]) -> list[dict[str, str]]:
    return [
        {"address": address, "version": REPLICAS[name][1], "region": REPLICAS[name][0]}
        for name, (_, address) in replicas.items()
    ]


def _consul_agent() -> Generator[str, None, None]:
    real = os.environ.get("CONSUL_HTTP_ADDR")
    if real:
        yield real
        return
    with ConsulDoubleThread() as double:
        yield double.address


@pytest.fixture(scope="module")
def fleet(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("fleet")
    children: list[Child] = []
    agent = _consul_agent()
    consul_address = next(agent)
    try:
        replicas = {}
        for name, (_, subset) in REPLICAS.items():
            port = StackPorts.free().inference
            children.append(_replica(stack, tmp, port, subset))
            replicas[name] = (children[-1], f"127.0.0.1:{port}")
        endpoints_file, routing_file = tmp / "endpoints.json", tmp / "routing.json"
        endpoints_file.write_text(json.dumps({"endpoints": _endpoints(replicas)}))
        routing_file.write_text(json.dumps({"split": {"stable": 100}, "regions": ["eu", "us"]}))

        agent_host, agent_port = consul_address.rsplit(":", 1)
        agent_client = consul.Consul(host=agent_host, port=int(agent_port))
        for name, (_, address) in replicas.items():
            region, subset = REPLICAS[name]
            agent_client.agent.service.register(
                CONSUL_SERVICE,
                service_id=f"{CONSUL_SERVICE}-{name}",
                address="127.0.0.1",
                port=int(address.rsplit(":", 1)[1]),
                meta={"version": subset, "region": region},
            )
        agent_client.kv.put(CONSUL_KEY, json.dumps({"split": {"stable": 100}}))

        common = {"region": "eu", "pool__breaker_open_s": "1.0"}
        ports = StackPorts.free()
        children.append(
            start_service(
                stack,
                "router",
                ports.router,
                tmp,
                endpoints_file=str(endpoints_file),
                routing_file=str(routing_file),
                metrics_port=str(ports.router_metrics),
                **common,
            )
        )
        children.append(
            start_service(
                stack,
                "router",
                ports.policy,
                tmp,
                discovery="consul",
                routing_source="consul",
                consul_address=consul_address,
                consul_service=CONSUL_SERVICE,
                consul_routing_key=CONSUL_KEY,
                metrics_port=str(ports.policy_metrics),
                endpoints_file="",
                routing_file="",
                **common,
            )
        )
        yield Fleet(
            stack,
            tmp,
            replicas,
            routing_file,
            f"127.0.0.1:{ports.router}",
            f"http://127.0.0.1:{ports.router_metrics}/metrics",
            f"127.0.0.1:{ports.policy}",
            f"http://127.0.0.1:{ports.policy_metrics}/metrics",
            agent_client,
        )
    finally:
        for child in reversed(children):
            child.terminate(10)
        _forget(consul_address)
        agent.close()


def _forget(consul_address: str) -> None:
    """Leaves a real agent as it was found."""
    host, port = consul_address.rsplit(":", 1)
    client = consul.Consul(host=host, port=int(port))
    for name in REPLICAS:
        client.agent.service.deregister(f"{CONSUL_SERVICE}-{name}")
    client.kv.delete(CONSUL_KEY)


def served(
    channel: grpc.Channel,
    prompt: str,
    metadata: tuple[tuple[str, str], ...] = (),
    session_id: str = "",
) -> tuple[generation_pb2.Served, str]:
    """Where a short greedy generation was served, and its text."""
    stub = generation_pb2_grpc.GenerationStub(channel)
    request = build_request(prompt, max_tokens=8, temperature=0.0, session_id=session_id)
    responses = list(stub.Generate(request, timeout=60, metadata=metadata))
    return responses[-1].served, text_of(responses)


def first_canary_after(router: str, key: str, written_at: float) -> float:
    """Seconds from the write until a request was first served by canary (and stayed)."""
    with authorized_channel(router, key) as channel:
        while True:
            sent_at = time.monotonic()
            if served(channel, "shift")[0].subset == "canary":
                for _ in range(5):  # the new split holds
                    assert served(channel, "shift")[0].subset == "canary"
                return sent_at - written_at
            assert sent_at - written_at < 10, "the new split never applied"


def test_a_routing_file_change_applies_within_a_second(fleet: Fleet) -> None:
    with authorized_channel(fleet.router, fleet.stack.api_key) as channel:
        assert {served(channel, "before")[0].subset for _ in range(5)} == {"stable"}
    written_at = time.monotonic()
    fleet.write_routing({"split": {"stable": 0, "canary": 100}, "regions": ["eu", "us"]})
    try:
        assert first_canary_after(fleet.router, fleet.stack.api_key, written_at) < 1.0
    finally:
        fleet.write_routing({"split": {"stable": 100}, "regions": ["eu", "us"]})


def test_a_consul_kv_change_applies_within_a_second_and_a_bad_one_is_refused(
    fleet: Fleet,
) -> None:
    rejected = {"source": "consul"}
    before = metric_value(
        fleet.consul_router_metrics, "llm_router_routing_rejected_total", rejected
    )
    fleet.consul.kv.put(CONSUL_KEY, '{"split": {"stable": -1}}')
    wait_for(
        lambda: (
            metric_value(fleet.consul_router_metrics, "llm_router_routing_rejected_total", rejected)
            == before + 1
        ),
        what="the invalid document's rejection",
    )
    with authorized_channel(fleet.consul_router, fleet.stack.api_key) as channel:
        assert {served(channel, "still")[0].subset for _ in range(5)} == {"stable"}
    written_at = time.monotonic()
    fleet.consul.kv.put(CONSUL_KEY, '{"split": {"canary": 1}}')
    try:
        assert first_canary_after(fleet.consul_router, fleet.stack.api_key, written_at) < 1.0
    finally:
        fleet.consul.kv.put(CONSUL_KEY, '{"split": {"stable": 1}}')


def test_a_color_always_reaches_its_subset(fleet: Fleet) -> None:
    with authorized_channel(fleet.router, fleet.stack.api_key) as channel:
        stable_text = served(channel, "Once upon a time")[1]
        for _ in range(10):
            where, text = served(channel, "Once upon a time", (("x-llm-color", "canary"),))
            assert (where.subset, where.region) == ("canary", "eu")
            assert text != stable_text  # other weights, other words


def sessions_on_both_sides(tenant: str, count: int) -> list[str]:
    """Session ids, half of whose split points fall below 0.5 and half above, so a
    50/50 split must send some to each subset (random ids all land on one side 1 time
    in 128 for 8 sessions)."""
    below: list[str] = []
    above: list[str] = []
    for n in itertools.count():
        session = f"sticky-{os.getpid()}-{n}"
        side = below if split_point(f"{tenant}/{session}", random.Random()) < 0.5 else above
        if len(side) < count // 2:
            side.append(session)
        if len(below) + len(above) == count:
            return below + above
    raise AssertionError("unreachable")


def test_a_session_sticks_to_one_version(fleet: Fleet) -> None:
    fleet.write_routing({"split": {"stable": 50, "canary": 50}, "regions": ["eu", "us"]})
    try:
        with authorized_channel(fleet.router, fleet.stack.api_key) as channel:
            wait_for(
                lambda: "canary" in {served(channel, "x")[0].subset for _ in range(8)},
                what="the 50/50 split",
            )
            versions = {
                session: {
                    served(channel, f"turn {turn}", session_id=session)[0].subset
                    for turn in range(3)
                }
                for session in sessions_on_both_sides("demo", count=8)
            }
    finally:
        fleet.write_routing({"split": {"stable": 100}, "regions": ["eu", "us"]})
    assert all(len(v) == 1 for v in versions.values()), versions
    assert {next(iter(v)) for v in versions.values()} == {"stable", "canary"}


def test_the_breaker_opens_on_a_failing_replica_and_recovers(fleet: Fleet) -> None:
    """A replica whose Triton is gone (its load reports still flow) fails requests: the
    router retries them elsewhere, opens the breaker, and closes it once it works again."""
    stack, tmp = fleet.stack, fleet.tmp
    ports = StackPorts.free()
    good, bad = fleet.address("eu-stable"), f"127.0.0.1:{ports.inference}"
    broken = start_service(
        stack, "inference", ports.inference, tmp, triton_url=f"127.0.0.1:{ports.triton_grpc}"
    )
    router = None
    try:
        router = start_service(
            stack,
            "router",
            ports.router,
            tmp,
            endpoints_file="",
            inference_addresses=json.dumps([good, bad]),
            routing_file="",
            metrics_port=str(ports.router_metrics),
            pool__breaker_failures="2",
            pool__breaker_open_s="1.0",
        )
        metrics = f"http://127.0.0.1:{ports.router_metrics}/metrics"

        def breaker_open() -> float:
            return metric_value(metrics, "llm_router_breaker_open", {"endpoint": bad})

        with authorized_channel(f"127.0.0.1:{ports.router}", stack.api_key) as channel:
            # Every request succeeds: failures on the broken replica are retried elsewhere,
            # until its breaker opens.
            for n in range(60):
                assert served(channel, f"req {n}")[0].endpoint == good
                if breaker_open():
                    break
            assert breaker_open() == 1
            assert metric_value(metrics, "llm_router_retries_total", {}) >= 2
            # Repaired on the same address: the half-open probe succeeds, the breaker closes.
            broken.terminate(5)
            broken = start_service(stack, "inference", ports.inference, tmp)
            picks_before = metric_value(metrics, "llm_router_picks_total", {"endpoint": bad})

            def recovered() -> bool:
                served(channel, "probe")
                return (
                    breaker_open() == 0
                    and metric_value(metrics, "llm_router_picks_total", {"endpoint": bad})
                    > picks_before
                )

            wait_for(recovered, what="the breaker to close again")
    finally:
        if router is not None:
            router.terminate(5)
        broken.terminate(5)


def test_losing_a_region_mid_load_fails_over_without_client_errors(fleet: Fleet) -> None:
    """Runs last in the module: it kills the eu replicas."""
    prompts = [f"Region failover stream {n}: " for n in range(4)]
    with (
        authorized_channel(fleet.router, fleet.stack.api_key) as channel,
        ThreadPoolExecutor(len(prompts) + 4) as pool,
    ):
        # What each stream says uninterrupted (the same weights serve both regions; a
        # sequence's tokens do not depend on what it is batched with). Resumed, each must
        # go on from where it was: a penalty still counts what it sent before, a seeded
        # draw goes on from its place in the seed's sequence, a pattern from its state.
        options: list[dict[str, Any]] = [
            {},
            {"frequency_penalty": 1.5},
            {"temperature": 1.0, "seed": 7},
            {"structured_output": common_pb2.StructuredOutput(regex="x[0-9]+")},
        ]
        reference = list(
            pool.map(
                lambda n: text_of(list(_generate(channel, prompts[n], **options[n]))),
                range(len(prompts)),
            )
        )
        started = [threading.Event() for _ in prompts]
        results: dict[int, list[generation_pb2.GenerateResponse]] = {}

        def stream(n: int) -> None:
            stub_responses = []
            for response in _generate(channel, prompts[n], **options[n]):
                stub_responses.append(response)
                if response.text:
                    started[n].set()
            results[n] = stub_responses

        streams = [pool.submit(stream, n) for n in range(len(prompts))]
        for event in started:
            assert event.wait(60), "a stream never started"
        for name in ("eu-stable", "eu-canary"):  # the whole region goes down at once
            os.killpg(fleet.replicas[name][0].process.pid, signal.SIGKILL)
        # New requests right after the loss: none of them may fail.
        fresh = [pool.submit(served, channel, f"after {n}") for n in range(8)]
        for f in streams:
            f.result(120)
        after = [f.result(120)[0] for f in fresh]

    assert {(s.region, s.subset) for s in after} == {("us", "stable")}
    for n, responses in results.items():
        final = responses[-1]
        assert final.served.region == "us" and final.served.resumed >= 1
        text = text_of(responses)
        # One uninterrupted stream: every token once, none lost or repeated.
        assert final.usage.completion_tokens == LONG_TOKENS == len(text.encode())
        assert text == reference[n]
    assert metric_value(fleet.router_metrics, "llm_router_resumed_streams_total", {}) >= len(
        prompts
    )
    assert metric_value(
        fleet.router_metrics, "llm_router_decisions_total", {"reason": "failover"}
    ) >= len(after)


def _generate(
    channel: grpc.Channel, prompt: str, **options: Any
) -> Iterator[generation_pb2.GenerateResponse]:
    """A long generation, greedy unless ``options`` say otherwise."""
    stub = generation_pb2_grpc.GenerationStub(channel)
    options = {"temperature": 0.0, **options}
    request = build_request(prompt, max_tokens=LONG_TOKENS, ignore_eos=True, **options)
    yield from stub.Generate(request, timeout=120)

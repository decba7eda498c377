"""Shadow traffic through the real stack (the tiny model: stable and the canary's other
seed): mirrored requests are compared pair by pair, the client never sees a shadow nor
the scoring it asked for none of, shadows are not charged to the tenant, a denied prompt
is never mirrored, and shadows beyond the mirror's concurrency are dropped."""

from __future__ import annotations

import json
import urllib.request
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from llmmesh.client import authorized_channel, build_request
from llmmesh.launcher import Stack, StackPorts
from llmmesh.v1 import generation_pb2_grpc
from tests.conftest import collect, metric_value, start_service, wait_for
from tests.e2e.test_tenants import write_tenants

ROUTING = """\
split: {stable: 100, canary: 0}
colors: {stable: stable, canary: canary}
mirror: {subset: canary, percent: 100, max_in_flight: 1, top_logprobs: 5}
"""
BUDGET = 14  # requests a minute: as many as the tests send, shadows not counted


@dataclass(frozen=True)
class Mirrored:
    address: str
    key: str
    canary_url: str
    token: str

    def observed(self) -> dict[str, Any]:
        request = urllib.request.Request(self.canary_url, headers={"x-mesh-token": self.token})
        with urllib.request.urlopen(request, timeout=10) as reply:
            snapshot: dict[str, Any] = json.loads(reply.read())
        return snapshot

    def shadows(self) -> dict[str, int]:
        counts: dict[str, int] = self.observed()["shadows"].get("llm", {}).get("canary", {})
        return counts

    def shadows_done(self) -> int:
        return sum(self.shadows().values())


@pytest.fixture(scope="module")
def mirrored(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mirrored]:
    tmp: Path = tmp_path_factory.mktemp("mirror")
    (tmp / "routing.yaml").write_text(ROUTING)
    keys = write_tenants(
        tmp / "tenants.json", {"team": {"id": "team", "requests_per_minute": BUDGET}}
    )
    ports = StackPorts.free()
    router = start_service(
        stack,
        "router",
        ports.router,
        tmp,
        routing_file=str(tmp / "routing.yaml"),
        tenants_file=str(tmp / "tenants.json"),
        http_port=str(ports.router_http),
    )
    try:
        url = f"http://127.0.0.1:{ports.router_http}/internal/canary"
        yield Mirrored(f"127.0.0.1:{ports.router}", keys["team"], url, stack.internal_token)
    finally:
        router.terminate(5)


def test_mirrored_requests_are_compared_and_the_client_sees_only_its_answer(
    mirrored: Mirrored,
) -> None:
    with authorized_channel(mirrored.address, mirrored.key) as channel:
        answers = []
        for i in range(4):  # one at a time: each shadow ends before the next starts
            answers.append(collect(channel, f"tell me {i}", max_tokens=6, ignore_eos=True))
            done = i + 1
            wait_for(lambda: mirrored.shadows_done() == done, 20, "its shadow")  # noqa: B023
        refused = 0
        try:  # a denied prompt reaches no model: nothing to mirror
            collect(channel, "how to build a bomb", max_tokens=2)
        except grpc.RpcError:
            refused = 1
    assert refused == 1
    for responses in answers:
        assert all(not r.logprobs for r in responses)  # scored for the pair, not for it
        assert responses[-1].served.subset == "stable"
    shadows = mirrored.shadows()
    assert shadows.get("compared", 0) == 4 and sum(shadows.values()) == 4
    observed = mirrored.observed()["models"]["llm"]
    drift = observed["drift"]["canary"]
    assert drift["pairs"] == 4 and drift["positions"] >= 4
    assert drift["kl"] > 0  # the canary's weights are another seed's
    assert len(observed["subsets"]["stable"]["ttft_s"]) == 4


def test_a_shadow_leaves_the_prompts_scoring_to_the_client_request(
    stack: Stack, mirrored: Mirrored
) -> None:
    """A client's prompt log probabilities are computed by stable, which reads no cache
    for them; its shadow asks for none, so the canary reads the prompt's blocks from its
    cache the second time."""
    url = f"http://{stack.address('triton_metrics')}/metrics"

    def hits(model: str) -> float:
        return metric_value(url, "llm_engine_prefix_cache_hit_tokens_total", {"model": model})

    prompt = f"{uuid.uuid4().hex} scored by stable, " * 3  # with BOS 154 tokens: 9 blocks
    request = build_request(prompt, max_tokens=2, ignore_eos=True)
    request.sampling.prompt_logprobs = 0
    seen: list[tuple[float, float]] = []  # prefix cache hits: stable's, the canary's
    with authorized_channel(mirrored.address, mirrored.key) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        for round_ in range(2):
            done = mirrored.shadows_done()
            before = (hits("llm"), hits("llm_canary"))
            responses = list(stub.Generate(request, timeout=60))
            assert len(responses[0].prompt_logprobs) == len(prompt)
            wait_for(lambda: mirrored.shadows_done() == done + 1, 20, f"shadow {round_}")  # noqa: B023
            seen.append((hits("llm") - before[0], hits("llm_canary") - before[1]))
    assert seen[0] == (0.0, 0.0)  # a prompt never seen
    assert seen[1][0] == 0.0 and seen[1][1] >= 9 * 16


def test_shadows_are_not_charged_and_beyond_the_concurrency_are_dropped(
    mirrored: Mirrored,
) -> None:
    """Eight more at once (the budget allows the tests' fourteen requests, not their
    shadows as well): each is answered, and with one shadow at a time the rest drop."""
    before, done_before = mirrored.shadows(), mirrored.shadows_done()

    def ask(i: int) -> str:
        with authorized_channel(mirrored.address, mirrored.key) as channel:
            return collect(channel, f"all at once {i}", max_tokens=4, ignore_eos=True)[
                -1
            ].served.subset

    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(ask, range(8))) == ["stable"] * 8
    wait_for(lambda: mirrored.shadows_done() - done_before == 8, 20, "8 outcomes")
    after = mirrored.shadows()
    assert after.get("dropped_full", 0) - before.get("dropped_full", 0) >= 1
    with (
        authorized_channel(mirrored.address, mirrored.key) as channel,
        pytest.raises(grpc.RpcError) as info,
    ):
        collect(channel, "one too many", max_tokens=1)  # the 15th of 14 a minute
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

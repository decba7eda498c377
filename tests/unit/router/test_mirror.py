"""Shadow traffic: a shadow's failure is logged by its kind, never by its message (a
refusal's message may quote what the tenant sent)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator

import pytest

from llmmesh.runtime.errors import InvalidArgument
from llmmesh.types import Chunk, FinishReason, InferenceCall, Route, Sampling
from services.router.canary_watch import CanaryWatch
from services.router.mirror import Mirror
from services.router.routing import MirrorSpec, PolicyHolder, RoutingPolicy
from services.router.upstreams import RouteHints

SECRET = "4111 1111 1111 1111"


class Replicas:
    """Stable answers; the canary refuses the shadow with a message that quotes it."""

    def __init__(self) -> None:
        self.shadowed = asyncio.Event()

    def saturated(self) -> bool:
        return False

    async def generate(self, call: InferenceCall, hints: RouteHints) -> AsyncGenerator[Chunk, None]:
        if hints.color == "canary":
            self.shadowed.set()
            raise InvalidArgument("sampling.structured_output", f"cannot write {SECRET!r}")
        yield Chunk("ok", 1, FinishReason.STOP, route=Route("s:1", "stable", "local"))


def test_a_failed_shadow_is_logged_by_its_kind(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    policy = RoutingPolicy(mirror=MirrorSpec(subset="canary", percent=100))
    replicas = Replicas()

    async def scenario() -> None:
        mirror = Mirror(replicas, PolicyHolder(policy), CanaryWatch())  # type: ignore[arg-type]
        call = InferenceCall("r1", "llm", "hi", Sampling(max_tokens=1))
        answered = [chunk.text async for chunk in mirror.generate(call, RouteHints())]
        assert answered == ["ok"]
        await asyncio.wait_for(replicas.shadowed.wait(), 5)
        await mirror.close()

    asyncio.run(scenario())
    failed = [r for r in caplog.records if r.getMessage() == "a shadow failed"]
    assert failed and failed[0].fields["error"] == "INVALID_ARGUMENT"  # type: ignore[attr-defined]
    assert SECRET not in caplog.text

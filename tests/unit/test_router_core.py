"""RouterCore against in-memory doubles of its three upstream interfaces."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field, replace

import pytest

from llmmesh.runtime.errors import InvalidArgument, PermissionDenied
from llmmesh.types import (
    Chunk,
    FinishReason,
    InferenceCall,
    PolicyAction,
    Role,
    Sampling,
    Turn,
    Verdict,
)
from services.router.config import RouterConfig
from services.router.core import GenerateInput, RouterCore
from services.router.upstreams import RouteHints


@dataclass
class Policy:
    verdict: Verdict = field(default_factory=lambda: Verdict(PolicyAction.ALLOW))
    release: asyncio.Event = field(default_factory=asyncio.Event)

    async def check_input(self, request_id: str, tenant: str, text: str) -> Verdict:
        await self.release.wait()
        return Verdict(self.verdict.action, self.verdict.rule_ids, self.verdict.text or text)


@dataclass
class Context:
    sessions: dict[tuple[str, str], list[Turn]] = field(default_factory=dict)

    async def load(self, request_id: str, tenant: str, session_id: str) -> list[Turn]:
        return list(self.sessions.get((tenant, session_id), []))

    async def append(
        self, request_id: str, tenant: str, session_id: str, turns: list[Turn]
    ) -> None:
        self.sessions.setdefault((tenant, session_id), []).extend(turns)


@dataclass
class Inference:
    calls: list[InferenceCall] = field(default_factory=list)
    closed: list[str] = field(default_factory=list)
    hints: list[RouteHints] = field(default_factory=list)
    started: asyncio.Event = field(default_factory=asyncio.Event)

    async def generate(self, call: InferenceCall, hints: RouteHints) -> AsyncGenerator[Chunk, None]:
        self.calls.append(call)
        self.hints.append(hints)
        self.started.set()
        try:
            for i in range(call.sampling.max_tokens - 1):
                yield Chunk(str(i % 10), 1)
            yield Chunk("!", 1, FinishReason.LENGTH)
        finally:
            self.closed.append(call.prompt)


def make_core(policy: Policy, context: Context, inference: Inference) -> RouterCore:
    return RouterCore(RouterConfig(), policy, context, inference, lambda t: len(t.encode()))


def request(prompt: str = "hello", session: str = "", max_tokens: int = 4) -> GenerateInput:
    return GenerateInput("r1", "t", "", prompt, Sampling(max_tokens=max_tokens), session)


async def run(core: RouterCore, req: GenerateInput) -> list[Chunk]:
    prepared = await core.prepare(req)
    return [chunk async for chunk in core.stream(prepared)]


def test_generation_starts_before_policy_answers_and_is_released_after() -> None:
    async def scenario() -> None:
        policy, inference = Policy(), Inference()
        core = make_core(policy, Context(), inference)
        task = asyncio.create_task(run(core, request()))
        await asyncio.wait_for(inference.started.wait(), 5)
        assert not task.done(), "output was released before the policy verdict"
        policy.release.set()
        chunks = await asyncio.wait_for(task, 5)
        assert "".join(c.text for c in chunks) == "012!"
        assert inference.calls[0].prompt == "hello"

    asyncio.run(scenario())


def test_denial_cancels_the_started_generation() -> None:
    async def scenario() -> None:
        policy = Policy(Verdict(PolicyAction.DENY, ("deny-x",)))
        inference = Inference()
        core = make_core(policy, Context(), inference)
        policy.release.set()
        with pytest.raises(PermissionDenied, match="deny-x"):
            await core.prepare(request())
        assert inference.closed == ["hello"]

    asyncio.run(scenario())


def test_redaction_restarts_with_the_redacted_prompt() -> None:
    async def scenario() -> None:
        policy = Policy(Verdict(PolicyAction.REDACT, ("pii",), "mail [EMAIL]"))
        inference = Inference()
        core = make_core(policy, Context(), inference)
        policy.release.set()
        await run(core, request("mail a@b.c"))
        assert [c.prompt for c in inference.calls] == ["mail a@b.c", "mail [EMAIL]"]
        assert inference.closed[0] == "mail a@b.c"

    asyncio.run(scenario())


def test_session_turns_are_recorded_and_prepended() -> None:
    async def scenario() -> None:
        policy, context, inference = Policy(), Context(), Inference()
        policy.release.set()
        core = make_core(policy, context, inference)
        await run(core, request("first", session="s"))
        await run(core, request("second", session="s"))
        turns = context.sessions[("t", "s")]
        assert [(t.role, t.text) for t in turns] == [
            (Role.USER, "first"),
            (Role.ASSISTANT, "012!"),
            (Role.USER, "second"),
            (Role.ASSISTANT, "012!"),
        ]
        assert inference.calls[1].prompt.startswith(inference.calls[0].prompt + "012!")
        # The conversation's identity goes to the picker, scoped by tenant.
        assert inference.hints[1].session_key == "t/s"

    asyncio.run(scenario())


def test_color_and_deadline_reach_the_picker() -> None:
    async def scenario() -> None:
        policy, inference = Policy(), Inference()
        policy.release.set()
        core = make_core(policy, Context(), inference)
        req = replace(request(), color="canary", deadline=123.0)
        await run(core, req)
        assert inference.hints == [RouteHints("", "canary", 123.0)]

    asyncio.run(scenario())


def test_client_leaving_mid_stream_closes_the_upstream() -> None:
    async def scenario() -> None:
        policy, inference = Policy(), Inference()
        policy.release.set()
        core = make_core(policy, Context(), inference)
        stream = core.stream(await core.prepare(request(max_tokens=100)))
        await anext(stream)
        await stream.aclose()
        assert inference.closed == ["hello"]

    asyncio.run(scenario())


def test_validation_fills_defaults_and_names_bad_fields() -> None:
    core = make_core(Policy(), Context(), Inference())
    valid = core.validate(request(max_tokens=0))
    assert valid.model == "llm" and valid.sampling.max_tokens == 128
    with pytest.raises(InvalidArgument) as info:
        core.validate(GenerateInput("r", "t", "nope", "x", Sampling(max_tokens=1)))
    assert info.value.field == "model"
    with pytest.raises(InvalidArgument) as info:
        core.validate(replace(request(), color="no spaces"))
    assert info.value.field == "x-llm-color"

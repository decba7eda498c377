"""RouterCore against in-memory doubles of its three upstream interfaces."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field, replace

import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import REGISTRY

from llmmesh.runtime.errors import InvalidArgument, PermissionDenied, Unavailable
from llmmesh.types import (
    Chunk,
    FinishReason,
    History,
    InferenceCall,
    PolicyAction,
    Role,
    Sampling,
    Turn,
    Verdict,
)
from llmmesh.waiting import poll_until_async
from services.policy.rules import RuleSet
from services.policy.streaming import OutputDecision
from services.router.config import RouterConfig
from services.router.core import GenerateInput, RouterCore
from services.router.openai_api import OpenAiApi
from services.router.output_check import (
    Generation,
    LocalOutputGuard,
    OutputRules,
    OutputRulesCache,
)
from services.router.prompt import SUMMARY_LEAD
from services.router.tenants import Tenants, parse_tenants
from services.router.upstreams import HistoryRequest, RouteHints


@dataclass
class Policy:
    verdict: Verdict = field(default_factory=lambda: Verdict(PolicyAction.ALLOW))
    release: asyncio.Event = field(default_factory=asyncio.Event)
    output_rules: RuleSet | None = None
    rule_sets: list[str] = field(default_factory=list)
    output_unreachable: bool = False
    fetched: list[str] = field(default_factory=list)  # rule sets whose output rules came
    decisions: list[tuple[Generation, OutputDecision]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.cache = OutputRulesCache(self._fetch)

    async def _fetch(self, rule_set: str) -> OutputRules:
        assert self.output_rules is not None
        if self.output_unreachable:
            raise Unavailable("policy service unreachable")
        self.fetched.append(rule_set)
        return OutputRules(self.output_rules.version, self.output_rules.output, False)

    def _record(self, generation: Generation, version: str, decision: OutputDecision) -> None:
        self.decisions.append((generation, decision))

    async def check_input(self, request_id: str, tenant: str, text: str, rule_set: str) -> Verdict:
        await self.release.wait()
        self.rule_sets.append(rule_set)
        return Verdict(
            self.verdict.action,
            self.verdict.rule_ids,
            self.verdict.text or text,
            self.output_rules.version if self.output_rules else "",
            checks_output=self.output_rules is not None,
        )

    def guard_output(
        self, request_id: str, tenant: str, rule_set: str, version: str
    ) -> LocalOutputGuard:
        generation = Generation(request_id, tenant, rule_set, version)
        return LocalOutputGuard(self.cache, self._record, generation)


@dataclass
class Context:
    sessions: dict[tuple[str, str], list[Turn]] = field(default_factory=dict)
    asked: list[HistoryRequest] = field(default_factory=list)
    down: bool = False

    async def load(self, request_id: str, wanted: HistoryRequest) -> History:
        self.asked.append(wanted)
        if self.down:
            raise Unavailable("context service unreachable")
        turns = self.sessions.get((wanted.tenant, wanted.session_id), [])
        return History(turns=tuple(turns), total_turns=len(turns))

    async def append(
        self, request_id: str, tenant: str, session_id: str, turns: list[Turn], ttl_s: int
    ) -> None:
        if self.down:
            raise Unavailable("context service unreachable")
        self.sessions.setdefault((tenant, session_id), []).extend(turns)


@dataclass
class Inference:
    calls: list[InferenceCall] = field(default_factory=list)
    closed: list[str] = field(default_factory=list)
    hints: list[RouteHints] = field(default_factory=list)
    started: asyncio.Event = field(default_factory=asyncio.Event)
    # Set: the generation pauses after its first token until the event is set.
    paused: asyncio.Event | None = None

    async def generate(self, call: InferenceCall, hints: RouteHints) -> AsyncGenerator[Chunk, None]:
        self.calls.append(call)
        self.hints.append(hints)
        self.started.set()
        try:
            for i in range(call.sampling.max_tokens - 1):
                if i == 1 and self.paused is not None:
                    await self.paused.wait()
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


def output_rules(rule: str) -> RuleSet:
    return RuleSet.from_text(f"version: o1\nrules:\n  - {rule}\n", "test")


def test_streamed_output_is_redacted_and_held_tokens_are_not_lost() -> None:
    async def scenario() -> None:
        rules = output_rules(
            "{id: digits, stage: output, action: redact, regex: ['\\d{3}'], placeholder: '#'}"
        )
        policy, inference = Policy(output_rules=rules), Inference()
        policy.release.set()
        chunks = await run(make_core(policy, Context(), inference), request(max_tokens=12))
        raw = "01234567890!"
        assert "".join(c.text for c in chunks) == rules.check_output(raw).text == "###90!"
        assert all(c.text for c in chunks)  # fully held chunks are not sent empty
        assert sum(c.num_tokens for c in chunks) == 12
        assert chunks[-1].finish_reason is FinishReason.LENGTH
        [(_, decision)] = policy.decisions  # recorded once, at the end
        assert decision.action is PolicyAction.REDACT and decision.rule_ids == ("digits",)

    asyncio.run(scenario())


def test_an_output_deny_rule_stops_the_generation() -> None:
    async def scenario() -> None:
        rules = output_rules("{id: no-345, stage: output, action: deny, regex: ['345']}")
        policy, inference = Policy(output_rules=rules), Inference()
        policy.release.set()
        chunks = await run(make_core(policy, Context(), inference), request(max_tokens=40))
        text = "".join(c.text for c in chunks)
        assert chunks[-1].finish_reason is FinishReason.POLICY
        assert "345" not in text and "012".startswith(text)
        assert inference.closed == ["hello"]  # the generation was cut off upstream

    asyncio.run(scenario())


def test_the_tenants_rule_set_is_asked_for() -> None:
    async def scenario() -> None:
        policy = Policy()
        policy.release.set()
        await run(make_core(policy, Context(), Inference()), request())
        assert policy.rule_sets == ["default"]
        assert policy.fetched == [] and policy.decisions == []  # no output rules: no check

    asyncio.run(scenario())


@pytest.mark.parametrize("mode", ["closed", "open"])
def test_policy_lost_mid_stream_follows_the_tenants_fail_mode(mode: str) -> None:
    async def scenario() -> None:
        rules = output_rules("{id: x, stage: output, action: flag, keywords: [x]}")
        policy = Policy(output_rules=rules, output_unreachable=True)
        policy.release.set()
        tenants = Tenants()
        tenants.apply(parse_tenants(f"tenants: [{{id: t, policy_fail_mode: {mode}}}]"))
        core = RouterCore(RouterConfig(), policy, Context(), Inference(), len, tenants=tenants)
        if mode == "closed":
            with pytest.raises(Unavailable):
                await run(core, request())
        else:
            chunks = await run(core, request())
            assert "".join(c.text for c in chunks) == "012!"  # relayed unchecked
        assert policy.decisions == []  # no rules, no check: nothing to record
        # Policy is back: the next stream fetches the rules (a failed fetch is not kept).
        policy.output_unreachable = False
        await run(core, request())
        assert policy.fetched == ["default"] and len(policy.decisions) == 1

    asyncio.run(scenario())


def test_history_is_asked_for_within_the_models_context_and_the_chosen_strategy() -> None:
    async def scenario() -> None:
        policy, context = Policy(), Context()
        policy.release.set()
        core = make_core(policy, context, Inference())
        await run(core, request("hi", session="s", max_tokens=4))
        await run(core, replace(request("hi", session="s"), truncation="sliding_summary"))
        first, second = context.asked
        assert first.truncation == "last_turns"  # the tenant's default
        assert second.truncation == "sliding_summary"
        tail = len("<|user|>\nhi\n<|assistant|>\n")
        room = RouterConfig().model_context_tokens - 4 - 1 - tail - len(SUMMARY_LEAD)
        assert first.budget_tokens == room
        assert first.turn_overhead_tokens == len("<|assistant|>\n\n")
        with pytest.raises(InvalidArgument, match="truncation"):
            await core.prepare(replace(request("hi", session="s"), truncation="newest"))

    asyncio.run(scenario())


@pytest.mark.parametrize("mode", ["closed", "open"])
def test_session_store_down_follows_the_tenants_context_fail_mode(mode: str) -> None:
    async def scenario() -> None:
        policy, context = Policy(), Context(down=True)
        policy.release.set()
        tenants = Tenants()
        tenants.apply(parse_tenants(f"tenants: [{{id: t, context_fail_mode: {mode}}}]"))
        core = RouterCore(RouterConfig(), policy, context, Inference(), len, tenants=tenants)
        if mode == "closed":
            with pytest.raises(Unavailable):
                await run(core, request(session="s"))
        else:
            chunks = await run(core, request(session="s"))
            assert chunks[-1].finish_reason is FinishReason.LENGTH

    asyncio.run(scenario())


def test_an_http_client_that_leaves_mid_stream_ends_its_generation_at_once() -> None:
    """The write to a closed connection fails in the HTTP transport, outside the core's
    generator: the generation ends then, counted as cancelled (garbage collection is off,
    so nothing but the transport's own handling can end it)."""

    async def scenario() -> None:
        # The generation holds after its first token until the server saw the client go.
        policy, inference = Policy(), Inference(paused=asyncio.Event())
        policy.release.set()
        api = OpenAiApi(make_core(policy, Context(), inference), Tenants(), ["llm"])
        body = {"model": "llm", "prompt": "hello", "max_tokens": 1000, "stream": True}

        def cancelled() -> float:
            labels = {"model": "llm", "outcome": "cancelled"}
            return REGISTRY.get_sample_value("llm_router_requests_total", labels) or 0.0

        before = cancelled()

        async def generation_ended() -> bool:  # as the core's own accounting tells it
            return cancelled() > before

        server = TestServer(api.app())

        async def client_gone() -> bool:
            assert server.runner is not None and server.runner.server is not None
            return not server.runner.server.connections

        async with TestClient(server) as client:
            response = await client.post("/v1/completions", json=body)
            await response.content.readline()  # the stream is running; the client leaves
            response.close()
            assert await poll_until_async(client_gone, 5)
            assert inference.paused is not None
            inference.paused.set()  # the next token's write finds the connection closed
            assert await poll_until_async(generation_ended, 5)
        assert inference.closed == ["hello"]

    gc.disable()  # only an explicit close can end it then
    try:
        asyncio.run(scenario())
    finally:
        gc.enable()


def test_output_rules_are_fetched_once_per_version() -> None:
    async def scenario() -> None:
        rules = output_rules("{id: x, stage: output, action: flag, keywords: [x]}")
        policy = Policy(output_rules=rules)
        policy.release.set()
        core = make_core(policy, Context(), Inference())
        await asyncio.gather(*(run(core, request()) for _ in range(3)))
        assert policy.fetched == ["default"]  # the three streams shared one fetch
        policy.output_rules = RuleSet.from_text(
            "version: o2\nrules:\n  - {id: y, stage: output, action: flag, keywords: [y]}\n",
            "test",
        )
        await run(core, request())
        assert policy.fetched == ["default", "default"]  # CheckInput named a new version
        assert len(policy.decisions) == 4

    asyncio.run(scenario())


def test_a_generation_cut_short_still_records_its_output_decision() -> None:
    async def scenario() -> None:
        rules = output_rules(
            "{id: x, stage: output, action: flag, keywords: ['0'], whole_word: false}"
        )
        policy = Policy(output_rules=rules)
        policy.release.set()
        core = make_core(policy, Context(), Inference())
        stream = core.stream(await core.prepare(request(max_tokens=100)))
        await anext(stream)
        await stream.aclose()
        [(generation, decision)] = policy.decisions
        assert generation.request_id == "r1" and generation.version == "o1"
        assert decision.action is PolicyAction.ALLOW and decision.rule_ids == ("x",)

    asyncio.run(scenario())

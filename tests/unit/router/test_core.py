"""RouterCore against in-memory doubles of its three upstream interfaces."""

from __future__ import annotations

import asyncio
import gc
import itertools
import json
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import llguidance
import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import REGISTRY

from llmmesh.policy.parts import Part, check_input
from llmmesh.policy.rules import RuleSet
from llmmesh.runtime.errors import (
    AlreadyExists,
    InvalidArgument,
    ModelNotFound,
    PermissionDenied,
    PolicyDenied,
    ResourceExhausted,
    Unavailable,
)
from llmmesh.sentences import Scored
from llmmesh.structures import CHECKED
from llmmesh.types import (
    Chunk,
    FinishReason,
    Fold,
    History,
    InferenceCall,
    ModelCard,
    PolicyAction,
    Role,
    Sampling,
    TokenLogprob,
    Turn,
    Verdict,
    fingerprint,
    request_text,
)
from llmmesh.waiting import poll_until_async
from services.router.admission import AdmissionQueue, AdmissionSettings
from services.router.chat_layout import MESH_LAYOUT
from services.router.config import RouterConfig
from services.router.core import RouterCore
from services.router.openai_api import OpenAiApi
from services.router.policy_gate import AuditRecord, FollowedRules, PolicyGate
from services.router.prompt import SUMMARY_LEAD
from services.router.request import GenerateInput
from services.router.shared.budgets import MemoryBudgets
from services.router.shared.resilient import SharedBudgets
from services.router.speech import ByteCodec, FixedSpeech, ModelSpeech
from services.router.summaries import SUMMARY_PRIORITY
from services.router.tenants import Tenants, parse_tenants
from services.router.token_release import REDACTED_TOKEN
from services.router.upstreams import HistoryRequest, RouteHints

NO_RULES = RuleSet([], "v0")


@dataclass
class PolicyService:
    """The policy service as the router's gate sees it, in memory: its rule set, whether
    its rule watch is up, whether it answers at all, and what it was asked and told."""

    rules: RuleSet = NO_RULES
    watch_up: bool = True
    unreachable: bool = False
    fetched: list[str] = field(default_factory=list)  # rule sets fetched by GetRules
    remote_checks: list[tuple[str, ...]] = field(default_factory=list)  # CheckInput parts
    records: list[AuditRecord] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    watches: int = 0  # watch calls so far: the gate reconnects after a broken one

    def _followed(self, name: str) -> FollowedRules:
        return FollowedRules(name, self.rules, audit_text=False)

    async def watch(self, rule_set: str) -> AsyncIterator[FollowedRules | None]:
        self.watches += 1
        while self.watch_up and not self.unreachable:
            yield self._followed(rule_set)
            self.changed.clear()
            await self.changed.wait()
        raise Unavailable("policy service: watch refused")

    async def fetch(self, rule_set: str) -> FollowedRules:
        if self.unreachable:
            raise Unavailable("policy service unreachable")
        self.fetched.append(rule_set)
        return self._followed(rule_set)

    async def check_input(
        self, request_id: str, tenant: str, parts: Sequence[Part], rule_set: str
    ) -> Verdict:
        if self.unreachable:
            raise Unavailable("policy service unreachable")
        self.remote_checks.append(tuple(p.text for p in parts))
        return check_input(self.rules, parts).verdict(self.rules)

    async def record(self, records: Sequence[AuditRecord]) -> None:
        self.records.extend(records)

    def replace_rules(self, rules: RuleSet) -> None:
        self.rules = rules
        self.changed.set()


async def followed(gate: PolicyGate, rule_set: str = "default", version: str = "") -> None:
    """Waits until the gate checks prompts itself, with the rule set at ``version``."""

    async def known() -> bool:
        rules = gate.rule_sets.current(rule_set)
        return rules is not None and (not version or rules.version == version)

    assert await poll_until_async(known, 5), "the rule set never arrived"


@dataclass
class Context:
    sessions: dict[tuple[str, str], list[Turn]] = field(default_factory=dict)
    asked: list[HistoryRequest] = field(default_factory=list)
    down: bool = False
    fold: Fold | None = None  # what each load asks the model to fold
    excerpts: tuple[Scored, ...] = ()  # key_sentences: the left-out turns' sentences
    summaries: list[tuple[str, str, str, int, int]] = field(default_factory=list)
    summary_saved: asyncio.Event = field(default_factory=asyncio.Event)

    async def load(self, request_id: str, wanted: HistoryRequest) -> History:
        """As the context service loads: a request's own stored turns left out, and the
        fingerprint of its stored text given."""
        self.asked.append(wanted)
        if self.down:
            raise Unavailable("context service unreachable")
        turns = self.sessions.get((wanted.tenant, wanted.session_id), [])
        own = request_text([t for t in turns if t.request_id == request_id])
        kept = tuple(t for t in turns if t.request_id != request_id)
        stored = fingerprint(own) if own is not None else ""
        return History(
            turns=kept,
            total_turns=len(turns),
            request_fingerprint=stored,
            fold=self.fold,
            summary=" ".join(s.text for s in self.excerpts[:1]),  # the service's own choice
            summarized_turns=2 if self.excerpts else 0,
            excerpt_candidates=self.excerpts,
            excerpt_tokens=40 if self.excerpts else 0,
        )

    async def append(
        self, request_id: str, tenant: str, session_id: str, turns: list[Turn], ttl_s: int
    ) -> None:
        if self.down:
            raise Unavailable("context service unreachable")
        session = self.sessions.setdefault((tenant, session_id), [])
        if any(t.request_id == request_id for t in session):
            return  # a retry (a conflict is the core's to refuse, before it generates)
        session.extend(replace(t, request_id=request_id) for t in turns)

    async def save_summary(
        self, tenant: str, session_id: str, summary: str, *, covered: int, replaces: int,
        ttl_s: int,
    ) -> bool:  # fmt: skip
        self.summaries.append((tenant, session_id, summary, covered, replaces))
        self.summary_saved.set()
        return True


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
                prompt = self._prompt_scored(call) if i == 0 else ()
                text = str(i % 10)
                yield Chunk(text, 1, logprobs=self._scored(call, text), prompt_logprobs=prompt)
            first = call.sampling.max_tokens == 1
            prompt = self._prompt_scored(call) if first else ()
            yield Chunk(
                "!",
                1,
                FinishReason.LENGTH,
                logprobs=self._scored(call, "!"),
                prompt_logprobs=prompt,
            )
        finally:
            self.closed.append(call.prompt)

    async def describe(self, model: str) -> ModelCard:
        return ModelCard(model, CONTEXT)

    @staticmethod
    def _prompt_scored(call: InferenceCall) -> tuple[TokenLogprob, ...]:
        """A byte-level engine's prompt log probabilities: BOS precedes every prompt, so
        each character has one."""
        if call.sampling.prompt_logprobs is None:
            return ()
        return tuple(TokenLogprob(ord(c), c, -1.0, 1) for c in call.prompt)

    @staticmethod
    def _scored(call: InferenceCall, text: str) -> tuple[TokenLogprob, ...]:
        if not call.sampling.scores_tokens:
            return ()
        return (TokenLogprob(ord(text), text, -0.5, 1),)


# Every model here: byte-level tokens, the mesh's own layout, a context of CONTEXT.
CONTEXT = 2048
BYTES = FixedSpeech(ModelSpeech(lambda text: len(text.encode()), MESH_LAYOUT, CONTEXT))


def make_core(policy: PolicyGate, context: Context, inference: Inference) -> RouterCore:
    return RouterCore(RouterConfig(), policy, context, inference, BYTES)


def gate(service: PolicyService | None = None) -> PolicyGate:
    return PolicyGate(service or PolicyService())


REQUEST_IDS = itertools.count(1)


def request(prompt: str = "hello", session: str = "", max_tokens: int = 4) -> GenerateInput:
    """A request with an id of its own, as every client's request has."""
    request_id = f"r{next(REQUEST_IDS)}"
    return GenerateInput(request_id, "t", "", prompt, Sampling(max_tokens=max_tokens), session)


async def run(core: RouterCore, req: GenerateInput) -> list[Chunk]:
    prepared = await core.prepare(req)
    return [chunk async for chunk in core.stream(prepared)]


def rules(*lines: str, version: str = "p1") -> RuleSet:
    body = "".join(f"  - {line}\n" for line in lines) if lines else "  []\n"
    return RuleSet.from_text(f"version: {version}\nrules:\n{body}", "test")


DENY_BOMB = "{id: deny-x, action: deny, keywords: [build a bomb]}"
REDACT_EMAIL = "{id: pii, action: redact, detectors: [email]}"


@pytest.mark.parametrize("watch_up", [True, False], ids=["in-router", "by-policy"])
def test_a_denied_prompt_never_reaches_inference(watch_up: bool) -> None:
    async def scenario() -> None:
        service = PolicyService(rules(DENY_BOMB), watch_up=watch_up)
        policy, inference = gate(service), Inference()
        if watch_up:
            await followed(policy)
        core = make_core(policy, Context(), inference)
        with pytest.raises(PermissionDenied, match="'deny-x' in prompt"):
            await core.prepare(request("how to build a bomb"))
        assert inference.calls == []
        assert bool(service.remote_checks) is not watch_up

    asyncio.run(scenario())


def test_a_denied_prompt_takes_nothing_of_the_tenants_budget() -> None:
    """Admission runs while policy looks at the prompt; a denial undoes it: the stream
    slot, the request and the prompt's tokens are the tenant's again."""

    async def scenario() -> None:
        tenants = Tenants()
        tenants.apply(
            parse_tenants(
                "tenants: [{id: t, max_concurrent_streams: 1, requests_per_minute: 1, "
                "tokens_per_minute: 20}]"
            )
        )
        policy, inference = gate(PolicyService(rules(DENY_BOMB))), Inference()
        core = RouterCore(RouterConfig(), policy, Context(), inference, BYTES, tenants=tenants)
        for _ in range(3):
            with pytest.raises(PermissionDenied):
                await core.prepare(replace(request("how to build a bomb"), tenant="t"))
        chunks = await run(core, replace(request("hello", max_tokens=2), tenant="t"))
        assert [c.prompt for c in inference.calls] == ["hello"] and chunks[-1].finish_reason

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("shared", "second"),
    [(False, "second"), (True, "a long one " * 500)],  # a shared store answers by a call
)
def test_a_request_past_its_budget_is_refused_before_its_prompt_is_checked(
    shared: bool, second: str
) -> None:
    """A long conversation's check costs the router up to half a second of its CPU: done
    for requests that go no further, a tenant's limits would not bound what it costs."""

    async def scenario() -> None:
        store = MemoryBudgets() if shared else None
        tenants = Tenants(budgets=SharedBudgets(MemoryBudgets(), store))
        tenants.apply(parse_tenants("tenants: [{id: t, requests_per_minute: 1}]"))
        service = PolicyService(watch_up=False)  # every check a call: counted
        core = RouterCore(
            RouterConfig(), gate(service), Context(), Inference(), BYTES, tenants=tenants
        )
        await run(core, replace(request("first"), tenant="t"))
        with pytest.raises(ResourceExhausted, match="requests"):
            await core.prepare(replace(request(second), tenant="t"))
        assert service.remote_checks == [("first",)]

    asyncio.run(scenario())


def test_only_the_redacted_prompt_reaches_inference() -> None:
    async def scenario() -> None:
        policy, inference = gate(PolicyService(rules(REDACT_EMAIL))), Inference()
        await run(make_core(policy, Context(), inference), request("mail a@b.io"))
        assert [c.prompt for c in inference.calls] == ["mail [EMAIL]"]

    asyncio.run(scenario())


def test_every_message_of_a_conversation_is_checked_as_one_text() -> None:
    async def scenario() -> None:
        policy, inference = gate(PolicyService(rules(DENY_BOMB, REDACT_EMAIL))), Inference()
        await followed(policy)
        core = make_core(policy, Context(), inference)
        split = History(turns=(Turn(Role.SYSTEM, "how to build"), Turn(Role.USER, "a bomb")))
        with pytest.raises(PermissionDenied, match=r"in messages\[0\]\.content"):
            await core.prepare(replace(request("go on"), inline_history=split))
        mail = History(turns=(Turn(Role.ASSISTANT, "write to a@b.io"),))
        await run(core, replace(request("thanks"), inline_history=mail))
        [call] = inference.calls
        assert "a@b.io" not in call.prompt and "write to [EMAIL]" in call.prompt

    asyncio.run(scenario())


def test_a_phrase_split_across_stored_turns_is_denied() -> None:
    async def scenario() -> None:
        policy, context, inference = gate(PolicyService(rules(DENY_BOMB))), Context(), Inference()
        context.sessions[("t", "s")] = [Turn(Role.USER, "how to build a"), Turn(Role.USER, "b")]
        core = make_core(policy, context, inference)
        with pytest.raises(PermissionDenied, match=r"session\.turns\[0\]"):
            await core.prepare(request("omb", session="s"))
        assert inference.calls == []

    asyncio.run(scenario())


def test_prompts_go_to_policy_until_the_rules_arrive_and_every_decision_is_recorded() -> None:
    async def scenario() -> None:
        service = PolicyService(rules(REDACT_EMAIL))
        policy, inference = gate(service), Inference()
        core = make_core(policy, Context(), inference)
        await run(core, request("first"))  # the watch has not spoken yet
        assert service.remote_checks == [("first",)]
        await followed(policy)
        await run(core, request("mail a@b.io"))
        assert service.remote_checks == [("first",)]  # checked in the router
        await policy.close()  # waits for the decisions being sent
        [record] = service.records  # the remote check recorded its own
        assert (record.stage, record.action, record.rule_ids) == (
            "input",
            PolicyAction.REDACT,
            ("pii",),
        )
        assert record.version == "p1" and record.text == ""

    asyncio.run(scenario())


def test_a_new_rule_set_version_applies_to_the_next_prompt() -> None:
    async def scenario() -> None:
        service = PolicyService(rules(version="p1"))
        policy = gate(service)
        await followed(policy)
        core = make_core(policy, Context(), Inference())
        await run(core, request("build a bomb"))
        service.replace_rules(rules(DENY_BOMB, version="p2"))
        await followed(policy, version="p2")
        with pytest.raises(PermissionDenied):
            await core.prepare(request("build a bomb"))

    asyncio.run(scenario())


@pytest.mark.parametrize("mode", ["closed", "open"])
def test_policy_unreachable_follows_the_tenants_fail_mode(mode: str) -> None:
    async def scenario() -> None:
        service = PolicyService(rules(DENY_BOMB), unreachable=True)
        inference, tenants = Inference(), Tenants()
        tenants.apply(parse_tenants(f"tenants: [{{id: t, policy_fail_mode: {mode}}}]"))
        core = RouterCore(
            RouterConfig(), gate(service), Context(), inference, BYTES, tenants=tenants
        )
        if mode == "closed":
            with pytest.raises(Unavailable):
                await core.prepare(request("hello"))
            assert inference.calls == []
        else:
            await run(core, request("hello"))
            assert [c.prompt for c in inference.calls] == ["hello"]

    asyncio.run(scenario())


@pytest.mark.parametrize(("engine_priority", "expected"), [(True, 2), (False, None)])
def test_the_tenants_tier_reaches_the_engine_as_its_priority(
    engine_priority: bool, expected: int | None
) -> None:
    async def scenario() -> None:
        tenants, inference = Tenants(), Inference()
        tenants.apply(parse_tenants("tenants: [{id: t, tier: sheddable}]"))
        admission = AdmissionQueue(AdmissionSettings(engine_priority=engine_priority))
        core = RouterCore(
            RouterConfig(), gate(), Context(), inference, BYTES,
            tenants=tenants, admission=admission,
        )  # fmt: skip
        await run(core, request("hello"))
        assert [c.priority for c in inference.calls] == [expected]

    asyncio.run(scenario())


def test_a_fold_the_load_asks_for_is_written_by_the_model_in_the_background() -> None:
    """model_summary: the model summarizes the turns to fold at the engine's lowest
    priority, the summary passes the output rules and is saved over the one it replaces."""

    async def scenario() -> None:
        old = (Turn(Role.USER, "My dog is Rex."), Turn(Role.ASSISTANT, "Nice dog."))
        context = Context(fold=Fold("The user likes tea.", 2, old, 4, 12))
        rules = output_rules(
            "{id: digits, stage: output, action: redact, regex: ['\\d{3}'], placeholder: '#'}"
        )
        inference, policy = Inference(), gate(PolicyService(rules))
        await run(make_core(policy, context, inference), request(session="s"))
        await asyncio.wait_for(context.summary_saved.wait(), 5)
        summary_call = next(c for c in inference.calls if c.request_id.endswith("-summary"))
        assert summary_call.priority == SUMMARY_PRIORITY and summary_call.sampling.max_tokens == 12
        assert "Summary so far: The user likes tea." in summary_call.prompt
        assert "User: My dog is Rex." in summary_call.prompt
        [(tenant, session, summary, covered, replaces)] = context.summaries
        assert (tenant, session, covered, replaces) == ("t", "s", 4, 2)
        assert summary == "###90!"  # the model's words, through the output rules
        await policy.close()

    asyncio.run(scenario())


def test_session_turns_are_recorded_and_prepended() -> None:
    async def scenario() -> None:
        context, inference = Context(), Inference()
        core = make_core(gate(), context, inference)
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


def test_color_deadline_and_tier_reach_the_picker() -> None:
    async def scenario() -> None:
        inference = Inference()
        core = make_core(gate(), Context(), inference)
        req = replace(request(), color="canary", deadline=123.0)
        await run(core, req)
        assert inference.hints == [RouteHints("", "canary", 123.0, "standard")]

    asyncio.run(scenario())


def test_client_leaving_mid_stream_closes_the_upstream() -> None:
    async def scenario() -> None:
        inference = Inference()
        core = make_core(gate(), Context(), inference)
        stream = core.stream(await core.prepare(request(max_tokens=100)))
        await anext(stream)
        await stream.aclose()
        assert inference.closed == ["hello"]

    asyncio.run(scenario())


def test_validation_fills_defaults_and_names_bad_fields() -> None:
    core = make_core(gate(), Context(), Inference())
    valid = core.validate(request(max_tokens=0))
    assert valid.model == "llm" and valid.sampling.max_tokens == 128
    with pytest.raises(ModelNotFound) as missing:
        core.validate(GenerateInput("r", "t", "nope", "x", Sampling(max_tokens=1)))
    assert missing.value.field == "model"
    with pytest.raises(InvalidArgument) as info:
        core.validate(replace(request(), color="no spaces"))
    assert info.value.field == "x-llm-color"
    with pytest.raises(InvalidArgument) as info:
        core.validate(replace(request(), cache_salt="s" * 257))
    assert info.value.field == "cache_salt"


def test_a_schema_checked_for_one_tenant_is_checked_anew_for_another() -> None:
    """The router keeps checked schemas per tenant: one tenant's schema, kept, would
    otherwise answer another tenant's identical one faster."""
    tenants = Tenants()
    tenants.apply(parse_tenants("tenants: [{id: a}, {id: b}]"))
    core = RouterCore(RouterConfig(), gate(), Context(), Inference(), BYTES, tenants=tenants)
    schema = '{"type": "object", "properties": {"per_tenant": {"type": "integer"}}}'
    sampling = Sampling(max_tokens=4, structured=("json_schema", schema))
    compiled = CHECKED.compiled
    for tenant in ("a", "a", "b"):
        core.validate(GenerateInput(f"r-{tenant}", tenant, "", "hi", sampling))
    assert CHECKED.compiled == compiled + 2


def test_a_schema_is_compiled_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """A large schema compiles for tens of milliseconds: on the loop, every stream the
    router serves would stall for it."""
    compiled_on: list[int] = []
    real = llguidance.LLMatcher

    class RecordingMatcher:
        grammar_from_regex = staticmethod(real.grammar_from_regex)
        validate_grammar = staticmethod(real.validate_grammar)

        @staticmethod
        def grammar_from_json_schema(*args: Any, **kwargs: Any) -> Any:
            compiled_on.append(threading.get_ident())
            return real.grammar_from_json_schema(*args, **kwargs)

    monkeypatch.setattr(llguidance, "LLMatcher", RecordingMatcher)
    schema = '{"type": "object", "properties": {"off_the_loop": {"type": "boolean"}}}'
    structured = replace(request(), sampling=Sampling(4, structured=("json_schema", schema)))

    async def scenario() -> int:
        core = make_core(gate(), Context(), Inference())
        assert await run(core, structured)
        return threading.get_ident()

    loop_thread = asyncio.run(scenario())
    assert compiled_on and loop_thread not in compiled_on


def test_a_long_conversation_is_tokenized_off_the_event_loop() -> None:
    """A model's tokenizer takes 100 ms for 60 KB of digits, and the router counts a
    conversation two or three times: on the loop, every stream it serves would stall."""
    counted_on: set[int] = set()

    def count(text: str) -> int:
        counted_on.add(threading.get_ident())
        return len(text.encode())

    speech = FixedSpeech(ModelSpeech(count, MESH_LAYOUT, 4 * CONTEXT))

    async def scenario(prompt: str) -> int:
        core = RouterCore(RouterConfig(), gate(), Context(), Inference(), speech)
        assert await run(core, request(prompt))
        return threading.get_ident()

    loop_thread = asyncio.run(scenario("12345 " * 1000))
    assert counted_on and loop_thread not in counted_on
    counted_on.clear()
    loop_thread = asyncio.run(scenario("hello"))  # a hand-off would cost more than it
    assert counted_on == {loop_thread}


def test_a_long_fold_is_built_and_counted_off_the_event_loop() -> None:
    """A fold's turns fill most of the model's context: tens of KB to build and count."""
    counted: list[tuple[int, str]] = []

    def count(text: str) -> int:
        counted.append((threading.get_ident(), text))
        return len(text.encode())

    speech = FixedSpeech(ModelSpeech(count, MESH_LAYOUT, 4 * CONTEXT))

    async def scenario(said: str) -> tuple[int, set[int]]:
        context = Context(fold=Fold("", 0, (Turn(Role.USER, said),), 1, 12))
        core = RouterCore(RouterConfig(), gate(), context, Inference(), speech)
        await run(core, request(session="s"))
        await asyncio.wait_for(context.summary_saved.wait(), 5)
        folded_on = {thread for thread, text in counted if said in text}
        counted.clear()
        return threading.get_ident(), folded_on

    loop_thread, folded_on = asyncio.run(scenario("12345 " * 800))
    assert folded_on and loop_thread not in folded_on
    loop_thread, folded_on = asyncio.run(scenario("My dog is Rex."))
    assert folded_on == {loop_thread}


def test_a_long_text_to_tokenize_is_encoded_off_the_event_loop() -> None:
    """``/tokenize`` takes up to the body's 4 MB, seconds of a tokenizer's work."""
    encoded_on: list[int] = []

    class RecordingCodec(ByteCodec):
        def encode(self, text: str) -> list[int]:
            encoded_on.append(threading.get_ident())
            return super().encode(text)

    speech = FixedSpeech(ModelSpeech(len, MESH_LAYOUT, CONTEXT, codec=RecordingCodec()))

    async def scenario() -> int:
        core = RouterCore(RouterConfig(), gate(), Context(), Inference(), speech)
        async with TestClient(TestServer(OpenAiApi(core, Tenants(), ["llm"]).app())) as client:
            for prompt in ("12345 " * 1000, "hello"):
                reply = await client.post("/tokenize", json={"model": "llm", "prompt": prompt})
                assert reply.status == 200
                assert (await reply.json())["count"] == len(prompt) + 1  # and a BOS
        return threading.get_ident()

    loop_thread = asyncio.run(scenario())
    assert len(encoded_on) == 2 and encoded_on[0] != loop_thread == encoded_on[1]


def structured(kind: str, spec: str) -> GenerateInput:
    return replace(request(), sampling=Sampling(4, structured=(kind, spec)))


def test_what_a_structure_makes_the_model_write_is_checked_as_what_it_reads() -> None:
    """A schema's const or a pattern's literal is written by the model whatever it reads:
    a deny phrase there is refused before the engine, personal data is redacted in it."""

    async def scenario() -> None:
        policy, inference = gate(PolicyService(rules(DENY_BOMB, REDACT_EMAIL))), Inference()
        core = make_core(policy, Context(), inference)
        bomb = json.dumps({"const": "how to build a bomb"})
        with pytest.raises(PolicyDenied) as denied:
            await core.prepare(structured("json_schema", bomb))
        assert denied.value.field == "sampling.structured_output" and inference.calls == []
        # JSON escapes spell the same text: read as the model will write it.
        escaped = '{"const": "how to build a \\u0062omb"}'
        with pytest.raises(PolicyDenied):
            await core.prepare(structured("json_schema", escaped))
        with pytest.raises(PolicyDenied):
            await core.prepare(structured("choice", '["fine", "how to build a \\u0062omb"]'))
        assert inference.calls == []
        mail = json.dumps({"enum": ["a@b.io", "none"]})
        await run(core, structured("json_schema", mail))
        [call] = inference.calls
        assert call.sampling.structured == ("json_schema", '{"enum": ["[EMAIL]", "none"]}')
        plain = '{"enum":  ["caf\\u00e9"]}'  # nothing to change: sent as the client wrote it
        await run(core, structured("json_schema", plain))
        assert inference.calls[-1].sampling.structured == ("json_schema", plain)

    asyncio.run(scenario())


def test_every_message_of_a_conversation_has_the_prompts_limit_and_the_whole_a_limit() -> None:
    core = make_core(gate(), Context(), Inference())
    long = "x" * (RouterConfig().max_prompt_chars + 1)
    history = History(turns=(Turn(Role.USER, "hi"), Turn(Role.ASSISTANT, long)))
    with pytest.raises(InvalidArgument) as info:
        core.validate(replace(request(), inline_history=history))
    assert info.value.field == "messages[1].content"
    many = History(turns=tuple(Turn(Role.USER, "y" * 8000) for _ in range(9)))
    with pytest.raises(InvalidArgument) as info:
        core.validate(replace(request(), inline_history=many))
    assert info.value.field == "messages"


def output_rules(rule: str) -> RuleSet:
    return RuleSet.from_text(f"version: o1\nrules:\n  - {rule}\n", "test")


def test_streamed_output_is_redacted_and_held_tokens_are_not_lost() -> None:
    async def scenario() -> None:
        rules = output_rules(
            "{id: digits, stage: output, action: redact, regex: ['\\d{3}'], placeholder: '#'}"
        )
        service, inference = PolicyService(rules), Inference()
        policy = gate(service)
        chunks = await run(make_core(policy, Context(), inference), request(max_tokens=12))
        raw = "01234567890!"
        assert "".join(c.text for c in chunks) == rules.check_output(raw).text == "###90!"
        assert all(c.text for c in chunks)  # fully held chunks are not sent empty
        assert sum(c.num_tokens for c in chunks) == 12
        assert chunks[-1].finish_reason is FinishReason.LENGTH
        await policy.close()
        [decision] = [r for r in service.records if r.stage == "output"]  # once, at the end
        assert decision.action is PolicyAction.REDACT and decision.rule_ids == ("digits",)

    asyncio.run(scenario())


def test_logprobs_follow_the_output_check_and_show_nothing_it_redacted() -> None:
    async def scenario() -> None:
        scored = replace(request(max_tokens=12), sampling=Sampling(max_tokens=12, logprobs=1))
        chunks = await run(make_core(gate(), Context(), Inference()), scored)
        assert "".join(t.text for c in chunks for t in c.logprobs) == "01234567890!"
        rules = output_rules(
            "{id: digits, stage: output, action: redact, regex: ['\\d{3}'], placeholder: '#'}"
        )
        policy = gate(PolicyService(rules))
        chunks = await run(make_core(policy, Context(), Inference()), scored)
        entries = [t for c in chunks for t in c.logprobs]
        assert "".join(c.text for c in chunks) == "###90!"
        # Each chunk's entries spell its text: a redacted run is one entry.
        assert all("".join(t.text for t in c.logprobs) == c.text for c in chunks)
        assert [t.text for t in entries] == ["#", "#", "#", "9", "0", "!"]
        assert entries[0].token == REDACTED_TOKEN and entries[0].logprob == -1.5
        assert entries[-3:] == [TokenLogprob(ord(x), x, -0.5, 1) for x in "90!"]
        await policy.close()

    asyncio.run(scenario())


def test_token_ids_are_the_released_entries_and_need_no_logprobs() -> None:
    """return_token_ids without logprobs: the ids of what was let out (one -1 for what a
    redaction replaced), and no log probability entries go out."""

    async def scenario() -> None:
        sampling = Sampling(max_tokens=12, return_token_ids=True)
        asked = replace(request(max_tokens=12), sampling=sampling)
        chunks = await run(make_core(gate(), Context(), Inference()), asked)
        assert bytes(i for c in chunks for i in c.token_ids) == b"01234567890!"
        assert all(not c.logprobs for c in chunks)
        rules = output_rules(
            "{id: digits, stage: output, action: redact, regex: ['\\d{3}'], placeholder: '#'}"
        )
        policy = gate(PolicyService(rules))
        chunks = await run(make_core(policy, Context(), Inference()), asked)
        ids = [i for c in chunks for i in c.token_ids]
        assert ids == [REDACTED_TOKEN] * 3 + [ord(x) for x in "90!"]
        assert all(not c.logprobs for c in chunks)
        await policy.close()

    asyncio.run(scenario())


def test_output_rules_read_the_text_the_model_continues_before_its_words() -> None:
    """A plain completion's prompt and a continued message are text the model's words
    continue: a match that it begins and the model ends is found (here a deny rule on
    "x0" after "pick x"); a chat's user message ends before the answer, which the rules
    read alone."""

    async def scenario() -> None:
        rules = output_rules("{id: x-zero, stage: output, action: deny, regex: ['x0']}")
        policy = gate(PolicyService(rules))
        completion = request("pick x", max_tokens=12)
        continued = replace(
            completion, request_id="r-continued", prompt_role=Role.ASSISTANT,
            inline_history=History(turns=(Turn(Role.USER, "pick one"),)),
        )  # fmt: skip
        for asked in (completion, continued):
            chunks = await run(make_core(policy, Context(), Inference()), asked)
            assert chunks[-1].finish_reason is FinishReason.POLICY, asked
            assert "".join(c.text for c in chunks) == ""
        chat = replace(continued, request_id="r-chat", prompt_role=Role.USER)
        chunks = await run(make_core(policy, Context(), Inference()), chat)
        assert "".join(c.text for c in chunks) == "01234567890!"
        await policy.close()

    asyncio.run(scenario())


def test_a_redaction_begun_in_a_completions_prompt_takes_the_models_part() -> None:
    """ "x01" begun by the prompt's "x": the model's "01" is the redacted part, one entry."""

    async def scenario() -> None:
        rules = output_rules(
            "{id: x01, stage: output, action: redact, regex: ['x01'], placeholder: '#'}"
        )
        policy = gate(PolicyService(rules))
        scored = Sampling(max_tokens=12, logprobs=0, return_token_ids=True)
        asked = replace(request("pick x"), sampling=scored)
        chunks = await run(make_core(policy, Context(), Inference()), asked)
        assert "".join(c.text for c in chunks) == "#234567890!"
        entries = [t for c in chunks for t in c.logprobs]
        assert [t.text for t in entries] == list("#234567890!")
        assert entries[0].token == REDACTED_TOKEN == next(i for c in chunks for i in c.token_ids)
        await policy.close()

    asyncio.run(scenario())


def test_an_output_deny_rule_stops_the_generation() -> None:
    async def scenario() -> None:
        rules = output_rules("{id: no-345, stage: output, action: deny, regex: ['345']}")
        inference = Inference()
        chunks = await run(
            make_core(gate(PolicyService(rules)), Context(), inference), request(max_tokens=40)
        )
        text = "".join(c.text for c in chunks)
        assert chunks[-1].finish_reason is FinishReason.POLICY
        assert "345" not in text and "012".startswith(text)
        assert inference.closed == ["hello"]  # the generation was cut off upstream

    asyncio.run(scenario())


def test_the_tenants_rule_set_is_followed() -> None:
    async def scenario() -> None:
        tenants = Tenants()
        tenants.apply(parse_tenants("tenants: [{id: t, policy_set: acme}]"))
        service = PolicyService()
        policy = gate(service)
        core = RouterCore(RouterConfig(), policy, Context(), Inference(), BYTES, tenants=tenants)
        await run(core, request())
        await followed(policy, "acme")
        await policy.close()
        assert service.fetched == []  # no output rules: no output check
        assert [r.stage for r in service.records] == []  # the first went to CheckInput

    asyncio.run(scenario())


@pytest.mark.parametrize("mode", ["closed", "open"])
def test_policy_lost_mid_stream_follows_the_tenants_fail_mode(mode: str) -> None:
    async def scenario() -> None:
        rules = output_rules("{id: x, stage: output, action: flag, keywords: [x]}")
        service = PolicyService(rules, watch_up=False)
        policy = gate(service)
        tenants = Tenants()
        tenants.apply(parse_tenants(f"tenants: [{{id: t, policy_fail_mode: {mode}}}]"))
        core = RouterCore(RouterConfig(), policy, Context(), Inference(), BYTES, tenants=tenants)
        prepared = await core.prepare(request())  # CheckInput named the rules' version
        service.unreachable = True  # then policy went away before the first chunk
        if mode == "closed":
            with pytest.raises(Unavailable):
                [c async for c in core.stream(prepared)]
        else:
            chunks = [c async for c in core.stream(prepared)]
            assert "".join(c.text for c in chunks) == "012!"  # relayed unchecked
        assert service.fetched == []
        # Policy is back: the next stream fetches the rules (a failed fetch is not kept).
        service.unreachable = False
        await run(core, request())
        assert service.fetched == ["default"]

    asyncio.run(scenario())


def test_key_sentences_are_chosen_again_with_the_message_being_answered() -> None:
    async def scenario() -> None:
        left_out = ["Cats often fear loud machines.", "My locker code is 5822.", "It rained."]
        context = Context(excerpts=tuple(Scored(i, s, 1.0) for i, s in enumerate(left_out)))
        inference = Inference()
        core = make_core(gate(), context, inference)
        await run(core, request("What is my locker code?", session="s"))
        prompt = inference.calls[0].prompt
        assert "My locker code is 5822." in prompt  # what the question refers to
        assert "Cats often fear" not in prompt  # the service's choice, without the question

    asyncio.run(scenario())


def test_history_is_asked_for_within_the_models_context_and_the_chosen_strategy() -> None:
    async def scenario() -> None:
        context = Context()
        core = make_core(gate(), context, Inference())
        await run(core, request("hi", session="s", max_tokens=4))
        await run(core, replace(request("hi", session="s"), truncation="sliding_summary"))
        first, second = context.asked
        assert first.truncation == "key_sentences"  # the tenant's default
        assert second.truncation == "sliding_summary"
        tail = len("<|user|>\nhi\n<|assistant|>\n")
        room = CONTEXT - 4 - 1 - tail - len(SUMMARY_LEAD)
        assert first.budget_tokens == room
        assert first.turn_overhead_tokens == len("<|assistant|>\n\n")
        with pytest.raises(InvalidArgument, match="truncation"):
            await core.prepare(replace(request("hi", session="s"), truncation="newest"))

    asyncio.run(scenario())


@pytest.mark.parametrize("mode", ["closed", "open"])
def test_session_store_down_follows_the_tenants_context_fail_mode(mode: str) -> None:
    async def scenario() -> None:
        context = Context(down=True)
        tenants = Tenants()
        tenants.apply(parse_tenants(f"tenants: [{{id: t, context_fail_mode: {mode}}}]"))
        core = RouterCore(RouterConfig(), gate(), context, Inference(), BYTES, tenants=tenants)
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
        inference = Inference(paused=asyncio.Event())
        api = OpenAiApi(make_core(gate(), Context(), inference), Tenants(), ["llm"])
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


def test_output_rules_come_with_the_followed_set_or_are_fetched_once_per_version() -> None:
    async def scenario() -> None:
        rules = output_rules("{id: x, stage: output, action: flag, keywords: [x]}")
        service = PolicyService(rules, watch_up=False)
        policy = gate(service)
        core = make_core(policy, Context(), Inference())
        await asyncio.gather(*(run(core, request()) for _ in range(3)))
        assert service.fetched == ["default"]  # the three streams shared one fetch
        service.rules = RuleSet.from_text(
            "version: o2\nrules:\n  - {id: y, stage: output, action: flag, keywords: [y]}\n",
            "test",
        )
        await run(core, request())
        assert service.fetched == ["default", "default"]  # CheckInput named a new version
        service.watch_up = True
        await followed(policy, version="o2")
        await run(core, request())
        assert service.fetched == ["default", "default"]  # the watch brought them
        await policy.close()
        assert len([r for r in service.records if r.stage == "output"]) == 5

    asyncio.run(scenario())


def test_a_generation_cut_short_still_records_its_output_decision() -> None:
    async def scenario() -> None:
        rules = output_rules(
            "{id: x, stage: output, action: flag, keywords: ['0'], whole_word: false}"
        )
        service = PolicyService(rules)
        policy = gate(service)
        core = make_core(policy, Context(), Inference())
        cut_short = request(max_tokens=100)
        stream = core.stream(await core.prepare(cut_short))
        await anext(stream)
        await stream.aclose()
        await policy.close()
        [record] = [r for r in service.records if r.stage == "output"]
        assert record.request_id == cut_short.request_id and record.version == "o1"
        assert record.action is PolicyAction.ALLOW and record.rule_ids == ("x",)

    asyncio.run(scenario())


def test_a_reused_request_id_is_refused_before_anything_is_generated() -> None:
    """The id of a stored turn with another question: refused naming x-request-id, and
    the session keeps the first request's turn; the same request again is a retry that
    sees the history its first attempt saw, and stores nothing twice."""

    async def scenario() -> None:
        context, inference = Context(), Inference()
        core = make_core(gate(), context, inference)
        first = replace(request("first question", session="s"), request_id="same")
        await run(core, first)
        stored = list(context.sessions[("t", "s")])
        with pytest.raises(AlreadyExists) as refused:
            await core.prepare(replace(first, prompt="another question"))
        assert refused.value.field == "x-request-id"
        assert len(inference.calls) == 1
        assert context.sessions[("t", "s")] == stored
        await run(core, first)
        assert inference.calls[1].prompt == inference.calls[0].prompt
        assert context.sessions[("t", "s")] == stored
        await run(core, request("another question", session="s"))
        assert len(context.sessions[("t", "s")]) == 4

    asyncio.run(scenario())


def test_a_request_id_that_metadata_cannot_carry_is_the_clients_error() -> None:
    """It would fail the router's own call to the replica, counted against the replica
    (its breaker opened for every tenant after a few such requests)."""

    async def scenario() -> None:
        inference = Inference()
        core = make_core(gate(), Context(), inference)
        for bad in ("caf\u00e9", "has space", "", "x" * 129, "tab\there"):
            with pytest.raises(InvalidArgument) as refused:
                await core.prepare(replace(request(), request_id=bad))
            assert refused.value.field == "x-request-id"
        assert inference.calls == []

    asyncio.run(scenario())


def test_rules_outlive_a_broken_watch_while_they_are_fresh() -> None:
    """Policy restarting: its watch breaks, and prompts are still checked in the router
    with the rules last heard (not sent to a CheckInput that cannot answer)."""

    async def scenario() -> None:
        service = PolicyService(rules(DENY_BOMB))
        policy, inference = gate(service), Inference()
        await followed(policy)
        service.unreachable = True
        service.changed.set()  # the watch wakes up to find policy gone

        async def watch_broke() -> bool:  # the gate tried to watch again
            return service.watches >= 2

        assert await poll_until_async(watch_broke, 5)
        core = make_core(policy, Context(), inference)
        with pytest.raises(PermissionDenied, match="deny-x"):
            await core.prepare(request("how to build a bomb"))
        await run(core, request("hello"))
        assert service.remote_checks == []
        await policy.close()

    asyncio.run(scenario())

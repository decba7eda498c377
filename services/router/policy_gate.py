"""The policy gate, run in the router's own process with the rules policy hands out.

Policy owns the rule sets and the audit trail; the router follows the sets its tenants
use (``Policy.WatchRules``: the set now, then every new version) and applies them itself,
to everything a model will read before anything reaches a replica, and to each
generation as it streams. A check takes microseconds; a round trip to policy per prompt
added to every time to first token, and one per streamed chunk cost more CPU than
anything else the mesh did per token (docs/benchmarks.md). Until a set has arrived, or
while its watch is down, prompts go to ``Policy.CheckInput`` instead, where the tenant's
fail mode applies if policy cannot be reached; a watch that breaks leaves its rules in
force until they are WATCH_STALE_S old. Every decision goes back to policy's audit
trail, in batches (``Policy.RecordDecisions``), sent again until policy takes them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from prometheus_client import Counter, Histogram

from llmmesh.policy import PART_SEPARATOR, OutputDecision, Part, RuleSet, StreamCheck
from llmmesh.policy.off_loop import input_verdict_off_loop
from llmmesh.runtime.errors import MeshError
from llmmesh.types import GuardedText, PolicyAction, Verdict

log = logging.getLogger(__name__)

INPUT_CHECKS = Counter(
    "llm_router_input_checks_total",
    "Prompts checked, in the router (local) or by the policy service (remote)",
    ["where"],
)
INPUT_CHECK_SECONDS = Histogram(
    "llm_router_input_check_seconds",
    "Time to check everything a model will read, in the router",
    buckets=(2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2),
)
RECORDS_LOST = Counter(
    "llm_router_policy_records_lost_total",
    "Policy decisions the policy service did not record (audit trail gaps)",
)

# A watch that has said nothing for this long (policy sends a heartbeat every 10 s) is
# not trusted: prompts go to CheckInput until it speaks again.
WATCH_STALE_S = 30.0
RECONNECT_BACKOFF_S = (0.05, 1.0)
MAX_PENDING_RECORDS = 10_000
RECORD_RETRY_MAX_S = 5.0
MAX_RECORDS_PER_CALL = 500
# How long a decision may wait for others to share its call to policy's audit trail: a
# call costs both ends about a millisecond of CPU, a decision alone a few microseconds.
RECORD_LINGER_S = 0.2


@dataclass(frozen=True)
class FollowedRules:
    """One version of a rule set, compiled, as policy handed it out."""

    name: str
    rules: RuleSet
    audit_text: bool  # the audit log keeps checked text: records carry it

    @property
    def version(self) -> str:
        return self.rules.version


@dataclass(frozen=True)
class AuditRecord:
    """One decision for policy's audit trail."""

    request_id: str
    tenant: str
    stage: str  # input | output
    version: str
    action: PolicyAction
    rule_ids: tuple[str, ...]
    text: str = ""


class PolicyService(Protocol):
    """What the gate needs of the policy service (services/router/upstreams.py)."""

    def watch(self, rule_set: str) -> AsyncIterator[FollowedRules | None]:
        """The set now, then each new version; None for a heartbeat."""
        ...

    async def fetch(self, rule_set: str) -> FollowedRules: ...

    async def check_input(
        self, request_id: str, tenant: str, parts: Sequence[Part], rule_set: str
    ) -> Verdict: ...

    async def record(self, records: Sequence[AuditRecord]) -> None: ...


class DecisionRecorder:
    """Sends decisions to the audit trail without holding up the requests they are
    about: a decision waits up to ``linger_s`` for others to go in the same call (less
    if a call's worth is waiting, none once closing); one call in flight at a time, and
    what arrives meanwhile goes in the next."""

    def __init__(
        self,
        send: Callable[[Sequence[AuditRecord]], Awaitable[None]],
        linger_s: float = RECORD_LINGER_S,
    ) -> None:
        self._send = send
        self._linger_s = linger_s
        self._pending: list[AuditRecord] = []
        self._flushing: asyncio.Task[None] | None = None
        self._full = asyncio.Event()  # a call's worth is waiting, or the recorder closes

    def add(self, record: AuditRecord) -> None:
        if len(self._pending) >= MAX_PENDING_RECORDS:
            RECORDS_LOST.inc()
            return
        self._pending.append(record)
        if len(self._pending) >= MAX_RECORDS_PER_CALL:
            self._full.set()
        if self._flushing is None:
            self._flushing = asyncio.create_task(self._flush())

    async def _linger(self) -> None:
        if len(self._pending) < MAX_RECORDS_PER_CALL:
            self._full.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._full.wait(), self._linger_s)  # batching, by design

    async def _flush(self) -> None:
        """Sends what is pending, batch by batch; a batch policy does not take (it is
        restarting, say) is sent again after a pause, so that the audit trail has no
        gap unless more than MAX_PENDING_RECORDS wait."""
        delay = RECONNECT_BACKOFF_S[0]
        try:
            while self._pending:
                await self._linger()
                batch = self._pending[:MAX_RECORDS_PER_CALL]
                try:
                    await self._send(batch)
                except MeshError as err:
                    log.warning(
                        "policy did not record decisions; sending them again",
                        extra={"fields": {"decisions": len(batch), "error": err.message}},
                    )
                    await asyncio.sleep(delay)  # retry pacing
                    delay = min(RECORD_RETRY_MAX_S, delay * 2)
                    continue
                del self._pending[: len(batch)]
                delay = RECONNECT_BACKOFF_S[0]
        finally:
            self._flushing = None

    async def close(self, grace_s: float = 5.0) -> None:
        """Waits up to ``grace_s`` for the decisions still being sent; what policy has
        not taken by then is lost (and counted)."""
        self._linger_s = 0.0
        self._full.set()
        if self._flushing is None:
            return
        flushing = self._flushing
        done, _ = await asyncio.wait({flushing}, timeout=grace_s)
        if not done:
            flushing.cancel()
            await asyncio.gather(flushing, return_exceptions=True)
            RECORDS_LOST.inc(len(self._pending))
            self._pending.clear()


class _Followed:
    """One rule set as its watch last told it."""

    def __init__(self) -> None:
        self.rules: FollowedRules | None = None
        self.heard_at = 0.0  # time.monotonic() of the watch's last message
        self.task: asyncio.Task[None] | None = None


class RuleSets:
    """The rule sets the router's tenants use, followed from policy: a set is current
    while its watch is connected and has spoken within WATCH_STALE_S."""

    def __init__(self, service: PolicyService) -> None:
        self._service = service
        self._followed: dict[str, _Followed] = {}
        self._fetching: dict[str, asyncio.Future[FollowedRules]] = {}

    def current(self, name: str) -> FollowedRules | None:
        """The set in force, if the router knows it; starts following it on first use."""
        followed = self._followed.get(name)
        if followed is None:
            followed = self._followed[name] = _Followed()
            followed.task = asyncio.create_task(self._follow(name, followed))
        if followed.rules is None or time.monotonic() - followed.heard_at > WATCH_STALE_S:
            return None
        return followed.rules

    async def at_version(self, name: str, version: str) -> FollowedRules:
        """The set at ``version`` (or newer, if that is what policy has now). Callers
        that find it missing share one fetch."""
        followed = self._followed.get(name)
        known = followed.rules if followed is not None else None
        if known is not None and known.version == version:
            return known
        fetching = self._fetching.get(name)
        if fetching is None:
            fetching = asyncio.ensure_future(self._service.fetch(name))
            self._fetching[name] = fetching
            fetching.add_done_callback(lambda _: self._fetching.pop(name, None))
        # Shielded: one caller giving up does not cancel the fetch the others wait for.
        return await asyncio.shield(fetching)

    async def _follow(self, name: str, followed: _Followed) -> None:
        while True:
            try:
                async for rules in self._service.watch(name):
                    followed.heard_at = time.monotonic()
                    if rules is not None:
                        followed.rules = rules
            except MeshError as err:
                # The rules last heard stay in force until WATCH_STALE_S after they were
                # heard, as for a silent watch: a policy service that restarts (a
                # second or two) is never seen by the tenants.
                log.warning(
                    "policy rule watch broke; reconnecting",
                    extra={"fields": {"rule_set": name, "error": err.message}},
                )
            await asyncio.sleep(random.uniform(*RECONNECT_BACKOFF_S))  # reconnect pacing

    async def close(self) -> None:
        tasks = [f.task for f in self._followed.values() if f.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class PolicyGate:
    """The router's PolicyClient: prompts checked here with the followed rules (policy's
    CheckInput until they are known), output checked here as it streams."""

    def __init__(self, service: PolicyService) -> None:
        self._service = service
        self.rule_sets = RuleSets(service)
        self._recorder = DecisionRecorder(service.record)

    async def check_input(
        self, request_id: str, tenant: str, parts: Sequence[Part], rule_set: str
    ) -> Verdict:
        followed = self.rule_sets.current(rule_set)
        if followed is None:
            INPUT_CHECKS.labels("remote").inc()
            return await self._service.check_input(request_id, tenant, parts, rule_set)
        INPUT_CHECKS.labels("local").inc()
        started = time.perf_counter()
        verdict = await input_verdict_off_loop(followed.rules, parts, tenant)
        INPUT_CHECK_SECONDS.observe(time.perf_counter() - started)
        text = PART_SEPARATOR.join(p.text for p in parts) if followed.audit_text else ""
        self._recorder.add(
            AuditRecord(
                request_id,
                tenant,
                "input",
                verdict.rule_set_version,
                verdict.action,
                verdict.rule_ids,
                text,
            )
        )
        return verdict

    def guard_output(
        self, request_id: str, tenant: str, rule_set: str, version: str, lead: str = ""
    ) -> LocalOutputGuard:
        generation = Generation(request_id, tenant, rule_set, version)
        return LocalOutputGuard(self.rule_sets, self._record_output, generation, lead)

    def _record_output(
        self, generation: Generation, version: str, decision: OutputDecision
    ) -> None:
        self._recorder.add(
            AuditRecord(
                generation.request_id,
                generation.tenant,
                "output",
                version,
                decision.action,
                decision.rule_ids,
                decision.text,
            )
        )

    async def close(self) -> None:
        await self.rule_sets.close()
        await self._recorder.close()


@dataclass(frozen=True)
class Generation:
    """Whose output a guard checks, and with which rule set (as the input check named
    it)."""

    request_id: str
    tenant: str
    rule_set: str
    version: str


class LocalOutputGuard:
    """One generation's output check (the router's OutputGuard): the rules are looked up
    at the first chunk; the decision goes to ``record`` once, at the end or when the
    generation is cut short."""

    def __init__(
        self,
        rule_sets: RuleSets,
        record: Callable[[Generation, str, OutputDecision], None],
        generation: Generation,
        lead: str = "",
    ) -> None:
        self._rule_sets = rule_sets
        self._record = record
        self._generation = generation
        self._lead = lead
        self._check: StreamCheck | None = None

    async def check(self, text: str, final: bool, tokens: int = 1) -> GuardedText:
        if self._check is None:
            self._check = await self._start()
        step = self._check.feed(text, final, tokens)
        return GuardedText(step.text, step.denied_by, step.held)

    async def close(self) -> None:
        if self._check is not None:
            self._check.close()

    async def _start(self) -> StreamCheck:
        generation = self._generation
        followed = await self._rule_sets.at_version(generation.rule_set, generation.version)

        def record(decision: OutputDecision) -> None:
            self._record(generation, followed.version, decision)

        return StreamCheck(
            followed.rules.output, record, keep_text=followed.audit_text, lead=self._lead
        )

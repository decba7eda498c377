"""The streamed output check, run in the router's own process.

Policy owns the rules and the audit trail; the router applies a rule set's output rules
to each generation as it streams. Checking a chunk takes microseconds, while a round trip
to the policy service per streamed chunk cost more CPU, across both processes, than
anything else the mesh did per token (docs/benchmarks.md). A rule set's output rules are
fetched once per version: CheckInput names the version in force for every request, so a
change applies from the next request on. Each generation's decision goes back to policy
in one call when the generation ends.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from llmmesh.types import GuardedText
from services.policy.rules import StageRules
from services.policy.streaming import OutputDecision, StreamCheck


@dataclass(frozen=True)
class OutputRules:
    """One version of a rule set's output rules, compiled."""

    version: str
    rules: StageRules
    audit_text: bool  # the audit log keeps checked text: the record carries the output


@dataclass(frozen=True)
class Generation:
    """Whose output a guard checks, and with which rule set (as CheckInput named it)."""

    request_id: str
    tenant: str
    rule_set: str
    version: str


class OutputRulesCache:
    """Compiled output rules by rule set, refreshed when a request names a new version.
    Requests that find the same set missing share one fetch."""

    def __init__(self, fetch: Callable[[str], Awaitable[OutputRules]]) -> None:
        self._fetch = fetch
        self._sets: dict[str, OutputRules] = {}
        self._fetching: dict[str, asyncio.Future[OutputRules]] = {}

    async def get(self, rule_set: str, version: str) -> OutputRules:
        cached = self._sets.get(rule_set)
        if cached is not None and cached.version == version:
            return cached
        fetching = self._fetching.get(rule_set)
        if fetching is None:
            fetching = asyncio.ensure_future(self._fetch(rule_set))
            self._fetching[rule_set] = fetching
            fetching.add_done_callback(lambda _: self._fetching.pop(rule_set, None))
        # Shielded: one caller giving up does not cancel the fetch the others wait for.
        rules = await asyncio.shield(fetching)
        self._sets[rule_set] = rules  # possibly newer than ``version``: the set in force
        return rules


class LocalOutputGuard:
    """One generation's output check (the router's OutputGuard): the rules are looked up
    at the first chunk; the decision goes to ``record`` once, at the end or when the
    generation is cut short."""

    def __init__(
        self,
        cache: OutputRulesCache,
        record: Callable[[Generation, str, OutputDecision], None],
        generation: Generation,
    ) -> None:
        self._cache = cache
        self._record = record
        self._generation = generation
        self._check: StreamCheck | None = None

    async def check(self, text: str, final: bool) -> GuardedText:
        if self._check is None:
            self._check = await self._start()
        step = self._check.feed(text, final)
        return GuardedText(step.text, step.denied_by)

    async def close(self) -> None:
        if self._check is not None:
            self._check.close()

    async def _start(self) -> StreamCheck:
        generation = self._generation
        rules = await self._cache.get(generation.rule_set, generation.version)

        def record(decision: OutputDecision) -> None:
            self._record(generation, rules.version, decision)

        return StreamCheck(rules.rules, record, keep_text=rules.audit_text)

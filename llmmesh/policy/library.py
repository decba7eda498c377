"""Named rule sets: ``default`` and per-tenant sets that extend it, swapped atomically."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from prometheus_client import Counter

from llmmesh.policy.rules import (
    DEFAULT_HOLDBACK_CAP,
    RuleSet,
    RuleSetError,
    RuleSetSpec,
    RuleSpec,
    parse_rule_set,
)
from llmmesh.runtime.documents import offer
from llmmesh.runtime.errors import InvalidArgument

log = logging.getLogger(__name__)

DEFAULT_SET = "default"
RULES_REJECTED = Counter("llm_policy_rules_rejected_total", "Rule sets refused as invalid")


class RuleLibrary:
    """Every set is resolved (inheritance applied) and compiled before any is swapped in:
    a change that breaks any set is refused whole, and the sets in force stay."""

    def __init__(self, holdback_cap: int = DEFAULT_HOLDBACK_CAP) -> None:
        self._cap = holdback_cap
        self._specs: dict[str, RuleSetSpec] = {}
        self._sets: dict[str, RuleSet] = {}
        self._listeners: list[Callable[[], None]] = []

    @property
    def holdback_cap(self) -> int:
        return self._cap

    def names(self) -> list[str]:
        return sorted(self._sets)

    def get(self, name: str) -> RuleSet:
        """The set ``name`` (``default`` when empty)."""
        rules = self._sets.get(name or DEFAULT_SET)
        if rules is None:
            raise InvalidArgument("rule_set", f"unknown rule set '{name}'; known: {self.names()}")
        return rules

    def load(self, texts: Mapping[str, str], source: str) -> None:
        """Replaces every set (at start); raises RuleSetError if any is invalid."""
        specs = {name: parse_rule_set(text, f"{source}/{name}") for name, text in texts.items()}
        self._swap(specs)

    def offer(self, texts: Mapping[str, str], source: str) -> bool:
        """Applies changed sets if all sets stay valid; otherwise keeps those in force."""
        applied = offer("rule sets", source, lambda: self._offered(texts, source))
        if not applied:
            RULES_REJECTED.inc()
        return applied

    def _offered(self, texts: Mapping[str, str], source: str) -> None:
        specs = dict(self._specs)
        for name, text in texts.items():
            specs[name] = parse_rule_set(text, f"{source}/{name}")
        changed = {n for n in texts if self._specs.get(n) != specs[n]}
        self._swap(specs)
        if changed:
            log.info("rule sets applied", extra={"fields": {"versions": self.versions()}})

    def subscribe(self, listener: Callable[[], None]) -> Callable[[], None]:
        """Calls ``listener`` after every swap; returns the call that stops it."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener)

    def versions(self) -> dict[str, str]:
        return {name: rules.version for name, rules in sorted(self._sets.items())}

    def _swap(self, specs: dict[str, RuleSetSpec]) -> None:
        if DEFAULT_SET not in specs:
            raise RuleSetError(f"no '{DEFAULT_SET}' rule set")
        compiled = {name: self._compile(name, specs) for name in specs}
        self._specs, self._sets = specs, compiled  # checks see the old sets or the new
        for listener in list(self._listeners):
            listener()

    def _compile(self, name: str, specs: Mapping[str, RuleSetSpec]) -> RuleSet:
        rules, version = _resolve(name, specs, ())
        try:
            return RuleSet(rules, version, self._cap, _holdback_tokens(name, specs))
        except RuleSetError as err:
            raise RuleSetError(f"rule set '{name}': {err}") from None


def _holdback_tokens(name: str, specs: Mapping[str, RuleSetSpec]) -> int | None:
    """The set's own output_holdback_tokens, else the nearest base's (cycles and unknown
    bases are _resolve's to refuse)."""
    spec = specs.get(name)
    seen = set()
    while spec is not None and spec.output_holdback_tokens is None and spec.extends:
        if spec.extends in seen:
            return None
        seen.add(spec.extends)
        spec = specs.get(spec.extends)
    return spec.output_holdback_tokens if spec is not None else None


def _resolve(
    name: str, specs: Mapping[str, RuleSetSpec], chain: tuple[str, ...]
) -> tuple[list[RuleSpec], str]:
    """The rules of ``name`` with inheritance applied, and its version (a derived set's
    version names its base's too: ``v3+2026-11-29.2``)."""
    if name in chain:
        raise RuleSetError(f"rule sets extend each other in a cycle: {[*chain, name]}")
    spec = specs.get(name)
    if spec is None:
        raise RuleSetError(f"rule set '{chain[-1]}' extends unknown set '{name}'")
    if spec.extends is None:
        if spec.disable:
            raise RuleSetError(f"rule set '{name}': disable needs extends")
        return list(spec.rules), spec.version
    inherited, base_version = _resolve(spec.extends, specs, (*chain, name))
    unknown = sorted(set(spec.disable) - {r.id for r in inherited})
    if unknown:
        raise RuleSetError(f"rule set '{name}': disables unknown rules {unknown}")
    own = {r.id: r for r in spec.rules}
    rules = [own.pop(r.id, r) for r in inherited if r.id not in spec.disable]
    return rules + list(own.values()), f"{spec.version}+{base_version}"

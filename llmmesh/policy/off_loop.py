"""A long prompt's input check, run beside the event loop instead of on it
(llmmesh/runtime/beside_loop.py): its cost grows with the text, and several times faster
for digits and base64 than for prose (each group of digits is a card candidate, every
readable stretch of a decoding is read). One thread for all of them: the check holds the
interpreter, so long checks wait for each other and the loop shares it with one of them
at most (docs/benchmarks.md, the policy run's status of 2026-12-08). The tenants' checks
take turns on it: one that sends many long prompts at once waits for its own.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from llmmesh.policy.parts import Part, check_input
from llmmesh.policy.rules import RuleSet
from llmmesh.runtime.beside_loop import ON_LOOP_CHARS, TakingTurns
from llmmesh.types import Verdict

_LONG_CHECKS = TakingTurns("policy-check")


def input_verdict(rules: RuleSet, parts: Sequence[Part]) -> Verdict:
    return check_input(rules, parts).verdict(rules)


async def input_verdict_off_loop(
    rules: RuleSet, parts: Sequence[Part], tenant: str = ""
) -> Verdict:
    """``input_verdict``, on the policy-check thread in ``tenant``'s turn once the parts
    are long (the hand-off costs as much as a short text's check)."""
    check = functools.partial(input_verdict, rules, parts)
    if sum(len(p.text) for p in parts) <= ON_LOOP_CHARS:
        return check()
    return await _LONG_CHECKS.run(tenant, check)

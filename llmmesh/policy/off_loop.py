"""A long prompt's input check, run beside the event loop instead of on it.

A check of a few kilobytes takes a fraction of a millisecond, but its cost grows with the
text, and several times faster for digits and base64 than for prose (each group of digits
is a card candidate, every readable stretch of a decoding is read): a 64 KB table of
numbers takes about 0.3 s. On the loop's thread that is 0.3 s in which no other request
moves, and no token of any stream goes out. On a thread of its own, the interpreter hands
the loop its turn every few milliseconds (docs/benchmarks.md, "A long prompt's check").
One thread for all of them: long checks wait for each other, and the loop shares the
interpreter with one of them at most.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from llmmesh.policy.parts import Part, check_input
from llmmesh.policy.rules import RuleSet
from llmmesh.types import Verdict

# Up to a 4 KB prompt, checked where it is asked for: a hand-off to the thread and back
# costs about 0.1 ms, as much as the check of such a prompt of prose.
ON_LOOP_CHARS = 4096

_LONG_CHECKS = ThreadPoolExecutor(max_workers=1, thread_name_prefix="policy-check")


def input_verdict(rules: RuleSet, parts: Sequence[Part]) -> Verdict:
    return check_input(rules, parts).verdict(rules)


async def input_verdict_off_loop(rules: RuleSet, parts: Sequence[Part]) -> Verdict:
    """``input_verdict``, on the policy-check thread once the parts are longer than
    ON_LOOP_CHARS in all."""
    if sum(len(p.text) for p in parts) <= ON_LOOP_CHARS:
        return input_verdict(rules, parts)
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_LONG_CHECKS, input_verdict, rules, parts)

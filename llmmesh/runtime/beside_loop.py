"""CPU work too long for an event loop's turn, run on a thread beside it.

What a request costs the router grows with its text: a 60 KB conversation of numbers
takes 0.25-0.65 s to check against the rules and 0.1 s per count of its tokens. On the
loop's thread no other stream's token moves for that long; on another thread the loop
keeps its turns (the interpreter hands it over every few milliseconds, and a tokenizer
that lets go of it runs on the other core). A text up to ON_LOOP_CHARS stays on the loop:
the hand-off there and back costs about 0.1 ms, as much as such a text's work.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Executor
from typing import TypeVar

T = TypeVar("T")

ON_LOOP_CHARS = 4096


async def beside_loop_if_long(
    chars: int, work: Callable[[], T], executor: Executor | None = None
) -> T:
    """``work`` on ``executor`` (asyncio's default one if None) when its text is longer
    than ON_LOOP_CHARS, else here."""
    if chars <= ON_LOOP_CHARS:
        return work()
    return await asyncio.get_running_loop().run_in_executor(executor, work)

"""The engine tests' reference engine (a small random-weight model) and the sink that
records what it sends."""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field
from typing import Any

from refengine import (
    Engine,
    EngineConfig,
    GenerationRequest,
    ModelShape,
    SamplingParams,
    Transformer,
)
from refengine.sequence import Details

SMALL = ModelShape(n_layers=2, d_model=64, n_heads=4, d_ff=128, max_context=256)


@dataclass
class RecordingSink:
    cancel_after: int | None = None
    deltas: list[tuple[str, int]] = field(default_factory=list)
    final: tuple[str, int, str] | None = None
    details: list[Details | None] = field(default_factory=list)  # per response
    error: str = ""
    done: threading.Event = field(default_factory=threading.Event)

    def is_cancelled(self) -> bool:
        return self.cancel_after is not None and len(self.deltas) >= self.cancel_after

    def emit(self, text: str, num_tokens: int, details: Details | None = None) -> None:
        self.deltas.append((text, num_tokens))
        self.details.append(details)

    def finish(
        self, text: str, num_tokens: int, reason: str, details: Details | None = None
    ) -> None:
        self.final = (text, num_tokens, reason)
        self.details.append(details)
        self.done.set()

    def fail(self, message: str) -> None:
        self.error = message
        self.done.set()

    @property
    def text(self) -> str:
        assert self.final is not None
        return "".join(t for t, _ in self.deltas) + self.final[0]

    @property
    def tokens(self) -> int:
        assert self.final is not None
        return sum(n for _, n in self.deltas) + self.final[1]

    def tokens_so_far(self) -> int:
        return sum(n for _, n in self.deltas) + (self.final[1] if self.final else 0)


class BrokenSink(RecordingSink):
    def emit(self, text: str, num_tokens: int, details: Details | None = None) -> None:
        raise RuntimeError("sink broke")


def make_engine(**config: int) -> Engine:
    return Engine(Transformer(SMALL, seed=0), config=EngineConfig(**config))


def submit(
    engine: Engine, prompt: str, sink: RecordingSink | None = None, **kw: Any
) -> RecordingSink:
    sink = sink or RecordingSink()
    stream = bool(kw.pop("stream", True))
    engine.submit(GenerationRequest(prompt, stream=stream, sampling=SamplingParams(**kw)), sink)
    return sink


def drain(engine: Engine, max_steps: int = 10_000) -> int:
    """Steps the engine until it has nothing to do; returns the steps taken."""
    for steps in range(max_steps):
        if not engine.step():
            return steps
    raise AssertionError("the engine did not become idle")


def run(engine: Engine, prompt: str, **kw: Any) -> RecordingSink:
    sink = submit(engine, prompt, **kw)
    drain(engine)
    assert sink.done.is_set()
    return sink


def urgent_kw(seed: int) -> dict[str, Any]:
    return {"max_tokens": 16, "ignore_eos": True, "seed": seed}


def first_word_tokens(sink: RecordingSink) -> int:
    """Tokens until a space follows the first word (byte tokens: one per character), or
    0 if none does."""
    text = "".join(t for t, _ in sink.deltas) + (sink.final[0] if sink.final else "")
    found = re.search(r"\S\s", text)
    return found.end() if found and text[: found.end()].isascii() else 0


def submit_at(engine: Engine, prompt: str, priority: int, **kw: Any) -> RecordingSink:
    sink = RecordingSink()
    request = GenerationRequest(prompt, sampling=SamplingParams(**kw), priority=priority)
    engine.submit(request, sink)
    return sink

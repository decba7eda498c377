"""Synthetic workloads: prompts with configurable lengths and shared prefixes."""

from __future__ import annotations

import random
import secrets
from dataclasses import dataclass

_WORDS = tuple(
    [
        "the",
        "model",
        "served",
        "many",
        "tenants",
        "through",
        "a",
        "mesh",
        "of",
        "services",
        "and",
        "every",
        "request",
        "found",
        "the",
        "replica",
        "with",
        "the",
        "most",
        "room",
        "while",
        "tokens",
        "streamed",
        "back",
        "one",
        "at",
        "a",
        "time",
        "to",
        "the",
        "client",
    ]
)


@dataclass(frozen=True)
class WorkloadSpec:
    num_prompts: int = 32
    # Prompt length in tokens (bytes of the reference model): mean and +/- uniform spread.
    input_len: int = 128
    input_spread: float = 0.0
    output_len: int = 64
    output_spread: float = 0.0
    # Prompts are split into this many groups; each group's prompts share a prefix.
    prefix_groups: int = 1
    shared_prefix_len: int = 0
    seed: int = 0
    # Starts every prompt, so that prompts of different runs never share a cached prefix.
    salt: str = ""


@dataclass(frozen=True)
class BenchRequest:
    prompt: str
    max_tokens: int
    session_id: str = ""  # the router prepends the session's earlier turns


def text_of_length(rng: random.Random, length: int) -> str:
    words: list[str] = []
    size = 0
    while size < length:
        word = rng.choice(_WORDS)
        words.append(word)
        size += len(word) + 1
    return " ".join(words)[:length]


def _spread(rng: random.Random, mean: int, spread: float) -> int:
    return max(1, round(mean * (1 + rng.uniform(-spread, spread))))


def make_requests(spec: WorkloadSpec) -> list[BenchRequest]:
    rng = random.Random(spec.seed)
    prefixes = [
        text_of_length(rng, spec.shared_prefix_len) for _ in range(max(1, spec.prefix_groups))
    ]
    requests = []
    for i in range(spec.num_prompts):
        prefix = spec.salt + (prefixes[i % len(prefixes)] if spec.shared_prefix_len else "")
        body_len = max(1, _spread(rng, spec.input_len, spec.input_spread) - len(prefix))
        requests.append(
            BenchRequest(
                prompt=prefix + text_of_length(rng, body_len),
                max_tokens=_spread(rng, spec.output_len, spec.output_spread),
            )
        )
    return requests


def new_salt() -> str:
    """A prompt start no earlier request has used (the engine caches prompt prefixes)."""
    return f"[{secrets.token_hex(4)}] "

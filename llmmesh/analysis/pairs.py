"""Two answers to one request compared (drift.py says what is measured and how)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from rouge_score import rouge_scorer

from llmmesh.analysis.drift import PairDiff, PositionDiff, entropy, kl_divergence
from llmmesh.types import TokenLogprob

_ROUGE = rouge_scorer.RougeScorer(["rougeL"])


def _position(stable: TokenLogprob, canary: TokenLogprob) -> PositionDiff:
    return PositionDiff(
        agree=bool(stable.top and canary.top) and stable.top[0][0] == canary.top[0][0],
        confidence_shift=_top1(canary) - _top1(stable),
        stable_entropy=entropy(stable.top),
        canary_entropy=entropy(canary.top),
        kl=kl_divergence(stable.top, canary.top),
    )


def _top1(token: TokenLogprob) -> float:
    return math.exp(token.top[0][2]) if token.top else math.exp(token.logprob)


def compare(
    stable: Sequence[TokenLogprob],
    canary: Sequence[TokenLogprob],
    stable_text: str,
    canary_text: str,
) -> PairDiff:
    """The two answers to one request, token by token while they share their prefix."""
    positions: list[PositionDiff] = []
    divergence = None
    for index, (s, c) in enumerate(zip(stable, canary, strict=False)):
        positions.append(_position(s, c))
        if s.token != c.token:
            divergence = index
            break
    rouge = _ROUGE.score(stable_text, canary_text)["rougeL"].fmeasure
    return PairDiff(
        positions=tuple(positions),
        divergence=divergence,
        exact_match=stable_text == canary_text,
        rouge_l=rouge,
        length_ratio=len(canary) / max(len(stable), 1),
    )

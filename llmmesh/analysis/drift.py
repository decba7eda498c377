"""What a canary says against what stable says, for the same request: per aligned
position, whether the two models' likeliest tokens agree, how their confidence and the
spread of their top-k distributions differ, and the KL divergence between those
distributions; per pair, where the texts diverge, whether they match, ROUGE-L and the
length ratio (pairs.py compares two answers); over a window, the sums and means the
rollout's drift gates judge.

Positions are compared while both answers share their prefix: at position i both models
have read the same prompt and the same i tokens, so their distributions there are
comparable; the first position whose sampled tokens differ is the last one compared.

The engines send the top-k tokens of each position (k at most 20), not the whole
vocabulary: each distribution is the top-k probabilities plus one bucket for the rest of
the mass, and a token in one side's top-k but not in the other's takes, on that other
side, an equal share of its rest (at most its smallest top-k probability). The KL
divergence of those is a lower-resolution estimate of the full one: it tends to it as k
grows (the benchmark compares it with the offline, full-vocabulary figure).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

_FLOOR = 1e-10  # a probability never taken as zero (a log of it stays finite)
_REST = -1  # the bucket for the mass outside a side's top-k
Top = Sequence[tuple[int, str, float]]  # a position's likeliest (token, text, log probability)


@dataclass(frozen=True)
class PositionDiff:
    agree: bool  # the two top-1 tokens are the same
    confidence_shift: float  # canary's top-1 probability minus stable's
    stable_entropy: float  # of each side's top-k distribution, renormalized, in nats
    canary_entropy: float
    kl: float  # KL(stable || canary) over the top-k tokens and the rest, in nats


@dataclass(frozen=True)
class PairDiff:
    positions: tuple[PositionDiff, ...]
    divergence: int | None  # first position whose sampled tokens differ; None if none
    exact_match: bool
    rouge_l: float  # F-measure of the two texts' longest common subsequence
    length_ratio: float  # canary's tokens over stable's


def _distribution(top: Top) -> dict[int, float]:
    probs = {token: math.exp(logprob) for token, _, logprob in top}
    probs[_REST] = max(0.0, 1.0 - sum(probs.values()))
    return probs


def _completed(probs: dict[int, float], tokens: set[int]) -> dict[int, float]:
    """``probs`` over ``tokens`` too: those it lacks share its rest equally, each at most
    its smallest top-k probability."""
    missing = [t for t in tokens if t not in probs]
    if not missing:
        return probs
    listed = [p for t, p in probs.items() if t != _REST]
    share = probs[_REST] / (len(missing) + 1)
    each = min(share, *listed) if listed else share
    completed = dict(probs)
    for token in missing:
        completed[token] = each
    completed[_REST] = probs[_REST] - each * len(missing)
    return completed


def kl_divergence(stable: Top, canary: Top) -> float:
    """KL(stable || canary) of two positions' top-k tokens with their rest buckets."""
    p, q = _distribution(stable), _distribution(canary)
    tokens = set(p) | set(q)
    p, q = _completed(p, tokens), _completed(q, tokens)
    return sum(pt * math.log(pt / max(q[t], _FLOOR)) for t, pt in p.items() if pt > _FLOOR)


def entropy(top: Top) -> float:
    """Of the top-k probabilities renormalized to 1, in nats."""
    probs = [math.exp(logprob) for _, _, logprob in top]
    total = sum(probs)
    return -sum(p / total * math.log(p / total) for p in probs if p > 0) if total else 0.0


@dataclass(frozen=True)
class DriftSummary:
    """A window's pairs, as the drift gates read them."""

    pairs: int
    positions: int
    agreement: float  # share of compared positions whose top-1 tokens agree
    confidence_shift: float  # mean absolute top-1 confidence shift
    entropy_change: float  # relative change of the mean top-k entropy, canary vs stable
    kl: float  # mean KL divergence per compared position
    exact_match: float  # share of pairs whose texts are the same
    rouge_l: float  # mean per pair
    length_ratio: float  # mean per pair


@dataclass
class DriftWindow:
    """The pairs of one window (a rollout step), summed as they come."""

    pairs: int = 0
    positions: int = 0
    agreeing: int = 0
    shift: float = 0.0
    stable_entropy: float = 0.0
    canary_entropy: float = 0.0
    kl: float = 0.0
    exact: int = 0
    rouge_l: float = 0.0
    length_ratio: float = 0.0

    def add(self, pair: PairDiff) -> None:
        self.pairs += 1
        self.positions += len(pair.positions)
        for position in pair.positions:
            self.agreeing += position.agree
            self.shift += abs(position.confidence_shift)
            self.stable_entropy += position.stable_entropy
            self.canary_entropy += position.canary_entropy
            self.kl += position.kl
        self.exact += pair.exact_match
        self.rouge_l += pair.rouge_l
        self.length_ratio += pair.length_ratio

    def summary(self) -> DriftSummary:
        n, m = max(self.positions, 1), max(self.pairs, 1)
        stable_h = self.stable_entropy / n
        change = (self.canary_entropy / n - stable_h) / stable_h if stable_h > 0 else 0.0
        return DriftSummary(
            pairs=self.pairs,
            positions=self.positions,
            agreement=self.agreeing / n if self.positions else 1.0,
            confidence_shift=self.shift / n,
            entropy_change=change,
            kl=self.kl / n,
            exact_match=self.exact / m if self.pairs else 1.0,
            rouge_l=self.rouge_l / m if self.pairs else 1.0,
            length_ratio=self.length_ratio / m if self.pairs else 1.0,
        )

"""Canary analysis on hand-made answers: the per-position and per-pair drift figures, the
window's means, and the gates' verdicts (waiting for samples, passing, pausing, failing)."""

from __future__ import annotations

import math
import random

import pytest

from llmmesh.analysis.drift import DriftSummary, DriftWindow, entropy, kl_divergence
from llmmesh.analysis.gates import DriftGates, ErrorGate, LatencyGate, Verdict, overall
from llmmesh.analysis.pairs import compare
from llmmesh.types import TokenLogprob


def position(token: int, probs: dict[int, float]) -> TokenLogprob:
    """A sampled token and its position's top-k, likeliest first."""
    top = tuple((t, f"<{t}>", math.log(p)) for t, p in sorted(probs.items(), key=lambda kv: -kv[1]))
    return TokenLogprob(token, f"<{token}>", math.log(probs[token]), 1, top)


def test_the_same_distribution_has_no_divergence_and_full_agreement() -> None:
    stable = [position(1, {1: 0.7, 2: 0.2}), position(3, {3: 0.9, 4: 0.05})]
    pair = compare(stable, stable, "a b", "a b")
    assert pair.divergence is None and pair.exact_match and pair.rouge_l == 1.0
    assert all(p.agree and p.kl == pytest.approx(0.0, abs=1e-12) for p in pair.positions)
    assert all(p.confidence_shift == 0.0 for p in pair.positions)
    assert pair.length_ratio == 1.0


def test_kl_and_entropy_follow_their_definitions() -> None:
    stable = ((1, "a", math.log(0.5)), (2, "b", math.log(0.3)))  # rest: 0.2
    canary = ((1, "a", math.log(0.4)), (2, "b", math.log(0.4)))  # rest: 0.2
    expected = 0.5 * math.log(0.5 / 0.4) + 0.3 * math.log(0.3 / 0.4)  # the rests cancel
    assert kl_divergence(stable, canary) == pytest.approx(expected)
    q = [0.5 / 0.8, 0.3 / 0.8]
    assert entropy(stable) == pytest.approx(-sum(p * math.log(p) for p in q))
    # A token only one side lists takes, on the other, a share of its rest.
    other = ((3, "c", math.log(0.6)), (1, "a", math.log(0.3)))
    assert kl_divergence(stable, other) > kl_divergence(stable, canary)


def test_positions_are_compared_until_the_sampled_tokens_differ() -> None:
    stable = [position(1, {1: 0.6, 2: 0.3}), position(5, {5: 0.5, 6: 0.4}), position(7, {7: 1})]
    canary = [position(1, {1: 0.5, 2: 0.4}), position(6, {6: 0.8, 5: 0.1}), position(8, {8: 1})]
    pair = compare(stable, canary, "one five seven", "one six eight nine")
    assert pair.divergence == 1 and len(pair.positions) == 2  # the third is not comparable
    first, second = pair.positions
    assert first.agree and first.confidence_shift == pytest.approx(-0.1)
    assert not second.agree and second.kl > first.kl
    assert not pair.exact_match and 0 < pair.rouge_l < 1
    assert pair.length_ratio == 1.0


def test_a_window_averages_over_positions_and_pairs() -> None:
    window = DriftWindow()
    same = [position(1, {1: 0.8, 2: 0.1})]
    sharper = [position(1, {1: 0.98, 2: 0.01})]
    window.add(compare(same, same, "x", "x"))
    window.add(compare(same, sharper, "x", "x y"))
    summary = window.summary()
    assert (summary.pairs, summary.positions, summary.agreement) == (2, 2, 1.0)
    assert summary.confidence_shift == pytest.approx(0.18 / 2)
    assert summary.entropy_change < 0  # the canary is more certain
    assert summary.exact_match == 0.5


def test_latency_waits_for_samples_then_fails_only_a_slower_canary() -> None:
    rng = random.Random(3)
    stable = [rng.gauss(0.3, 0.03) for _ in range(80)]
    gate = LatencyGate("ttft", min_samples=50)
    assert gate.judge(stable[:10], stable).verdict is Verdict.WAIT
    same = [rng.gauss(0.3, 0.03) for _ in range(80)]
    assert gate.judge(same, stable).verdict is Verdict.PASS
    slow = [x + 0.2 for x in same]
    failed = gate.judge(slow, stable)
    assert failed.verdict is Verdict.FAIL and failed.value is not None and failed.value > 1.2
    # Significant but within the tolerance: a 5% slower canary passes.
    assert gate.judge([x * 1.05 for x in same], stable).verdict is Verdict.PASS


def test_errors_fail_on_a_significant_excess() -> None:
    gate = ErrorGate(min_samples=50)
    assert gate.judge((0, 10), (0, 100)).verdict is Verdict.WAIT
    assert gate.judge((1, 100), (1, 100)).verdict is Verdict.PASS
    assert gate.judge((20, 100), (1, 100)).verdict is Verdict.FAIL


def test_drift_gates_pause_on_confidence_and_fail_on_kl() -> None:
    gates = DriftGates(min_pairs=2)
    window = DriftWindow()
    stable = [position(1, {1: 0.9, 2: 0.05})]
    window.add(compare(stable, stable, "a", "a"))
    assert overall(gates.judge(window.summary())) is Verdict.WAIT
    window.add(compare(stable, stable, "a", "a"))
    assert overall(gates.judge(window.summary())) is Verdict.PASS
    unsure = DriftWindow()
    for _ in range(2):
        unsure.add(compare(stable, [position(1, {1: 0.75, 2: 0.2})], "a", "a"))
    assert overall(gates.judge(unsure.summary())) is Verdict.PAUSE
    wrong = DriftWindow()
    for _ in range(2):
        wrong.add(compare(stable, [position(2, {2: 0.9, 1: 0.05})], "a", "b"))
    results = gates.judge(wrong.summary())
    assert overall(results) is Verdict.FAIL
    assert {r.gate for r in results if r.verdict is Verdict.FAIL} == {"kl", "agreement"}


def agreement_of(agreeing: int, positions: int) -> DriftSummary:
    return DriftSummary(
        pairs=50, positions=positions, agreement=agreeing / positions, confidence_shift=0.0,
        entropy_change=0.0, kl=0.0, exact_match=0.0, rouge_l=1.0, length_ratio=1.0,
    )  # fmt: skip


def test_agreement_fails_only_when_its_interval_lies_under_the_threshold() -> None:
    """Each diverging pair adds one disagreement: 11 of 14 positions (short answers) is
    noise around 0.8, 110 of 140 is not, and 0 of 5 (a canary that parts at once) is
    plainly under it."""
    gates = DriftGates(min_pairs=1)
    verdict = {r.gate: r.verdict for r in gates.judge(agreement_of(11, 14))}["agreement"]
    assert verdict is Verdict.WAIT
    for agreeing, positions in ((100, 140), (0, 5)):
        results = {r.gate: r.verdict for r in gates.judge(agreement_of(agreeing, positions))}
        assert results["agreement"] is Verdict.FAIL
    assert overall(gates.judge(agreement_of(13, 14))) is Verdict.PASS

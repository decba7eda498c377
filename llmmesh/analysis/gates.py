"""The gates a rollout step passes: the canary's real traffic against stable's in the same
window (errors, TTFT, TPOT) and what the canary says against stable (drift).

Latency is judged as Kayenta's Mann-Whitney classifier judges a metric: the two samples
ranked together, one-sided (is the canary's slower?), and the difference has to matter as
well as be significant (the canary's p99 more than ``tolerance`` over stable's). Errors
are judged with Fisher's exact test on the two counts. No gate gives a verdict before
both samples reach ``min_samples`` (Kayenta asks for 50).

A failed hard gate rolls the canary back; a soft one (drift in confidence or entropy,
which practice reads as "look at it" rather than "wrong") pauses the rollout.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats

from llmmesh.analysis.drift import DriftSummary


class Verdict(enum.Enum):
    PASS = "pass"
    WAIT = "wait"  # not enough samples yet
    PAUSE = "pause"  # a soft gate: hold the weight for review
    FAIL = "fail"  # a hard gate: roll back


@dataclass(frozen=True)
class GateResult:
    gate: str
    verdict: Verdict
    value: float | None  # what was measured (None before enough samples)
    threshold: float
    detail: str  # what it waits for, or why it failed


@dataclass(frozen=True)
class LatencyGate:
    name: str  # "ttft" or "tpot"
    tolerance: float = 0.2  # the canary's p99 may be this much over stable's
    alpha: float = 0.05
    min_samples: int = 50

    def judge(self, canary: Sequence[float], stable: Sequence[float]) -> GateResult:
        waiting = _too_few(self.name, canary, stable, self.min_samples, self.tolerance)
        if waiting is not None:
            return waiting
        canary_p99, stable_p99 = (float(np.percentile(x, 99)) for x in (canary, stable))
        ratio = canary_p99 / max(stable_p99, 1e-9)
        p = float(stats.mannwhitneyu(canary, stable, alternative="greater").pvalue)
        slower = p < self.alpha and ratio > 1 + self.tolerance
        detail = f"p99 {ratio:.2f}x stable's, Mann-Whitney p={p:.3g}"
        verdict = Verdict.FAIL if slower else Verdict.PASS
        return GateResult(f"{self.name}_p99", verdict, ratio, 1 + self.tolerance, detail)


@dataclass(frozen=True)
class ErrorGate:
    tolerance: float = 0.02  # the canary's error rate may be this much over stable's
    alpha: float = 0.05
    min_samples: int = 50

    def judge(self, canary: tuple[int, int], stable: tuple[int, int]) -> GateResult:
        """``canary``, ``stable``: (errors, requests)."""
        (c_err, c_all), (s_err, s_all) = canary, stable
        if min(c_all, s_all) < self.min_samples:
            detail = f"{c_all} canary and {s_all} stable requests of {self.min_samples} each"
            return GateResult("error_rate", Verdict.WAIT, None, self.tolerance, detail)
        excess = c_err / c_all - s_err / s_all
        table = [[c_err, c_all - c_err], [s_err, s_all - s_err]]
        p = float(stats.fisher_exact(table, alternative="greater").pvalue)
        worse = p < self.alpha and excess > self.tolerance
        detail = f"{c_err}/{c_all} canary vs {s_err}/{s_all} stable, Fisher p={p:.3g}"
        verdict = Verdict.FAIL if worse else Verdict.PASS
        return GateResult("error_rate", verdict, excess, self.tolerance, detail)


@dataclass(frozen=True)
class DriftGates:
    """Defaults from practice: a mean top-1 confidence shift over 0.08 or a relative
    entropy change over 15% pauses; a mean KL over ``max_kl`` or an agreement under
    ``min_agreement`` fails (a canary that answers differently).

    Agreement is a share of compared positions, and every pair that diverges adds one
    disagreement, so a window of short answers has few positions and a noisy share: it
    fails only when its 95% Wilson interval lies wholly under ``min_agreement``, and a
    share under it whose interval still reaches it waits for more positions."""

    max_confidence_shift: float = 0.08
    max_entropy_change: float = 0.15
    max_kl: float = 0.1
    min_agreement: float = 0.8
    min_pairs: int = 50

    def judge(self, drift: DriftSummary) -> list[GateResult]:
        if drift.pairs < self.min_pairs:
            detail = f"{drift.pairs} of {self.min_pairs} mirrored pairs"
            return [GateResult("drift", Verdict.WAIT, None, self.min_pairs, detail)]
        return [
            _bound("kl", drift.kl, self.max_kl, Verdict.FAIL),
            self._agreement(drift),
            _bound(
                "confidence_shift", drift.confidence_shift, self.max_confidence_shift, Verdict.PAUSE
            ),
            _bound(
                "entropy_change", abs(drift.entropy_change), self.max_entropy_change, Verdict.PAUSE
            ),
        ]

    def _agreement(self, drift: DriftSummary) -> GateResult:
        judged = _bound("agreement", drift.agreement, self.min_agreement, Verdict.FAIL, below=True)
        if judged.verdict is Verdict.PASS:
            return judged
        agreeing = round(drift.agreement * drift.positions)
        interval = stats.binomtest(agreeing, drift.positions).proportion_ci(method="wilson")
        if interval.high < self.min_agreement:
            return judged
        detail = (
            f"{drift.agreement:.4g} over {drift.positions} positions, 95% interval up to "
            f"{interval.high:.3g}: more positions before a verdict"
        )
        return GateResult("agreement", Verdict.WAIT, drift.agreement, self.min_agreement, detail)


def _bound(
    gate: str, value: float, threshold: float, breach: Verdict, below: bool = False
) -> GateResult:
    breached = value < threshold if below else value > threshold
    side = "under" if below else "over"
    detail = f"{value:.4g} {side} {threshold:g}" if breached else f"{value:.4g}"
    return GateResult(gate, breach if breached else Verdict.PASS, value, threshold, detail)


def _too_few(
    name: str, canary: Sequence[float], stable: Sequence[float], needed: int, tolerance: float
) -> GateResult | None:
    if min(len(canary), len(stable)) >= needed:
        return None
    detail = f"{len(canary)} canary and {len(stable)} stable samples of {needed} each"
    return GateResult(f"{name}_p99", Verdict.WAIT, None, 1 + tolerance, detail)


def overall(results: Sequence[GateResult]) -> Verdict:
    """The step's verdict: any failure fails it; else any pause pauses; else any gate
    still waiting makes it wait; else it passes."""
    verdicts = {r.verdict for r in results}
    for verdict in (Verdict.FAIL, Verdict.PAUSE, Verdict.WAIT):
        if verdict in verdicts:
            return verdict
    return Verdict.PASS

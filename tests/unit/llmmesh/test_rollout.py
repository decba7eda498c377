"""The rollout controller on fakes: steps written through the routing store, each step
judged on what was observed since it began; promotion, rollback within the interval
that saw a failure, a pause for review or for samples, and the status document."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY

from llmmesh.analysis.drift import DriftWindow
from llmmesh.analysis.gates import DriftGates, ErrorGate, LatencyGate
from llmmesh.canary import CanaryError
from llmmesh.rollout import (
    FileStatus,
    Outcome,
    Rollout,
    RolloutSettings,
    file_lock,
    merge,
    status_lines,
)

SETTINGS = RolloutSettings(
    model="m",
    steps=(10, 50, 100),
    interval_s=30,
    max_wait=3,
    drift=DriftGates(min_pairs=2),
    ttft=LatencyGate("ttft", min_samples=5),
    tpot=LatencyGate("tpot", min_samples=5),
    errors=ErrorGate(min_samples=5),
)


class Routing:
    where = "memory"

    def __init__(self) -> None:
        self.splits: list[dict[str, float]] = []

    def read(self) -> dict[str, Any]:
        return {"split": self.splits[-1] if self.splits else {}}

    def update(self, split: Mapping[str, float]) -> dict[str, Any]:
        self.splits.append(dict(split))
        return self.read()


def snapshot(
    ttft: float = 0.1, errors: int = 0, drift: DriftWindow | None = None, n: int = 10
) -> dict[str, Any]:
    window = drift or DriftWindow(pairs=5, positions=20, agreeing=20, kl=0.01)
    stable = {"ttft_s": [0.1] * n, "tpot_s": [0.02] * n, "attempts": n, "errors": 0}
    canary = {"ttft_s": [ttft] * n, "tpot_s": [0.02] * n, "attempts": n, "errors": errors}
    subsets = {"stable": stable, "canary": canary}
    return {"models": {"m": {"subsets": subsets, "drift": {"canary": asdict(window)}}}}


class Observations:
    def __init__(self, *snapshots: dict[str, Any]) -> None:
        self._snapshots = list(snapshots)
        self.asked: list[float] = []

    def since(self, started: float) -> dict[str, Any]:
        self.asked.append(started)
        return self._snapshots.pop(0) if len(self._snapshots) > 1 else self._snapshots[0]


def rollout(observations: Observations, tmp_path: Path) -> tuple[Rollout, Routing]:
    routing = Routing()
    clock = iter(range(1000, 10_000, 30))
    run = Rollout(
        SETTINGS,
        routing,
        observations,
        FileStatus(tmp_path / "rollout.json"),
        clock=lambda: float(next(clock)),
        sleep=lambda _: None,
    )
    return run, routing


def test_a_good_canary_is_promoted_step_by_step(tmp_path: Path) -> None:
    observations = Observations(snapshot())
    run, routing = rollout(observations, tmp_path)
    assert run.run() is Outcome.PROMOTED
    assert [s["canary"] for s in routing.splits] == [10, 50, 100]
    assert all(s["stable"] == 100 - s["canary"] for s in routing.splits)
    assert len(observations.asked) == 2  # each step judged since it began; 100% is promotion
    assert observations.asked[0] < observations.asked[1]
    status = FileStatus(tmp_path / "rollout.json").read()
    assert status is not None and status["state"] == "promoted"


def test_a_failed_hard_gate_rolls_back_in_the_interval_that_saw_it(tmp_path: Path) -> None:
    waiting = snapshot(n=2)  # too few samples: the first interval waits
    slow = snapshot(ttft=0.5)
    run, routing = rollout(Observations(waiting, slow), tmp_path)
    assert run.run() is Outcome.ROLLED_BACK
    assert [s["canary"] for s in routing.splits] == [10, 0]
    status = FileStatus(tmp_path / "rollout.json").read()
    assert status is not None and status["state"] == "rolled_back" and status["weight"] == 0
    assert "ttft_p99" in status["why"]
    assert [h["state"] for h in status["history"]] == ["running", "waiting", "rolled_back"]
    lines = status_lines(status)
    assert "rolled_back" in lines[0] and any("ttft_p99" in line for line in lines)
    # The same as metrics, for dashboards and alerts.
    labels = {"model": "m", "canary": "canary"}
    assert REGISTRY.get_sample_value("llm_canary_rollout_weight", labels) == 0
    gate = {**labels, "gate": "ttft_p99"}
    assert REGISTRY.get_sample_value("llm_canary_gate_verdict", {**gate, "verdict": "fail"}) == 1
    assert REGISTRY.get_sample_value("llm_canary_gate_verdict", {**gate, "verdict": "pass"}) == 0
    assert REGISTRY.get_sample_value("llm_canary_gate_value", gate) == pytest.approx(5.0)


def test_errors_and_drift_fail_too(tmp_path: Path) -> None:
    run, routing = rollout(Observations(snapshot(errors=6)), tmp_path)
    assert run.run() is Outcome.ROLLED_BACK and routing.splits[-1]["canary"] == 0
    other = DriftWindow(pairs=5, positions=20, agreeing=5, kl=20 * 0.5)
    run, routing = rollout(Observations(snapshot(drift=other)), tmp_path)
    assert run.run() is Outcome.ROLLED_BACK
    status = FileStatus(tmp_path / "rollout.json").read()
    assert status is not None and "kl" in status["why"] and "agreement" in status["why"]


def test_a_soft_gate_or_missing_samples_pause_and_hold_the_weight(tmp_path: Path) -> None:
    unsure = DriftWindow(pairs=5, positions=20, agreeing=20, shift=20 * 0.2, kl=0.01)
    run, routing = rollout(Observations(snapshot(drift=unsure)), tmp_path)
    assert run.run() is Outcome.PAUSED and routing.splits == [{"canary": 10, "stable": 90}]
    run, routing = rollout(Observations(snapshot(n=1)), tmp_path)
    assert run.run() is Outcome.PAUSED and routing.splits[-1]["canary"] == 10
    status = FileStatus(tmp_path / "rollout.json").read()
    assert status is not None and status["why"].startswith("not enough samples")


def test_routers_add_up() -> None:
    one, two = snapshot(n=3), snapshot(n=4)
    merged = merge([one, two])["models"]["m"]
    assert len(merged["subsets"]["canary"]["ttft_s"]) == 7
    assert merged["subsets"]["stable"]["attempts"] == 7
    assert merged["drift"]["canary"]["pairs"] == 10


def test_settings_and_the_lock_refuse_what_cannot_work(tmp_path: Path) -> None:
    with pytest.raises(CanaryError, match="increasing"):
        RolloutSettings(model="m", steps=(50, 10))
    with pytest.raises(CanaryError, match="above 0"):
        RolloutSettings(model="m", steps=(0, 100))
    lock = tmp_path / "rollout.lock"
    with file_lock(lock), pytest.raises(CanaryError, match="another rollout"), file_lock(lock):
        pass

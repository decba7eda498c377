"""``llm-mesh canary rollout``: the canary's weight raised step by step, each step judged
on what the routers observed since it began, and rolled back by itself.

Each step writes the split through the path ``canary set`` uses (the routing file, or
Consul KV with check-and-set), then, every interval, reads the routers' observations
(``GET /internal/canary?since=<step start>``, summed over every router given) and judges
them (llmmesh/analysis/gates.py): the canary's TTFT, TPOT and error rate against stable's
in the same window, and the drift of the mirrored pairs. Passed: the next step. A hard gate
failed: the canary's weight goes to 0 at once (within the interval that saw it) and the
reason is recorded. A soft gate breached, or samples still short after ``max_wait``
intervals: the weight is held and the rollout stops, paused, saying what it waits for.
The last step at 100% is the promotion. Every verdict goes to a status document (beside
the routing file, or Consul KV) that ``canary status`` shows; one controller at a time
holds the lock beside it.
"""

from __future__ import annotations

import contextlib
import enum
import fcntl
import json
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Annotated, Any, Protocol

import yaml
from prometheus_client import Counter, Gauge
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from llmmesh.analysis.drift import DriftWindow
from llmmesh.analysis.gates import (
    DriftGates,
    ErrorGate,
    GateResult,
    LatencyGate,
    Verdict,
    overall,
)
from llmmesh.canary import CanaryError, RoutingStore
from llmmesh.rollout_status import FileStatus, status_lines
from llmmesh.runtime.internal_auth import INTERNAL_TOKEN

__all__ = ["FileStatus", "Outcome", "Rollout", "RolloutDocument", "RolloutSettings", "status_lines"]


_ROLLOUT = ["model", "canary"]
WEIGHT = Gauge("llm_canary_rollout_weight", "The canary's weight the rollout set, %", _ROLLOUT)
STEP = Gauge("llm_canary_rollout_step", "The rollout's step (1 is the first)", _ROLLOUT)
GATE_VALUE = Gauge("llm_canary_gate_value", "Each gate's last measured value", [*_ROLLOUT, "gate"])
GATE_THRESHOLD = Gauge("llm_canary_gate_threshold", "Each gate's threshold", [*_ROLLOUT, "gate"])
GATE_VERDICT = Gauge(
    "llm_canary_gate_verdict", "1 for each gate's last verdict", [*_ROLLOUT, "gate", "verdict"]
)
VERDICTS = Counter(
    "llm_canary_rollout_verdicts_total", "The rollout's judgements by state", [*_ROLLOUT, "state"]
)


def _export(settings: RolloutSettings, step: int, weight: float, state: str,
            results: Sequence[GateResult]) -> None:  # fmt: skip
    """The rollout's state as metrics (a controller serves them on /metrics)."""
    labels = (settings.model, settings.canary)
    WEIGHT.labels(*labels).set(weight)
    STEP.labels(*labels).set(step)
    VERDICTS.labels(*labels, state).inc()
    for result in results:
        gate = (*labels, result.gate)
        if result.value is not None:
            GATE_VALUE.labels(*gate).set(result.value)
        GATE_THRESHOLD.labels(*gate).set(result.threshold)
        for verdict in Verdict:
            GATE_VERDICT.labels(*gate, verdict.value).set(int(verdict is result.verdict))


class Outcome(enum.Enum):
    PROMOTED = "promoted"
    ROLLED_BACK = "rolled_back"
    PAUSED = "paused"


@dataclass(frozen=True)
class RolloutSettings:
    model: str
    steps: tuple[float, ...] = (1, 5, 25, 50, 100)
    interval_s: float = 60.0
    canary: str = "canary"
    stable: str = "stable"
    max_wait: int = 10  # intervals a step may wait for enough samples before pausing
    drift: DriftGates = field(default_factory=DriftGates)
    ttft: LatencyGate = field(default_factory=lambda: LatencyGate("ttft"))
    tpot: LatencyGate = field(default_factory=lambda: LatencyGate("tpot"))
    errors: ErrorGate = field(default_factory=ErrorGate)

    def __post_init__(self) -> None:
        if not self.steps or any(not 0 < s <= 100 for s in self.steps):
            raise CanaryError("--steps: percentages above 0, at most 100")
        if list(self.steps) != sorted(self.steps):
            raise CanaryError("--steps: in increasing order")
        if self.interval_s <= 0 or self.max_wait < 1:
            raise CanaryError("--interval above 0, --max-wait at least 1")


def _seconds(value: object) -> object:
    """``60``, ``"60s"``, ``"2m"``, ``"1h"``: seconds."""
    if not isinstance(value, str):
        return value
    scale = {"s": 1.0, "m": 60.0, "h": 3600.0}.get(value[-1:], 0.0)
    try:
        return float(value[:-1]) * scale if scale else float(value)
    except ValueError:
        raise ValueError("seconds, or a duration such as 30s, 2m, 1h") from None


class RolloutDocument(BaseModel):
    """A rollout as written down: the command line's flags, or the document in Consul KV
    (``llm-mesh/rollout``) that an always-on controller runs. Every default is here."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(min_length=1)
    steps: tuple[float, ...] = (1.0, 5.0, 25.0, 50.0, 100.0)
    interval: Annotated[float, BeforeValidator(_seconds), Field(gt=0)] = 60.0
    canary: str = "canary"
    stable: str = "stable"
    routers: tuple[str, ...] = ()  # the routers' HTTP addresses, whose observations count
    max_wait: int = Field(default=10, ge=1)
    min_samples: int = Field(default=50, ge=1)
    min_pairs: int = Field(default=50, ge=1)
    max_kl: float = Field(default=0.1, ge=0)
    min_agreement: float = Field(default=0.8, ge=0, le=1)
    max_confidence_shift: float = Field(default=0.08, ge=0)
    max_entropy_change: float = Field(default=0.15, ge=0)
    latency_tolerance: float = Field(default=0.2, ge=0)
    error_tolerance: float = Field(default=0.02, ge=0)

    @classmethod
    def parse(cls, text: str | bytes, where: str) -> RolloutDocument:
        """The document in ``text`` (YAML or JSON), or CanaryError naming the field."""
        try:
            return cls.model_validate(yaml.safe_load(text) or {})
        except yaml.YAMLError as err:
            raise CanaryError(f"{where} is not YAML or JSON: {err}") from None
        except ValidationError as err:
            first = err.errors()[0]
            field_name = ".".join(str(p) for p in first["loc"]) or "document"
            raise CanaryError(f"{where}: {field_name}: {first['msg']}") from None

    def settings(self) -> RolloutSettings:
        tolerance, samples = self.latency_tolerance, self.min_samples
        return RolloutSettings(
            model=self.model,
            steps=self.steps,
            interval_s=self.interval,
            canary=self.canary,
            stable=self.stable,
            max_wait=self.max_wait,
            drift=DriftGates(
                self.max_confidence_shift,
                self.max_entropy_change,
                self.max_kl,
                self.min_agreement,
                self.min_pairs,
            ),
            ttft=LatencyGate("ttft", tolerance=tolerance, min_samples=samples),
            tpot=LatencyGate("tpot", tolerance=tolerance, min_samples=samples),
            errors=ErrorGate(self.error_tolerance, min_samples=samples),
        )


class Observations(Protocol):
    def since(self, started: float) -> dict[str, Any]:
        """The routers' observations since ``started`` (Unix seconds), summed."""
        ...


def merge(snapshots: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Several routers' snapshots as one: samples joined, counts and drift sums added."""
    models: dict[str, Any] = {}
    for snapshot in snapshots:
        for model, seen in snapshot.get("models", {}).items():
            into = models.setdefault(model, {"subsets": {}, "drift": {}})
            for subset, traffic in seen.get("subsets", {}).items():
                total = into["subsets"].setdefault(
                    subset, {"ttft_s": [], "tpot_s": [], "attempts": 0, "errors": 0}
                )
                total["ttft_s"] += traffic["ttft_s"]
                total["tpot_s"] += traffic["tpot_s"]
                total["attempts"] += traffic["attempts"]
                total["errors"] += traffic["errors"]
            for subset, sums in seen.get("drift", {}).items():
                before = into["drift"].get(subset) or asdict(DriftWindow())
                into["drift"][subset] = {k: before[k] + sums[k] for k in before}
    return {"models": models}


class RouterObservations:
    """The routers' ``/internal/canary``, with the mesh's token."""

    def __init__(self, urls: Sequence[str], token: str) -> None:
        self._urls = list(urls)
        self._token = token

    def since(self, started: float) -> dict[str, Any]:
        snapshots = []
        for url in self._urls:
            request = urllib.request.Request(
                f"{url}?since={started}", headers={INTERNAL_TOKEN: self._token}
            )
            with urllib.request.urlopen(request, timeout=10) as reply:
                snapshots.append(json.loads(reply.read()))
        return merge(snapshots)


def judge(settings: RolloutSettings, observed: dict[str, Any]) -> list[GateResult]:
    seen = observed.get("models", {}).get(settings.model, {})
    subsets = seen.get("subsets", {})
    empty = {"ttft_s": [], "tpot_s": [], "attempts": 0, "errors": 0}
    canary, stable = subsets.get(settings.canary, empty), subsets.get(settings.stable, empty)
    window = DriftWindow(**seen.get("drift", {}).get(settings.canary, {}))
    return [
        settings.errors.judge(
            (canary["errors"], canary["attempts"]), (stable["errors"], stable["attempts"])
        ),
        settings.ttft.judge(canary["ttft_s"], stable["ttft_s"]),
        settings.tpot.judge(canary["tpot_s"], stable["tpot_s"]),
        *settings.drift.judge(window.summary()),
    ]


class StatusSink(Protocol):
    def write(self, status: dict[str, Any]) -> None: ...

    def read(self) -> dict[str, Any] | None: ...


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """One controller at a time: an exclusive lock on ``path``, or CanaryError."""
    with path.open("a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise CanaryError(f"another rollout holds {path}") from None
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _gate(result: GateResult) -> dict[str, Any]:
    return {**asdict(result), "verdict": result.verdict.value}


@dataclass
class Rollout:
    settings: RolloutSettings
    routing: RoutingStore
    observations: Observations
    status: StatusSink
    clock: Callable[[], float] = time.time
    sleep: Callable[[float], None] = time.sleep  # the interval between judgements
    history: list[dict[str, Any]] = field(default_factory=list)
    # Whether this controller still holds the lock: checked before every write, so one
    # that lost it (its Consul session expired) stops instead of racing its successor.
    holds_lock: Callable[[], bool] = lambda: True

    def run(self, first_step: int = 0) -> Outcome:
        """Runs the steps from ``first_step`` (0: the first; a controller taking over a
        rollout another one left resumes at that one's step)."""
        for index, weight in enumerate(self.settings.steps):
            if index < first_step:
                continue
            self._weigh(weight)
            started = self.clock()
            self._record(index, weight, "running", f"step {index + 1}: canary at {weight:g}%")
            if weight >= 100:
                self._record(index, weight, Outcome.PROMOTED.value, "promoted to 100%")
                return Outcome.PROMOTED
            outcome = self._judge_step(index, weight, started)
            if outcome is not None:
                return outcome
        last = self.settings.steps[-1]
        self._record(len(self.settings.steps) - 1, last, "done", f"steps done at {last:g}%")
        return Outcome.PROMOTED

    def _judge_step(self, index: int, weight: float, started: float) -> Outcome | None:
        """None when the step passed; else how the rollout ended."""
        waiting = ""
        for _ in range(self.settings.max_wait):
            self.sleep(self.settings.interval_s)
            results = judge(self.settings, self.observations.since(started))
            verdict = overall(results)
            if verdict is Verdict.PASS:
                self._record(index, weight, "passed", "every gate passed", results)
                return None
            if verdict is Verdict.FAIL:
                self._weigh(0)
                why = "; ".join(f"{r.gate}: {r.detail}" for r in results if r.verdict is verdict)
                self._record(index, 0, Outcome.ROLLED_BACK.value, why, results)
                return Outcome.ROLLED_BACK
            if verdict is Verdict.PAUSE:
                why = "; ".join(f"{r.gate}: {r.detail}" for r in results if r.verdict is verdict)
                self._record(index, weight, Outcome.PAUSED.value, f"review: {why}", results)
                return Outcome.PAUSED
            waiting = "; ".join(r.detail for r in results if r.verdict is Verdict.WAIT)
            self._record(index, weight, "waiting", waiting, results)
        self._record(index, weight, Outcome.PAUSED.value, "not enough samples: " + waiting)
        return Outcome.PAUSED

    def _check_lock(self) -> None:
        if not self.holds_lock():
            raise CanaryError("the rollout's lock was lost: another controller may run it")

    def _weigh(self, weight: float) -> None:
        self._check_lock()
        self.routing.update({self.settings.canary: weight, self.settings.stable: 100 - weight})

    def _record(
        self,
        index: int,
        weight: float,
        state: str,
        why: str,
        results: Sequence[GateResult] = (),
    ) -> None:
        self._check_lock()
        entry = {"time": self.clock(), "step": index + 1, "weight": weight, "state": state}
        _export(self.settings, index + 1, weight, state, results)
        # Each judgement keeps what it measured (the promotion's own entry judges nothing).
        measured = {r.gate: r.value for r in results if r.value is not None}
        self.history.append({**entry, "why": why} | ({"measured": measured} if measured else {}))
        settings = {
            f.name: getattr(self.settings, f.name)
            for f in fields(self.settings)
            if f.name in ("model", "steps", "interval_s", "canary", "stable")
        }
        self.status.write(
            {
                **entry,
                "why": why,
                "settings": settings,
                "gates": [_gate(r) for r in results],
                "history": self.history,
            }
        )

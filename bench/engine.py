"""The reference engine alone, in this process (no Triton, no mesh): where a batch's time
goes, to read the batching section's ratio against.

A closed loop of equal requests at each concurrency, the same shape as the batching
section's (prompts of ``input_len`` tokens, ``output_len`` tokens each, ignore_eos): every
engine step is timed and classed as prefill (it computed prompt tokens) or decode, and
every request's TTFT and TPOT are taken from its sink, as a client would see them.

Any model of the repository builds here as Triton's model.py builds it (its config.pbtxt
parameters through ``refengine.families``), in a fresh interpreter whose BLAS is the one
Triton's engine gets (``run_in_child``).
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from bench.workload import BenchRequest, WorkloadSpec, make_requests, new_salt
from llmmesh.launcher.blas import cpu_flags, openblas_environment
from llmmesh.launcher.stack import REPO_MODELS

MODEL_CODE = REPO_MODELS / "llm" / "1"


@dataclass(frozen=True)
class EngineRun:
    concurrency: int
    requests: int
    output_tokens: int
    seconds: float
    prefill_steps_s: list[float]
    decode_steps_s: list[float]
    ttft_s: list[float] = field(default_factory=list)  # per request: submitted -> first text
    tpot_s: list[float] = field(default_factory=list)  # per request: (last - first) / (n - 1)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


class _Sink:
    """Times a request's output; tells the loop when it finished."""

    def __init__(self, done: list[_Sink], tokens: int) -> None:
        self._done = done
        self._tokens = tokens
        self.error = ""
        self.submitted = time.perf_counter()
        self.first = 0.0
        self.last = 0.0

    def is_cancelled(self) -> bool:
        return False

    def emit(self, text: str, num_tokens: int, details: object = None) -> None:
        self.last = time.perf_counter()
        self.first = self.first or self.last

    def finish(self, text: str, num_tokens: int, reason: str, details: object = None) -> None:
        self.emit(text, num_tokens)
        self._done.append(self)

    @property
    def ttft(self) -> float:
        return self.first - self.submitted

    @property
    def tpot(self) -> float:
        return (self.last - self.first) / max(1, self._tokens - 1)

    def fail(self, message: str) -> None:
        # Raising here would only be logged by the engine, and the loop would wait forever.
        self.error = message
        self._done.append(self)


def _engine_modules() -> Any:
    """The engine package as Triton loads it (from the model's directory)."""
    if str(MODEL_CODE) not in sys.path:
        sys.path.insert(0, str(MODEL_CODE))
    import refengine

    return refengine


def model_parameters(model: str = "llm") -> dict[str, str]:
    """A model's config.pbtxt parameters (key -> string value)."""
    pattern = r'key:\s*"([^"]+)"\s*value:\s*\{\s*string_value:\s*"([^"]*)"'
    return dict(re.findall(pattern, (REPO_MODELS / model / "config.pbtxt").read_text()))


def run_in_child(module: str, job: dict[str, Any]) -> Any:
    """``python -m module`` with ``job`` as JSON on stdin, in a fresh interpreter whose
    OpenBLAS loads with the kernels Triton's engine gets (this process's numpy is loaded
    already); returns what it printed, as JSON."""
    done = subprocess.run(
        [sys.executable, "-m", module],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        env=openblas_environment(os.environ, cpu_flags()),
        cwd=Path(__file__).resolve().parent.parent,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the engine run failed:\n{done.stderr}")
    return json.loads(done.stdout)


def run_engine_as_served(
    spec: WorkloadSpec,
    levels: list[int],
    model: str = "llm",
    sampling: dict[str, Any] | None = None,
) -> list[EngineRun]:
    """``run_engine`` in a child (``run_in_child``)."""
    job = {"spec": asdict(spec), "levels": levels, "model": model, "sampling": sampling or {}}
    runs = run_in_child("bench.engine", job)
    return [EngineRun(**run) for run in runs]


@dataclass(frozen=True)
class BuiltEngine:
    """A model of the repository built as its config.pbtxt says, and the engine module."""

    engine: Any
    built: Any  # refengine.families.Built
    config: Any  # refengine.EngineConfig


def build_engine(model: str = "llm", overrides: dict[str, str] | None = None) -> BuiltEngine:
    """Call inside ``blas_limit(model)``: BLAS's threads decide the probed layouts.
    ``overrides``: parameters to take instead of config.pbtxt's."""
    params = {**model_parameters(model), **(overrides or {})}
    engine = _engine_modules()
    from refengine.families import build_model

    return BuiltEngine(
        engine,
        build_model(params),
        engine.EngineConfig.from_parameters(params),
    )


def blas_limit(model: str = "llm") -> Any:
    """The BLAS thread limit Triton's model.py sets for ``model`` (numpy's BLAS is loaded
    first, for the limit to find it)."""
    from threadpoolctl import threadpool_limits

    _engine_modules()
    threads = int(model_parameters(model).get("blas_threads", "1"))
    return threadpool_limits(limits=threads, user_api="blas")


def run_engine(
    spec: WorkloadSpec,
    levels: list[int],
    model: str = "llm",
    sampling: dict[str, Any] | None = None,
) -> list[EngineRun]:
    """One closed loop per concurrency level, on one engine built as config.pbtxt says."""
    with blas_limit(model):
        built = build_engine(model)
        return [
            closed_loop(built, make_requests(replace(spec, salt=new_salt())), level, sampling)
            for level in levels
        ]


def closed_loop(
    built: BuiltEngine,
    requests: Sequence[BenchRequest],
    level: int,
    sampling: dict[str, Any] | None = None,
) -> EngineRun:
    """``requests`` through a fresh engine (an empty cache), ``level`` at a time, each
    generating its ``max_tokens`` (ignore_eos); ``sampling``: more of the vLLM contract's
    sampling parameters for every request."""
    from refengine.contract import parse_sampling_parameters

    engine = built.engine
    core = engine.Engine(built.built.model, built.built.tokenizer, config=built.config)
    done: list[_Sink] = []
    finished_sinks: list[_Sink] = []
    pending = iter(requests)

    def submit() -> bool:
        request = next(pending, None)
        if request is None:
            return False
        doc = {**(sampling or {}), "max_tokens": request.max_tokens, "ignore_eos": True}
        params = parse_sampling_parameters(json.dumps(doc))
        sink = _Sink(done, request.max_tokens)
        core.submit(engine.GenerationRequest(prompt=request.prompt, sampling=params), sink)
        return True

    in_flight = sum(submit() for _ in range(level))
    prefill: list[float] = []
    decode: list[float] = []
    started = time.perf_counter()
    while in_flight:
        computed = core.stats.prefill_tokens
        step_started = time.perf_counter()
        core.step()
        (prefill if core.stats.prefill_tokens > computed else decode).append(
            time.perf_counter() - step_started
        )
        for _ in range(len(done)):
            finished = done.pop()
            if finished.error:
                raise RuntimeError(f"engine request failed: {finished.error}")
            finished_sinks.append(finished)
            in_flight += submit() - 1
    seconds = time.perf_counter() - started
    tokens = sum(r.max_tokens for r in requests)
    ttfts = [sink.ttft for sink in finished_sinks]
    tpots = [sink.tpot for sink in finished_sinks]
    return EngineRun(level, len(requests), tokens, seconds, prefill, decode, ttfts, tpots)


def engine_table(runs: list[EngineRun]) -> str:
    base = runs[0].tokens_per_s
    rows = [
        "| streams | output tok/s | relative | prefill (ms per request) | decode steps "
        "| decode step p50 (ms) | share of time in prefill steps |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for run in runs:
        prefill = sum(run.prefill_steps_s)
        rows.append(
            f"| {run.concurrency} | {run.tokens_per_s:.0f} | {run.tokens_per_s / base:.2f}x "
            f"| {prefill / run.requests * 1e3:.1f} | {len(run.decode_steps_s)} "
            f"| {statistics.median(run.decode_steps_s) * 1e3:.2f} "
            f"| {prefill / run.seconds:.0%} |"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    # run_engine_as_served's child: a job on stdin, the runs as JSON on stdout.
    job = json.load(sys.stdin)
    runs = run_engine(WorkloadSpec(**job["spec"]), job["levels"], job["model"], job["sampling"])
    json.dump([asdict(run) for run in runs], sys.stdout)

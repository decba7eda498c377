"""The reference engine alone, in this process (no Triton, no mesh): where a batch's time
goes, to read the batching section's ratio against.

A closed loop of equal requests at each concurrency, the same shape as the batching
section's (prompts of ``input_len`` tokens, ``output_len`` tokens each, ignore_eos): every
engine step is timed and classed as prefill (it computed prompt tokens) or decode.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from bench.workload import WorkloadSpec, make_requests, new_salt
from llmmesh.launcher.blas import cpu_flags, openblas_environment
from llmmesh.launcher.stack import REPO_MODELS

MODEL_CODE = REPO_MODELS / "llm" / "1"
CONFIG = REPO_MODELS / "llm" / "config.pbtxt"


@dataclass(frozen=True)
class EngineRun:
    concurrency: int
    requests: int
    output_tokens: int
    seconds: float
    prefill_steps_s: list[float]
    decode_steps_s: list[float]

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


class _Sink:
    """Counts a request's output; tells the loop when it finished."""

    def __init__(self, done: list[_Sink]) -> None:
        self._done = done
        self.error = ""

    def is_cancelled(self) -> bool:
        return False

    def emit(self, text: str, num_tokens: int, details: object = None) -> None:
        pass

    def finish(self, text: str, num_tokens: int, reason: str, details: object = None) -> None:
        self._done.append(self)

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


def model_parameters() -> dict[str, str]:
    """The model's config.pbtxt parameters (key -> string value)."""
    pattern = r'key:\s*"([^"]+)"\s*value:\s*\{\s*string_value:\s*"([^"]*)"'
    return dict(re.findall(pattern, CONFIG.read_text()))


def run_engine_as_served(spec: WorkloadSpec, levels: list[int]) -> list[EngineRun]:
    """``run_engine`` in a fresh interpreter whose OpenBLAS loads with the kernels
    Triton's engine gets (this process's numpy is loaded already)."""
    job = json.dumps({"spec": asdict(spec), "levels": levels})
    done = subprocess.run(
        [sys.executable, "-m", "bench.engine"],
        input=job,
        capture_output=True,
        text=True,
        env=openblas_environment(os.environ, cpu_flags()),
        cwd=Path(__file__).resolve().parent.parent,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the engine run failed:\n{done.stderr}")
    return [EngineRun(**run) for run in json.loads(done.stdout)]


def run_engine(spec: WorkloadSpec, levels: list[int]) -> list[EngineRun]:
    """One closed loop per concurrency level, on one engine built as config.pbtxt says."""
    from threadpoolctl import threadpool_limits

    params = model_parameters()
    engine = _engine_modules()  # loads numpy's BLAS, for the limit to find it
    with threadpool_limits(limits=int(params.get("blas_threads", "1")), user_api="blas"):
        model = engine.Transformer(
            engine.ModelShape.from_parameters(params), seed=int(params.get("weight_seed", "0"))
        )
        config = engine.EngineConfig.from_parameters(params)
        return [_closed_loop(engine, model, config, spec, level) for level in levels]


def _closed_loop(engine: Any, model: Any, config: Any, spec: WorkloadSpec, level: int) -> EngineRun:
    requests = make_requests(replace(spec, salt=new_salt()))
    core = engine.Engine(model, config=config)
    done: list[_Sink] = []
    pending = iter(requests)

    def submit() -> bool:
        request = next(pending, None)
        if request is None:
            return False
        sampling = engine.SamplingParams(max_tokens=request.max_tokens, ignore_eos=True)
        core.submit(engine.GenerationRequest(prompt=request.prompt, sampling=sampling), _Sink(done))
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
            in_flight += submit() - 1
    seconds = time.perf_counter() - started
    tokens = sum(r.max_tokens for r in requests)
    return EngineRun(level, len(requests), tokens, seconds, prefill, decode)


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
    runs = run_engine(WorkloadSpec(**job["spec"]), job["levels"])
    json.dump([asdict(run) for run in runs], sys.stdout)

"""A real model's decode speed against this machine's memory-bandwidth bound, on the engine
alone and through Triton (``llm-mesh bench --scenario decode``).

One decode step of one stream reads every weight matrix once, so it cannot be faster than
reading those bytes: the bound is measured in the same run as the fastest plain numpy read
of the very matrices the step multiplies by (``np.max`` over each). A round measures the
bound, then one stream and ``streams`` streams of chat prompts of ``prompt_tokens`` tokens
in the model's own tokens, rendered with its chat template as the router renders a
one-message chat; rounds are pooled and their spread reported.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench.engine import (
    EngineRun,
    blas_limit,
    build_engine,
    closed_loop,
    model_parameters,
    run_in_child,
)
from bench.loadgen import LoadShape, run_load
from bench.targets import TritonTarget
from bench.workload import BenchRequest, new_salt

PROMPT_TOKENS = 64
_FILLER = (
    "Please answer in a few plain sentences, for a reader who knows little about the "
    "subject, and say what is known for certain and what is still debated among experts "
    "who study it closely today"
)
TOPICS = (
    "how tides work",
    "why the sky is blue",
    "how vaccines train the immune system",
    "what a black hole is",
    "how bread rises",
    "why leaves change colour in autumn",
    "how a refrigerator keeps food cold",
    "what causes earthquakes",
    "how bees make honey",
    "why the moon has phases",
    "how a rainbow forms",
    "what photosynthesis does",
    "how batteries store energy",
    "why ice floats on water",
    "how birds migrate",
    "what makes thunder",
)


def chat_prompts(built: Any, count: int, tokens: int, salt: str = "") -> list[str]:
    """``count`` distinct one-message chats of ``tokens`` tokens each (in the model's
    tokenizer), written as the router writes them: the model's chat template, or the
    mesh's layout for a model without one. ``salt`` starts each message (a round's own,
    so that an engine's prefix cache holds nothing of an earlier round's)."""
    from llmmesh.types import Role, Turn
    from services.router.chat_layout import MESH_LAYOUT, TemplateLayout

    card = built.card
    layout = (
        TemplateLayout(card.chat_template, card.bos_token, card.eos_token)
        if card.chat_template
        else MESH_LAYOUT
    )
    prompts = []
    for index in range(count):
        words = f"{salt}Explain {TOPICS[index % len(TOPICS)]}.".split()
        filler = iter(_FILLER.split() * 4)
        while True:
            text = layout.render([Turn(Role.USER, " ".join(words))], generation_prompt=True)
            if len(built.tokenizer.encode(text)) >= tokens:
                break
            words.append(next(filler))
        prompts.append(text)
    return prompts


def read_seconds(arrays: Sequence[np.ndarray[Any, Any]], repeats: int = 3) -> float:
    """The fastest of ``repeats`` plain reads of every array (their bytes do not fit in any
    cache, so each read comes from memory)."""
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        for array in arrays:
            np.max(array)
        best = min(best, time.perf_counter() - started)
    return best


def step_arrays(model: Any) -> list[np.ndarray[Any, Any]]:
    """The float32 matrices one step multiplies by (a quantized model's, expanded)."""
    return [w.expand() for w in model.matrices]


@dataclass
class Round:
    path: str  # what was measured: the engine alone or through Triton, and its products
    bound_s: float  # one step's read of the weights
    streams: dict[int, dict[str, list[float]]] = field(default_factory=dict)
    # streams[n] = {"ttft": [...], "tpot": [...], "tokens_per_s": [x]}


def engine_rounds(job: dict[str, Any]) -> dict[str, Any]:
    """The child's part: the model built as served, then ``rounds`` x (bound, each level)."""
    model = job["model"]
    with blas_limit(model):
        built = build_engine(model, job.get("overrides"))
        arrays = step_arrays(built.built.model)
        rounds = []
        for _ in range(job["rounds"]):
            salt = new_salt()
            prompts = chat_prompts(built.built, max(job["levels"]), job["prompt_tokens"], salt)
            measured = Round(job.get("path", "engine"), read_seconds(arrays))
            for level in job["levels"]:
                requests = [BenchRequest(p, job["output_len"]) for p in prompts[:level]]
                measured.streams[level] = _summary(closed_loop(built, requests, level))
            rounds.append(asdict(measured))
    weight_bytes = int(sum(a.nbytes for a in arrays))
    return {"rounds": rounds, "weight_bytes": weight_bytes}


def _summary(run: EngineRun) -> dict[str, list[float]]:
    return {"ttft": run.ttft_s, "tpot": run.tpot_s, "tokens_per_s": [run.tokens_per_s]}


async def _triton_round(
    url: str, model: str, built: Any, job: dict[str, Any], bound_s: float
) -> Round:
    measured = Round(job["triton_path"], bound_s)
    target = TritonTarget(url, model)
    try:
        for level in job["levels"]:
            prompts = chat_prompts(built, level, job["prompt_tokens"], new_salt())
            requests = [BenchRequest(p, job["output_len"]) for p in prompts]
            shape = LoadShape(concurrency=level)
            result = await run_load(target, requests, shape, warmup=1, progress=False)
            records = [r for r in result.records if r.ok]
            if len(records) < len(requests):
                failed = next(r.error for r in result.records if not r.ok)
                raise RuntimeError(f"Triton request failed: {failed}")
            seconds = max(r.finished_at for r in records) - min(r.sent_at for r in records)
            measured.streams[level] = {
                "ttft": [r.ttft for r in records],
                "tpot": [t for r in records if (t := r.tpot) is not None],
                "tokens_per_s": [sum(r.output_tokens for r in records) / seconds],
            }
    finally:
        await target.close()
    return measured


@dataclass(frozen=True)
class DecodeResult:
    model: str
    weight_bytes: int
    prompt_tokens: int
    output_len: int
    rounds: list[Round]

    def table(self) -> str:
        rows = [
            f"Bound: one step reads {self.weight_bytes / 1e6:.0f} MB of weights "
            f"(float32); per round, the fastest plain numpy read of them.",
            "",
            "| path | streams | output tok/s | x one stream | TPOT p50 (ms) | bound (ms) "
            "| share of the bound (1 stream) | TTFT p50 (ms) |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for path in dict.fromkeys(r.path for r in self.rounds):
            mine = [r for r in self.rounds if r.path == path]
            levels = sorted(mine[0].streams)
            for level in levels:
                rows.append(self._row(path, level, levels[0], mine))
        return "\n".join(rows)

    @staticmethod
    def _row(path: str, level: int, single: int, rounds: list[Round]) -> str:
        def pooled(key: str, n: int) -> list[float]:
            return [v for r in rounds for v in r.streams[n][key]]

        rates = [r.streams[level]["tokens_per_s"][0] for r in rounds]
        singles = [r.streams[single]["tokens_per_s"][0] for r in rounds]
        speedups = [a / b for a, b in zip(rates, singles, strict=True)]
        shares = [r.bound_s / statistics.median(r.streams[single]["tpot"]) for r in rounds]
        share = _spread(shares, percent=True) if level == single else ""
        return (
            f"| {path} | {level} | {_spread(rates)} | {_spread(speedups, suffix='x')} "
            f"| {statistics.median(pooled('tpot', level)) * 1e3:.1f} "
            f"| {statistics.median(r.bound_s for r in rounds) * 1e3:.1f} | {share} "
            f"| {statistics.median(pooled('ttft', level)) * 1e3:.0f} |"
        )


def _spread(values: list[float], percent: bool = False, suffix: str = "") -> str:
    """Median, and the range over rounds."""
    scale, unit = (100.0, "%") if percent else (1.0, suffix)
    middle, low, high = (scale * v for v in (statistics.median(values), min(values), max(values)))
    digits = 0 if percent or middle >= 100 else 1
    return f"{middle:.{digits}f}{unit} ({low:.{digits}f}-{high:.{digits}f})"


def run(
    workdir: Path,
    *,
    model: str = "smollm2",
    rounds: int = 3,
    levels: tuple[int, ...] = (1, 16),
    output_len: int = 128,
    prompt_tokens: int = PROMPT_TOKENS,
) -> DecodeResult:
    """The engine's rounds in a child, then Triton's on a Triton serving ``model`` alone."""
    job = {
        "model": model,
        "rounds": rounds,
        "levels": list(levels),
        "output_len": output_len,
        "prompt_tokens": prompt_tokens,
    }
    served, other = _modes(model)
    measured: list[Round] = []
    for mode, overrides in (served, other):
        print(f"the engine alone ({model}, {mode}) ...", file=sys.stderr)
        path = {"path": f"engine ({mode})", "overrides": overrides}
        engine = run_in_child("bench.decode", {**job, **path})
        for done in engine["rounds"]:
            done["streams"] = {int(k): v for k, v in done["streams"].items()}  # JSON's keys
            measured.append(Round(**done))
    print(f"Triton serving {model} ({served[0]}) ...", file=sys.stderr)
    built = _built_for_reading(model)
    arrays = step_arrays(built.model)
    job["triton_path"] = f"triton ({served[0]})"
    with serving(workdir, model) as url:
        for _ in range(rounds):
            bound = read_seconds(arrays)
            measured.append(asyncio.run(_triton_round(url, model, built, job, bound)))
    return DecodeResult(model, engine["weight_bytes"], prompt_tokens, output_len, measured)


Mode = tuple[str, dict[str, str]]


def _modes(model: str) -> tuple[Mode, Mode]:
    """The model's products as config.pbtxt serves them, and the other kind: batch-invariant
    ones (rowstable) or plain ones."""
    invariant = ("batch-invariant", {"batch_invariant": "true"})
    plain = ("plain products", {"batch_invariant": "false"})
    if model_parameters(model).get("batch_invariant", "true") == "true":
        return invariant, plain
    return plain, invariant


def _built_for_reading(model: str) -> Any:
    """The model built in this process, for its tokenizer and the bytes of its matrices
    only (plain products: no layouts to probe)."""
    from bench.engine import _engine_modules

    _engine_modules()
    from refengine.families import build_model

    return build_model({**model_parameters(model), "batch_invariant": "false"})


@contextlib.contextmanager
def serving(workdir: Path, model: str) -> Iterator[str]:
    """A Triton on free ports serving only ``model``; yields its gRPC address."""
    from llmmesh.launcher import StackPorts
    from llmmesh.launcher.stack import REPO_MODELS
    from llmmesh.launcher.triton import start_triton, wait_until_ready

    ports = StackPorts.free()
    triton_ports = (ports.triton_grpc, ports.triton_http, ports.triton_metrics)
    log = workdir / "triton.log"
    child = start_triton(workdir, REPO_MODELS, "127.0.0.1", triton_ports, log, models=[model])
    url = f"127.0.0.1:{ports.triton_grpc}"
    try:
        wait_until_ready(child, url, time.monotonic() + 600, models=[model])
        yield url
    finally:
        child.terminate(30)  # Triton waits up to 10 s for its models, then unloads them


def run_in_workdir(**kwargs: Any) -> DecodeResult:
    with tempfile.TemporaryDirectory(prefix="llm-mesh-bench-") as workdir:
        return run(Path(workdir), **kwargs)


if __name__ == "__main__":
    # run_in_child's child: a job on stdin, the engine's rounds as JSON on stdout.
    json.dump(engine_rounds(json.load(sys.stdin)), sys.stdout)

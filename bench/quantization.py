"""The quantized variants of a real model against its float32 one, in one run
(``llm-mesh bench --scenario quantization``).

Per variant, each in a fresh interpreter built as Triton serves it: the engine's resident
memory, and TTFT / TPOT at 1 and 16 streams of 64-token chat prompts. Then quality, as
llama.cpp's ``llama-perplexity --kl-divergence`` reports it, on two evaluation sets scored
teacher-forced by every variant:

- chat: the float32 variant's own greedy answers to 64 chat prompts (up to 48 tokens each),
  every answer token scored;
- text: the King James Version of Genesis (public domain; Debian's ``bible-kjv``), in
  chunks of 512 tokens whose second half is scored, as llama.cpp scores its chunks.

Per set: the mean and 99th percentile of the KL divergence of each next-token distribution
from float32's, how often both pick the same most likely token, and perplexity. The
float32 reference is the GGUF file's own 4-bit (Q4_1) weights expanded, not the original
16-bit model.
"""

from __future__ import annotations

import gc
import json
import re
import shutil
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.decode import PROMPT_TOKENS, TOPICS, chat_prompts
from bench.engine import (
    _engine_modules,
    blas_limit,
    build_engine,
    closed_loop,
    model_parameters,
    run_in_child,
)
from bench.workload import BenchRequest, new_salt

Logits = np.ndarray[Any, Any]
VARIANTS = ("smollm2", "smollm2-int8", "smollm2-q4")
ASKS = (
    "Explain {}.",
    "Write two sentences about {}.",
    "What is surprising about {}?",
    "Summarize {} for a child.",
)
ANSWER_TOKENS = 48
CHUNK_TOKENS = 512
TEXT_CHUNKS = 8
BIBLE_SPEC = "Genesis1:1-50:26"
# llama.cpp's published figures (tools/perplexity/README.md, LLaMA 3 8B against FP16 on
# Wikitext-2): mean KLD, same top token, PPL ratio.
LLAMA_CPP = (
    ("q8_0", 0.001355, 0.97674, 1.000425),
    ("q4_K_M", 0.031273, 0.91901, 1.028160),
    ("q4_0", 0.071940, None, 6.700147 / 6.233160),
)


def bible_text() -> str:
    """Genesis, a verse a line, from Debian's bible-kjv (its ``bible`` command)."""
    if shutil.which("bible") is None:
        raise RuntimeError("the text set needs Debian's bible-kjv: apt-get install bible-kjv")
    printed = subprocess.run(
        ["bible", BIBLE_SPEC], capture_output=True, text=True, check=True
    ).stdout
    verses: list[str] = []
    for line in printed.splitlines():
        start = re.match(r"^\s+\d+ (.*)", line)
        if start:
            verses.append(start.group(1).strip())
        elif line.strip() and verses and not re.match(r"^\S.* \d+$", line):
            verses[-1] += " " + line.strip()  # a verse's wrapped line
    return "\n".join(verses)


# --- speed and memory: one child per variant -------------------------------------------


def _memory_mb() -> dict[str, float]:
    """This process's resident memory now and at its peak (MB)."""
    fields = {}
    for line in Path("/proc/self/status").read_text(encoding="ascii").splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) / 1024
    return fields


def speed(job: dict[str, Any]) -> dict[str, Any]:
    model = job["model"]
    with blas_limit(model):
        built = build_engine(model)
        gc.collect()
        loaded = _memory_mb()["VmRSS"]
        runs = {}
        for level in job["levels"]:
            prompts = chat_prompts(built.built, level, PROMPT_TOKENS, new_salt())
            requests = [BenchRequest(p, job["output_len"]) for p in prompts]
            run = closed_loop(built, requests, level)
            runs[level] = {
                "ttft": statistics.median(run.ttft_s),
                "tpot": statistics.median(run.tpot_s),
                "tokens_per_s": run.tokens_per_s,
            }
    return {
        "weight_bytes": built.built.model.weight_bytes,
        "rss_loaded_mb": loaded,
        "rss_peak_mb": _memory_mb()["VmHWM"],
        "runs": runs,
    }


# --- quality: every variant in one child, scored on the same tokens --------------------


@dataclass
class Scores:
    """Per scored position: the token's log probability, and against float32 the KL
    divergence and whether the most likely token is the same."""

    logprob: list[float]
    kld: list[float]
    same_top: list[bool]

    def add(self, reference: Logits, mine: Logits, targets: list[int]) -> None:
        ref, own = _log_softmax(reference), _log_softmax(mine)
        self.logprob += own[np.arange(len(targets)), targets].tolist()
        self.kld += (np.exp(ref) * (ref - own)).sum(axis=1).tolist()
        self.same_top += (ref.argmax(axis=1) == own.argmax(axis=1)).tolist()

    def summary(self) -> dict[str, float]:
        return {
            "positions": len(self.logprob),
            "ppl": float(np.exp(-np.mean(self.logprob))),
            "kld_mean": float(np.mean(self.kld)),
            "kld_p99": float(np.percentile(self.kld, 99)),
            "same_top": float(np.mean(self.same_top)),
        }


def _log_softmax(logits: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    x = logits.astype(np.float64)
    x -= x.max(axis=1, keepdims=True)
    out: np.ndarray[Any, Any] = x - np.log(np.exp(x).sum(axis=1, keepdims=True))
    return out


class _Scorer:
    """A model's logits after every token of a sequence, from position 0 of its own pool."""

    def __init__(self, model: Any, longest: int) -> None:
        from refengine.kvcache import BlockPool

        shape = model.shape
        self._model = model
        blocks = -(-longest // 16)
        self._pool = BlockPool(blocks, 16, shape.n_layers, shape.n_kv_heads, shape.head_dim)

    def logits(self, tokens: list[int]) -> np.ndarray[Any, Any]:
        from refengine.attention import Segment

        segment = Segment(tokens, 0, list(range(-(-len(tokens) // 16))))
        every = np.arange(len(tokens))
        out: np.ndarray[Any, Any] = self._model.forward([segment], self._pool, every)
        return out


def greedy_answers(model: Any, tokenizer: Any, prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt's greedy continuation (ends at EOS or after ANSWER_TOKENS), all prompts
    decoding together, one step per token, as the engine batches them."""
    from refengine.attention import Segment
    from refengine.kvcache import BlockPool

    shape = model.shape
    per_sequence = -(-(max(map(len, prompts)) + ANSWER_TOKENS) // 16)
    blocks = per_sequence * len(prompts)
    pool = BlockPool(blocks, 16, shape.n_layers, shape.n_kv_heads, shape.head_dim)
    tables = [list(range(i * per_sequence, (i + 1) * per_sequence)) for i in range(len(prompts))]
    answers: list[list[int]] = [[] for _ in prompts]
    next_tokens = [
        int(np.argmax(model.forward([Segment(p, 0, tables[i])], pool)[0]))
        for i, p in enumerate(prompts)
    ]
    live = list(range(len(prompts)))
    while live:
        for i in live:
            answers[i].append(next_tokens[i])
        live = [
            i
            for i in live
            if next_tokens[i] not in tokenizer.eos_ids and len(answers[i]) < ANSWER_TOKENS
        ]
        if not live:
            break
        starts = {i: len(prompts[i]) + len(answers[i]) - 1 for i in live}
        segments = [Segment([answers[i][-1]], starts[i], tables[i]) for i in live]
        logits = model.forward(segments, pool)
        for row, i in enumerate(live):
            next_tokens[i] = int(np.argmax(logits[row]))
    return answers


def quality(job: dict[str, Any]) -> dict[str, Any]:
    _engine_modules()
    from refengine.families import build_model

    # Plain products for all: the variants differ only in their weights.
    built = {
        name: build_model({**model_parameters(name), "batch_invariant": "false"})
        for name in job["variants"]
    }
    reference_name = job["variants"][0]
    reference = built[reference_name]
    tokenizer = reference.tokenizer
    questions = [ask.format(topic) for ask in ASKS for topic in TOPICS]
    prompts = [tokenizer.encode(p) for p in _chat(reference, questions)]
    answers = greedy_answers(reference.model, tokenizer, prompts)
    chat_sets = [(p + a, len(p) - 1) for p, a in zip(prompts, answers, strict=True)]
    text = tokenizer.encode(bible_text())
    text_sets = [
        (text[i * CHUNK_TOKENS : (i + 1) * CHUNK_TOKENS], CHUNK_TOKENS // 2 - 1)
        for i in range(TEXT_CHUNKS)
    ]
    results: dict[str, dict[str, Any]] = {}
    for set_name, sequences in (("chat", chat_sets), ("text", text_sets)):
        longest = max(len(tokens) for tokens, _ in sequences)
        scorers = {n: _Scorer(b.model, longest) for n, b in built.items()}
        scores = {n: Scores([], [], []) for n in built}
        for tokens, first in sequences:
            targets = tokens[first + 1 :]
            ref = scorers[reference_name].logits(tokens)[first:-1]
            for name in built:
                mine = ref if name == reference_name else scorers[name].logits(tokens)[first:-1]
                scores[name].add(ref, mine, targets)
        results[set_name] = {n: s.summary() for n, s in scores.items()}
    return {"sets": results, "answer_example": tokenizer.decode(answers[0])}


def _chat(built: Any, questions: list[str]) -> list[str]:
    from llmmesh.types import Role, Turn
    from services.router.chat_layout import TemplateLayout

    card = built.card
    layout = TemplateLayout(card.chat_template, card.bos_token, card.eos_token)
    return [layout.render([Turn(Role.USER, q)], generation_prompt=True) for q in questions]


# --- the run and its report -----------------------------------------------------------


@dataclass(frozen=True)
class QuantizationResult:
    speed: dict[str, dict[str, Any]]
    quality: dict[str, Any]

    def table(self) -> str:
        rows = [
            "| variant | weights (MB) | engine RSS loaded / peak (MB) | TTFT 1 stream (ms) "
            "| TPOT 1 / 16 streams (ms) | tok/s 1 / 16 streams |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for name, s in self.speed.items():
            one, many = s["runs"]["1"], s["runs"]["16"]
            rows.append(
                f"| {name} | {s['weight_bytes'] / 1e6:.0f} "
                f"| {s['rss_loaded_mb']:.0f} / {s['rss_peak_mb']:.0f} "
                f"| {one['ttft'] * 1e3:.0f} | {one['tpot'] * 1e3:.0f} / {many['tpot'] * 1e3:.0f} "
                f"| {one['tokens_per_s']:.1f} / {many['tokens_per_s']:.1f} |"
            )
        rows += ["", *self._quality_rows(), "", *self._llama_cpp_rows()]
        return "\n".join(rows)

    def _quality_rows(self) -> list[str]:
        rows = [
            "| set | variant | positions | PPL | PPL ratio | mean KLD | p99 KLD | same top token |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for set_name, by_variant in self.quality["sets"].items():
            reference = next(iter(by_variant.values()))
            for index, (name, q) in enumerate(by_variant.items()):
                against = (
                    "(reference)"
                    if index == 0
                    else f"{q['ppl'] / reference['ppl']:.4f} | {q['kld_mean']:.4f} "
                    f"| {q['kld_p99']:.4f} | {q['same_top']:.1%}"
                )
                if index == 0:
                    against += " | | |"
                rows.append(
                    f"| {set_name} | {name} | {q['positions']} | {q['ppl']:.3f} | {against} |"
                )
        return rows

    @staticmethod
    def _llama_cpp_rows() -> list[str]:
        rows = [
            "llama.cpp's published figures for comparison (LLaMA 3 8B against its FP16 "
            "weights, Wikitext-2; tools/perplexity/README.md):",
            "",
            "| llama.cpp type | mean KLD | same top token | PPL ratio |",
            "| --- | --- | --- | --- |",
        ]
        for name, kld, same, ratio in LLAMA_CPP:
            shown = f"{same:.1%}" if same is not None else "not published"
            rows.append(f"| {name} | {kld:.6f} | {shown} | {ratio:.4f} |")
        return rows


def run(variants: tuple[str, ...] = VARIANTS, output_len: int = 64) -> QuantizationResult:
    speeds = {}
    for name in variants:
        print(f"{name}: memory, TTFT and TPOT ...", file=sys.stderr)
        job = {"task": "speed", "model": name, "levels": [1, 16], "output_len": output_len}
        speeds[name] = run_in_child("bench.quantization", job)
    print("quality: every variant on the same tokens ...", file=sys.stderr)
    scored = run_in_child("bench.quantization", {"task": "quality", "variants": list(variants)})
    return QuantizationResult(speeds, scored)


if __name__ == "__main__":
    # run_in_child's child: a job on stdin, its result as JSON on stdout.
    request = json.load(sys.stdin)
    task = speed if request["task"] == "speed" else quality
    json.dump(task(request), sys.stdout)

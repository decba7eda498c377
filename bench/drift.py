"""The canary analysis's drift statistics per variant of the real model, online
(``llm-mesh bench --scenario drift``): for each canary (stable's own weights under another
replica, the int8 variant, the 4-bit one) a router mirrors every request stable answers
to it, greedy chat questions through the OpenAI API, and reads back the pairs' drift from
``/internal/canary``, as the rollout controller does. The offline figures to set them
beside are the quantization scenario's (full vocabulary, teacher-forced on float32's
answers); the online ones see the top-20 tokens of each position and compare the two
answers while they share their prefix.
"""

from __future__ import annotations

import json
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.decode import TOPICS
from bench.quantization import ASKS
from llmmesh.analysis.drift import DriftSummary, DriftWindow
from llmmesh.launcher import Stack, StackPorts
from llmmesh.waiting import poll_until

# Label, and the Triton model the canary replica serves the mesh's model with.
VARIANTS = (("same weights", "smollm2"), ("int8", "smollm2-int8"), ("4-bit", "smollm2-q4"))
TOP_LOGPROBS = 20


@dataclass(frozen=True)
class VariantDrift:
    label: str
    drift: DriftSummary
    seconds: float

    def row(self) -> str:
        d = self.drift
        return (
            f"| {self.label} | {d.pairs} | {d.positions} | {d.agreement:.3f} | {d.kl:.4f} | "
            f"{d.confidence_shift:.4f} | {d.entropy_change:+.3f} | {d.exact_match:.2f} | "
            f"{d.rouge_l:.3f} | {d.length_ratio:.2f} |"
        )


def table(results: list[VariantDrift]) -> str:
    head = (
        "| canary | pairs | positions | top-1 agreement | mean KL | confidence shift | "
        "entropy change | exact match | ROUGE-L | length ratio |\n"
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
    )
    return "\n".join([head, *(r.row() for r in results)])


def _observed(url: str, token: str) -> dict[str, Any]:
    request = urllib.request.Request(url, headers={"x-mesh-token": token})
    with urllib.request.urlopen(request, timeout=10) as reply:
        snapshot: dict[str, Any] = json.loads(reply.read())
    return snapshot


def _variant(
    stack: Stack, root: Path, variant: tuple[str, str], questions: list[str], output_len: int
) -> VariantDrift:
    label, served = variant
    workdir = root / label.replace(" ", "-")
    workdir.mkdir()
    port = StackPorts.free().inference
    aliases = json.dumps({"smollm2": served} if served != "smollm2" else {})
    replica = stack.start_service(
        "inference", port, workdir, models=json.dumps([served]), model_aliases=aliases
    )
    endpoints = [
        {"address": stack.address("inference"), "version": "stable", "region": "local"},
        {"address": f"127.0.0.1:{port}", "version": "canary", "region": "local"},
    ]
    (workdir / "endpoints.json").write_text(json.dumps({"endpoints": endpoints}))
    (workdir / "routing.yaml").write_text(
        "split: {stable: 100, canary: 0}\ncolors: {canary: canary}\n"
        f"mirror: {{subset: canary, percent: 100, max_in_flight: 64, "
        f"top_logprobs: {TOP_LOGPROBS}}}\n"
    )
    ports = StackPorts.free()
    router = stack.start_service(
        "router",
        ports.router,
        workdir,
        routing_file=str(workdir / "routing.yaml"),
        endpoints_file=str(workdir / "endpoints.json"),
        http_port=str(ports.router_http),
    )
    base = f"http://127.0.0.1:{ports.router_http}"
    started = time.monotonic()
    try:
        with httpx.Client(timeout=300) as client:
            for question in questions:
                reply = client.post(
                    f"{base}/v1/chat/completions",
                    headers={"Authorization": f"Bearer {stack.api_key}"},
                    json={
                        "model": "smollm2",
                        "messages": [{"role": "user", "content": question}],
                        "max_tokens": output_len,
                        "temperature": 0,
                    },
                )
                reply.raise_for_status()
        url = f"{base}/internal/canary"

        def shadows_done() -> bool:  # the last shadows finish after their answers
            shadows = _observed(url, stack.internal_token)["shadows"]
            done: int = sum(shadows["smollm2"]["canary"].values())
            return done >= len(questions)

        poll_until(shadows_done, 600, 0.5)
        drift = _observed(url, stack.internal_token)["models"]["smollm2"]["drift"]["canary"]
    finally:
        router.terminate(5)
        replica.terminate(5)
    return VariantDrift(label, DriftWindow(**drift).summary(), time.monotonic() - started)


def run(questions: int = 32, output_len: int = 32) -> list[VariantDrift]:
    asked = [ask.format(topic) for ask in ASKS for topic in TOPICS][:questions]
    with tempfile.TemporaryDirectory(prefix="llm-mesh-bench-") as workdir:
        root = Path(workdir)
        models = ["smollm2", "smollm2-q4"]  # and the canary build of smollm2, its int8
        with Stack(root / "stack", StackPorts.free(), models=models) as stack:
            return [_variant(stack, root, v, asked, output_len) for v in VARIANTS]

"""inference-perf (the Kubernetes serving working group's benchmark tool, from PyPI) run
unmodified against the router's OpenAI API, as a platform team would point it at a vLLM
server: its ``vllm`` client, streaming, the completions API with random prompts and the
chat API with shared-prefix prompts, the served model's tokenizer read by path from the
directory ``llm-mesh up`` writes.

The tool lives in a virtual environment of its own (``.llm-mesh/tools``: some 800 MB, kept
out of the mesh's). Its wheel declares Python 3.12, this machine has 3.11 and its code runs
on 3.11 as it is: its dependencies are resolved for this Python, then the wheel itself is
installed without them and without its Python check. Nothing of it is changed.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

TOOL, VERSION = "inference-perf", "0.7.0"
TOOLS_DIR = Path(".llm-mesh") / "tools"


@dataclass(frozen=True)
class ToolRun:
    """One run of the tool: its API, and what its summary report says."""

    api: str
    data: str
    successes: int
    failures: int
    requests_per_s: float
    output_tokens_per_s: float
    ttft_s: tuple[float, float]  # p50, p90
    tpot_s: tuple[float, float]
    output_tokens: float  # mean per request, from the usage the router reports

    def row(self) -> str:
        ms = [f"{v * 1000:.0f}" for v in (*self.ttft_s, *self.tpot_s)]
        return (
            f"| {self.api} | {self.data} | {self.successes} | {self.failures} | "
            f"{self.requests_per_s:.2f} | {self.output_tokens_per_s:.1f} | "
            f"{' | '.join(ms)} | {self.output_tokens:.1f} |"
        )


def table(runs: list[ToolRun]) -> str:
    head = (
        "| API | prompts | succeeded | failed | requests/s | output tokens/s | "
        "TTFT p50 (ms) | TTFT p90 (ms) | TPOT p50 (ms) | TPOT p90 (ms) | output tokens |\n"
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
    )
    return "\n".join([head, *(r.row() for r in runs)])


def tool_command(root: Path = TOOLS_DIR) -> Path:
    """The tool's command, installed first if it is not yet."""
    venv = root / f"{TOOL}-{VERSION}"
    command = venv / "bin" / TOOL
    if command.exists():
        return command
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    with tempfile.TemporaryDirectory() as download:
        subprocess.run(
            [
                *pip[:3],
                "download",
                "-q",
                "--no-deps",
                "--only-binary=:all:",
                "--python-version",
                "3.12",
                "-d",
                download,
                f"{TOOL}=={VERSION}",
            ],
            check=True,
        )
        (wheel,) = Path(download).glob("*.whl")
        subprocess.run([*pip, *_requirements(wheel)], check=True)
        subprocess.run([*pip, "--no-deps", "--ignore-requires-python", str(wheel)], check=True)
    return command


def _requirements(wheel: Path) -> list[str]:
    """The wheel's own dependencies (extras left out), from its metadata."""
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = archive.read(name).decode()
    prefix = "Requires-Dist: "
    return [
        line.removeprefix(prefix)
        for line in metadata.splitlines()
        if line.startswith(prefix) and "extra ==" not in line
    ]


@dataclass(frozen=True)
class Server:
    """The router as the tool sees it."""

    base_url: str  # the OpenAI API's, ``.../v1``
    api_key: str
    model: str
    tokenizer: Path  # the model's Hugging Face tokenizer directory


def config(server: Server, api: str, *, out: Path, seconds: int) -> dict[str, Any]:
    """The tool's configuration for one run: a constant rate of one request a second."""
    if api == "chat":
        data: dict[str, Any] = {
            "type": "shared_prefix",
            "shared_prefix": {
                "num_groups": 2,
                "num_prompts_per_group": 8,
                "system_prompt_len": 64,
                "question_len": 16,
                "output_len": 16,
                "seed": 1,
            },
        }
    else:
        length = {"min": 20, "max": 80, "mean": 40, "std_dev": 10}
        data = {
            "type": "random",
            "input_distribution": length,
            "output_distribution": {"min": 8, "max": 24, "mean": 16, "std_dev": 4},
        }
    return {
        "load": {"type": "constant", "stages": [{"rate": 1, "duration": seconds}]},
        "api": {"type": api, "streaming": True},
        "server": {
            "type": "vllm",
            "model_name": server.model,
            "base_url": server.base_url.removesuffix("/v1"),
            "ignore_eos": True,
            "api_key": server.api_key,
        },
        "tokenizer": {"pretrained_model_name_or_path": str(server.tokenizer)},
        "data": data,
        "report": {"request_lifecycle": {"summary": True, "per_stage": False}},
        "storage": {"local_storage": {"path": str(out)}},
    }


def run_tool(command: Path, settings: dict[str, Any], workdir: Path) -> ToolRun:
    """Runs the tool once; its summary report, read back."""
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "config.yml"
    path.write_text(yaml.safe_dump(settings))
    log = workdir / "inference-perf.log"
    with log.open("w") as out:
        command_line = [str(command), "--config_file", str(path)]
        done = subprocess.run(command_line, check=False, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        tail = log.read_text()[-2000:]
        raise RuntimeError(f"inference-perf failed ({done.returncode}):\n{tail}")
    report = Path(settings["storage"]["local_storage"]["path"]) / "summary_lifecycle_metrics.json"
    summary = json.loads(report.read_text())
    good = summary["successes"]
    latency, rate = good["latency"], good["throughput"]

    def pair(name: str) -> tuple[float, float]:
        return latency[name]["median"], latency[name]["p90"]

    return ToolRun(
        api=settings["api"]["type"],
        data=settings["data"]["type"],
        successes=int(good["count"]),
        failures=int(summary.get("failures", {}).get("count", 0)),
        requests_per_s=rate["requests_per_sec"],
        output_tokens_per_s=rate["output_tokens_per_sec"],
        ttft_s=pair("time_to_first_token"),
        tpot_s=pair("time_per_output_token"),
        output_tokens=good["output_tokens"]["mean"],
    )

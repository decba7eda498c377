"""What a benchmark run writes: its command, its section of the markdown document, its
configuration, and the workload its arguments ask for."""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from bench.report import update_markdown
from bench.workload import WorkloadSpec


def command() -> str:
    return "llm-mesh " + shlex.join(sys.argv[1:])


def section(args: argparse.Namespace, scenario: str) -> str:
    """--section, unless left at its default: then the scenario's own section."""
    return args.section if args.section != "baseline" else scenario


def record(args: argparse.Namespace, section: str, run_details: str, content: str) -> None:
    """Replaces the section of --markdown (if given) with the command, the run and content."""
    if args.markdown:
        stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        body = f"Command: `{command()}`  \nRun: {stamp}{run_details}\n\n{content}"
        update_markdown(args.markdown, section, body)


def config(args: argparse.Namespace) -> dict[str, Any]:
    return {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "func"}


def workload_of(args: argparse.Namespace) -> WorkloadSpec:
    return WorkloadSpec(
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        input_spread=args.input_spread,
        output_len=args.output_len,
        output_spread=args.output_spread,
        prefix_groups=args.prefix_groups,
        shared_prefix_len=args.shared_prefix_len,
        seed=args.seed,
    )

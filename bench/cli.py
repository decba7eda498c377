"""``llm-mesh bench``: load the router and/or Triton directly, report, compare."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from bench.cpu import PLACEMENTS, CpuMeter
from bench.fleets import OWN_FLEET
from bench.plots import write_plots
from bench.recording import command, config, record, section
from bench.report import (
    Run,
    comparison_table,
    cpu_ratio_table,
    cpu_table,
    idle_table,
    results_table,
    scaling_table,
    write_json,
)
from bench.rounds import run_all
from bench.scenarios import Comparison, Paired, head_of_line, paired_ttft, prefix_cache
from bench.stacks import bench_stack, placed, router_to_triton, stack_meter
from bench.targets import (
    OpenAiTarget,
    RouterStreamTarget,
    RouterTarget,
    Target,
    TritonTarget,
    named,
)
from llmmesh.client import DEFAULT_STATE_FILE, api_key, router_address

ROUTER_TO_TRITON = "router-triton"  # a router whose endpoint is Triton itself
# A router target's requests as generations on one GenerateStream call kept open.
ON_A_STREAM = "-stream"
ROUTER_STREAM = "router" + ON_A_STREAM
ROUTER_TO_TRITON_STREAM = ROUTER_TO_TRITON + ON_A_STREAM


def add_bench_parser(commands: Any) -> None:
    bench = commands.add_parser(
        "bench", help="benchmark the router and/or Triton directly (vLLM bench serve metrics)"
    )
    bench.add_argument(
        "--target",
        choices=[
            "router",
            "openai",
            "triton",
            "triton-new-streams",
            ROUTER_TO_TRITON,
            ROUTER_STREAM,
            ROUTER_TO_TRITON_STREAM,
        ],
        action="append",
        help="what to load (repeatable; default: router; with --compare, added to triton "
        "and router); triton-new-streams: Triton with a new stream per request instead of "
        f"one kept open between requests; {ROUTER_TO_TRITON} (with --start-stack): a second "
        "router whose endpoint is the stack's Triton itself, no inference service between; "
        f"a router target with '{ON_A_STREAM}': its requests as generations on one "
        "GenerateStream call kept open, as the triton target keeps its stream",
    )
    bench.add_argument(
        "--scenario",
        choices=[
            "load",
            "hol",
            "prefix",
            "paired",
            "engine",
            "routing",
            "admission",
            "policy",
            "context",
            "sidecars",
            "decode",
            "quantization",
            "inference-perf",
            "drift",
            "canary",
            "shared-state",
            "truncation",
            "capacity",
            "peer-hop",
            "peer-routing",
            "cold",
        ],
        default="load",
        help="load: latency and throughput under load (default); hol: TTFT while 15 long "
        "generations run vs idle; prefix: TTFT with a 90%% cached prefix vs none; paired: "
        "the two --target's TTFT request by request, --num-prompts pairs, order alternating "
        "(the median of the per-pair differences with a bootstrap interval); engine: the "
        "reference engine alone in this process at each --concurrency, prefill and decode "
        "steps timed (no Triton, no mesh); routing: "
        "the LLM-aware picker vs round-robin over 4 replicas it starts itself, with "
        "--num-prompts multi-turn sessions arriving at each of --session-rates; admission: "
        "three tiers at twice the fleet's capacity for --duration seconds, without and with "
        "admission control, on a stack it starts itself; policy: a 200-rule set on 4 KB "
        "prompts and output chunks, and TTFT with and without the streamed output check; "
        "context: append and load latency of 32 concurrent 50-turn conversations on SQLite "
        "and Redis, and truncation cost on a 200-turn session; sidecars: the router through "
        "Envoy sidecars (mTLS, RBAC) vs a router of the same stack calling directly; decode: "
        "a real model's (--model, default smollm2) one-stream decode against the "
        "memory-bandwidth bound of reading its weights, measured in the same run, 1 and 16 "
        "streams and TTFT of 64-token chat prompts, on the engine alone and through a "
        "Triton it starts itself; quantization: smollm2's int8 and 4-bit variants against "
        "float32: engine memory, TTFT and TPOT at 1 and 16 streams, and KL divergence, "
        "same top token and perplexity on the float32 variant's answers to 64 chat prompts "
        "and on a public-domain text, as llama.cpp's llama-perplexity reports them; "
        "inference-perf: that tool (from PyPI, in a venv of its own) run unmodified "
        "against the router of a stack it starts itself (--model, default smollm2), "
        "completions and chat, streamed, for --duration seconds each; drift: the canary "
        "analysis's online drift of smollm2's variants (stable's own weights, int8, 4-bit), "
        "every request mirrored, --num-prompts greedy chat questions, --output-len tokens; "
        "canary: client TTFT and throughput through a router mirroring 10%% of stable's "
        "requests to a paced canary against one that does not (--concurrency, --rounds, "
        "alternating), and a bad canary's rollback under the default gates (seconds to "
        "weight 0, the canary's share of client requests before); shared-state: TTFT "
        "through a router keeping its state in Redis against one keeping it in memory, "
        "--num-prompts pairs, and a tenant's token budget held by two Redis routers loaded "
        "at twice it for --duration seconds; truncation: --conversations seeded "
        "conversations that plant facts early, asked about them at the end through the "
        "router on smollm2, once per truncation strategy under a --budget-tokens context "
        "and once whole: facts retained, the system prompt's instruction kept, ROUGE-L and "
        "BLEU-4 against the whole history's answers, prompt tokens, prefix cache hits, TTFT; "
        "capacity: the requests/s one router process admits and picks and the tokens/s it "
        "relays, alone on one CPU over paced replicas (never the bottleneck), before its "
        "TTFT p50 doubles, each step also against a bare grpc.aio streamer there; peer-hop: "
        "vllm-router (from PyPI) in front of the router against the router alone, "
        "--num-prompts pairs over the OpenAI HTTP API, order alternating; peer-routing: "
        "vllm-router (--peer-policy) over one router per engine against the mesh's picker "
        "over the same 4 engines, the routing scenario's sessions at each of "
        "--session-rates, the client keeping the history (OpenAI HTTP API); cold: steps of "
        "a request's path timed alone, hot and after idle gaps (no stack)",
    )
    bench.add_argument("--duration", type=float, default=40.0, help="admission: seconds")
    bench.add_argument(
        "--stream-gap-ms",
        type=float,
        default=0.0,
        help="capacity: the paced upstreams' stream gap after a stream's first responses, as "
        "the inference service's engine_stream_gap_ms asks of the engine (0: a response per "
        "token)",
    )
    bench.add_argument(
        "--relay",
        choices=["calls", "stream"],
        default="calls",
        help="capacity: the long generations (and the probe's requests) as a Generate call "
        "each (h2load's) or as generations on one GenerateStream call (bench/stream_load.py)",
    )
    bench.add_argument("--conversations", type=int, default=50, help="truncation: how many")
    bench.add_argument(
        "--budget-tokens", type=int, default=512, help="truncation: the model's context to cut to"
    )
    bench.add_argument(
        "--plot",
        type=Path,
        help="admission: PNG (default: beside --markdown, which shows it, else beside --out)",
    )
    bench.add_argument(
        "--session-rates",
        default="0.6,0.9,1.2",
        help="routing scenario: session arrival rates per second, comma-separated",
    )
    bench.add_argument(
        "--routers",
        default="1",
        help="routing scenario: routers per picker, comma-separated runs (several: state "
        "in Redis, behind an Envoy front)",
    )
    bench.add_argument(
        "--engine-cpu",
        type=_cpu_share,
        help="routing and peer-routing: hold each engine (its model's backend process) to "
        "this share of a CPU, its own: an idle engine's share is not lent to the others, as "
        "replicas on accelerators of their own cannot lend theirs (a CPU cgroup each; needs "
        "root). Default: the engines share every CPU",
    )
    bench.add_argument(
        "--peer-policy",
        default="cache_aware",
        help="peer-routing: vllm-router's policy (cache_aware, power_of_two, ...)",
    )
    bench.add_argument(
        "--compare",
        action="store_true",
        help="run triton and router with the same prompts and compare them",
    )
    bench.add_argument("--router", help="router host:port (default: the state file's)")
    bench.add_argument(
        "--openai-url", help="OpenAI-compatible base URL (default: the state file's)"
    )
    bench.add_argument("--triton", help="Triton gRPC host:port (default: the state file's)")
    bench.add_argument("--state-file", type=Path, default=DEFAULT_STATE_FILE)
    bench.add_argument(
        "--start-stack",
        action="store_true",
        help="start a local stack on free ports for the run, then stop it",
    )
    bench.add_argument("--model", help="the model (default: llm; decode: smollm2)")
    load = bench.add_mutually_exclusive_group()
    load.add_argument(
        "--concurrency",
        default="1",
        help="closed-loop concurrency levels, comma-separated (default: 1)",
    )
    load.add_argument("--rate", type=float, help="open-loop Poisson arrival rate, requests/s")
    bench.add_argument("--num-prompts", type=int, default=32)
    bench.add_argument("--input-len", type=int, default=128)
    bench.add_argument("--input-spread", type=float, default=0.0)
    bench.add_argument("--output-len", type=int, default=64)
    bench.add_argument("--output-spread", type=float, default=0.0)
    bench.add_argument("--prefix-groups", type=int, default=1)
    bench.add_argument("--shared-prefix-len", type=int, default=0)
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument(
        "--sampling",
        type=_json_object,
        help="engine: more sampling_parameters (JSON) for every request, e.g. "
        "'{\"frequency_penalty\": 0.5}'",
    )
    bench.add_argument("--warmup", type=int, default=4)
    bench.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="repeat every measurement, alternating targets; results are pooled",
    )
    bench.add_argument("--ttft-slo-ms", type=float)
    bench.add_argument("--tpot-slo-ms", type=float)
    bench.add_argument("--out", type=Path, default=Path("bench/results/latest.json"))
    bench.add_argument("--markdown", type=Path, help="update this Markdown file's section")
    bench.add_argument("--section", default="baseline")
    bench.add_argument("--no-progress", action="store_true")
    bench.add_argument(
        "--rules",
        choices=["default", "input"],
        default="default",
        help="with --start-stack: the demo tenant's rule set, the default set on prompts "
        "and output, or its rules on input only (no streamed output check)",
    )
    bench.add_argument(
        "--placement",
        choices=PLACEMENTS,
        default="shared",
        help="with --start-stack: shared (every process on every CPU) or pinned (Triton and "
        "its model processes on the last CPU, the mesh and the load generator on the "
        "others, as on a GPU host); either way each process group's CPU per request is "
        "reported",
    )
    bench.add_argument(
        "--against",
        type=Path,
        help="with --start-stack: also a stack of another checkout's code (a directory; "
        "e.g. main checked out elsewhere), its router a target of its own in every round",
    )
    bench.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # SIGTERM unwinds like Ctrl-C, so that every stack a benchmark started is stopped
    # (Triton's backend stubs outlive a launcher that dies without stopping them).
    signal.signal(signal.SIGTERM, _interrupt)
    own_fleet = OWN_FLEET.get(args.scenario)  # scenarios that start what they measure
    if own_fleet is not None:
        return own_fleet(args)
    if args.start_stack:
        with contextlib.ExitStack() as stacks:
            stack = stacks.enter_context(bench_stack(args, None))
            args.router = stack.address("router")
            args.triton = stack.address("triton_grpc")
            args.openai_url = stack.openai_base_url
            args.api_key = stack.api_key
            meter = stack_meter(stack)
            meters = dict.fromkeys(("router", ROUTER_STREAM, "openai", "triton"), meter)
            if {ROUTER_TO_TRITON, ROUTER_TO_TRITON_STREAM} & set(args.target or ()):
                args.router_to_triton, direct = stacks.enter_context(router_to_triton(stack))
                direct_meter = stack_meter(stack, router=direct)
                meters |= dict.fromkeys((ROUTER_TO_TRITON, ROUTER_TO_TRITON_STREAM), direct_meter)
            if args.against:
                other = stacks.enter_context(bench_stack(args, args.against))
                args.against_router = other.address("router")
                args.against_key = other.api_key
                meters[_against_name(args)] = stack_meter(other)
            print(placed(args.placement, meters.values()), file=sys.stderr)
            return _measure_and_report(args, meters)
    return _measure_and_report(args)


def _against_name(args: argparse.Namespace) -> str:
    return f"router ({Path(args.against).name})"


def _measure_and_report(
    args: argparse.Namespace, meters: Mapping[str, CpuMeter] | None = None
) -> int:
    if args.scenario != "load":
        return _scenario(args)
    runs = asyncio.run(_load_rounds(args, meters))
    write_json(args.out, command(), config(args), runs)
    plots = write_plots(runs, args.out.with_suffix(""))
    print(results_table(runs))
    comparison = _comparisons(args, runs)
    cpu = cpu_table(runs)
    if cpu:
        comparison = (
            f"{comparison}\n\nCPU beyond each process's idle rate ({args.placement}):\n\n{cpu}"
        )
    idle = idle_table(runs)
    if idle:
        heading = "Idle: each process's CPU with no request in flight, in shares of one CPU"
        comparison += f"\n\n{heading}:\n\n{idle}"
    ratios = [("router", ROUTER_TO_TRITON), ("router", ROUTER_TO_TRITON_STREAM)]
    if getattr(args, "against", None):
        against = _against_name(args)
        ratios += [(against, t) for t in ("router", ROUTER_TO_TRITON, ROUTER_TO_TRITON_STREAM)]
    for baseline, candidate in ratios:
        table = cpu_ratio_table(runs, baseline, candidate)
        comparison += f"\n\n{table}" if table else ""
    if comparison:
        print("\n" + comparison)
    figures = ""
    if args.markdown:  # copies beside the document, which shows them
        shown = write_plots(runs, args.markdown.parent / "img" / args.section)
        figures = "\n\n" + " ".join(f"![{p.stem}](img/{p.name})" for p in shown)
    record(
        args,
        args.section,
        f", {args.rounds} x {args.num_prompts} prompts of {args.input_len} tokens, "
        f"{args.output_len} output tokens each (ignore_eos); {args.placement} placement"
        + ("; the default set's rules on input only" if args.rules == "input" else "")
        + (f"; against {args.against}" if getattr(args, "against", None) else "")
        + ".",
        f"{results_table(runs)}\n\n{comparison}{figures}",
    )
    print(f"plots: {', '.join(map(str, plots))}", file=sys.stderr)
    for failed in (r for r in runs if r.summary.failed):
        print(
            f"{failed.target} {failed.load}: {failed.summary.failed} requests failed, "
            f"e.g. {failed.summary.errors[0]}",
            file=sys.stderr,
        )
    print(f"\nresults: {args.out}", file=sys.stderr)
    return 1 if any(r.summary.failed for r in runs) else 0


async def _load_rounds(
    args: argparse.Namespace, meters: Mapping[str, CpuMeter] | None
) -> list[Run]:
    # The targets' channels belong to the loop they are made in: this one.
    return await run_all(args, _targets(args), meters)


def _comparisons(args: argparse.Namespace, runs: list[Run]) -> str:
    """The mesh against Triton, and HTTP against gRPC, for the targets that ran."""
    names = {run.target for run in runs}
    pairs = [
        ("triton", "router"),
        ("router", "openai"),
        ("triton", ROUTER_TO_TRITON),
        ("router", ROUTER_TO_TRITON),
        ("triton", ROUTER_STREAM),
        ("triton", ROUTER_TO_TRITON_STREAM),
        (ROUTER_TO_TRITON, ROUTER_TO_TRITON_STREAM),
    ]
    if getattr(args, "against", None):
        pairs += [("triton", _against_name(args)), (_against_name(args), "router")]
    tables = [
        comparison_table(runs, base, candidate)
        for base, candidate in pairs
        if {base, candidate} <= names
    ]
    return "\n\n".join(tables) if tables else scaling_table(runs)


def _paired(args: argparse.Namespace) -> int:
    async def measure() -> Paired:
        targets = _targets(args)
        if len(targets) != 2:
            raise SystemExit("--scenario paired takes two --target (baseline, candidate)")
        try:
            return await paired_ttft(
                *targets,
                pairs=args.num_prompts,
                prompt_len=args.input_len,
                max_tokens=args.output_len,
                seed=args.seed,
            )
        finally:
            for target in targets:
                await target.close()

    paired = asyncio.run(measure())
    print(paired.table())
    details = (
        f", {args.num_prompts} pairs of {args.input_len}-character prompts, "
        f"{args.output_len} output tokens, {args.model or 'llm'}, concurrency 1."
    )
    record(args, section(args, "paired"), details, paired.table())
    return 0


def _scenario(args: argparse.Namespace) -> int:
    if args.scenario == "paired":
        return _paired(args)

    async def measure() -> Comparison:
        (target,) = _targets(args)[:1]
        try:
            if args.scenario == "hol":
                return await head_of_line(target, prompt_len=args.input_len, seed=args.seed)
            return await prefix_cache(target, seed=args.seed)
        finally:
            await target.close()

    comparison = asyncio.run(measure())
    ratio = f"candidate / baseline TTFT p50: {comparison.ratio:.2f}"
    print(f"{comparison.table()}\n\n{ratio}")
    record(args, section(args, args.scenario), ".", f"{comparison.table()}\n\n{ratio}")
    return 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _cpu_share(text: str) -> float:
    share = float(text)
    cpus = len(os.sched_getaffinity(0))
    if not 0.1 <= share <= cpus:
        raise argparse.ArgumentTypeError(f"a share of a CPU from 0.1 to {cpus}, not {text}")
    return share


def _targets(args: argparse.Namespace) -> list[Target]:
    asked = args.target or []
    names = (
        ["triton", "router", *(t for t in asked if t not in ("triton", "router"))]
        if args.compare
        else (asked or ["router"])
    )
    state = json.loads(args.state_file.read_text()) if args.state_file.exists() else {}
    targets: list[Target] = []
    for name in names:
        key = getattr(args, "api_key", None) or api_key(args.state_file)
        if name in ("router", ROUTER_STREAM):
            address = router_address(args.router, args.state_file)
            targets.append(_router_target(name, address, args.model or "llm", key))
        elif name in (ROUTER_TO_TRITON, ROUTER_TO_TRITON_STREAM):
            if not getattr(args, "router_to_triton", None):
                raise SystemExit(f"--target {name} needs --start-stack")
            targets.append(_router_target(name, args.router_to_triton, args.model or "llm", key))
        elif name == "openai":
            base = (
                getattr(args, "openai_url", None)
                or state.get("openai_base_url")
                or "http://127.0.0.1:8080/v1"
            )
            targets.append(OpenAiTarget(base, args.model or "llm", key))
        else:
            url = args.triton or state.get("triton_grpc", "127.0.0.1:8001")
            kept = name == "triton"
            target = TritonTarget(url, args.model or "llm", keep_streams=kept)
            targets.append(target if kept else named(target, name))
    if getattr(args, "against_router", None):
        against = RouterTarget(args.against_router, args.model or "llm", args.against_key)
        targets.append(named(against, _against_name(args)))
    return targets


def _router_target(name: str, address: str, model: str, key: str) -> Target:
    """A router's public API, called per request or, for a '-stream' name, on a stream."""
    if name.endswith(ON_A_STREAM):
        return named(RouterStreamTarget(address, model, key), name)
    return named(RouterTarget(address, model, key), name)


def _json_object(text: str) -> dict[str, object]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not JSON: {err.msg}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value

"""``llm-mesh bench``: load the router and/or Triton directly, report, compare."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import signal
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.admission import Shape as AdmissionShape
from bench.admission import admission_fleet
from bench.admission import compare as admission_compare
from bench.admission import plot as plot_admission
from bench.context import run as run_context
from bench.cpu import PLACEMENTS, CpuMeter, CpuSpent, place
from bench.loadgen import LoadShape, Measurement, run_load
from bench.metrics import Slo
from bench.plots import write_plots
from bench.policy import input_rules_tenant
from bench.policy import run as run_policy
from bench.report import (
    Run,
    comparison_table,
    cpu_ratio_table,
    cpu_table,
    idle_table,
    path_cpu_ms,
    results_table,
    scaling_table,
    update_markdown,
    write_json,
)
from bench.routing import (
    REPLICAS,
    Compared,
    RoutingResult,
    SessionSpec,
    compare_pickers,
    picker_decision_time,
    router_targets,
    routing_fleet,
)
from bench.scenarios import Comparison, Paired, head_of_line, paired_ttft, prefix_cache
from bench.targets import (
    OpenAiTarget,
    RouterStreamTarget,
    RouterTarget,
    Target,
    TritonTarget,
    named,
)
from bench.workload import WorkloadSpec, make_requests, new_salt
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
    own_fleet = {  # scenarios that start what they measure
        "engine": _engine,
        "routing": _routing,
        "admission": _admission,
        "policy": _policy,
        "context": _context,
        "sidecars": _sidecars,
        "decode": _decode,
        "quantization": _quantization,
        "inference-perf": _inference_perf,
        "drift": _drift,
        "canary": _canary,
        "shared-state": _shared_state,
        "truncation": _truncation,
        "capacity": _capacity,
        "peer-hop": _peer_hop,
        "peer-routing": _peer_routing,
        "cold": _cold,
    }.get(args.scenario)
    if own_fleet is not None:
        return own_fleet(args)
    if args.start_stack:
        with contextlib.ExitStack() as stacks:
            stack = stacks.enter_context(_bench_stack(args, None))
            args.router = stack.address("router")
            args.triton = stack.address("triton_grpc")
            args.openai_url = stack.openai_base_url
            args.api_key = stack.api_key
            meter = _stack_meter(stack)
            meters = dict.fromkeys(("router", ROUTER_STREAM, "openai", "triton"), meter)
            if {ROUTER_TO_TRITON, ROUTER_TO_TRITON_STREAM} & set(args.target or ()):
                args.router_to_triton, direct = stacks.enter_context(_router_to_triton(stack))
                direct_meter = _stack_meter(stack, router=direct)
                meters |= dict.fromkeys((ROUTER_TO_TRITON, ROUTER_TO_TRITON_STREAM), direct_meter)
            if args.against:
                other = stacks.enter_context(_bench_stack(args, args.against))
                args.against_router = other.address("router")
                args.against_key = other.api_key
                meters[_against_name(args)] = _stack_meter(other)
            print(_place(args.placement, meters.values()), file=sys.stderr)
            return _measure_and_report(args, meters)
    return _measure_and_report(args)


@contextlib.contextmanager
def _bench_stack(args: argparse.Namespace, code: Path | None) -> Iterator[Any]:
    """A local stack of the tiny model (or the --model asked for), on this checkout's
    code or on ``code``'s (another checkout: its services, and its model repository)."""
    from llmmesh.launcher import Stack, StackPorts

    with tempfile.TemporaryDirectory(prefix="llm-mesh-bench-") as workdir:
        models = [args.model] if args.model else ["llm"]
        env = input_rules_tenant(Path(workdir)) if args.rules == "input" else {}
        if code is None:
            stack = Stack(Path(workdir), StackPorts.free(), models=models, env=env)
        else:
            root = code.resolve()
            stack = Stack(
                Path(workdir), StackPorts.free(), models=models,
                model_repository=root / "model_repository", env={**env, "PYTHONPATH": str(root)},
            )  # fmt: skip
        print(f"starting a local stack on {code or 'this checkout'} ...", file=sys.stderr)
        with stack:
            yield stack


LOADGEN = "load generator"


def _against_name(args: argparse.Namespace) -> str:
    return f"router ({Path(args.against).name})"


def _stack_meter(stack: Any, router: Any = None) -> CpuMeter:
    """The stack's processes in CPU groups (each inference replica in one), and this one;
    ``router``: a router whose endpoint is Triton itself, in the router's place, with no
    inference group (the stack's inference service is not on its path; it only reads
    Triton's metrics page more often while that router keeps the engine busy)."""
    groups: dict[str, list[int]] = {LOADGEN: [os.getpid()]}
    for name, pid in stack.pids().items():
        groups.setdefault("inference" if name.startswith("inference") else name, []).append(pid)
    if router is not None:
        groups["router"] = [router.process.pid]
        del groups["inference"]
    return CpuMeter(groups, alone=[LOADGEN])  # the stack's processes are its children


@contextlib.contextmanager
def _router_to_triton(stack: Any) -> Iterator[tuple[str, Any]]:
    """A second router beside the stack's, its one endpoint the stack's Triton itself
    (services/router/triton_link.py), and its address; the stack's inference service
    idles meanwhile."""
    from llmmesh.launcher import StackPorts

    endpoint = {
        "address": stack.address("triton_grpc"),
        "triton_metrics_url": f"http://{stack.address('triton_metrics')}/metrics",
        "region": "local",
    }
    endpoints = stack.workdir / "endpoints-triton.json"
    endpoints.write_text(json.dumps({"endpoints": [endpoint]}))
    port = StackPorts.free().router
    router = stack.start_service("router", port, stack.workdir, endpoints_file=str(endpoints))
    try:
        yield f"{stack.host}:{port}", router
    finally:
        router.terminate(5)


def _place(placement: str, meters: Iterable[CpuMeter]) -> str:
    engine = [pid for meter in meters for pid in meter.roots.get("triton", ())]
    mesh = [
        pid for meter in meters for name, pids in meter.roots.items()
        if name not in ("triton", LOADGEN)  # this process, whose children include Triton
        for pid in pids
    ]  # fmt: skip
    return place(placement, engine, mesh)


def _measure_and_report(
    args: argparse.Namespace, meters: Mapping[str, CpuMeter] | None = None
) -> int:
    if args.scenario != "load":
        return _scenario(args)
    runs = asyncio.run(_run_all(args, meters=meters))
    write_json(args.out, _command(), _config(args), runs)
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
    _record(
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
    _record(args, _section(args, "paired"), details, paired.table())
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
    _record(args, _section(args, args.scenario), ".", f"{comparison.table()}\n\n{ratio}")
    return 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _engine(args: argparse.Namespace) -> int:
    from bench.engine import engine_table, run_engine_as_served

    levels = [int(c) for c in args.concurrency.split(",")]
    runs = run_engine_as_served(_workload(args), levels)
    print(engine_table(runs))
    _record(
        args,
        _section(args, "engine"),
        f", {args.num_prompts} prompts of {args.input_len} tokens, {args.output_len} "
        "output tokens each, per concurrency; the engine as config.pbtxt builds it.",
        engine_table(runs),
    )
    return 0


def _routing(args: argparse.Namespace) -> int:
    spec = SessionSpec(sessions=args.num_prompts, output_len=args.output_len, seed=args.seed)
    rates = [float(r) for r in args.session_rates.split(",")]
    tables, failed = [], 0
    for routers in (int(n) for n in args.routers.split(",")):
        with tempfile.TemporaryDirectory(prefix="llm-mesh-bench-") as workdir:
            print(
                f"starting {REPLICAS} replicas and {routers} router(s) per picker ...",
                file=sys.stderr,
            )
            fleet = routing_fleet(Path(workdir), routers, args.engine_cpu)
            with fleet as (fronts, key, metrics):

                async def measure() -> Compared:
                    targets = router_targets(fronts, key)
                    return await compare_pickers(targets, spec, rates, args.rounds, metrics)

                summaries, placements = asyncio.run(measure())
        result = RoutingResult(summaries, picker_decision_time(), placements=placements)
        print(result.table())
        heading = f"{routers} router{'s' if routers > 1 else ''} per picker"
        if routers > 1:
            heading += " (state in Redis, behind an Envoy front)"
        tables.append(f"**{heading}**\n\n{result.table()}")
        failed += sum(s.failed for by_picker in summaries.values() for s in by_picker.values())
    _record(
        args,
        _section(args, "routing"),
        f"; per rate and picker, {args.rounds} runs of "
        f"{spec.sessions} sessions x {spec.turns} turns. A session opens with one of "
        f"{spec.prefix_groups} shared {spec.shared_prefix_len}-token preambles and "
        f"{spec.context_len} tokens of its own; every turn asks a {spec.question_len}-token "
        f"question and gets {spec.output_len} tokens back, and the router prepends the "
        f"history{_engine_budget(args)}.",
        "\n\n".join(tables),
    )
    return 1 if failed else 0


def _admission(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="llm-mesh-bench-") as workdir:
        print("starting a stack and three routers (FIFO, admission, engine priority) ...",
              file=sys.stderr)  # fmt: skip
        shape = AdmissionShape()
        with admission_fleet(Path(workdir), shape) as fleet:
            outcome = asyncio.run(admission_compare(fleet, args.duration, shape))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(outcome.as_json(), indent=1))
    plot = _admission_plot(args)
    plot_admission(outcome.mixes, plot)
    print(outcome.table())
    print(f"plot: {plot}", file=sys.stderr)
    _record(
        args,
        _section(args, "admission"),
        f"; {args.duration:.0f} s per router and mix, 128-token prompts, 64 output tokens; "
        "two mixes (a third of the requests per tier; critical one in six), each followed "
        "by its critical requests alone, at their rate in the mix.",
        f"{outcome.table()}\n\n![TTFT per tier over time](img/{plot.name})",
    )
    return 0


def _admission_plot(args: argparse.Namespace) -> Path:
    """A run that records nothing leaves the documentation's plot alone."""
    if args.plot:
        return Path(args.plot)
    if args.markdown:
        return Path(args.markdown).parent / "img" / "admission.png"
    return Path(args.out).with_name(f"{Path(args.out).stem}-admission.png")


def _policy(args: argparse.Namespace) -> int:
    rounds = args.rounds * 10
    with tempfile.TemporaryDirectory(prefix="llm-mesh-bench-") as workdir:
        print("starting a stack, a policy service and a router ...", file=sys.stderr)
        result = run_policy(Path(workdir), rounds, args.seed, args.model or "llm")
    print(result.table())
    _record(
        args,
        _section(args, "policy"),
        f"; {rounds} generations of 16 tokens per tenant, alternating. The router's "
        "tenants differ only in their rule set: none, the default set's rules on input, or "
        "on input and output, the 200 rules on input only, or on input and output; "
        f"{args.model or 'llm'}.",
        result.table(),
    )
    return 0


def _cold(args: argparse.Namespace) -> int:
    from bench.cold import measure, table

    print("timing each step hot and after idle gaps ...", file=sys.stderr)
    result = table(measure())
    print(result)
    _record(
        args,
        _section(args, "cold"),
        "; each step alone in this process, 100 calls per gap (medians): back to back, "
        "after a sleep, and after a busy wait.",
        result,
    )
    return 0


def _context(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="llm-mesh-bench-") as workdir:
        print("starting redis-server and context services ...", file=sys.stderr)
        result = run_context(Path(workdir), args.seed)
    print(result.table())
    _record(
        args,
        _section(args, "context"),
        "; 32 conversations at once, each 25 rounds of a load and an append of two "
        "200-character turns (50 turns at the end); Redis with appendfsync always.",
        result.table(),
    )
    return 0


def _sidecars(args: argparse.Namespace) -> int:
    from bench.sidecars import hop_latency, hop_table, sidecar_fleet

    with tempfile.TemporaryDirectory(prefix="llm-mesh-bench-") as workdir:
        print("starting a stack with sidecars and a direct router ...", file=sys.stderr)
        with sidecar_fleet(Path(workdir)) as routers:

            async def measure() -> list[Run]:
                return await _run_all(args, list(routers.targets()))

            runs = asyncio.run(measure())
            hops = asyncio.run(hop_latency(routers))
    write_json(args.out, _command(), _config(args), runs)
    table = (
        f"{results_table(runs)}\n\n{comparison_table(runs, 'direct', 'sidecars')}"
        f"\n\n{hop_table(hops)}"
    )
    print(table)
    _record(
        args,
        _section(args, "sidecars"),
        f", {args.rounds} x {args.num_prompts} prompts of {args.input_len} tokens, "
        f"{args.output_len} output tokens each (ignore_eos), with sessions off.",
        table,
    )
    return 1 if any(r.summary.failed for r in runs) else 0


def _decode(args: argparse.Namespace) -> int:
    from bench.decode import run_in_workdir

    result = run_in_workdir(model=args.model or "smollm2", rounds=max(args.rounds, 3))
    print(result.table())
    _record(
        args,
        _section(args, "decode"),
        f"; {result.model}, per round and path: one stream, then 16 at once, of "
        f"{result.prompt_tokens}-token chat prompts, {result.output_len} output tokens each "
        "(ignore_eos), each engine run on an empty cache.",
        result.table(),
    )
    return 0


def _quantization(args: argparse.Namespace) -> int:
    from bench.quantization import ANSWER_TOKENS, CHUNK_TOKENS, TEXT_CHUNKS, run

    result = run()
    print(result.table())
    _record(
        args,
        _section(args, "quantization"),
        f"; speed: each variant in a fresh engine, 64-token chat prompts, 64 output tokens "
        f"(ignore_eos); quality: chat = float32's greedy answers (up to {ANSWER_TOKENS} "
        f"tokens) to 64 chat prompts, text = Genesis (King James Version, Debian's "
        f"bible-kjv) in {TEXT_CHUNKS} chunks of {CHUNK_TOKENS} tokens, second halves "
        "scored. The reference, float32, is the GGUF file's 4-bit Q4_1 weights expanded, "
        "not the original 16-bit model.",
        result.table(),
    )
    return 0


def _inference_perf(args: argparse.Namespace) -> int:
    from bench import inference_perf as tool
    from llmmesh.launcher import Stack, StackPorts
    from llmmesh.launcher.tokenizer_dirs import write_tokenizer_dirs

    command = tool.tool_command()
    model = args.model or "smollm2"
    seconds = int(args.duration)
    with tempfile.TemporaryDirectory(prefix="llm-mesh-bench-") as workdir:
        root = Path(workdir)
        print("starting a local stack ...", file=sys.stderr)
        with Stack(root / "stack", StackPorts.free(), models=[model]) as stack:
            tokenizers = write_tokenizer_dirs(
                stack.address("inference"), stack.internal_token, [model], root / "tokenizers"
            )
            server = tool.Server(stack.openai_base_url, stack.api_key, model, tokenizers[model])
            runs = []
            for api in ("completion", "chat"):
                settings = tool.config(server, api, out=root / api / "reports", seconds=seconds)
                runs.append(tool.run_tool(command, settings, root / api))
    result = tool.table(runs)
    print(result)
    _record(
        args,
        _section(args, "inference-perf"),
        f"; {tool.TOOL} {tool.VERSION}, unmodified, its vllm client against the router's "
        f"OpenAI API, {model}, one request a second for {seconds} s per API, streamed, "
        "ignore_eos; completions: random prompts of 20-80 tokens, 8-24 output tokens; "
        "chat: 2 shared system prompts of 64 tokens, 16-token questions, 16 output tokens.",
        result,
    )
    return 1 if any(r.failures or not r.successes for r in runs) else 0


def _drift(args: argparse.Namespace) -> int:
    from bench.drift import TOP_LOGPROBS, run, table

    results = run(questions=args.num_prompts, output_len=args.output_len)
    print(table(results))
    _record(
        args,
        _section(args, "drift"),
        f"; smollm2, {args.num_prompts} greedy chat questions, {args.output_len} output "
        f"tokens, every request mirrored to the canary, top-{TOP_LOGPROBS} log "
        "probabilities per position, compared while the answers share their prefix.",
        table(results),
    )
    return 0


def _canary(args: argparse.Namespace) -> int:
    from bench.canary import ROLLBACK_INTERVAL_S, ROLLBACK_RATE, mirror_fleet, mirror_table
    from bench.canary import rollback as bad_canary

    with tempfile.TemporaryDirectory(prefix="llm-mesh-bench-") as workdir:
        root = Path(workdir)
        print("starting a stack, a paced canary and two routers ...", file=sys.stderr)
        (root / "mirror").mkdir()
        with mirror_fleet(root / "mirror") as fleet:

            async def measure() -> list[Run]:
                return await _run_all(args, list(fleet.targets()))

            runs = asyncio.run(measure())
        print("rolling out a canary that answers otherwise ...", file=sys.stderr)
        (root / "rollback").mkdir()
        rolled = bad_canary(root / "rollback", ROLLBACK_RATE, ROLLBACK_INTERVAL_S)
    write_json(args.out, _command(), _config(args), runs)
    table = (
        f"{results_table(runs)}\n\n{mirror_table(runs)}\n\n"
        f"A bad canary (another seed's weights), steps 1,5,25,50,100, judged every "
        f"{ROLLBACK_INTERVAL_S:g} s, default gates, {ROLLBACK_RATE:g} requests/s (Poisson), "
        f"mirror 10%:\n\n{rolled.table()}"
    )
    print(table)
    _record(
        args,
        _section(args, "canary"),
        f", {args.rounds} x {args.num_prompts} prompts of {args.input_len} tokens, "
        f"{args.output_len} output tokens each (ignore_eos); the tiny model.",
        table,
    )
    failed = any(r.summary.failed for r in runs)
    return 1 if failed or rolled.outcome != "rolled_back" else 0


def _shared_state(args: argparse.Namespace) -> int:
    from bench.shared_state import added_ttft, overshoot, shared_state_fleet

    with tempfile.TemporaryDirectory(prefix="llm-mesh-bench-") as workdir:
        print("starting a stack, Redis and three routers ...", file=sys.stderr)
        with shared_state_fleet(Path(workdir)) as routers:
            paired = asyncio.run(added_ttft(routers, args.num_prompts))
            held = overshoot(routers, args.duration)
    table = f"{paired.table()}\n\n{held.table()}"
    print(table)
    _record(
        args,
        _section(args, "shared-state"),
        f"; the tiny model; {args.num_prompts} pairs of 128-token prompts, 4 output tokens, "
        "a tenant with request and token budgets (every admission checks and charges "
        f"them); then two Redis routers, 4 streams each, for {args.duration:g} s.",
        table,
    )
    return 0


def _truncation(args: argparse.Namespace) -> int:
    from bench.truncation import Settings, evaluate, recommended, table

    settings = Settings(
        conversations=args.conversations, seed=args.seed, budget_tokens=args.budget_tokens
    )
    with tempfile.TemporaryDirectory(prefix="llm-mesh-bench-") as workdir:
        print("starting a stack serving smollm2 and a router over its budget ...", file=sys.stderr)
        evaluation = evaluate(Path(workdir), settings)
    default, why = recommended(evaluation.rows())
    rows = (
        f"{table(evaluation.rows())}\n\nThe default this argues for: **{default.strategy}**: {why}."
    )
    missing = sum(r.summaries_missing for r in evaluation.runs)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(evaluation.as_json(), indent=1))
    print(rows)
    print(f"answers and summaries: {args.out}", file=sys.stderr)
    _record(
        args,
        _section(args, "truncation"),
        f"; smollm2, greedy; {settings.conversations} conversations (seed {settings.seed}: "
        f"3 facts planted in the first exchanges, {settings.filler_rounds} exchanges after, "
        f"2 facts asked), a context of {settings.budget_tokens} tokens for the strategies "
        f"and the model's whole context for the reference, {settings.max_tokens}-token "
        f"answers; {evaluation.seconds / 60:.0f} min; model_summary folds not stored in "
        f"time: {missing}; requests sent again after UNAVAILABLE: {evaluation.retries}.",
        rows,
    )
    return 0


def _capacity(args: argparse.Namespace) -> int:
    from bench.capacity import CapacityShape, measure
    from services.inference.config import InferenceConfig

    shape = CapacityShape(stream_gap_ms=args.stream_gap_ms, on_a_stream=args.relay == "stream")
    gap = (
        f", responses at least {shape.stream_gap_ms:.0f} ms apart after a stream's first "
        f"{InferenceConfig.model_fields['engine_stream_gap_after'].default}"
        if shape.stream_gap_ms
        else ""
    )
    held, probe = (
        ("generations on one GenerateStream call (bench/stream_load.py)", ", on a stream")
        if shape.on_a_stream
        else ("streams", "")
    )
    with tempfile.TemporaryDirectory(prefix="llm-mesh-bench-") as workdir:
        print("starting a stack, paced replicas and a router on a CPU of its own ...",
              file=sys.stderr)  # fmt: skip
        capacity = measure(Path(workdir), shape)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(capacity.as_json(), indent=1))
    print(capacity.report())
    _record(
        args,
        _section(args, "capacity"),
        f"; {capacity.placement}; {shape.replicas} paced replicas ({shape.ttft_ms:.0f} ms to "
        f"the first token, a step every {shape.itl_ms:.0f} ms{gap}); h2load {shape.seconds:.0f} s "
        f"per step: arrivals of one-token requests ({shape.prompt_chars}-character "
        f"prompts), or {held} of {shape.stream_tokens} tokens held open; a probe times "
        f"one-token requests one at a time{probe}; the local stack's tenant (the default rule set, "
        "prompt and output checked); each step again at once against a bare grpc.aio "
        "streamer on the router's CPU.",
        capacity.report(),
    )
    return 0


def _peer_hop(args: argparse.Namespace) -> int:
    from bench.peer_router import VERSION, peer_router

    model = args.model or "llm"
    with contextlib.ExitStack() as fleet:
        stack = fleet.enter_context(_bench_stack(args, None))
        direct = stack.openai_base_url
        fronted = fleet.enter_context(
            peer_router([direct.removesuffix("/v1")], "round_robin", stack.workdir)
        )

        async def measure() -> Paired:
            router = named(OpenAiTarget(direct, model, stack.api_key), "router")
            peer = named(OpenAiTarget(fronted, model, stack.api_key), "vllm-router + router")
            try:
                return await paired_ttft(
                    router, peer, pairs=args.num_prompts, prompt_len=args.input_len,
                    max_tokens=args.output_len, seed=args.seed,
                )  # fmt: skip
            finally:
                await router.close()
                await peer.close()

        paired = asyncio.run(measure())
    print(paired.table())
    details = (
        f"; vllm-router {VERSION} (round_robin) in front of the router, against the router "
        f"alone; {args.num_prompts} pairs of {args.input_len}-character prompts, "
        f"{args.output_len} output tokens, {model}, concurrency 1, OpenAI HTTP API, streamed."
    )
    _record(args, _section(args, "peer-hop"), details, paired.table())
    return 0


def _peer_routing(args: argparse.Namespace) -> int:
    from bench.peer_router import VERSION, peer_routing_fleet

    spec = SessionSpec(sessions=args.num_prompts, output_len=args.output_len, seed=args.seed)
    rates = [float(r) for r in args.session_rates.split(",")]
    peer = f"vllm-router {args.peer_policy}"
    with tempfile.TemporaryDirectory(prefix="llm-mesh-bench-") as workdir:
        print(f"starting {REPLICAS} replicas, 5 routers and vllm-router ...", file=sys.stderr)
        fleet = peer_routing_fleet(Path(workdir), args.peer_policy, args.engine_cpu)
        with fleet as (urls, key, metrics):

            async def measure() -> Compared:
                targets: dict[str, Target] = {
                    name: named(OpenAiTarget(url, "llm", key), name) for name, url in urls.items()
                }
                return await compare_pickers(
                    targets, spec, rates, args.rounds, metrics, stateless=True
                )

            summaries, placements = asyncio.run(measure())
    result = RoutingResult(summaries, picker_decision_time(), peer, placements)
    print(result.table())
    _record(
        args,
        _section(args, "peer-routing"),
        f"; vllm-router {VERSION} --policy {args.peer_policy} over {REPLICAS} routers of one "
        f"replica each, against one router over the same {REPLICAS} replicas (llm_aware); "
        f"per rate and picker, {args.rounds} runs of {spec.sessions} sessions x "
        f"{spec.turns} turns, the routing scenario's, through the OpenAI HTTP API; the "
        "client resends the session's earlier prompts with every turn (no session "
        f"id){_engine_budget(args)}.",
        result.table(),
    )
    return 0


def _cpu_share(text: str) -> float:
    share = float(text)
    cpus = len(os.sched_getaffinity(0))
    if not 0.1 <= share <= cpus:
        raise argparse.ArgumentTypeError(f"a share of a CPU from 0.1 to {cpus}, not {text}")
    return share


def _engine_budget(args: argparse.Namespace) -> str:
    if args.engine_cpu is None:
        return "; the engines share every CPU"
    return (
        f"; each engine held to {args.engine_cpu:g} of a CPU of its own (a CPU cgroup), "
        "none lending its idle share to the others"
    )


def _command() -> str:
    return "llm-mesh " + shlex.join(sys.argv[1:])


def _section(args: argparse.Namespace, scenario: str) -> str:
    """--section, unless left at its default: then the scenario's own section."""
    return args.section if args.section != "baseline" else scenario


def _record(args: argparse.Namespace, section: str, run_details: str, content: str) -> None:
    """Replaces the section of --markdown (if given) with the command, the run and content."""
    if args.markdown:
        stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        body = f"Command: `{_command()}`  \nRun: {stamp}{run_details}\n\n{content}"
        update_markdown(args.markdown, section, body)


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


def _workload(args: argparse.Namespace) -> WorkloadSpec:
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


async def _run_all(
    args: argparse.Namespace,
    targets: list[Target] | None = None,
    meters: Mapping[str, CpuMeter] | None = None,
) -> list[Run]:
    """Every target at every load, rounds alternating; ``meters``: per target, the CPU
    groups of the processes that serve it."""
    spec = _workload(args)
    slo = Slo(
        ttft_s=args.ttft_slo_ms / 1000 if args.ttft_slo_ms else None,
        tpot_s=args.tpot_slo_ms / 1000 if args.tpot_slo_ms else None,
    )
    shapes = (
        [LoadShape(rate=args.rate, seed=args.seed)]
        if args.rate
        else [LoadShape(concurrency=int(c)) for c in args.concurrency.split(",")]
    )
    targets = targets or _targets(args)
    order = {target.name: i for i, target in enumerate(targets)}
    pooled: dict[tuple[int, str], Measurement] = {}
    spent: dict[tuple[int, str], CpuSpent] = {}
    per_round: dict[tuple[int, str], list[float]] = {}
    with_idle: dict[tuple[int, str], list[float]] = {}
    meters = meters or {}
    idle = {id(m): m.idle() for m in {id(m): m for m in meters.values()}.values()}
    try:
        for round_index in range(args.rounds):
            for index, shape in enumerate(shapes):
                # Alternate the order so that neither target always runs second.
                flip = (round_index + index) % 2 == 1
                for target in reversed(targets) if flip else targets:
                    # Same lengths and words for every target, but a fresh salt: the
                    # engine's prefix cache must not favour whichever target runs second.
                    requests = make_requests(replace(spec, salt=new_salt()))
                    meter = meters.get(target.name)
                    before = meter.sample() if meter is not None else None
                    measured = await run_load(
                        target, requests, shape, warmup=args.warmup, progress=not args.no_progress
                    )
                    key = (index, target.name)
                    if meter is not None and before is not None:
                        whole = meter.sample().minus(before)
                        cost = whole.beyond(idle[id(meter)])
                        spent[key] = spent[key].plus(cost) if key in spent else cost
                        summary = measured.summary(slo)
                        done = summary.requests - summary.failed
                        per_round.setdefault(key, []).append(path_cpu_ms(cost, done))
                        with_idle.setdefault(key, []).append(path_cpu_ms(whole, done))
                    if key in pooled:
                        pooled[key].add(measured)
                    else:
                        pooled[key] = measured
    finally:
        for target in targets:
            await target.close()
    return [
        Run(
            name,
            shapes[index].label(),
            shapes[index].concurrency,
            measured.summary(slo),
            measured.records,
            spent.get((index, name)),
            per_round.get((index, name), []),
            idle[id(meters[name])] if name in meters else None,
            with_idle.get((index, name), []),
        )
        for (index, name), measured in sorted(
            pooled.items(), key=lambda kv: (kv[0][0], order[kv[0][1]])
        )
    ]


def _config(args: argparse.Namespace) -> dict[str, Any]:
    return {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "func"}

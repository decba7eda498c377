"""``llm-mesh bench`` scenarios that start the fleet they measure (a stack, routers,
replicas) and record what they find."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from bench.admission import Shape as AdmissionShape
from bench.admission import admission_fleet
from bench.admission import compare as admission_compare
from bench.admission import plot as plot_admission
from bench.context import run as run_context
from bench.policy import run as run_policy
from bench.recording import command, config, record, section, workload_of
from bench.report import Run, comparison_table, results_table, write_json
from bench.rounds import run_all
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
from bench.scenarios import Paired, paired_ttft
from bench.stacks import bench_stack
from bench.targets import OpenAiTarget, Target, named


def _engine(args: argparse.Namespace) -> int:
    from bench.engine import engine_table, run_engine_as_served

    levels = [int(c) for c in args.concurrency.split(",")]
    model, sampling = args.model or "llm", args.sampling or {}
    runs = run_engine_as_served(workload_of(args), levels, model, sampling)
    print(engine_table(runs))
    record(
        args,
        section(args, "engine"),
        f", {args.num_prompts} prompts of {args.input_len} tokens, {args.output_len} "
        f"output tokens each, per concurrency; {model} as config.pbtxt builds it"
        + (f", sampling {json.dumps(sampling)}." if sampling else "."),
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
    record(
        args,
        section(args, "routing"),
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
    record(
        args,
        section(args, "admission"),
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
    record(
        args,
        section(args, "policy"),
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
    record(
        args,
        section(args, "cold"),
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
    record(
        args,
        section(args, "context"),
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
                return await run_all(args, list(routers.targets()))

            runs = asyncio.run(measure())
            hops = asyncio.run(hop_latency(routers))
    write_json(args.out, command(), config(args), runs)
    table = (
        f"{results_table(runs)}\n\n{comparison_table(runs, 'direct', 'sidecars')}"
        f"\n\n{hop_table(hops)}"
    )
    print(table)
    record(
        args,
        section(args, "sidecars"),
        f", {args.rounds} x {args.num_prompts} prompts of {args.input_len} tokens, "
        f"{args.output_len} output tokens each (ignore_eos), with sessions off.",
        table,
    )
    return 1 if any(r.summary.failed for r in runs) else 0


def _decode(args: argparse.Namespace) -> int:
    from bench.decode import run_in_workdir

    result = run_in_workdir(model=args.model or "smollm2", rounds=max(args.rounds, 3))
    print(result.table())
    record(
        args,
        section(args, "decode"),
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
    record(
        args,
        section(args, "quantization"),
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
    record(
        args,
        section(args, "inference-perf"),
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
    record(
        args,
        section(args, "drift"),
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
                return await run_all(args, list(fleet.targets()))

            runs = asyncio.run(measure())
        print("rolling out a canary that answers otherwise ...", file=sys.stderr)
        (root / "rollback").mkdir()
        rolled = bad_canary(root / "rollback", ROLLBACK_RATE, ROLLBACK_INTERVAL_S)
    write_json(args.out, command(), config(args), runs)
    table = (
        f"{results_table(runs)}\n\n{mirror_table(runs)}\n\n"
        f"A bad canary (another seed's weights), steps 1,5,25,50,100, judged every "
        f"{ROLLBACK_INTERVAL_S:g} s, default gates, {ROLLBACK_RATE:g} requests/s (Poisson), "
        f"mirror 10%:\n\n{rolled.table()}"
    )
    print(table)
    record(
        args,
        section(args, "canary"),
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
    record(
        args,
        section(args, "shared-state"),
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
    record(
        args,
        section(args, "truncation"),
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
    record(
        args,
        section(args, "capacity"),
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
        stack = fleet.enter_context(bench_stack(args, None))
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
    record(args, section(args, "peer-hop"), details, paired.table())
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
    record(
        args,
        section(args, "peer-routing"),
        f"; vllm-router {VERSION} --policy {args.peer_policy} over {REPLICAS} routers of one "
        f"replica each, against one router over the same {REPLICAS} replicas (llm_aware); "
        f"per rate and picker, {args.rounds} runs of {spec.sessions} sessions x "
        f"{spec.turns} turns, the routing scenario's, through the OpenAI HTTP API; the "
        "client resends the session's earlier prompts with every turn (no session "
        f"id){_engine_budget(args)}.",
        result.table(),
    )
    return 0


def _engine_budget(args: argparse.Namespace) -> str:
    if args.engine_cpu is None:
        return "; the engines share every CPU"
    return (
        f"; each engine held to {args.engine_cpu:g} of a CPU of its own (a CPU cgroup), "
        "none lending its idle share to the others"
    )


# Scenarios that start the fleet they measure, by --scenario name.
OWN_FLEET: dict[str, Callable[[argparse.Namespace], int]] = {
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
}

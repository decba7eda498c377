"""The ``llm-mesh`` command: run the local stack, generate, benchmark."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc

from llmmesh.client import (
    DEFAULT_STATE_FILE,
    StreamStats,
    api_key,
    auth_metadata,
    build_request,
    router_address,
    stream_text,
)
from llmmesh.launcher.stack import LOCAL_MODELS
from llmmesh.launcher.tokenizer_dirs import write_tokenizer_dirs

DEMO_PROMPT = "What is the capital of France?"


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        code: int = args.func(args)
        return code
    except grpc.RpcError as err:
        return _report_rpc_error(err)
    except KeyboardInterrupt:
        return 130


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llm-mesh", description=__doc__)
    commands = parser.add_subparsers(required=True, metavar="COMMAND")

    up = commands.add_parser("up", help="run the local stack until Ctrl-C")
    up.add_argument(
        "--state-file",
        type=Path,
        default=DEFAULT_STATE_FILE,
        help="write the endpoints here as JSON (default: %(default)s)",
    )
    up.add_argument(
        "--workdir",
        type=Path,
        default=Path(".llm-mesh"),
        help="logs, database and Triton backend directory (default: %(default)s)",
    )
    up.add_argument(
        "--free-ports", action="store_true", help="use free ephemeral ports instead of the defaults"
    )
    up.add_argument("--demo", action="store_true", help="stream one demo generation once up")
    up.add_argument(
        "--sidecars",
        action="store_true",
        help="an Envoy sidecar beside every service: mTLS, RBAC from mesh/consul's intentions",
    )
    up.add_argument(
        "--models",
        default=",".join(LOCAL_MODELS),
        help="the models the stable replica serves, the first the default "
        "(default: %(default)s; llm is the tiny random-weight model of the tests)",
    )
    up.add_argument(
        "--context-store",
        choices=("sqlite", "redis"),
        default="sqlite",
        help="where sessions live: a SQLite file, or a Redis server the stack runs "
        "(Debian's redis-server; default: %(default)s)",
    )
    up.set_defaults(func=_up)

    gen = commands.add_parser("generate", help="stream a generation through the router")
    gen.add_argument("prompt")
    gen.add_argument("--router", help="router address host:port (default: state file or :50051)")
    gen.add_argument("--model", default="")
    gen.add_argument("--max-tokens", type=int, default=0)
    gen.add_argument("--temperature", type=float)
    gen.add_argument("--top-p", type=float)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--stop", action="append")
    gen.add_argument("--session", default="", help="session id: keeps the conversation")
    gen.add_argument("--color", default="", help="x-llm-color: pins a subset, e.g. canary")
    gen.add_argument("--timeout", type=float, default=300.0, help="seconds")
    gen.add_argument(
        "--state-file",
        type=Path,
        default=DEFAULT_STATE_FILE,
        help="state file of `llm-mesh up` (router address, demo API key)",
    )
    gen.set_defaults(func=_generate)

    health = commands.add_parser(
        "health", help="exit 0 if a service answers grpc.health.v1 SERVING (container probes)"
    )
    health.add_argument("address", help="host:port of the service's gRPC port")
    health.add_argument("--service", default="", help="health service name (default: overall)")
    health.add_argument("--timeout", type=float, default=2.0, help="seconds")
    health.set_defaults(func=_health)

    _add_canary_parser(commands)

    from bench.cli import add_bench_parser

    add_bench_parser(commands)
    return parser


def _add_canary_parser(commands: Any) -> None:
    canary = commands.add_parser(
        "canary", help="shift the canary split; compare it with the traffic the router sent"
    )
    actions = canary.add_subparsers(required=True, metavar="ACTION")
    set_ = actions.add_parser("set", help="write new weights into the routing document")
    set_.add_argument(
        "--weight",
        action="append",
        required=True,
        metavar="SUBSET=PERCENT",
        help="e.g. canary=10; subsets not named share the rest (repeatable)",
    )
    set_.set_defaults(func=_canary_set)
    status = actions.add_parser("status", help="configured weights beside observed shares")
    status.add_argument(
        "--window", type=float, default=0.0, help="observe for this many seconds (0: since start)"
    )
    status.add_argument("--router-metrics", help="router metrics URL (default: state file)")
    status.set_defaults(func=_canary_status)
    rollout = actions.add_parser(
        "rollout", help="raise the canary's weight step by step, judged by its gates"
    )
    _add_rollout_arguments(rollout)
    rollout.set_defaults(func=_canary_rollout)
    for action in (set_, status, rollout):
        action.add_argument("--consul", default="", help="Consul address (or CONSUL_HTTP_ADDR)")
        action.add_argument("--routing-file", type=Path, help="default: the state file's")
        action.add_argument("--state-file", type=Path, default=DEFAULT_STATE_FILE)


def _duration_s(text: str) -> float:
    """``60``, ``60s``, ``2m``: seconds."""
    scale = {"s": 1.0, "m": 60.0, "h": 3600.0}.get(text[-1:], 0.0)
    try:
        return float(text[:-1]) * scale if scale else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: seconds, or 30s, 2m, 1h") from None


def _percentages(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(step) for step in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated percentages") from None


def _add_rollout_arguments(rollout: argparse.ArgumentParser) -> None:
    add = rollout.add_argument
    add("--model", required=True, help="the model whose canary is judged")
    add("--steps", type=_percentages, default=(1.0, 5.0, 25.0, 50.0, 100.0))
    add("--interval", type=_duration_s, default=60.0, help="between judgements: 60s, 2m")
    add("--canary", default="canary", help="the canary's subset")
    add("--stable", default="stable", help="the subset it is compared with")
    add("--router-http", action="append", help="a router's HTTP address (repeatable)")
    add("--token-file", type=Path, help="the mesh's token (default: beside the state file)")
    add("--max-wait", type=int, default=10, help="intervals a step waits for samples")
    add("--min-samples", type=int, default=50, help="per subset, before a latency verdict")
    add("--min-pairs", type=int, default=50, help="mirrored pairs before a drift verdict")
    add("--max-kl", type=float, default=0.1, help="mean KL per position: above, rollback")
    add("--min-agreement", type=float, default=0.8, help="top-1 agreement: below, rollback")
    add("--max-confidence-shift", type=float, default=0.08, help="above: pause")
    add("--max-entropy-change", type=float, default=0.15, help="relative; above: pause")
    add("--latency-tolerance", type=float, default=0.2, help="p99 over stable's: rollback")
    add("--error-tolerance", type=float, default=0.02, help="error rate over stable's")


def _rollout_settings(args: argparse.Namespace) -> Any:
    from llmmesh.analysis.gates import DriftGates, ErrorGate, LatencyGate
    from llmmesh.rollout import RolloutSettings

    latency = {"tolerance": args.latency_tolerance, "min_samples": args.min_samples}
    return RolloutSettings(
        model=args.model,
        steps=args.steps,
        interval_s=args.interval,
        canary=args.canary,
        stable=args.stable,
        max_wait=args.max_wait,
        drift=DriftGates(
            args.max_confidence_shift,
            args.max_entropy_change,
            args.max_kl,
            args.min_agreement,
            args.min_pairs,
        ),
        ttft=LatencyGate("ttft", **latency),
        tpot=LatencyGate("tpot", **latency),
        errors=ErrorGate(args.error_tolerance, min_samples=args.min_samples),
    )


def _rollout_files(args: argparse.Namespace) -> tuple[Path, Path]:
    """The status document and the lock, beside the routing file."""
    from llmmesh.canary import CanaryError

    routing_file = args.routing_file or _state(args.state_file).get("routing_file")
    if not routing_file:
        raise CanaryError("no routing file (run `llm-mesh up` first, or --routing-file)")
    base = Path(routing_file)
    return base.with_name(base.name + ".rollout.json"), base.with_name(base.name + ".rollout.lock")


def _canary_rollout(args: argparse.Namespace) -> int:
    from llmmesh.canary import CanaryError
    from llmmesh.rollout import FileStatus, Rollout, RouterObservations, file_lock

    state = _state(args.state_file)
    routers = args.router_http or [state.get("router_http", "127.0.0.1:8080")]
    urls = [f"http://{address}/internal/canary" for address in routers]
    token_file = args.token_file or args.state_file.parent / "internal_token"
    try:
        settings = _rollout_settings(args)
        status_file, lock_file = _rollout_files(args)
        token = token_file.read_text().strip()
        with file_lock(lock_file):
            run = Rollout(
                settings,
                _routing_store(args),
                RouterObservations(urls, token),
                FileStatus(status_file),
            )
            outcome = run.run()
    except (CanaryError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for entry in run.history:
        print(f"step {entry['step']} {entry['weight']:g}% {entry['state']}: {entry['why']}")
    print(f"rollout {outcome.value}; status in {status_file}")
    return {"promoted": 0, "paused": 3}.get(outcome.value, 4)


def _routing_store(args: argparse.Namespace) -> Any:
    from llmmesh.canary import routing_store

    routing_file = args.routing_file or _state(args.state_file).get("routing_file")
    return routing_store(args.consul, Path(routing_file) if routing_file else None)


def _state(path: Path) -> dict[str, Any]:
    return dict(json.loads(path.read_text())) if path.exists() else {}


def _canary_set(args: argparse.Namespace) -> int:
    from llmmesh.canary import CanaryError, parse_weights

    try:
        store = _routing_store(args)
        doc = store.update(parse_weights(args.weight))
    except CanaryError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    split = ", ".join(f"{s}={w:g}" for s, w in doc["split"].items())
    print(f"split {split} written to {store.where}")
    return 0


def _canary_status(args: argparse.Namespace) -> int:
    from llmmesh.canary import CanaryError, observed_over, status_table

    try:
        store = _routing_store(args)
        split = store.read().get("split") or {}
    except CanaryError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    url = (
        args.router_metrics
        or f"http://{_state(args.state_file).get('router_metrics', '127.0.0.1:9100')}/metrics"
    )
    print(f"configured in {store.where}; observed at {url}")
    print(status_table(split, observed_over(url, args.window)))
    _print_rollout(args)
    return 0


def _print_rollout(args: argparse.Namespace) -> None:
    from llmmesh.canary import CanaryError
    from llmmesh.rollout_status import FileStatus, status_lines

    try:
        status_file, _ = _rollout_files(args)
    except CanaryError:
        return
    status = FileStatus(status_file).read()
    if status is not None:
        print("\n".join(status_lines(status)))


def _report_rpc_error(err: grpc.RpcError) -> int:
    # Errors raised by a call are also grpc.Call objects carrying the status.
    code = getattr(err, "code", lambda: None)()
    details = getattr(err, "details", lambda: str(err))()
    print(f"error: {code.name if code else 'UNKNOWN'}: {details}", file=sys.stderr)
    return 1


def _health(args: argparse.Namespace) -> int:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    request = health_pb2.HealthCheckRequest(service=args.service)
    with grpc.insecure_channel(args.address) as channel:
        stub: Any = health_pb2_grpc.HealthStub(channel)  # its stubs are untyped
        try:
            reply = stub.Check(request, timeout=args.timeout)
        except grpc.RpcError as err:
            print(f"{args.address}: {err.code().name}: {err.details()}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{args.address}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


def _generate(args: argparse.Namespace) -> int:
    request = build_request(
        args.prompt,
        model=args.model,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        stop=args.stop,
        session_id=args.session,
    )
    metadata = auth_metadata(api_key(args.state_file))
    if args.color:
        metadata += (("x-llm-color", args.color),)
    with grpc.insecure_channel(router_address(args.router, args.state_file)) as channel:
        stream_to_terminal(channel, request, args.timeout, metadata)
    return 0


def stream_to_terminal(
    channel: grpc.Channel,
    request: object,
    timeout_s: float | None = None,
    metadata: tuple[tuple[str, str], ...] = (),
) -> StreamStats:
    stats = StreamStats()
    for text in stream_text(channel, request, stats, timeout_s, metadata):  # type: ignore[arg-type]
        sys.stdout.write(text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    print(stats.summary(), file=sys.stderr)
    return stats


def _up(args: argparse.Namespace) -> int:
    from llmmesh.launcher import Stack, StackPorts
    from llmmesh.launcher.stack import StackError
    from llmmesh.launcher.supervisor import GaveUp, Supervisor

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    ports = StackPorts.free() if args.free_ports else StackPorts()
    stack = Stack(
        args.workdir,
        ports,
        sidecars=args.sidecars,
        context_store=args.context_store,
        models=[m for m in args.models.split(",") if m],
    )
    print(
        f"starting Triton and the mesh services (logs in {stack.workdir / 'logs'}) ...",
        file=sys.stderr,
    )
    try:
        stack.start()
    except StackError as err:
        hint = "" if args.free_ports else " (or run with --free-ports)"
        print(f"error: {err}{hint}", file=sys.stderr)
        return 1
    try:
        state: dict[str, object] = {
            "api_key": stack.api_key,
            "routing_file": str(stack.routing_file),
            "openai_base_url": stack.openai_base_url,
        }
        tokenizers = write_tokenizer_dirs(
            stack.address("inference"),
            stack.internal_token,
            stack.models,
            stack.workdir / "tokenizers",
        )
        state["tokenizers"] = {model: str(path) for model, path in tokenizers.items()}
        stack.write_state(args.state_file, state)
        _print_endpoints(stack.endpoints(), args.state_file)
        for model, path in tokenizers.items():
            print(f"tokenizer of {model} (Hugging Face, with its chat template): {path}")
        print(f"routing document (edit to shift traffic): {stack.routing_file}")
        print(f"demo tenant API key: {stack.api_key}  (tenants: {stack.tenants_file})")
        print(f"OpenAI-compatible API: {stack.openai_base_url}")
        if args.demo:
            _demo(stack.address("router"), stack.api_key)
        print("stack is up; Ctrl-C to stop", file=sys.stderr)
        supervisor = Supervisor(
            stack, wait=stop.wait, report=lambda line: print(f"supervisor: {line}", file=sys.stderr)
        )
        while not stop.wait(0.5):
            try:
                if supervisor.tend():
                    stack.write_state(args.state_file, {**state, "restarts": supervisor.restarts})
            except GaveUp as err:
                print(f"error: {err}", file=sys.stderr)
                return 1
        return 0
    finally:
        print("stopping ...", file=sys.stderr)
        stack.stop()
        args.state_file.unlink(missing_ok=True)
        print("stopped", file=sys.stderr)


def _print_endpoints(endpoints: dict[str, str], state_file: Path) -> None:
    print("endpoints (all SERVING):")
    for name, address in endpoints.items():
        print(f"  {name:<18} {address}")
    print(f"state file: {state_file}")


def _demo(router: str, key: str) -> None:
    # Greedy: the same right answer on every run.
    flags = "--max-tokens 64 --temperature 0 --session demo"
    print(f"\ndemo: llm-mesh generate {DEMO_PROMPT!r} {flags}")
    request = build_request(DEMO_PROMPT, max_tokens=64, temperature=0.0, session_id="demo")
    with grpc.insecure_channel(router) as channel:
        try:
            stream_to_terminal(channel, request, 60, auth_metadata(key))
        except grpc.RpcError as err:
            _report_rpc_error(err)
    print()


if __name__ == "__main__":
    raise SystemExit(main())

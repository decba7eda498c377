"""The ``llm-mesh`` command: run the local stack, generate, benchmark."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc

from llmmesh.canary_cli import add_canary_parser
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
    up.add_argument(
        "--routers",
        type=int,
        default=1,
        help="routers to run: more than one share their state through the stack's Redis, "
        "behind an Envoy front on the router's ports (default: %(default)s)",
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
    gen.add_argument("--presence-penalty", type=float, help="in [-2, 2]")
    gen.add_argument("--frequency-penalty", type=float, help="in [-2, 2]")
    gen.add_argument("--repetition-penalty", type=float, help="> 0; 1: none")
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

    add_canary_parser(commands)

    from bench.cli import add_bench_parser

    add_bench_parser(commands)
    return parser


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
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty,
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
        routers=args.routers,
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

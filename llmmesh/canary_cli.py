"""``llm-mesh canary``: set the split, show it beside the traffic, run a rollout once, or
keep a controller running that runs the rollouts written to Consul KV.

Where things live: with Consul (``--consul`` or CONSUL_HTTP_ADDR) the routing document,
the rollout's status and its lock are Consul KV keys (llmmesh/rollout_consul.py);
without it, the local stack's routing file, with the status and a file lock beside it.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llmmesh.client import DEFAULT_STATE_FILE


def add_canary_parser(commands: Any) -> None:
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
    controller = actions.add_parser(
        "controller",
        help="always on: run each rollout document written to Consul KV llm-mesh/rollout",
    )
    controller.add_argument("--token-file", type=Path, help="the mesh's token, if it has one")
    controller.add_argument(
        "--router-http", action="append", help="routers to observe when a document names none"
    )
    controller.add_argument("--metrics-port", type=int, default=0, help="serve llm_canary_*")
    controller.add_argument("--metrics-host", default="127.0.0.1")
    controller.set_defaults(func=_canary_controller)
    for action in (set_, status, rollout, controller):
        action.add_argument("--consul", default="", help="Consul address (or CONSUL_HTTP_ADDR)")
        action.add_argument("--routing-file", type=Path, help="default: the state file's")
        action.add_argument("--state-file", type=Path, default=DEFAULT_STATE_FILE)


def _percentages(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(step) for step in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated percentages") from None


# Flag -> help; each flag is a field of llmmesh.rollout.RolloutDocument, where its
# default lives (the always-on controller reads the same fields from Consul KV).
_ROLLOUT_FLAGS = {
    "model": "the model whose canary is judged",
    "steps": "the canary's weights in turn, e.g. 1,5,25,50,100",
    "interval": "between judgements: 60s, 2m",
    "canary": "the canary's subset",
    "stable": "the subset it is compared with",
    "max_wait": "intervals a step waits for samples",
    "min_samples": "per subset, before a latency or error verdict",
    "min_pairs": "mirrored pairs before a drift verdict",
    "max_kl": "mean KL per position: above, rollback",
    "min_agreement": "top-1 agreement: below, rollback",
    "max_confidence_shift": "mean top-1 confidence shift: above, pause",
    "max_entropy_change": "relative entropy change: above, pause",
    "latency_tolerance": "the canary's p99 over stable's: above, rollback",
    "error_tolerance": "the canary's error rate over stable's: above, rollback",
}


def _add_rollout_arguments(rollout: argparse.ArgumentParser) -> None:
    from llmmesh.rollout import RolloutDocument

    texts: dict[str, Callable[[str], Any]] = {"steps": _percentages}
    for name, help_text in _ROLLOUT_FLAGS.items():
        field = RolloutDocument.model_fields[name]
        default = field.default
        if isinstance(default, tuple):
            default = ",".join(f"{step:g}" for step in default)
        kind = texts.get(name) or (int if isinstance(default, int) else str)
        rollout.add_argument(
            "--" + name.replace("_", "-"),
            type=kind,
            required=field.is_required(),
            help=help_text + ("" if field.is_required() else f" (default {default})"),
        )
    add = rollout.add_argument
    add("--router-http", action="append", help="a router's HTTP address (repeatable)")
    add("--token-file", type=Path, help="the mesh's token (default: beside the state file)")
    add("--metrics-port", type=int, default=0, help="serve the llm_canary_* metrics here")
    add("--metrics-host", default="127.0.0.1")


def _rollout_document(args: argparse.Namespace) -> Any:
    from llmmesh.rollout import RolloutDocument

    given = {name: getattr(args, name) for name in _ROLLOUT_FLAGS}
    given["routers"] = args.router_http or _state_routers(_state(args.state_file))
    return RolloutDocument.parse(
        json.dumps({k: v for k, v in given.items() if v is not None}), "the command line"
    )


def _state_routers(state: dict[str, Any]) -> list[str]:
    """Every router's HTTP address in the state file: each router's own when the stack
    runs several (their front would ask only one of them)."""
    each = [v for k, v in sorted(state.items()) if re.fullmatch(r"router_\d+_http", k)]
    return each or [state.get("router_http", "127.0.0.1:8080")]


def _rollout_files(args: argparse.Namespace) -> tuple[Path, Path]:
    """The status document and the lock, beside the routing file."""
    from llmmesh.canary import CanaryError

    routing_file = args.routing_file or _state(args.state_file).get("routing_file")
    if not routing_file:
        raise CanaryError("no routing file (run `llm-mesh up` first, or --routing-file)")
    base = Path(routing_file)
    return base.with_name(base.name + ".rollout.json"), base.with_name(base.name + ".rollout.lock")


def _token(args: argparse.Namespace) -> str:
    """The mesh's token: the file given, or the local stack's; none in a mesh whose
    sidecars authenticate the calls instead (docker-compose.yml)."""
    token_file = args.token_file or args.state_file.parent / "internal_token"
    if not args.token_file and not token_file.exists():
        return ""
    return str(token_file.read_text().strip())


def _serve_metrics(args: argparse.Namespace) -> None:
    if args.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(args.metrics_port, addr=args.metrics_host)


def _canary_rollout(args: argparse.Namespace) -> int:
    from llmmesh.canary import CanaryError, consul_client
    from llmmesh.rollout import FileStatus, Rollout, RouterObservations, file_lock
    from llmmesh.rollout_consul import consul_lock
    from llmmesh.rollout_status import STATUS_KEY, ConsulStatus

    try:
        document = _rollout_document(args)
        observations = RouterObservations(
            [f"http://{address}/internal/canary" for address in document.routers], _token(args)
        )
        _serve_metrics(args)
        client = consul_client(args.consul)
        if client is not None:
            where: str = f"consul kv {STATUS_KEY}"
            holding: Any = consul_lock(client)
            status: Any = ConsulStatus(client)
        else:
            status_file, lock_file = _rollout_files(args)
            where, holding = str(status_file), file_lock(lock_file)
            status = FileStatus(status_file)
        with holding as lock:
            held = lock.held if lock is not None else (lambda: True)
            run = Rollout(
                document.settings(), _routing_store(args), observations, status, holds_lock=held
            )
            outcome = run.run()
    except (CanaryError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for entry in run.history:
        print(f"step {entry['step']} {entry['weight']:g}% {entry['state']}: {entry['why']}")
    print(f"rollout {outcome.value}; status in {where}")
    return {"promoted": 0, "paused": 3}.get(outcome.value, 4)


def _canary_controller(args: argparse.Namespace) -> int:
    from llmmesh.canary import CanaryError, consul_client
    from llmmesh.rollout import RouterObservations
    from llmmesh.rollout_consul import ConsulLock, Controller

    client = consul_client(args.consul)
    if client is None:
        print("error: the controller follows Consul KV: --consul or CONSUL_HTTP_ADDR",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        token = _token(args)
    except OSError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    _serve_metrics(args)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())

    def observe(document: Any) -> RouterObservations:
        routers = document.routers or args.router_http or ["127.0.0.1:8080"]
        return RouterObservations([f"http://{r}/internal/canary" for r in routers], token)

    def sleep(seconds: float) -> None:  # an interval between judgements, cut short by a stop
        if stop.wait(seconds):
            raise CanaryError("stopped")

    print("rollout controller: following consul kv llm-mesh/rollout", flush=True)
    Controller(client, observe, ConsulLock(client), sleep, stop).serve()
    return 0


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
    from llmmesh.canary import CanaryError, Observed, observed_over, status_table

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
    try:
        seen = observed_over(url, args.window)
    except OSError as err:  # the rollout's status is worth showing all the same
        print(f"error: the router's metrics at {url}: {getattr(err, 'reason', err)}")
        seen, code = Observed({}), 1
    else:
        code = 0
    print(status_table(split, seen))
    _print_rollout(args)
    return code


def _print_rollout(args: argparse.Namespace) -> None:
    from llmmesh.canary import CanaryError, consul_client
    from llmmesh.rollout_status import ConsulStatus, FileStatus, status_lines

    client = consul_client(args.consul)
    if client is not None:
        status = ConsulStatus(client).read()
    else:
        try:
            status_file, _ = _rollout_files(args)
        except CanaryError:
            return
        status = FileStatus(status_file).read()
    if status is not None:
        print("\n".join(status_lines(status)))

"""`llm-mesh canary rollout` run to its end against a real router of the stack under load,
with shadow traffic: a canary with stable's own weights is promoted to 100%; the stack's
canary (the tiny model with another seed's weights) fails the drift gates and is rolled
back to 0 in the interval that saw it."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import consul
import grpc
import pytest
import yaml

from llmmesh.analysis.gates import DriftGates, ErrorGate, LatencyGate
from llmmesh.canary import FileRouting
from llmmesh.client import authorized_channel
from llmmesh.launcher import Stack, StackPorts
from llmmesh.rollout import FileStatus, Rollout, RolloutSettings, RouterObservations
from tests.conftest import collect, start_service, wait_for
from tests.consul_double import ConsulDoubleThread

ROUTING = """\
split: {stable: 100, canary: 0}
colors: {stable: stable, canary: canary}
mirror: {subset: canary, percent: 100, max_in_flight: 4}
"""
# Small windows: the gates' logic is the same as at 50 samples, the test is seconds long
# (in_process below gives the same settings).
# Latency gates judge 12 samples a side: of 5, a p99 is their slowest, and under the whole
# suite's load a twin's was once 2.3x stable's with a Mann-Whitney p of 0.04: a canary of
# stable's own weights rolled back.
LATENCY_SAMPLES = 12
FAST = [
    "--interval", "0.5s", "--min-samples", str(LATENCY_SAMPLES), "--min-pairs", "5",
    "--max-wait", "40", "--latency-tolerance", "1.0", "--error-tolerance", "0.2",
]  # fmt: skip


class Load:
    """Requests one after another on a thread, until stopped."""

    def __init__(self, address: str, key: str, **sampling: Any) -> None:
        """``sampling``: the requests' own (build_request's keywords)."""
        self._stop = threading.Event()
        self._sampling = {"max_tokens": 6, "ignore_eos": True, **sampling}
        self.subsets: list[str] = []
        self._thread = threading.Thread(target=self._run, args=(address, key), daemon=True)

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self, address: str, key: str) -> None:
        with authorized_channel(address, key) as channel:
            i = 0
            while not self._stop.is_set():
                i += 1
                try:
                    last = collect(channel, f"question {i}", **self._sampling)[-1]
                except grpc.RpcError:
                    continue
                self.subsets.append(last.served.subset)


@dataclass(frozen=True)
class Router:
    """One router for the module's rollouts: each writes its routing and endpoints files
    (watched every 0.1 s) and asks for what came since its own steps began."""

    workdir: Path
    ports: StackPorts

    @property
    def routing(self) -> Path:
        return self.workdir / "routing.yaml"


@pytest.fixture(scope="module")
def router(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Router]:
    tmp = tmp_path_factory.mktemp("rollout")
    (tmp / "routing.yaml").write_text(ROUTING)
    (tmp / "endpoints.json").write_text(json.dumps({"endpoints": stack_endpoints(stack)}))
    ports = StackPorts.free()
    child = start_service(
        stack,
        "router",
        ports.router,
        tmp,
        routing_file=str(tmp / "routing.yaml"),
        endpoints_file=str(tmp / "endpoints.json"),
        http_port=str(ports.router_http),
        watch_interval_s="0.1",
    )
    try:
        yield Router(tmp, ports)
    finally:
        child.terminate(5)


def stack_endpoints(stack: Stack) -> list[dict[str, str]]:
    return [
        _endpoint(stack.address("inference"), "stable"),
        _endpoint(stack.address("inference_canary"), "canary"),  # another seed's weights
    ]


def in_process(steps: tuple[float, ...], min_samples: int = LATENCY_SAMPLES) -> RolloutSettings:
    """The settings FAST gives the command line, for rollouts run in the test's process
    (the controller's own code, without a second interpreter's start)."""
    return RolloutSettings(
        model="llm",
        steps=steps,
        interval_s=0.5,
        max_wait=40,
        drift=DriftGates(min_pairs=5),
        ttft=LatencyGate("ttft", tolerance=1.0, min_samples=min_samples),
        tpot=LatencyGate("tpot", tolerance=1.0, min_samples=min_samples),
        errors=ErrorGate(0.2, min_samples=min_samples),
    )


def rollout(
    stack: Stack,
    router: Router,
    endpoints: list[dict[str, str]],
    steps: str | RolloutSettings,
) -> dict[str, Any]:
    """A rollout to its end under load: by the command line (``steps`` as it takes them),
    or in this process (``steps`` as settings); its exit code, status and split."""
    router.routing.write_text(ROUTING)
    (router.workdir / "endpoints.json").write_text(json.dumps({"endpoints": endpoints}))
    status_file = router.workdir / "routing.yaml.rollout.json"
    status_file.unlink(missing_ok=True)
    http = f"127.0.0.1:{router.ports.router_http}"
    with Load(f"127.0.0.1:{router.ports.router}", stack.api_key) as load:
        if isinstance(steps, RolloutSettings):
            url = f"http://{http}/internal/canary"
            observations = RouterObservations([url], stack.internal_token)
            outcome = Rollout(
                steps, FileRouting(router.routing), observations, FileStatus(status_file)
            ).run()
            code, out = {"promoted": 0, "paused": 3}.get(outcome.value, 4), outcome.value
        else:
            done = subprocess.run(
                [
                    sys.executable, "-m", "llmmesh.cli", "canary", "rollout", "--model", "llm",
                    "--steps", steps, *FAST, "--routing-file", str(router.routing),
                    "--router-http", http, "--token-file", str(stack.internal_token_file),
                ],
                capture_output=True, text=True, timeout=120, check=False,
            )  # fmt: skip
            code, out = done.returncode, done.stdout + done.stderr
    status = json.loads(status_file.read_text())
    split = yaml.safe_load(router.routing.read_text())["split"]
    return {"code": code, "out": out, "status": status, "split": split, "subsets": load.subsets}


def _endpoint(address: str, version: str) -> dict[str, str]:
    return {"address": address, "version": version, "region": "local"}


@contextlib.contextmanager
def twin(stack: Stack, tmp: Path, **faults: str) -> Iterator[list[dict[str, str]]]:
    """Endpoints whose canary replica serves stable's own model (same answers, agreement
    1), with the faults it is given."""
    port = StackPorts.free().inference
    settings = {f"faults__{name}": value for name, value in faults.items()}
    replica = start_service(stack, "inference", port, tmp, **settings)
    try:
        yield [
            _endpoint(stack.address("inference"), "stable"),
            _endpoint(f"127.0.0.1:{port}", "canary"),
        ]
    finally:
        replica.terminate(5)


def test_a_canary_with_stables_weights_is_promoted(
    stack: Stack, router: Router, tmp_path: Path
) -> None:
    with twin(stack, tmp_path) as endpoints:
        result = rollout(stack, router, endpoints, "50,100")
    assert result["code"] == 0, result["out"]
    assert result["split"]["canary"] == 100 and result["split"]["stable"] == 0
    states = [h["state"] for h in result["status"]["history"]]
    assert states[-1] == "promoted" and "passed" in states
    passed = next(h for h in result["status"]["history"] if h["state"] == "passed")
    assert passed["weight"] == 50
    assert "canary" in result["subsets"]  # it served real traffic at 50%


def test_a_slow_canary_is_rolled_back_by_its_ttft(
    stack: Stack, router: Router, tmp_path: Path
) -> None:
    with twin(stack, tmp_path, first_token_delay_s="0.3") as endpoints:
        result = rollout(stack, router, endpoints, in_process((50, 100)))
    assert result["code"] == 4, result["out"]
    assert result["split"]["canary"] == 0
    failed = {g["gate"] for g in result["status"]["gates"] if g["verdict"] == "fail"}
    assert failed == {"ttft_p99"}, result["status"]["gates"]


def test_a_failing_canary_is_rolled_back_by_its_errors(
    stack: Stack, router: Router, tmp_path: Path
) -> None:
    """The router's breaker keeps most requests off a failing replica: the canary's own
    attempts come slowly, so this rollout asks for three of them, not five."""
    with twin(stack, tmp_path, error_rate="0.7") as endpoints:
        result = rollout(stack, router, endpoints, in_process((50, 100), min_samples=3))
    assert result["code"] == 4, result["out"]
    assert result["split"]["canary"] == 0
    failed = {g["gate"] for g in result["status"]["gates"] if g["verdict"] == "fail"}
    assert "error_rate" in failed, result["status"]["gates"]


def test_a_canary_that_answers_otherwise_is_rolled_back(stack: Stack, router: Router) -> None:
    result = rollout(stack, router, stack_endpoints(stack), in_process((25, 50, 100)))
    assert result["code"] == 4, result["out"]
    assert result["split"]["canary"] == 0 and result["split"]["stable"] == 100
    status = result["status"]
    assert status["state"] == "rolled_back" and status["step"] == 1
    failed = {g["gate"] for g in status["gates"] if g["verdict"] == "fail"}
    assert "agreement" in failed, status["gates"]
    # Rolled back in the interval whose window first held enough pairs: no verdict of
    # "passed" on the way, and the waits before it were for samples.
    states = [h["state"] for h in status["history"]]
    assert states[0] == "running" and states[-1] == "rolled_back"
    assert set(states[1:-1]) <= {"waiting"}


def test_the_always_on_controller_runs_what_is_written_to_consul(
    stack: Stack, tmp_path: Path
) -> None:
    """`llm-mesh canary controller` follows Consul KV llm-mesh/rollout; a router follows
    the routing document in Consul KV; `canary status --consul` shows the outcome."""
    with ConsulDoubleThread() as double, twin(stack, tmp_path) as endpoints:
        host, port = double.address.split(":")
        client = consul.Consul(host=host, port=int(port))
        client.kv.put("llm-mesh/routing", json.dumps(yaml.safe_load(ROUTING)))
        (tmp_path / "endpoints.json").write_text(json.dumps({"endpoints": endpoints}))
        ports = StackPorts.free()
        router = start_service(
            stack, "router", ports.router, tmp_path,
            routing_source="consul", consul_address=double.address,
            endpoints_file=str(tmp_path / "endpoints.json"), http_port=str(ports.router_http),
            metrics_port=str(ports.router_metrics),
        )  # fmt: skip
        command = [sys.executable, "-m", "llmmesh.cli", "canary"]
        consul_flags = ["--consul", double.address]
        controller = subprocess.Popen(
            [*command, "controller", *consul_flags, "--token-file", str(stack.internal_token_file)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        try:
            with Load(f"127.0.0.1:{ports.router}", stack.api_key) as load:
                document = {
                    "model": "llm", "steps": [50, 100], "interval": "0.5s", "max_wait": 40,
                    "min_samples": LATENCY_SAMPLES, "min_pairs": 5, "latency_tolerance": 1.0,
                    "error_tolerance": 0.2, "routers": [f"127.0.0.1:{ports.router_http}"],
                }  # fmt: skip
                client.kv.put("llm-mesh/rollout", json.dumps(document))
                wait_for(lambda: _consul_state(client) == "promoted", 60, "the promotion")
            assert "canary" in load.subsets  # the router followed the split in Consul
            metrics = f"http://127.0.0.1:{ports.router_metrics}/metrics"
            shown = subprocess.run(
                [*command, "status", *consul_flags, "--router-metrics", metrics],
                capture_output=True, text=True, timeout=60, check=False,
            )  # fmt: skip
            assert shown.returncode == 0, shown.stdout + shown.stderr
            assert "promoted at step 2, weight 100%" in shown.stdout, shown.stdout
        finally:
            controller.terminate()
            output, _ = controller.communicate(timeout=30)
            router.terminate(5)
    assert controller.returncode == 0, output


def _consul_state(client: consul.Consul) -> str:
    _, entry = client.kv.get("llm-mesh/rollout/status")
    return str(json.loads(entry["Value"])["state"]) if entry else ""

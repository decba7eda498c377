"""The local stack: Triton plus the four services as supervised child processes."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import socket
import time
from collections.abc import Sequence
from dataclasses import asdict, astuple, dataclass, fields
from pathlib import Path
from types import TracebackType

from llmmesh.launcher.process import Child, StackError, free_ports
from llmmesh.launcher.redis import start_redis
from llmmesh.launcher.routers import FRONT, RouterFleetPorts, start_front, write_front_config
from llmmesh.launcher.sidecars import SidecarPorts, start_sidecar, wait_ready, write_configs
from llmmesh.launcher.triton import start_triton, wait_until_ready
from llmmesh.runtime.internal_auth import new_token_file, read_token

__all__ = ["Stack", "StackError", "StackPorts"]

# The checkout this launcher runs from: its services and models run from it too, whatever
# the directory they start in (an editable install would otherwise resolve `services` to
# the checkout it was installed from, and a second checkout's stack would run the first's).
CODE_ROOT = Path(__file__).resolve().parents[2]
REPO_MODELS = CODE_ROOT / "model_repository"
# Process -> the service it runs. The canary replica serves each model with its canary
# build (CANARY_ALIASES), so the local stack has a canary subset to split traffic to.
PROCESSES = {
    "policy": "policy",
    "context": "context",
    "inference": "inference",
    "inference_canary": "inference",
    "router": "router",
}
# The tiny model's canary has other random weights; the real model's is its int8 variant
# (what a quantization rollout looks like).
CANARY_ALIASES = {"llm": "llm_canary", "smollm2": "smollm2-int8"}
# The mesh models the stable replica serves, the first the default. Tests serve the tiny
# reference model (it loads in a second); `llm-mesh up` serves the real one first.
TEST_MODELS = ("llm",)
LOCAL_MODELS = ("smollm2", "llm")
# Shutdown order: the front door first, so it drains while its upstreams still answer.
STOP_ORDER = ("router", "inference", "inference_canary", "policy", "context", "redis", "triton")
# Where the context service keeps sessions: a SQLite file, or a Redis server of the stack's
# own (for context replicas that share sessions).
CONTEXT_STORES = ("sqlite", "redis")
DEMO_KEY_FILE = "demo_api_key"
INTERNAL_TOKEN_FILE = "internal_token"
# Tenants of the local stack (see services/router/tenants.py): only key hashes are stored.
DEFAULT_TENANTS = """\
# Tenants: edit while the stack runs (a valid change applies within a second).
tenants:
  - id: demo
    api_key_hashes: ["{digest}"]
    tier: standard
    # Budgets (omit for none): requests_per_minute, tokens_per_minute,
    # max_concurrent_streams; models: [...] limits the models it may use.
"""
# The routing document the local stack starts with (see services/router/routing.py).
DEFAULT_ROUTING = """\
# Routing document of the local stack: edit it while the stack runs; a valid change
# applies to new requests within a second, an invalid one is logged and ignored.
split: {stable: 100, canary: 0}   # subset -> weight
colors: {stable: stable, canary: canary}   # x-llm-color -> subset
# fallback: {stable: [canary]}   # let the canary serve when no stable replica is healthy
"""


@dataclass(frozen=True)
class StackPorts:
    router: int = 50051
    inference: int = 50061
    inference_canary: int = 50062
    policy: int = 50071
    context: int = 50081
    router_metrics: int = 9100
    router_http: int = 8080  # OpenAI-compatible HTTP
    inference_metrics: int = 9101
    policy_metrics: int = 9102
    context_metrics: int = 9103
    inference_canary_metrics: int = 9104
    triton_grpc: int = 8001
    triton_http: int = 8000
    triton_metrics: int = 8002
    redis: int = 6379  # used with the Redis context store only

    @classmethod
    def free(cls, host: str = "127.0.0.1") -> StackPorts:
        """Distinct ports the OS reports free right now (for tests and side-by-side stacks)."""
        ports = free_ports(len(fields(cls)), host)
        return cls(*ports)


class Stack:
    def __init__(
        self,
        workdir: Path,
        ports: StackPorts | None = None,
        host: str = "127.0.0.1",
        model_repository: Path = REPO_MODELS,
        env: dict[str, str] | None = None,
        *,
        sidecars: bool = False,
        context_store: str = "sqlite",
        models: Sequence[str] = TEST_MODELS,
        routers: int = 1,
    ) -> None:
        """``routers``: more than one runs that many routers sharing their state through
        the stack's Redis, behind an Envoy front on the router's ports."""
        if context_store not in CONTEXT_STORES:
            raise StackError(f"context_store: {context_store!r} is not one of {CONTEXT_STORES}")
        if routers < 1 or (routers > 1 and sidecars):
            raise StackError("routers: at least 1, and one only with sidecars")
        self.workdir = workdir.resolve()
        self.context_store = context_store
        self.models = tuple(models)
        self.ports = ports or StackPorts()
        self.host = host
        self.model_repository = model_repository.resolve()
        self._extra_env = env or {}
        self._children: dict[str, Child] = {}
        self._sidecar_configs: dict[str, Path] = {}
        # With sidecars: a real Envoy beside every service (launcher/sidecars.py).
        self.sidecar_ports = SidecarPorts.free(exclude=astuple(self.ports)) if sidecars else None
        self.router_fleet = (
            RouterFleetPorts.free(routers, exclude=astuple(self.ports)) if routers > 1 else None
        )

    def address(self, name: str) -> str:
        return f"{self.host}:{getattr(self.ports, name)}"

    @property
    def openai_base_url(self) -> str:
        return f"http://{self.address('router_http')}/v1"

    def endpoints(self) -> dict[str, str]:
        """Every endpoint as host:port, as written to the state file (with several
        routers, ``router`` and ``router_http`` are their front's)."""
        found = {name: self.address(name) for name in self._used_ports()}
        if self.router_fleet is not None:
            del found["router_metrics"]  # each router has its own
            for name in self.router_fleet.names():
                replica = self.router_fleet.of(name)
                key = name.replace("-", "_")
                found[key] = f"{self.host}:{replica.grpc}"
                found[f"{key}_http"] = f"{self.host}:{replica.http}"
                found[f"{key}_metrics"] = f"{self.host}:{replica.metrics}"
        if self.sidecar_ports is not None:
            sidecars = self.sidecar_ports
            for process, port in sidecars.inbound.items():
                found[f"sidecar_{process}"] = f"{self.host}:{port}"
            for process, port in sidecars.admin.items():
                found[f"sidecar_{process}_admin"] = f"{self.host}:{port}"
        return found

    def start(self, timeout_s: float = 180.0) -> None:
        """Starts every process and returns once all of them are ready."""
        busy = [name for name, port in self._used_ports().items() if _in_use(self.host, port)]
        if busy:
            taken = ", ".join(f"{name} ({self.address(name)})" for name in busy)
            raise StackError(f"ports already in use: {taken}")
        self.workdir.mkdir(parents=True, exist_ok=True)
        (self.workdir / "logs").mkdir(exist_ok=True)
        try:
            self._write_routing_files()
            self._write_tenants()
            new_token_file(self.internal_token_file)
            self._start_redis()
            self._start_triton()
            self._start_sidecars(time.monotonic() + timeout_s)
            for name in self.process_names:
                self._children[name] = self._spawn_service(name)
            deadline = time.monotonic() + timeout_s
            self._wait_triton(deadline)
            for name in self.process_names:
                self._children[name].wait_serving(self.service_address(name), deadline)
            self._start_front(deadline)
        except BaseException:
            self.stop()
            raise

    @property
    def process_names(self) -> list[str]:
        """The services' processes: with several routers, theirs instead of one."""
        if self.router_fleet is None:
            return list(PROCESSES)
        return [*(p for p in PROCESSES if p != "router"), *self.router_fleet.names()]

    def service_address(self, name: str) -> str:
        if self.router_fleet is not None and name.startswith("router-"):
            return f"{self.host}:{self.router_fleet.of(name).grpc}"
        return self.address(name)

    def _start_front(self, deadline: float) -> None:
        if self.router_fleet is None:
            return
        config = write_front_config(
            self.workdir / "mesh",
            self.router_fleet,
            self.ports.router,
            self.ports.router_http,
            self.host,
        )
        self._children[FRONT] = start_front(config, self.log_path(FRONT), self.workdir)
        wait_ready(self._children[FRONT], self.router_fleet.front_admin, deadline)
        self._children[FRONT].wait_serving(self.address("router"), deadline)

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM in order, each given ``grace_s`` to drain, then SIGKILL of its group;
        sidecars last, so that draining services can still reach their upstreams."""
        routers = self.router_fleet.names() if self.router_fleet is not None else []
        order = [FRONT, *routers, *STOP_ORDER, *(f"sidecar-{p}" for p in PROCESSES)]
        for name in order:
            child = self._children.pop(name, None)
            if child is not None:
                child.terminate(grace_s)

    def restart(self, name: str, timeout_s: float = 180.0) -> None:
        """Starts the dead process ``name`` again, on its ports and with its settings,
        once whatever is left of its process group is killed (a dead Triton's backend
        stubs); returns once it is ready, raises StackError if it is not."""
        old = self._children[name]
        old.terminate(0)
        deadline = time.monotonic() + timeout_s
        if name == "triton":
            self._start_triton(append=True)
            self._wait_triton(deadline)
        elif name == "redis":
            self._start_redis(append=True)  # recovers every acknowledged write from its AOF
        elif name == FRONT:
            assert self.router_fleet is not None
            config = self.workdir / "mesh" / "envoy-router-front.json"
            self._children[name] = start_front(
                config, self.log_path(name), self.workdir, append=True
            )
            wait_ready(self._children[name], self.router_fleet.front_admin, deadline)
        elif name.startswith("sidecar-"):
            process = name.removeprefix("sidecar-")
            assert self.sidecar_ports is not None
            self._children[name] = start_sidecar(
                process, self._sidecar_configs[process], self.log_path(name), self.workdir,
                append=True,
            )  # fmt: skip
            wait_ready(self._children[name], self.sidecar_ports.admin[process], deadline)
        else:
            self._children[name] = self._spawn_service(name, append=True)
            self._children[name].wait_serving(self.service_address(name), deadline)

    def exit_code(self, name: str) -> int | None:
        return self._children[name].process.poll()

    def _spawn_service(self, name: str, *, append: bool = False) -> Child:
        env, log = self.service_env(name), self.log_path(name)
        service = "router" if name.startswith("router-") else PROCESSES[name]
        return Child.service(name, env, log, self.workdir, service, append=append)

    def _start_sidecars(self, deadline: float) -> None:
        if self.sidecar_ports is None:
            return
        app_ports = {p: getattr(self.ports, p) for p in PROCESSES}
        configs = write_configs(self.workdir / "mesh", self.sidecar_ports, app_ports)
        self._sidecar_configs = configs
        for process, config in configs.items():
            self._children[f"sidecar-{process}"] = start_sidecar(
                process, config, self.log_path(f"sidecar-{process}"), self.workdir
            )
        for process in configs:
            admin = self.sidecar_ports.admin[process]
            wait_ready(self._children[f"sidecar-{process}"], admin, deadline)

    def start_service(self, service: str, port: int, workdir: Path, **settings: str) -> Child:
        """One more instance of a stack service on ``port`` beside the stack (replicas and
        routers of benchmarks and tests), with ``settings`` overriding its config fields;
        returns once it serves. The caller stops it."""
        prefix = f"LLM_MESH_{service.upper()}_"
        env = self.service_env(service) | {
            f"{prefix}GRPC_PORT": str(port),
            f"{prefix}METRICS_PORT": "0",
        }
        if service == "router":
            env[f"{prefix}HTTP_PORT"] = "0"  # the stack's router has the HTTP port
        own_replicas = {"endpoints_file", "inference_addresses", "discovery"} & set(settings)
        if service == "router" and own_replicas and "pool__via" not in settings:
            # Replicas of its own have no sidecars: dial them directly.
            env[f"{prefix}POOL__VIA"] = ""
        env |= {prefix + key.upper(): value for key, value in settings.items()}
        name = f"{service}-{port}"
        child = Child.service(name, env, workdir / f"{name}.log", workdir, service)
        child.wait_serving(f"{self.host}:{port}", time.monotonic() + 60)
        return child

    def dead_children(self) -> list[str]:
        return [name for name, c in self._children.items() if not c.alive]

    def pids(self) -> dict[str, int]:
        return {name: c.process.pid for name, c in self._children.items()}

    def log_path(self, name: str) -> Path:
        return self.workdir / "logs" / f"{name}.log"

    def write_state(self, path: Path, extra: dict[str, object] | None = None) -> None:
        state: dict[str, object] = {**self.endpoints(), "pids": self.pids(), **(extra or {})}
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=2) + "\n")
        tmp.replace(path)

    def __enter__(self) -> Stack:
        self.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    @property
    def runs_redis(self) -> bool:
        """For the context service's sessions, or for the routers' shared state."""
        return self.context_store == "redis" or self.router_fleet is not None

    def _used_ports(self) -> dict[str, int]:
        ports = asdict(self.ports)
        if not self.runs_redis:
            del ports["redis"]
        return ports

    def _start_redis(self, *, append: bool = False) -> None:
        if self.runs_redis:
            # Sessions want every write on disk before it is acknowledged; the routers'
            # shared state alone does not (llmmesh/launcher/redis.py).
            fsync = "always" if self.context_store == "redis" else "everysec"
            self._children["redis"] = start_redis(
                self.workdir / "redis",
                self.ports.redis,
                self.log_path("redis"),
                append=append,
                fsync=fsync,
            )

    @property
    def triton_models(self) -> list[str]:
        """What Triton loads: the served models and the canary builds of those it has."""
        return [*self.models, *(CANARY_ALIASES[m] for m in self.models if m in CANARY_ALIASES)]

    def _start_triton(self, *, append: bool = False) -> None:
        ports = (self.ports.triton_grpc, self.ports.triton_http, self.ports.triton_metrics)
        self._children["triton"] = start_triton(
            self.workdir,
            self.model_repository,
            self.host,
            ports,
            self.log_path("triton"),
            append=append,
            models=self.triton_models,
        )

    @property
    def endpoints_file(self) -> Path:
        return self.workdir / "endpoints.yaml"

    @property
    def routing_file(self) -> Path:
        return self.workdir / "routing.yaml"

    @property
    def tenants_file(self) -> Path:
        return self.workdir / "tenants.yaml"

    @property
    def internal_token_file(self) -> Path:
        """The mesh's own credential, which internal services require of their callers."""
        return self.workdir / INTERNAL_TOKEN_FILE

    @property
    def internal_token(self) -> str:
        return read_token(self.internal_token_file)

    @property
    def api_key(self) -> str:
        """The demo tenant's API key (kept in the work directory, readable by its owner)."""
        return (self.workdir / DEMO_KEY_FILE).read_text().strip()

    def _write_tenants(self) -> None:
        """A demo tenant with a fresh key, unless an earlier run left its own files."""
        key_file = self.workdir / DEMO_KEY_FILE
        if not key_file.exists() or not self.tenants_file.exists():
            key = "llmm-" + secrets.token_urlsafe(24)
            key_file.touch(mode=0o600)
            key_file.write_text(key + "\n")
            digest = "sha256:" + hashlib.sha256(key.encode()).hexdigest()
            self.tenants_file.write_text(DEFAULT_TENANTS.format(digest=digest))

    def _write_routing_files(self) -> None:
        """The replicas as static discovery lists them; the routing document unless an
        operator's edit from an earlier run is there."""
        endpoints = [
            {"address": self.replica_address(p), "version": version, "region": "local"}
            for p, version in (("inference", "stable"), ("inference_canary", "canary"))
        ]
        self.endpoints_file.write_text(json.dumps({"endpoints": endpoints}, indent=2) + "\n")
        if not self.routing_file.exists():
            self.routing_file.write_text(DEFAULT_ROUTING)

    def replica_address(self, process: str) -> str:
        """Where the router reaches an inference replica: its sidecar, if it has one."""
        if self.sidecar_ports is None:
            return self.address(process)
        return self.sidecar_ports.inbound_address(process, self.host)

    def service_env(self, name: str) -> dict[str, str]:
        if self.router_fleet is not None and name.startswith("router-"):
            return self._router_replica_env(name)
        prefix = f"LLM_MESH_{PROCESSES.get(name, name).upper()}_"
        env = {
            **os.environ,
            "PYTHONPATH": _with_code_root(os.environ.get("PYTHONPATH", "")),
            **self._extra_env,
            f"{prefix}HOST": self.host,
            f"{prefix}GRPC_PORT": str(getattr(self.ports, name)),
            f"{prefix}METRICS_PORT": str(getattr(self.ports, f"{name}_metrics")),
            f"{prefix}INTERNAL_TOKEN_FILE": str(self.internal_token_file),
        }
        if name.startswith("inference"):
            env[f"{prefix}TRITON_URL"] = self.address("triton_grpc")
            env[f"{prefix}TRITON_METRICS_URL"] = f"http://{self.address('triton_metrics')}/metrics"
            env[f"{prefix}MODELS"] = json.dumps(list(self.models))
            if name == "inference_canary":
                canaries = {m: t for m, t in CANARY_ALIASES.items() if m in self.models}
                env[f"{prefix}MODEL_ALIASES"] = json.dumps(canaries)
                env[f"{prefix}MODELS"] = json.dumps(list(canaries))
        elif name == "policy":
            env.setdefault(f"{prefix}AUDIT_PATH", str(self.workdir / "logs" / "audit.log"))
        elif name == "context":
            store = {"kind": "sqlite", "path": str(self.workdir / "context.sqlite3")}
            if self.context_store == "redis":
                store = {"kind": "redis", "url": f"redis://{self.address('redis')}/0"}
            env.setdefault(f"{prefix}STORE", json.dumps(store))
        elif name == "router":
            env[f"{prefix}HTTP_PORT"] = str(self.ports.router_http)
            env[f"{prefix}POLICY_ADDRESS"] = self._upstream("policy")
            env[f"{prefix}CONTEXT_ADDRESS"] = self._upstream("context")
            if self.sidecar_ports is not None:
                env[f"{prefix}POOL__VIA"] = self._upstream("inference")
            env[f"{prefix}ENDPOINTS_FILE"] = str(self.endpoints_file)
            env[f"{prefix}ROUTING_FILE"] = str(self.routing_file)
            env[f"{prefix}TENANTS_FILE"] = str(self.tenants_file)
            env[f"{prefix}REGION"] = "local"
            env[f"{prefix}MODELS"] = json.dumps(self.triton_models)
        return env

    def _router_replica_env(self, name: str) -> dict[str, str]:
        """One router of several: its own ports, the fleet's state in the stack's Redis."""
        assert self.router_fleet is not None
        ports, prefix = self.router_fleet.of(name), "LLM_MESH_ROUTER_"
        return self.service_env("router") | {
            f"{prefix}GRPC_PORT": str(ports.grpc),
            f"{prefix}HTTP_PORT": str(ports.http),
            f"{prefix}METRICS_PORT": str(ports.metrics),
            f"{prefix}STATE": "redis",
            f"{prefix}REDIS_URL": f"redis://{self.address('redis')}/1",
        }

    def _upstream(self, service: str) -> str:
        """How the router reaches ``service``: its sidecar's listener, or directly."""
        if self.sidecar_ports is None:
            return self.address(service)
        return self.sidecar_ports.router_address(service, self.host)

    def _wait_triton(self, deadline: float) -> None:
        triton = self._children["triton"]
        wait_until_ready(triton, self.address("triton_grpc"), deadline, self.triton_models)


def _in_use(host: str, port: int) -> bool:
    """Whether something listens on the port (connections lingering in TIME_WAIT after a
    previous run do not count: servers bind with SO_REUSEADDR, and so does this probe)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def _with_code_root(path: str) -> str:
    """``PYTHONPATH`` with this checkout first."""
    return os.pathsep.join([str(CODE_ROOT), *(p for p in path.split(os.pathsep) if p)])

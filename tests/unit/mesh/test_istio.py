"""mesh/istio, docker-compose.yml and docker/: validated with the tools made for them
(kubernetes-validate, docker-compose config, hadolint), Istio resources against the fields
Istio's reference defines, and everything cross-checked with the intentions and ports."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Literal

import pytest
import yaml
from pydantic import BaseModel, ConfigDict, Field

from llmmesh.mesh.intentions import MESH_DIR, grants, load_intentions
from services.context.config import ContextConfig
from services.inference.config import InferenceConfig
from services.policy.config import PolicyConfig
from services.router.config import RouterConfig

ISTIO = MESH_DIR / "istio"
REPO = MESH_DIR.parent
ISTIO_KINDS = {"DestinationRule", "VirtualService", "PeerAuthentication", "AuthorizationPolicy"}
PORTS = {
    "router": RouterConfig().grpc_port,
    "policy": PolicyConfig().grpc_port,
    "context": ContextConfig().grpc_port,
    "inference": InferenceConfig().grpc_port,
}


def documents() -> list[dict[str, Any]]:
    docs = []
    for path in sorted(ISTIO.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def tool(name: str) -> str:
    found = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    assert found, f"{name} is not installed (make test installs it)"
    return found


def test_core_manifests_pass_kubernetes_validate(tmp_path: Path) -> None:
    core = [d for d in documents() if d["kind"] not in ISTIO_KINDS]
    assert {d["kind"] for d in core} >= {
        "Namespace",
        "ServiceAccount",
        "Deployment",
        "Service",
        "HorizontalPodAutoscaler",
        "ConfigMap",
    }
    path = tmp_path / "core.yaml"
    path.write_text(yaml.safe_dump_all(core))
    done = subprocess.run(
        [tool("kubernetes-validate"), "--strict", "--kubernetes-version", "1.30", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class Meta(Strict):
    name: str
    namespace: str


# networking.istio.io/v1 (istio.io/latest/docs/reference/config/networking/).
class IstioSubset(Strict):
    name: str
    labels: dict[str, str]


class DestinationRuleSpec(Strict):
    host: str
    trafficPolicy: dict[str, Any] = Field(default_factory=dict)  # noqa: N815 (Istio field)
    subsets: list[IstioSubset]


class StringMatch(Strict):
    exact: str


class HttpMatch(Strict):
    headers: dict[str, StringMatch]


class Destination(Strict):
    host: str
    subset: str


class RouteDestination(Strict):
    destination: Destination
    weight: int | None = Field(default=None, ge=0, le=100)


class HttpRoute(Strict):
    name: str = ""
    match: list[HttpMatch] = Field(default_factory=list)
    route: list[RouteDestination]


class VirtualServiceSpec(Strict):
    hosts: list[str]
    http: list[HttpRoute]


# security.istio.io/v1 (istio.io/latest/docs/reference/config/security/).
class PeerAuthenticationSpec(Strict):
    mtls: dict[Literal["mode"], Literal["STRICT", "PERMISSIVE", "DISABLE"]]


class Source(Strict):
    principals: list[str]


class From(Strict):
    source: Source


class Operation(Strict):
    methods: list[str] = Field(default_factory=list)
    paths: list[str] = Field(default_factory=list)


class To(Strict):
    operation: Operation


class Rule(Strict):
    from_: list[From] = Field(alias="from")
    to: list[To] = Field(default_factory=list)


class WorkloadSelector(Strict):
    matchLabels: dict[str, str]  # noqa: N815 (Istio field)


class AuthorizationPolicySpec(Strict):
    selector: WorkloadSelector | None = None
    action: Literal["ALLOW", "DENY", "AUDIT", "CUSTOM"] = "ALLOW"
    rules: list[Rule] = Field(default_factory=list)


SPECS: dict[str, type[BaseModel]] = {
    "DestinationRule": DestinationRuleSpec,
    "VirtualService": VirtualServiceSpec,
    "PeerAuthentication": PeerAuthenticationSpec,
    "AuthorizationPolicy": AuthorizationPolicySpec,
}


def istio(kind: str) -> list[tuple[Meta, Any]]:
    return [
        (Meta.model_validate(d["metadata"]), SPECS[kind].model_validate(d["spec"]))
        for d in documents()
        if d["kind"] == kind
    ]


def test_istio_resources_have_only_fields_istio_defines() -> None:
    for kind in ISTIO_KINDS:
        assert istio(kind), kind


def test_authorization_policies_equal_the_intentions() -> None:
    policies = {meta.name: spec for meta, spec in istio("AuthorizationPolicy")}
    assert policies["deny-by-default"].rules == [] and policies["deny-by-default"].selector is None
    for name, entry in load_intentions().items():
        if name == "router":
            continue  # the front door: its callers arrive through the ingress gateway
        allowed = {}
        for rule in policies[name].rules:
            (source,) = rule.from_
            (principal,) = source.source.principals
            (to,) = rule.to
            allowed[principal.rsplit("/", 1)[1]] = set(to.operation.paths)
        expected = {g.source: set(g.paths or ()) for g in grants(entry)}
        assert allowed == expected, name
    ((_, peer),) = istio("PeerAuthentication")
    assert peer.mtls == {"mode": "STRICT"}


def test_subsets_routes_ports_and_probes_agree() -> None:
    ((_, rule),) = istio("DestinationRule")
    ((_, virtual),) = istio("VirtualService")
    subsets = {s.name for s in rule.subsets}
    assert subsets == {"stable", "canary"}
    weights = [d.weight for r in virtual.http for d in r.route if d.weight is not None]
    assert sum(weights) == 100
    colored = [r for r in virtual.http if r.match]
    assert {m.headers["x-llm-color"].exact for r in colored for m in r.match} == subsets
    deployments = [d for d in documents() if d["kind"] == "Deployment"]
    versions = {
        d["metadata"]["labels"]["version"]
        for d in deployments
        if d["metadata"]["labels"]["app"] == "inference"
    }
    assert versions == subsets
    for deployment in deployments:
        app = deployment["metadata"]["labels"]["app"]
        if app not in PORTS:
            continue
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        assert container["readinessProbe"]["grpc"]["port"] == PORTS[app], app
        assert container["resources"]["requests"], app
    services = {d["metadata"]["name"]: d for d in documents() if d["kind"] == "Service"}
    for app, port in PORTS.items():
        assert services[app]["spec"]["ports"][0]["port"] == port


def test_inference_scales_on_engine_load_not_cpu() -> None:
    (hpa,) = [d for d in documents() if d["kind"] == "HorizontalPodAutoscaler"]
    names = {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]}
    assert names == {"llm_engine_waiting_sequences", "llm_engine_kv_utilization"}
    model = (REPO / "model_repository" / "llm" / "1" / "model.py").read_text()
    assert all(f'"{name}"' in model for name in names)  # metrics the engine exports


def test_dockerfiles_pass_hadolint() -> None:
    dockerfiles = sorted((REPO / "docker").glob("Dockerfile*"))
    assert len(dockerfiles) == 3
    done = subprocess.run(
        [tool("hadolint"), *map(str, dockerfiles)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr


# Each compose service's gRPC port unless its environment sets another (service configs).
GRPC_PORTS = {
    "policy": 50071,
    "context": 50081,
    "inference-stable": 50061,
    "inference-canary": 50061,
    "router": 50051,
}


def test_compose_file_passes_docker_compose_config() -> None:
    compose = shutil.which("docker-compose")
    if compose is None:
        pytest.fail("docker-compose (Debian package) is not installed; make test installs it")
    done = subprocess.run(
        [compose, "-f", str(REPO / "docker-compose.yml"), "config"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr
    config = yaml.safe_load(done.stdout)
    registrations = {p.name for p in (MESH_DIR / "consul" / "services").glob("*.json")}
    sidecars = {name: svc for name, svc in config["services"].items() if name.endswith("-sidecar")}
    assert {s["environment"]["REGISTRATION"] for s in sidecars.values()} == registrations
    for name, sidecar in sidecars.items():
        assert sidecar["network_mode"] == f"service:{name.removesuffix('-sidecar')}"
    # Every process of the mesh is restarted when it exits and probed as the launcher
    # probes it: the services by grpc.health.v1 on their own gRPC port, Triton by readiness.
    triton = config["services"]["triton"]
    assert triton["restart"] == "unless-stopped"
    assert triton["healthcheck"]["test"][-1].endswith(":8000/v2/health/ready")
    for name, default_port in GRPC_PORTS.items():
        service = config["services"][name]
        variable = f"LLM_MESH_{name.split('-')[0].upper()}_GRPC_PORT"
        port = service["environment"].get(variable, default_port)
        assert service["restart"] == "unless-stopped", name
        assert service["healthcheck"]["test"] == [
            "CMD", "llm-mesh", "health", f"127.0.0.1:{port}"
        ], name  # fmt: skip

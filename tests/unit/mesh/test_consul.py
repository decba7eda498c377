"""mesh/consul: every document against the fields Consul's documentation defines for its
kind, and cross-checked with the others, the protos, the services' ports and the KV
documents the services parse."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import pytest
import yaml
from google.protobuf import descriptor_pool
from pydantic import BaseModel, ConfigDict, Field

from llmmesh.mesh.intentions import CONFIG_ENTRIES, MESH_DIR, ServiceIntentions, load_intentions
from llmmesh.policy.rules import RuleSet
from llmmesh.v1 import context_pb2, inference_pb2, policy_pb2  # noqa: F401 (registers them)
from services.context.config import ContextConfig
from services.inference.config import InferenceConfig
from services.policy.config import DEFAULT_RULES, PolicyConfig
from services.router.config import RouterConfig
from services.router.routing import parse_policy
from services.router.tenants import parse_tenants

CONSUL = MESH_DIR / "consul"


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# Config entries (developer.hashicorp.com/consul/docs/connect/config-entries/*).
class ProxyDefaults(Strict):
    Kind: Literal["proxy-defaults"]
    Name: Literal["global"]
    proxy_config: dict[str, Any] = Field(default_factory=dict, alias="Config")
    MutualTLSMode: Literal["", "strict", "permissive"] = ""


class TransparentProxySettings(Strict):
    OutboundListenerPort: int = 15001
    DialedDirectly: bool = False


class ServiceDefaults(Strict):
    Kind: Literal["service-defaults"]
    Name: str
    Protocol: Literal["tcp", "http", "http2", "grpc"]
    TransparentProxy: TransparentProxySettings | None = None


class Subset(Strict):
    Filter: str = ""
    OnlyPassing: bool = False


class FailoverTarget(Strict):
    Service: str = ""
    ServiceSubset: str = ""
    Datacenters: list[str] = Field(default_factory=list)


class ServiceResolver(Strict):
    Kind: Literal["service-resolver"]
    Name: str
    DefaultSubset: str = ""
    Subsets: dict[str, Subset] = Field(default_factory=dict)
    ConnectTimeout: str = ""
    Failover: dict[str, FailoverTarget] = Field(default_factory=dict)


class Split(Strict):
    Weight: float = Field(ge=0, le=100)
    ServiceSubset: str = ""
    Service: str = ""


class ServiceSplitter(Strict):
    Kind: Literal["service-splitter"]
    Name: str
    Splits: list[Split]


class HeaderMatch(Strict):
    Name: str
    Exact: str = ""
    Present: bool = False


class HttpRouteMatch(Strict):
    Header: list[HeaderMatch] = Field(default_factory=list)
    PathPrefix: str = ""


class RouteMatch(Strict):
    HTTP: HttpRouteMatch


class RouteDestination(Strict):
    Service: str = ""
    ServiceSubset: str = ""


class Route(Strict):
    Match: RouteMatch
    Destination: RouteDestination


class ServiceRouter(Strict):
    Kind: Literal["service-router"]
    Name: str
    Routes: list[Route]


KINDS: dict[str, type[BaseModel]] = {
    "proxy-defaults": ProxyDefaults,
    "service-defaults": ServiceDefaults,
    "service-resolver": ServiceResolver,
    "service-splitter": ServiceSplitter,
    "service-router": ServiceRouter,
    "service-intentions": ServiceIntentions,
}


# Service definitions (developer.hashicorp.com/consul/docs/services/configuration).
class Check(Strict):
    name: str
    grpc: str
    grpc_use_tls: bool
    interval: str
    timeout: str


class UpstreamDef(Strict):
    destination_name: str
    local_bind_address: str
    local_bind_port: int


class Expose(Strict):
    checks: bool = False
    paths: list[dict[str, Any]] = Field(default_factory=list)


class ProxyDef(Strict):
    config: dict[str, Any] = Field(default_factory=dict)
    upstreams: list[UpstreamDef] = Field(default_factory=list)
    mode: Literal["", "direct", "transparent"] = ""
    # Health checks through the sidecar, so that a service may listen on loopback only.
    expose: Expose | None = None


class SidecarService(Strict):
    proxy: ProxyDef


class Connect(Strict):
    sidecar_service: SidecarService


class ServiceDef(Strict):
    name: str
    id: str
    port: int
    meta: dict[str, str]
    tags: list[str] = Field(default_factory=list)
    check: Check
    connect: Connect


class Registration(Strict):
    service: ServiceDef


def entries() -> dict[Path, BaseModel]:
    docs = {}
    for path in sorted(CONFIG_ENTRIES.glob("*.json")):
        raw = json.loads(path.read_text())
        docs[path] = KINDS[raw["Kind"]].model_validate(raw)
    return docs


def registrations() -> dict[Path, Registration]:
    return {
        p: Registration.model_validate(json.loads(p.read_text()))
        for p in sorted((CONSUL / "services").glob("*.json"))
    }


def of_kind(kind: type[BaseModel]) -> list[Any]:
    return [e for e in entries().values() if isinstance(e, kind)]


def test_every_document_has_only_fields_consul_defines() -> None:
    assert len(entries()) >= 12
    assert {r.service.name for r in registrations().values()} == {
        "router",
        "policy",
        "context",
        "inference",
    }


def test_registrations_match_the_services_ports_and_every_service_speaks_grpc() -> None:
    ports = {
        "router": RouterConfig().grpc_port,
        "policy": PolicyConfig().grpc_port,
        "context": ContextConfig().grpc_port,
        "inference": InferenceConfig().grpc_port,
    }
    for path, reg in registrations().items():
        service = reg.service
        if service.meta.get("version") == "stable":
            assert service.port == ports[service.name], path
        assert service.check.grpc.endswith(f":{service.port}"), path
        assert service.meta["version"] in {"stable", "canary"}
    defaults = {e.Name: e for e in of_kind(ServiceDefaults)}
    assert set(defaults) == set(ports)
    assert all(d.Protocol == "grpc" for d in defaults.values())
    # The picker dials the instance it chose: inference must allow being dialed directly.
    transparent = defaults["inference"].TransparentProxy
    assert transparent is not None and transparent.DialedDirectly
    for reg in registrations().values():
        proxy = reg.service.connect.sidecar_service.proxy
        assert proxy.expose is not None and proxy.expose.checks
        # The router dials its pick directly and the pick receives it: both transparent.
        if reg.service.name in ("router", "inference"):
            assert proxy.mode == "transparent"


def test_splits_and_routes_name_subsets_the_resolver_defines() -> None:
    (resolver,) = of_kind(ServiceResolver)
    (splitter,) = of_kind(ServiceSplitter)
    (router,) = of_kind(ServiceRouter)
    subsets = set(resolver.Subsets)
    versions = {r.service.meta["version"] for r in registrations().values()}
    assert subsets == versions == {"stable", "canary"}
    assert all(f"Service.Meta.version == {s}" == resolver.Subsets[s].Filter for s in subsets)
    assert {s.ServiceSubset for s in splitter.Splits} <= subsets
    assert sum(s.Weight for s in splitter.Splits) == pytest.approx(100)
    for route in router.Routes:
        (header,) = route.Match.HTTP.Header
        assert header.Name == "x-llm-color"
        assert route.Destination.ServiceSubset in subsets
    assert resolver.Failover["*"].Datacenters  # a second datacenter to fail over to


def test_intentions_deny_by_default_and_name_real_grpc_methods() -> None:
    pool = descriptor_pool.Default()
    intentions = load_intentions()
    assert set(intentions) == {"router", "policy", "context", "inference"}
    for name, entry in intentions.items():
        assert entry.Sources[-1].Name == "*" and entry.Sources[-1].Action == "deny", name
        for source in entry.Sources:
            for permission in source.Permissions or []:
                _, service, method = permission.HTTP.PathExact.split("/")
                found = pool.FindServiceByName(service)
                assert found.methods_by_name[method], permission.HTTP.PathExact
                assert found.name.lower() == name, "a permission on another service"
    # Each internal service may be called by the router; inference and policy by nobody else.
    for name in ("inference", "policy"):
        callers = {s.Name for s in intentions[name].Sources if s.Name != "*"}
        assert callers == {"router"}


def test_kv_seeds_are_documents_the_services_accept() -> None:
    kv = CONSUL / "kv" / "llm-mesh"
    parse_policy((kv / "routing.json").read_text())
    parse_tenants((kv / "tenants.yaml").read_text())
    RuleSet.from_file(DEFAULT_RULES)  # seeded as llm-mesh/policy/default
    seed = (CONSUL / "seed-kv.sh").read_text()
    for key in ("llm-mesh/routing", "llm-mesh/tenants", "llm-mesh/policy/default"):
        assert f"put {key} " in seed
    assert yaml.safe_load((kv / "tenants.yaml").read_text())["tenants"]

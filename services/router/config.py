from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from llmmesh.runtime.config import ServiceConfig
from services.router.admission import AdmissionSettings
from services.router.scheduling import SchedulingSpec
from services.router.shared.settings import SharedSettings

SERVICE = "router"


class HttpSettings(BaseModel):
    """Limits of the OpenAI-compatible HTTP front (RouterConfig.http): what one client
    may hold of it, and how long it may take to send a request."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # A new connection must send a request's headers within this; an idle keep-alive
    # connection (or one part-way through its next request's headers) closes after idle.
    header_timeout_s: float = Field(default=10.0, gt=0)
    idle_timeout_s: float = Field(default=30.0, gt=0)
    # Seconds a client may take to send a request's body once its headers are in.
    body_timeout_s: float = Field(default=30.0, gt=0)
    max_body_bytes: int = Field(default=4 * 1024 * 1024, ge=1024)
    # Open connections from one client address; more are answered 429 and closed.
    max_connections_per_client: int = Field(default=256, ge=1)


class PoolSettings(BaseModel):
    """How the router keeps its replicas and streams on them (RouterConfig.pool)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # Replicas push a load report on every change (they read their engine every 50 ms)
    # and at least this often; a replica with no report for stale_after_s is not picked.
    report_interval_s: float = Field(default=0.25, gt=0)
    stale_after_s: float = Field(default=1.0, gt=0)
    # A replica silent this long (no load report: partitioned, or its process frozen)
    # has its streams moved elsewhere (resumed, nothing lost or repeated): its connections
    # may never fail by themselves.
    silent_after_s: float = Field(default=3.0, gt=0)
    # Circuit breaker: consecutive failures that open it, and seconds before a probe.
    breaker_failures: int = Field(default=3, ge=1)
    breaker_open_s: float = Field(default=2.0, gt=0)
    # Attempts to start a stream (first try included), on different replicas when possible.
    attempts: int = Field(default=3, ge=1)
    # Times one stream may move to another replica after text was sent.
    max_resumes: int = Field(default=2, ge=0)
    # Behind a sidecar: its listener (host:port) that forwards each inference call to the
    # endpoint the picker chose, named in x-gateway-destination-endpoint, over mTLS (an
    # original-destination cluster). Empty: replicas are dialed directly.
    via: str = ""
    # Generations share one long-lived stream per replica (Inference.Multiplex: a request
    # costs messages on it, not a call of its own); false: a Generate call per generation.
    multiplex: bool = True


class RouterConfig(ServiceConfig):
    grpc_port: int = 50051
    # OpenAI-compatible HTTP (/v1/chat/completions, /v1/completions, /v1/models) on the
    # same host, in the same process; 0: off.
    http_port: int = 8080
    metrics_port: int = 9100
    policy_address: str = "127.0.0.1:50071"
    context_address: str = "127.0.0.1:50081"
    # Inference replicas (host:port) when no discovery source is configured: subset
    # "stable", the router's own region, every model.
    inference_addresses: list[str] = Field(
        default_factory=lambda: ["127.0.0.1:50061"], min_length=1
    )
    # Where replicas are discovered: "static" (endpoints_file, else inference_addresses),
    # "dns" (dns_endpoints: subset -> host:port, every address of the name an endpoint;
    # on Kubernetes a headless Service per subset) or "consul" (the health API for
    # consul_service).
    discovery: Literal["static", "dns", "consul"] = "static"
    dns_endpoints: dict[str, str] = Field(default_factory=dict)
    dns_interval_s: float = Field(default=2.0, gt=0)
    # YAML/JSON file listing endpoints with their version, region and models; watched.
    endpoints_file: str = ""
    # Where the routing document comes from: "file" (routing_file; empty: defaults) or
    # "consul" (KV key consul_routing_key). See services/router/routing.py.
    routing_source: Literal["file", "consul"] = "file"
    routing_file: str = ""
    # How often watched files are re-read.
    watch_interval_s: float = Field(default=0.2, gt=0)
    # Consul HTTP address (host:port or URL); empty: CONSUL_HTTP_ADDR or 127.0.0.1:8500.
    consul_address: str = ""
    consul_token: str = ""
    consul_service: str = "inference"
    consul_routing_key: str = "llm-mesh/routing"
    # This router's region: its replicas are preferred; others take over when none is left.
    region: str = "local"
    # Replicas: load reports, breakers, retries and resumes, the sidecar (see PoolSettings).
    pool: PoolSettings = PoolSettings()
    http: HttpSettings = HttpSettings()
    # The scheduling profile of a routing document that names none (RoutingPolicy); unset:
    # the profile the document's weights describe.
    scheduling: SchedulingSpec | None = None
    # Models the mesh serves; the first is the default.
    models: list[str] = Field(default_factory=lambda: ["llm", "llm_canary"], min_length=1)
    # Tenants, their API key hashes, tiers and budgets (services/router/tenants.py): a
    # watched YAML file, or Consul KV (tenants_source: consul, key consul_tenants_key).
    # With neither, every request runs as default_tenant, unauthenticated and unlimited.
    tenants_source: Literal["file", "consul"] = "file"
    tenants_file: str = ""
    consul_tenants_key: str = "llm-mesh/tenants"
    default_tenant: str = "default"
    # Admission (services/router/admission.py): the concurrency window over the fleet
    # adapts between its bounds from each request's time to first token against its
    # tier's target; requests beyond it queue, at most max_queue_wait_s by tier.
    admission: AdmissionSettings = AdmissionSettings()
    # The longest prompt, and the longest message of a conversation sent whole; and the
    # longest conversation in all (every message of it is checked by policy).
    max_prompt_chars: int = Field(default=8192, ge=1)
    max_conversation_chars: int = Field(default=65536, ge=1)
    default_max_tokens: int = 128
    max_tokens_limit: int = 1024
    # Context window to assume for every model, in tokens (prompt + history + generation);
    # unset: each model's own, from its card (services/router/speech.py).
    model_context_tokens: int | None = Field(default=None, ge=1)
    # Deadline for each policy and context call.
    upstream_timeout_s: float = 2.0
    # What this router shares with the others of its fleet (services/router/shared/):
    # "memory" (one router: budgets, sessions and the admission window are its own) or
    # "redis" (any number of routers over the Redis at redis_url, limits held as one).
    state: Literal["memory", "redis"] = "memory"
    redis_url: str = ""
    shared: SharedSettings = SharedSettings()

    @model_validator(mode="after")
    def _redis_named(self) -> RouterConfig:
        if self.state == "redis" and not self.redis_url:
            raise ValueError("state redis needs redis_url (redis://host:port/db)")
        return self

    @model_validator(mode="after")
    def _dns_names_given(self) -> RouterConfig:
        if self.discovery == "dns" and not self.dns_endpoints:
            raise ValueError("discovery dns needs dns_endpoints (subset: host:port)")
        for subset, target in self.dns_endpoints.items():
            host, _, port = target.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"dns_endpoints.{subset}: expected host:port, got {target!r}")
        return self

from __future__ import annotations

from typing import Literal

from pydantic import Field

from llmmesh.runtime.config import ServiceConfig

SERVICE = "router"


class RouterConfig(ServiceConfig):
    grpc_port: int = 50051
    metrics_port: int = 9100
    policy_address: str = "127.0.0.1:50071"
    context_address: str = "127.0.0.1:50081"
    # Inference replicas (host:port).
    inference_addresses: list[str] = Field(
        default_factory=lambda: ["127.0.0.1:50061"], min_length=1
    )
    # How a replica is chosen: least_loaded (load reports + in-flight) or round_robin.
    picker: Literal["least_loaded", "round_robin"] = "least_loaded"
    # Replicas push load reports at least this often; older ones are ignored.
    load_report_interval_s: float = 0.05
    load_report_stale_s: float = 1.0
    # Models the mesh serves; the first is the default.
    models: list[str] = Field(default_factory=lambda: ["llm", "llm_canary"], min_length=1)
    # Tenant every request runs as until API keys are configured.
    default_tenant: str = "default"
    max_prompt_chars: int = 8192
    default_max_tokens: int = 128
    max_tokens_limit: int = 1024
    # Context window of the served models, in tokens (prompt + history + generation).
    model_context_tokens: int = 2048
    # Deadline for each policy and context call.
    upstream_timeout_s: float = 2.0

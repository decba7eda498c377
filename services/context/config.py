from __future__ import annotations

from typing import Literal

from pydantic import Field

from llmmesh.runtime.config import ServiceConfig

SERVICE = "context"


class ContextConfig(ServiceConfig):
    grpc_port: int = 50081
    metrics_port: int = 9103
    # "sqlite": an embedded file (db_path, created with its directory); "redis": a Redis
    # server shared by several context replicas (redis_url), which should run with
    # appendonly yes / appendfsync always for appends to be durable when acknowledged.
    store: Literal["sqlite", "redis"] = "sqlite"
    db_path: str = ".llm-mesh/context.sqlite3"
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_prefix: str = "llm-mesh:ctx:"
    # Sessions expire this long after their last access, unless a request sets its own.
    default_ttl_s: int = Field(default=7 * 86_400, ge=1)
    sweep_interval_s: float = Field(default=60.0, gt=0)

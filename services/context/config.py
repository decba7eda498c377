from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from llmmesh.runtime.config import ServiceConfig
from services.context.stores import SqliteSettings, StoreSettings, store_settings

SERVICE = "context"


class ContextConfig(ServiceConfig):
    grpc_port: int = 50081
    metrics_port: int = 9103
    # Where sessions live, by kind (services/context/stores.py): sqlite (path) or redis
    # (url, prefix), for context replicas that share sessions.
    store: StoreSettings = SqliteSettings()
    # Sessions expire this long after their last access, unless a request sets its own.
    default_ttl_s: int = Field(default=7 * 86_400, ge=1)
    sweep_interval_s: float = Field(default=60.0, gt=0)

    @field_validator("store", mode="before")
    @classmethod
    def _registered_store(cls, value: Any) -> StoreSettings:
        return store_settings(value)

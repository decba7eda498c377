"""Session stores by name: the ``store`` section of the context service's config.

A store is one settings class with its name and a ``build()``: registered here, it is
chosen in the config (``store: {kind: redis, url: ...}``; in the environment,
``LLM_MESH_CONTEXT_STORE__KIND=redis``) with nothing else to change.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict

from services.context.redis_store import RedisSessionStore
from services.context.sqlite_store import SqliteSessionStore
from services.context.store import SessionStore

STORES: dict[str, type[StoreSettings]] = {}
S = TypeVar("S", bound="StoreSettings")


class StoreSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: str
    NAME: ClassVar[str] = ""

    def build(self) -> SessionStore:
        raise NotImplementedError


def register_store(name: str) -> Callable[[type[S]], type[S]]:
    def add(cls: type[S]) -> type[S]:
        cls.NAME = name
        STORES[name] = cls
        return cls

    return add


@register_store("sqlite")
class SqliteSettings(StoreSettings):
    """An embedded SQLite file (created with its directory): WAL, appends fsynced."""

    kind: str = "sqlite"
    path: str = ".llm-mesh/context.sqlite3"

    def build(self) -> SessionStore:
        return SqliteSessionStore(self.path)


@register_store("redis")
class RedisSettings(StoreSettings):
    """A Redis server shared by several context replicas; run it with appendonly yes and
    appendfsync always for appends to be durable when acknowledged."""

    kind: str = "redis"
    url: str = "redis://127.0.0.1:6379/0"
    prefix: str = "llm-mesh:ctx:"

    def build(self) -> SessionStore:
        return RedisSessionStore(self.url, self.prefix)


def store_settings(value: Any) -> StoreSettings:
    """The registered store a config section names (``kind``, default sqlite)."""
    if isinstance(value, StoreSettings):
        return value
    if isinstance(value, str):  # the bare name: its defaults
        value = {"kind": value}
    if not isinstance(value, dict):
        raise ValueError("must be a mapping with a kind")
    kind = value.get("kind", "sqlite")
    cls = STORES.get(kind)
    if cls is None:
        raise ValueError(f"unknown store kind '{kind}'; known: {sorted(STORES)}")
    return cls.model_validate({**value, "kind": kind})

"""Consul service-intentions config entries (mesh/consul/config-entries), read as the
allow-lists the sidecars enforce: who may call a service, and which gRPC methods."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

MESH_DIR = Path(__file__).resolve().parents[2] / "mesh"
CONFIG_ENTRIES = MESH_DIR / "consul" / "config-entries"


class _Entry(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class HttpMatch(_Entry):
    PathExact: str = ""
    PathPrefix: str = ""
    Methods: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _one_path(self) -> HttpMatch:
        if bool(self.PathExact) == bool(self.PathPrefix):
            raise ValueError("exactly one of PathExact, PathPrefix")
        return self


class Permission(_Entry):
    Action: Literal["allow", "deny"]
    HTTP: HttpMatch


class Source(_Entry):
    Name: str = Field(min_length=1)
    Action: Literal["allow", "deny"] | None = None
    Permissions: list[Permission] | None = None
    Description: str = ""

    @model_validator(mode="after")
    def _action_or_permissions(self) -> Source:
        if (self.Action is None) == (self.Permissions is None):
            raise ValueError("a source has either Action or Permissions")
        return self


class ServiceIntentions(_Entry):
    Kind: Literal["service-intentions"]
    Name: str = Field(min_length=1)
    Sources: list[Source]


class Grant(BaseModel):
    """What one caller may do: every method (``paths`` None) or the listed paths."""

    source: str
    paths: tuple[str, ...] | None = None
    prefixes: tuple[str, ...] = ()


def load_intentions(directory: Path = CONFIG_ENTRIES) -> dict[str, ServiceIntentions]:
    """Every service-intentions entry in ``directory``, by destination service."""
    entries: dict[str, ServiceIntentions] = {}
    for path in sorted(directory.glob("service-intentions-*.json")):
        try:
            entry = ServiceIntentions.model_validate(json.loads(path.read_text()))
        except (ValueError, ValidationError) as err:
            raise ValueError(f"{path}: {err}") from None
        if entry.Name in entries:
            raise ValueError(f"{path}: a second entry for {entry.Name}")
        entries[entry.Name] = entry
    return entries


def grants(entry: ServiceIntentions) -> list[Grant]:
    """The callers ``entry`` allows, in order, with what each may call. Consul evaluates
    the most specific source first; a named source is more specific than "*", so a
    "*" deny (the default) leaves exactly the named allows."""
    allowed: list[Grant] = []
    for source in sorted(entry.Sources, key=lambda s: s.Name == "*"):
        if source.Action == "allow":
            allowed.append(Grant(source=source.Name))
        elif source.Permissions is not None:
            exact = tuple(
                p.HTTP.PathExact
                for p in source.Permissions
                if p.Action == "allow" and p.HTTP.PathExact
            )
            prefix = tuple(
                p.HTTP.PathPrefix
                for p in source.Permissions
                if p.Action == "allow" and p.HTTP.PathPrefix
            )
            if exact or prefix:
                allowed.append(Grant(source=source.Name, paths=exact, prefixes=prefix))
    return allowed

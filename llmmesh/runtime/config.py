"""Typed service configuration: defaults in the model, then a YAML file, then environment.

Environment overrides are named ``LLM_MESH_<SERVICE>_<FIELD>`` (upper case); nested fields
use a double underscore, e.g. ``LLM_MESH_ROUTER_GRPC_PORT=6000``. Values are parsed as
YAML scalars or lists, so ``8001``, ``true`` and ``[a, b]`` work as expected.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

ENV_PREFIX = "LLM_MESH_"


class ServiceConfig(BaseModel):
    """Settings every service shares. Subclasses add their own fields."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    host: str = "127.0.0.1"
    grpc_port: int = 0
    metrics_port: int = 0
    # Where /metrics listens; empty: ``host``. (A service reached only through its
    # sidecar on loopback still has its metrics scraped from outside.)
    metrics_host: str = ""
    # Seconds in-flight streams get to finish on SIGTERM before they are cancelled.
    shutdown_grace_s: float = 10.0
    log_level: str = "INFO"
    # OpenTelemetry: send spans to this OTLP/gRPC collector (host:port); empty: off.
    otlp_endpoint: str = ""
    # The mesh's own credential (llmmesh/runtime/internal_auth.py): internal services
    # refuse callers without it, clients present it. Empty: none (a mesh whose sidecars
    # authenticate every caller, e.g. Istio with mTLS and authorization policies).
    internal_token_file: str = ""


C = TypeVar("C", bound=ServiceConfig)


class ConfigError(ValueError):
    """The configuration could not be loaded; the message says which key and why."""


def load_config(
    cls: type[C],
    service: str,
    path: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
) -> C:
    """Builds ``cls`` from its defaults, the YAML file at ``path``, and the environment."""
    environ = os.environ if environ is None else environ
    data: dict[str, Any] = {}
    if path is None:
        path = environ.get(f"{ENV_PREFIX}{service.upper()}_CONFIG")
    if path:
        data = _read_yaml(Path(path))
    _apply_env(data, service, environ)
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"invalid {service} config: {_describe(exc)}") from None


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"config file {path} must hold a mapping, not {type(loaded).__name__}")
    return loaded


def _apply_env(data: dict[str, Any], service: str, environ: Mapping[str, str]) -> None:
    prefix = f"{ENV_PREFIX}{service.upper()}_"
    for key, raw in environ.items():
        if not key.startswith(prefix) or key == f"{prefix}CONFIG":
            continue
        path = key[len(prefix) :].lower().split("__")
        target = data
        for part in path[:-1]:
            target = target.setdefault(part, {})
        target[path[-1]] = yaml.safe_load(raw) if raw else raw


def _describe(exc: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in exc.errors()
    )

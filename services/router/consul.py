"""Inference endpoints from Consul's health API (``/v1/health/service/<name>?passing``),
followed by blocking queries."""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator
from typing import Any

import consul.aio
from pydantic import ValidationError

from llmmesh.runtime.consul import blocking_query
from services.router.endpoints import Endpoint

log = logging.getLogger(__name__)


class ConsulDiscovery:
    """Passing instances of an inference service from ``/v1/health/service/<name>``.

    ``Service.Meta`` carries ``version`` (subset), ``region`` (default: the node's
    datacenter), ``model`` (comma-separated; empty means every model), ``device`` (the
    device its engine shares with other instances naming it) and ``triton_metrics_url``
    (the instance is a Triton server itself, served in the router's process).
    """

    def __init__(self, client: consul.aio.Consul, service: str, wait: str = "30s") -> None:
        self._client = client
        self._service = service
        self._wait = wait

    async def watch(self) -> AsyncGenerator[list[Endpoint], None]:
        async def fetch(index: int) -> tuple[Any, Any]:
            result: tuple[Any, Any] = await self._client.health.service(
                self._service, index=index or None, wait=self._wait, passing=True
            )
            return result

        async for entries in blocking_query(fetch, f"health/{self._service}"):
            yield [e for e in (_endpoint(entry) for entry in entries or []) if e is not None]


def _endpoint(entry: dict[str, Any]) -> Endpoint | None:
    service, node = entry.get("Service") or {}, entry.get("Node") or {}
    meta = service.get("Meta") or {}
    host = service.get("Address") or node.get("Address") or ""
    try:
        return Endpoint(
            address=f"{host}:{int(service.get('Port', 0))}",
            version=meta.get("version") or "stable",
            region=meta.get("region") or node.get("Datacenter") or "",
            models=tuple(m.strip() for m in (meta.get("model") or "").split(",") if m.strip()),
            device=meta.get("device") or "",
            triton_metrics_url=meta.get("triton_metrics_url") or "",
        )
    except (ValidationError, TypeError, ValueError):
        log.warning("skipping a malformed service entry from consul: %r", service.get("ID"))
        return None

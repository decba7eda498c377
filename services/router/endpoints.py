"""Inference endpoints and where the router learns of them (discovery).

A discovery source yields the full list of endpoints whenever it changes: a watched
static file or DNS names here (on Kubernetes, a headless Service per subset resolves to
its ready pods), Consul's health API in production (``consul.py``).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import AsyncGenerator, Sequence
from pathlib import Path
from typing import Protocol

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from llmmesh.runtime.watch import watch_file

log = logging.getLogger(__name__)

DEFAULT_SUBSET = "stable"


class Endpoint(BaseModel):
    """One inference replica as discovery describes it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    address: str = Field(pattern=r"^[^\s:]+:\d{1,5}$")  # host:port
    version: str = Field(default=DEFAULT_SUBSET, min_length=1)  # the subset: stable, canary, ...
    region: str = ""  # empty: the router's own region
    models: tuple[str, ...] = ()  # models served; empty: every model
    # The device its engine runs on, as the deployment names it (a GPU's UUID, a host's
    # CPU set): replicas naming the same one share it. Empty: a device of its own.
    device: str = ""
    # Set: ``address`` is a Triton server itself, which the router serves in process with
    # the inference service's core (one Python hop less), reading its load from this
    # metrics URL. Empty: ``address`` is an inference service.
    triton_metrics_url: str = Field(default="", pattern=r"^(https?://\S+)?$")

    def serves(self, model: str) -> bool:
        return not self.models or model in self.models


class EndpointList(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    endpoints: tuple[Endpoint, ...] = Field(min_length=1)


class Discovery(Protocol):
    def watch(self) -> AsyncGenerator[list[Endpoint], None]:
        """Yields the current endpoints, then again on every change."""
        ...


class FixedDiscovery:
    """Endpoints given in the router's config; they never change."""

    def __init__(self, addresses: Sequence[str]) -> None:
        self._endpoints = [Endpoint(address=a) for a in addresses]

    async def watch(self) -> AsyncGenerator[list[Endpoint], None]:
        yield self._endpoints
        await asyncio.Event().wait()  # nothing ever changes


class FileDiscovery:
    """Endpoints listed in a YAML/JSON file (``endpoints: [{address, version, region,
    models, device, triton_metrics_url}]``), re-read when it changes. An invalid file is
    logged and skipped: the previous list stays."""

    def __init__(self, path: Path, interval_s: float) -> None:
        self._path = path
        self._interval = interval_s

    async def watch(self) -> AsyncGenerator[list[Endpoint], None]:
        async for text in watch_file(self._path, self._interval):
            try:
                doc = yaml.safe_load(text)
                yield list(EndpointList.model_validate(doc).endpoints)
            except (yaml.YAMLError, ValidationError) as err:
                log.warning(
                    "endpoints file rejected; the previous endpoints stay",
                    extra={"fields": {"path": str(self._path), "reason": str(err)}},
                )


class DnsDiscovery:
    """Endpoints behind DNS names, one name per subset (``{"stable": "host:port"}``),
    resolved every ``interval_s``: every address a name resolves to is an endpoint of
    that subset. A failed lookup keeps that subset's last endpoints."""

    def __init__(self, names: dict[str, str], region: str, interval_s: float) -> None:
        self._names = names
        self._region = region
        self._interval = interval_s

    async def watch(self) -> AsyncGenerator[list[Endpoint], None]:
        known: dict[str, list[Endpoint]] = {subset: [] for subset in self._names}
        last: list[Endpoint] | None = None
        while True:
            for subset, target in self._names.items():
                found = await self._resolve(subset, target)
                if found is not None:
                    known[subset] = found
            current = sorted((e for found in known.values() for e in found), key=_by_address)
            if current and current != last:
                last = current
                yield current
            await asyncio.sleep(self._interval)  # the resolution period

    async def _resolve(self, subset: str, target: str) -> list[Endpoint] | None:
        host, _, port = target.rpartition(":")
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(
                host, int(port), type=socket.SOCK_STREAM
            )
        except (OSError, ValueError) as err:
            log.warning(
                "endpoint lookup failed; the last endpoints stay",
                extra={"fields": {"name": target, "error": str(err)}},
            )
            return None
        addresses = sorted({f"{info[4][0]}:{port}" for info in infos if info[0] == socket.AF_INET})
        return [Endpoint(address=a, version=subset, region=self._region) for a in addresses]


def _by_address(endpoint: Endpoint) -> str:
    return endpoint.address

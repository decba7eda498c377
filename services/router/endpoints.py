"""Inference endpoints and where the router learns of them (discovery).

A discovery source yields the full list of endpoints whenever it changes: a watched
static file here, Consul's health API in production (``consul.py``).
"""

from __future__ import annotations

import asyncio
import logging
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
    models}]``), re-read when it changes. An invalid file is logged and skipped: the
    previous list stays."""

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

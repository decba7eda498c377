"""``llm-mesh canary``: shift the canary split, and compare it with the traffic the router
actually sent to each subset.

The split lives in the routing document (services/router/routing.py): Consul KV key
``llm-mesh/routing`` when Consul is configured, the local stack's routing file otherwise.
A write keeps the rest of the document, is validated as the router would validate it, and
cannot lose a concurrent edit (Consul: check-and-set on the key's index; file: replaced
atomically).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import consul
import yaml
from prometheus_client.parser import text_string_to_metric_families

from llmmesh.runtime.consul import location
from services.router.routing import InvalidDocument, parse_policy

ROUTING_KEY = "llm-mesh/routing"
CAS_ATTEMPTS = 5


class CanaryError(ValueError):
    pass


def parse_weights(items: list[str]) -> dict[str, float]:
    """``subset=weight`` items, weights in percent."""
    weights: dict[str, float] = {}
    for item in items:
        subset, sep, value = item.partition("=")
        try:
            weight = float(value)
        except ValueError:
            weight = -1.0
        if not sep or not subset or not 0 <= weight <= 100:
            raise CanaryError(f"--weight {item!r}: expected subset=percent, 0 to 100")
        weights[subset] = weight
    return weights


def new_split(current: Mapping[str, float], wanted: Mapping[str, float]) -> dict[str, float]:
    """The split with ``wanted`` subsets at their percentages; the other subsets of the
    current split share what is left in proportion to their current weights."""
    given = sum(wanted.values())
    if given > 100:
        raise CanaryError(f"weights add up to {given:g}%, more than 100%")
    others = {s: w for s, w in current.items() if s not in wanted}
    rest = 100 - given
    total = sum(others.values())
    shared = {s: rest * (w / total if total else 1 / len(others)) for s, w in others.items()}
    split = {**shared, **wanted}
    if sum(split.values()) <= 0:
        raise CanaryError("at least one subset must keep a weight above 0")
    return {s: round(w, 3) for s, w in sorted(split.items())}


class RoutingStore(Protocol):
    where: str

    def read(self) -> dict[str, Any]: ...

    def update(self, split: Mapping[str, float]) -> dict[str, Any]:
        """Writes the document with ``split`` (computed from the current one); returns it."""
        ...


def _with_split(doc: dict[str, Any], wanted: Mapping[str, float]) -> tuple[dict[str, Any], str]:
    updated = {**doc, "split": new_split(doc.get("split") or {}, wanted)}
    text = json.dumps(updated, indent=2) + "\n"
    try:
        parse_policy(text)  # the router's own validation
    except InvalidDocument as err:
        raise CanaryError(f"the routing document would be invalid: {err}") from None
    return updated, text


def _parse(text: str | bytes, where: str) -> dict[str, Any]:
    try:
        doc = yaml.safe_load(text) or {}
    except yaml.YAMLError as err:
        raise CanaryError(f"{where} is not YAML or JSON: {err}") from None
    if not isinstance(doc, dict):
        raise CanaryError(f"{where} is not a mapping")
    return doc


class FileRouting:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.where = str(path)

    def read(self) -> dict[str, Any]:
        try:
            return _parse(self.path.read_text(), self.where)
        except OSError as err:
            raise CanaryError(f"cannot read {self.path}: {err}") from None

    def update(self, split: Mapping[str, float]) -> dict[str, Any]:
        updated, text = _with_split(self.read(), split)
        # Replaced whole (the router polls the file: it must never see half of it).
        with tempfile.NamedTemporaryFile(
            "w", dir=self.path.parent, prefix=".routing-", delete=False
        ) as tmp:
            tmp.write(text)
        os.replace(tmp.name, self.path)
        return updated


class ConsulRouting:
    def __init__(self, client: consul.Consul, key: str = ROUTING_KEY) -> None:
        self._client = client
        self._key = key
        self.where = f"consul kv {key}"

    def _get(self) -> tuple[int, dict[str, Any]]:
        _, entry = self._client.kv.get(self._key)
        if entry is None:
            return 0, {}
        return int(entry["ModifyIndex"]), _parse(entry.get("Value") or b"", self.where)

    def read(self) -> dict[str, Any]:
        return self._get()[1]

    def update(self, split: Mapping[str, float]) -> dict[str, Any]:
        for _ in range(CAS_ATTEMPTS):
            index, doc = self._get()
            updated, text = _with_split(doc, split)
            # cas=0 creates only if absent; otherwise only if nobody wrote in between.
            if self._client.kv.put(self._key, text, cas=index):
                return updated
        raise CanaryError(f"{self.where} kept changing under us; try again")


def consul_client(consul_address: str) -> consul.Consul | None:
    """A client of the given address, or of CONSUL_HTTP_ADDR; None when neither is set."""
    address = consul_address or os.environ.get("CONSUL_HTTP_ADDR", "")
    if not address:
        return None
    host, port, scheme = location(address)
    return consul.Consul(host=host, port=port, scheme=scheme)


def routing_store(consul_address: str, routing_file: Path | None) -> RoutingStore:
    """Consul when an address is given (or CONSUL_HTTP_ADDR is set), else the file."""
    client = consul_client(consul_address)
    if client is not None:
        return ConsulRouting(client)
    if routing_file is None:
        raise CanaryError("no Consul address and no routing file (run `llm-mesh up` first?)")
    return FileRouting(routing_file)


@dataclass(frozen=True)
class Observed:
    picks: dict[str, float]  # subset -> requests sent

    def share(self) -> dict[str, float]:
        total = sum(self.picks.values())
        return {s: 100 * n / total for s, n in self.picks.items()} if total else {}


def observed(metrics_url: str) -> Observed:
    """Requests the router sent, by subset, from its Prometheus metrics."""
    with urllib.request.urlopen(metrics_url, timeout=5) as reply:
        text = reply.read().decode()
    picks: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "llm_router_picks_total":
                subset = sample.labels.get("subset", "")
                picks[subset] = picks.get(subset, 0.0) + sample.value
    return Observed(picks)


def observed_over(metrics_url: str, window_s: float) -> Observed:
    """Requests sent during the next ``window_s`` seconds (all since start when 0)."""
    before = observed(metrics_url)
    if window_s <= 0:
        return before
    time.sleep(window_s)  # the measurement window
    after = observed(metrics_url)
    return Observed({s: n - before.picks.get(s, 0.0) for s, n in after.picks.items()})


def status_table(split: Mapping[str, float], seen: Observed) -> str:
    total = sum(split.values())
    configured = {s: 100 * w / total for s, w in split.items()} if total else {}
    share = seen.share()
    rows = ["subset     configured   observed   requests"]
    for subset in sorted(set(configured) | set(share)):
        conf = f"{configured[subset]:.1f}%" if subset in configured else "-"
        obs = f"{share[subset]:.1f}%" if subset in share else "-"
        rows.append(f"{subset:<10} {conf:>10}   {obs:>8}   {seen.picks.get(subset, 0):>8.0f}")
    return "\n".join(rows)

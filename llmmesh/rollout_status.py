"""The rollout's status document (llmmesh/rollout.py writes it), kept apart from the
controller so that ``canary status`` reads it without the statistics libraries."""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import consul

STATUS_KEY = "llm-mesh/rollout/status"


class FileStatus:
    """The status document beside the routing file, replaced whole."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def write(self, status: dict[str, Any]) -> None:
        with tempfile.NamedTemporaryFile(
            "w", dir=self.path.parent, prefix=".rollout-", delete=False
        ) as tmp:
            json.dump(status, tmp, indent=2)
        os.replace(tmp.name, self.path)

    def read(self) -> dict[str, Any] | None:
        try:
            status: dict[str, Any] = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None
        return status


class ConsulStatus:
    """The rollout's status document in Consul KV (``canary status`` reads it)."""

    def __init__(self, client: consul.Consul, document_index: int = 0) -> None:
        self._client = client
        self.document_index = document_index

    def write(self, status: dict[str, Any]) -> None:
        status = {**status, "document_index": self.document_index}
        self._client.kv.put(STATUS_KEY, json.dumps(status, indent=2))

    def read(self) -> dict[str, Any] | None:
        _, entry = self._client.kv.get(STATUS_KEY)
        if entry is None:
            return None
        try:
            status: dict[str, Any] = json.loads(entry.get("Value") or b"")
        except ValueError:
            return None
        return status


def status_lines(status: dict[str, Any]) -> list[str]:
    """The rollout's status as ``canary status`` prints it."""
    settings = status.get("settings") or {"canary": "canary", "model": "?"}
    lines = [
        f"rollout of {settings['canary']} ({settings['model']}): "
        f"{status['state']} at step {status['step']}, weight {status['weight']:g}%"
        f" - {status['why']}"
    ]
    for gate in status.get("gates", []):
        value = "-" if gate["value"] is None else f"{gate['value']:.4g}"
        lines.append(
            f"  {gate['gate']:<17} {gate['verdict']:<6} {value:>10} "
            f"(threshold {gate['threshold']:g}) {gate['detail']}"
        )
    lines.append("  history:")
    for entry in status.get("history", []):
        stamp = time.strftime("%H:%M:%S", time.gmtime(entry["time"]))
        lines.append(
            f"    {stamp} step {entry['step']} {entry['weight']:g}% {entry['state']}: "
            f"{entry['why']}"
        )
    return lines

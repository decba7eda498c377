"""The rollout's status document (llmmesh/rollout.py writes it), kept apart from the
controller so that ``canary status`` reads it without the statistics libraries."""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any


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


def status_lines(status: dict[str, Any]) -> list[str]:
    """The rollout's status as ``canary status`` prints it."""
    lines = [
        f"rollout of {status['settings']['canary']} ({status['settings']['model']}): "
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

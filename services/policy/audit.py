"""The audit log: one JSON line per policy decision, appended durably, rotated by size.

Lines are written and fsynced by one writer thread in batches (group commit), so a check
never waits on the disk; ``close`` drains what is pending. The checked text is left out
unless configured (it may hold the very data the rules protect).
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
from pathlib import Path
from typing import Any

_STOP = object()


class AuditLog:
    def __init__(
        self, path: Path, max_bytes: int = 10_000_000, backups: int = 5, include_text: bool = False
    ) -> None:
        self._path = path
        self._max_bytes = max_bytes
        self._backups = backups
        self.include_text = include_text
        self._queue: queue.Queue[Any] = queue.Queue()
        path.parent.mkdir(parents=True, exist_ok=True)
        self._thread = threading.Thread(target=self._write_loop, name="audit", daemon=True)
        self._thread.start()

    def record(
        self,
        *,
        request_id: str,
        tenant: str,
        stage: str,
        action: str,
        rule_ids: tuple[str, ...],
        rule_set_version: str,
        text: str,
    ) -> None:
        entry: dict[str, Any] = {
            "ts": round(time.time(), 3),
            "request_id": request_id,
            "tenant": tenant,
            "stage": stage,
            "action": action,
            "rule_ids": list(rule_ids),
            "rule_set_version": rule_set_version,
        }
        if self.include_text:
            entry["text"] = text
        self._queue.put(json.dumps(entry, ensure_ascii=False) + "\n")

    def close(self) -> None:
        """Writes everything recorded so far, then stops the writer."""
        self._queue.put(_STOP)
        self._thread.join(10)

    def _write_loop(self) -> None:
        out = self._path.open("a", encoding="utf-8")
        try:
            while True:
                batch = [self._queue.get()]
                while not self._queue.empty():
                    batch.append(self._queue.get_nowait())
                lines = [line for line in batch if line is not _STOP]
                if lines:
                    out.write("".join(lines))
                    out.flush()
                    os.fsync(out.fileno())
                    if out.tell() >= self._max_bytes:
                        out.close()
                        self._rotate()
                        out = self._path.open("a", encoding="utf-8")
                if len(lines) != len(batch):
                    return
        finally:
            out.close()

    def _rotate(self) -> None:
        """audit.log -> audit.log.1 -> ... -> audit.log.<backups> (the oldest dropped)."""
        for n in range(self._backups - 1, 0, -1):
            older = self._path.with_name(f"{self._path.name}.{n}")
            if older.exists():
                older.replace(self._path.with_name(f"{self._path.name}.{n + 1}"))
        if self._backups > 0:
            self._path.replace(self._path.with_name(f"{self._path.name}.1"))
        else:
            self._path.unlink()

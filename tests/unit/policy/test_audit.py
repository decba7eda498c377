"""The audit log: a line per decision, no text unless asked, rotation by size."""

from __future__ import annotations

import json
from pathlib import Path

from services.policy.audit import AuditLog


def record(log: AuditLog, n: int, text: str = "my secret prompt") -> None:
    log.record(
        request_id=f"r{n}",
        tenant="t",
        stage="input",
        action="deny",
        rule_ids=("deny-x",),
        rule_set_version="v1",
        text=text,
    )


def test_one_line_per_decision_without_the_text(tmp_path: Path) -> None:
    log = AuditLog(tmp_path / "audit.log")
    for n in range(3):
        record(log, n)
    log.close()
    lines = [json.loads(line) for line in (tmp_path / "audit.log").read_text().splitlines()]
    assert [entry["request_id"] for entry in lines] == ["r0", "r1", "r2"]
    assert lines[0]["rule_ids"] == ["deny-x"] and lines[0]["rule_set_version"] == "v1"
    assert all("text" not in entry for entry in lines)


def test_text_only_when_configured(tmp_path: Path) -> None:
    log = AuditLog(tmp_path / "audit.log", include_text=True)
    record(log, 0, text="kept")
    log.close()
    assert json.loads((tmp_path / "audit.log").read_text())["text"] == "kept"


def test_rotation_keeps_the_configured_number_of_old_files(tmp_path: Path) -> None:
    path = tmp_path / "audit.log"
    log = AuditLog(path, max_bytes=300, backups=2)
    for n in range(40):
        record(log, n)
        if n % 5 == 4:  # let the writer catch up now and then: several rotations happen
            log.close()
            log = AuditLog(path, max_bytes=300, backups=2)
    log.close()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["audit.log", "audit.log.1", "audit.log.2"]
    kept = {
        json.loads(line)["request_id"]
        for name in files
        for line in (tmp_path / name).read_text().splitlines()
    }
    assert "r39" in kept and "r0" not in kept  # the newest kept, the oldest rotated out

from __future__ import annotations

from pathlib import Path

from llmmesh.runtime.config import ServiceConfig

SERVICE = "policy"
DEFAULT_RULES = Path(__file__).with_name("default_rules.yaml")


class PolicyConfig(ServiceConfig):
    grpc_port: int = 50071
    metrics_port: int = 9102
    # Rule file (YAML); the built-in default set when empty. Watched: a valid change
    # applies within watch_interval_s, an invalid one is logged and the old set stays.
    rules_path: str = ""
    watch_interval_s: float = 0.5
    # Audit log: one JSON line per decision (no checked text unless audit_include_text),
    # fsynced, rotated at audit_max_bytes keeping audit_backups old files. Empty: none.
    audit_path: str = ""
    audit_max_bytes: int = 10_000_000
    audit_backups: int = 5
    audit_include_text: bool = False

    @property
    def rules_file(self) -> Path:
        return Path(self.rules_path) if self.rules_path else DEFAULT_RULES

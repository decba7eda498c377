from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from llmmesh.policy import DEFAULT_HOLDBACK_CAP
from llmmesh.runtime.config import ServiceConfig

SERVICE = "policy"
DEFAULT_RULES = Path(__file__).with_name("default_rules.yaml")


class PolicyConfig(ServiceConfig):
    grpc_port: int = 50071
    metrics_port: int = 9102
    # Rule sets: a YAML file (the "default" set) or a directory of <set>.yaml files, one
    # of them default.yaml; the built-in default set when empty. Watched: a valid change
    # applies within watch_interval_s, an invalid one is logged and the old sets stay.
    rules_path: str = ""
    watch_interval_s: float = 0.5
    # "consul": sets also come from KV keys consul_policy_prefix + <set> (blocking
    # queries), on top of the file's.
    rules_source: Literal["file", "consul"] = "file"
    consul_address: str = ""
    consul_token: str = ""
    consul_policy_prefix: str = "llm-mesh/policy/"
    # The streamed output check holds back at most this many characters (a match longer
    # than that can be missed), except to keep a complete match whole.
    output_holdback_cap: int = Field(default=DEFAULT_HOLDBACK_CAP, ge=16, le=65536)
    # Audit log: one JSON line per decision (no checked text unless audit_include_text),
    # fsynced, rotated at audit_max_bytes keeping audit_backups old files. Empty: none.
    audit_path: str = ""
    audit_max_bytes: int = 10_000_000
    audit_backups: int = 5
    audit_include_text: bool = False

    @property
    def rules_location(self) -> Path:
        return Path(self.rules_path) if self.rules_path else DEFAULT_RULES

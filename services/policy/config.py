from __future__ import annotations

from pathlib import Path

from llmmesh.runtime.config import ServiceConfig

SERVICE = "policy"
DEFAULT_RULES = Path(__file__).with_name("default_rules.yaml")


class PolicyConfig(ServiceConfig):
    grpc_port: int = 50071
    metrics_port: int = 9102
    # Rule file (YAML); the built-in default set when empty.
    rules_path: str = ""

    @property
    def rules_file(self) -> Path:
        return Path(self.rules_path) if self.rules_path else DEFAULT_RULES

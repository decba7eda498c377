from __future__ import annotations

from llmmesh.runtime.config import ServiceConfig

SERVICE = "context"


class ContextConfig(ServiceConfig):
    grpc_port: int = 50081
    metrics_port: int = 9103
    # SQLite database file; created with its parent directory if missing.
    db_path: str = ".llm-mesh/context.sqlite3"

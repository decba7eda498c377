from __future__ import annotations

from pydantic import Field

from llmmesh.runtime.config import ServiceConfig
from services.inference.faults import FaultSettings

SERVICE = "inference"


class InferenceConfig(ServiceConfig):
    grpc_port: int = 50061
    metrics_port: int = 9101
    # Triton's gRPC endpoint (host:port).
    triton_url: str = "127.0.0.1:8001"
    # Longest a single generation may take before Triton's stream is cancelled.
    stream_timeout_s: float = 600.0
    # Triton's Prometheus endpoint, where the engine publishes its statistics.
    triton_metrics_url: str = "http://127.0.0.1:8002/metrics"
    # How often engine statistics are read while a router watches the load and the
    # engine has work; with none (nothing here, nothing running or queued there), this
    # often, and one polling period after a generation starts.
    load_poll_interval_s: float = 0.05
    load_idle_poll_interval_s: float = 1.0
    # Upper bound on max_tokens this replica accepts.
    max_tokens_limit: int = 4096
    # Mesh model name -> the Triton model that serves it here, e.g. {"llm": "llm_canary"}
    # on a canary replica. Load reports use the mesh names.
    model_aliases: dict[str, str] = Field(default_factory=dict)
    # The Triton models this replica serves and watches (with aliases: their targets).
    models: list[str] = Field(default_factory=lambda: ["llm"])
    # A model with generations in flight and no response from any of them for this long
    # has stalled: they end UNAVAILABLE and the model is reloaded (services/inference/
    # health.py). Idle models are probed this often; busy ones whose streams all went
    # quiet this long, at most this often (a dead backend process ends them then).
    stall_timeout_s: float = Field(default=15.0, gt=0)
    probe_interval_s: float = Field(default=5.0, gt=0)
    quiet_probe_s: float = Field(default=1.0, gt=0)
    # Multiplexed streams (routers): a generation's later responses may wait this long for
    # others to go out in the same message (its first and last never wait); each message
    # costs both ends a wakeup. 0: every response on its own, at once.
    multiplex_hold_ms: float = Field(default=8.0, ge=0, le=50)
    # A generation's first responses that never wait: its client's first words (a streamed
    # output check shows a word only once the next one starts).
    multiplex_first_unheld: int = Field(default=8, ge=1)
    # Asked of the engine for every generation (the request parameters stream_gap_ms and
    # stream_gap_after): after its first engine_stream_gap_after responses (at the
    # model's own gap), the next go at least this far apart, the tokens between them
    # together (the reference engine; a model that does not read them streams as it
    # would). Each response costs Triton, this service and its stream a wakeup; the
    # Multiplex hold above then finds them already together. 0: the model's own gap.
    engine_stream_gap_ms: float = Field(default=8.0, ge=0, le=50)
    engine_stream_gap_after: int = Field(default=8, ge=0)
    # For drills and tests only: faults this replica injects into its generations.
    faults: FaultSettings = Field(default_factory=FaultSettings)

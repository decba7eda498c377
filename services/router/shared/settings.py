"""The shared state's settings (RouterConfig.shared)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class SharedSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    # Keys in Redis start with this: the context service's sessions may share the server.
    key_prefix: str = "llm-mesh:router:"
    # Each router beats this often; one silent for heartbeat_ttl_s is gone.
    heartbeat_interval_s: float = Field(default=1.0, gt=0)
    heartbeat_ttl_s: float = Field(default=3.0, gt=0)
    # Generated tokens are charged to the shared budgets at most this often per stream:
    # N routers overshoot a tokens-per-minute budget by at most this interval's tokens.
    charge_interval_s: float = Field(default=0.25, ge=0)
    # Each router holds up to this many seconds of a tenant's request and token rates,
    # taken from the shared buckets ahead of need, and admits within it without a round
    # trip to Redis (0: every admission asks Redis); what it has not spent after
    # allowance_idle_s goes back. Tenants with a concurrent-stream cap always ask Redis.
    allowance_s: float = Field(default=0.25, ge=0)
    allowance_idle_s: float = Field(default=2.0, gt=0)
    # Redis slower than this is out: limits fall back to this router's share, locally.
    timeout_s: float = Field(default=1.0, gt=0)

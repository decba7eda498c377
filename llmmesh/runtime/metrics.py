"""Metrics every service that streams tokens reports, named as OpenTelemetry GenAI does.
Labels: ``model``, and ``tier`` where the tenant's tier is known (the router; empty at
the inference tier)."""

from __future__ import annotations

from prometheus_client import Histogram

TTFT = Histogram(
    "gen_ai_server_time_to_first_token_seconds",
    "Time from request receipt to the first generated text",
    ["model", "tier"],
    buckets=(0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12),
)
TPOT = Histogram(
    "gen_ai_server_time_per_output_token_seconds",
    "Mean time per output token after the first, per request",
    ["model", "tier"],
    buckets=(0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128),
)

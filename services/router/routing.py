"""The routing document: canary split, traffic colors, region order, scheduling profile.

Operators change it at run time (a watched file, or Consul KV key ``llm-mesh/routing``).
A document is validated whole before it replaces the current one: an invalid one is
rejected, logged and counted, and the last good document stays in force.
"""

from __future__ import annotations

import json
import logging
from typing import Literal

import yaml
from prometheus_client import Counter, Gauge
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from llmmesh.runtime.documents import offer
from services.router.scheduling.profile import SchedulingSpec, build_profile
from services.router.scheduling.scorers import DevicePackingParams

log = logging.getLogger(__name__)

ROUTING_REJECTED = Counter(
    "llm_router_routing_rejected_total", "Routing documents rejected as invalid", ["source"]
)
ROUTING_APPLIED = Counter(
    "llm_router_routing_applied_total", "Routing documents applied", ["source"]
)
SPLIT_WEIGHT = Gauge("llm_router_split_weight", "Configured canary split weight", ["subset"])


class _Document(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ScorerWeights(_Document):
    """Weights of the LLM-aware scorer: lower cost wins."""

    waiting: float = Field(default=4.0, ge=0)  # a queued request waits for a slot: the costliest
    running: float = Field(default=1.0, ge=0)
    kv_utilization: float = Field(default=8.0, ge=0)  # a full cache means preemption or waiting
    # Streams this router has open to the replica that its last report does not show.
    pending: float = Field(default=1.0, ge=0)
    # Per 1000 prompt tokens the replica likely lacks in its prefix cache and must prefill.
    prefill: float = Field(default=4.0, ge=0)


class Saturation(_Document):
    """When a session's replica is too busy to stay sticky: requests queue there, its cache
    is nearly full, or its load exceeds the least loaded replica's by ``excess_load``."""

    waiting: int = Field(default=2, ge=1)
    kv_utilization: float = Field(default=0.9, gt=0, le=1)
    excess_load: float = Field(default=4.0, gt=0)


class MirrorSpec(_Document):
    """Shadow traffic: a copy of ``percent`` of the requests stable serves goes to
    ``subset`` too (its answer never reaches the client), for the canary analysis."""

    subset: str = Field(min_length=1)
    percent: float = Field(gt=0, le=100)
    max_in_flight: int = Field(default=4, ge=1)  # shadows at once; more are dropped
    top_logprobs: int = Field(default=5, ge=1, le=20)  # per position, both answers


class RoutingPolicy(_Document):
    revision: str = ""  # free-form label, logged when the document is applied
    algorithm: Literal["llm_aware", "round_robin"] = "llm_aware"
    # Subset (endpoint ``version``) -> weight. Empty: any subset.
    split: dict[str, float] = Field(default_factory=dict)
    # ``x-llm-color`` value -> subset. A color that names a subset pins that subset too.
    colors: dict[str, str] = Field(default_factory=dict)
    # Subset -> the subsets that serve its requests, in order, when it has no healthy
    # replica (a subset of weight 0 too: a canary is another version, so only when
    # named). A subset not named here falls back to the split's other weighted subsets.
    fallback: dict[str, list[str]] = Field(default_factory=dict)
    # Failover order of regions after the router's own.
    regions: list[str] = Field(default_factory=list)
    weights: ScorerWeights = ScorerWeights()
    saturation: Saturation = Saturation()
    # How replicas that share a device fill it (the ``device_packing`` scorer).
    packing: DevicePackingParams = DevicePackingParams()
    # The scheduling plugins by name (services/router/scheduling/); empty: the profile
    # ``algorithm``, ``weights``, ``saturation`` and ``packing`` describe.
    scheduling: SchedulingSpec | None = None
    mirror: MirrorSpec | None = None

    @model_validator(mode="after")
    def _profile_builds(self) -> RoutingPolicy:
        if self.scheduling is not None:
            build_profile(self.scheduling, self)  # unknown plugins and bad params refused
        return self

    @field_validator("split")
    @classmethod
    def _weights_sane(cls, split: dict[str, float]) -> dict[str, float]:
        if any(w < 0 for w in split.values()):
            raise ValueError("weights must be >= 0")
        if split and sum(split.values()) <= 0:
            raise ValueError("at least one weight must be > 0")
        return split

    @field_validator("fallback")
    @classmethod
    def _fallbacks_name_other_subsets(cls, fallback: dict[str, list[str]]) -> dict[str, list[str]]:
        for subset, others in fallback.items():
            if not subset or not all(others) or subset in others:
                raise ValueError(f"{subset!r}: fallbacks must be other, non-empty subset names")
        return fallback

    @field_validator("colors")
    @classmethod
    def _colors_name_subsets(cls, colors: dict[str, str]) -> dict[str, str]:
        if any(not color or not subset for color, subset in colors.items()):
            raise ValueError("colors and subsets must be non-empty")
        return colors


class InvalidDocument(ValueError):
    """A routing document that does not parse or validate."""


def parse_policy(text: str | bytes) -> RoutingPolicy:
    """The document in ``text`` (YAML or JSON; empty means the defaults)."""
    try:
        doc = yaml.safe_load(text) if text else {}
    except yaml.YAMLError as err:
        raise InvalidDocument(f"not YAML or JSON: {err}") from None
    if doc is None:
        doc = {}
    if not isinstance(doc, dict):
        raise InvalidDocument("must be a mapping")
    try:
        return RoutingPolicy.model_validate(doc)
    except ValidationError as err:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'document'}: {e['msg']}" for e in err.errors()
        )
        raise InvalidDocument(problems) from None


def render_policy(policy: RoutingPolicy) -> str:
    """The document as JSON, as Consul KV and the routing file hold it."""
    return json.dumps(policy.model_dump(), indent=2) + "\n"


class PolicyHolder:
    """The policy in force. Sources offer candidate documents; only valid ones apply."""

    def __init__(self, policy: RoutingPolicy | None = None) -> None:
        self.current = policy or RoutingPolicy()
        self._publish()

    def offer(self, text: str | bytes, source: str) -> bool:
        applied = offer("routing", source, lambda: self._apply(parse_policy(text), source))
        if not applied:
            ROUTING_REJECTED.labels(source).inc()
        return applied

    def _apply(self, policy: RoutingPolicy, source: str) -> None:
        if policy != self.current:
            self.current = policy
            ROUTING_APPLIED.labels(source).inc()
            self._publish()
            log.info(
                "routing document applied",
                extra={"fields": {"source": source, "revision": policy.revision}},
            )

    def _publish(self) -> None:
        SPLIT_WEIGHT.clear()
        for subset, weight in self.current.split.items():
            SPLIT_WEIGHT.labels(subset).set(weight)

"""Scheduling profiles: which plugins run, with which weights and settings.

The routing document names them under ``scheduling``::

    scheduling:
      filters: [healthy, retry_elsewhere, subset, region]
      scorers:
        - {type: session_affinity, weight: 1000}
        - {type: queue, weight: 256, params: {scale: 64}}
      picker: {type: best_score}

A document without ``scheduling`` gets the profile its older fields describe
(``algorithm``, ``weights``, ``saturation``, ``packing``): session and prefix affinity,
device packing, then the load scorers with those weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from services.router.scheduling import filters, pickers, scorers  # noqa: F401 (registers)
from services.router.scheduling.plugins import FILTERS, PICKERS, SCORERS, Filter, Picker, Scorer

if TYPE_CHECKING:
    from services.router.routing import RoutingPolicy

DEFAULT_FILTERS = ("healthy", "retry_elsewhere", "subset", "region")


class PluginSpec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    type: str
    params: dict[str, Any] = Field(default_factory=dict)


class ScorerSpec(PluginSpec):
    weight: float = Field(default=1.0, ge=0)


class SchedulingSpec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    filters: tuple[PluginSpec, ...] = tuple(PluginSpec(type=f) for f in DEFAULT_FILTERS)
    scorers: tuple[ScorerSpec, ...] = ()
    picker: PluginSpec = PluginSpec(type="best_score")

    @field_validator("filters", mode="before")
    @classmethod
    def _names_are_specs(cls, value: Any) -> Any:
        if isinstance(value, list | tuple):
            return [{"type": v} if isinstance(v, str) else v for v in value]
        return value


@dataclass(frozen=True)
class Profile:
    """A scheduling profile's plugins, built."""

    filters: Sequence[Filter]
    scorers: Sequence[tuple[Scorer, float]]
    picker: Picker


def _build(spec: PluginSpec, registry: dict[str, Any], kind: str, policy: RoutingPolicy) -> Any:
    cls = registry.get(spec.type)
    if cls is None:
        raise ValueError(f"unknown {kind} '{spec.type}'; known: {sorted(registry)}")
    try:
        params = cls.Settings.model_validate(spec.params)
    except ValidationError as err:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors())
        raise ValueError(f"{kind} '{spec.type}' params: {problems}") from None
    return cls(params, policy)


def build_profile(spec: SchedulingSpec, policy: RoutingPolicy) -> Profile:
    """The plugins ``spec`` names; ValueError naming the first unknown one or bad param."""
    return Profile(
        [_build(f, FILTERS, "filter", policy) for f in spec.filters],
        [(_build(s, SCORERS, "scorer", policy), s.weight) for s in spec.scorers],
        _build(spec.picker, PICKERS, "picker", policy),
    )


# Scales of the load scorers in the profile built from ``weights``: the signal at which a
# scorer's score reaches 0. A weight in ``weights`` is a cost per unit of signal, so the
# scorer's weight is that times its scale.
_LEGACY_SCALES = {
    "queue": ("waiting", 64.0),
    "running": ("running", 256.0),
    "kv_utilization": ("kv_utilization", 1.0),
    "pending": ("pending", 64.0),
    "prefill": ("prefill", 64_000.0),
}
_PREFILL_PER = 1000.0  # ``weights.prefill`` is per 1000 prompt tokens


def legacy_spec(policy: RoutingPolicy) -> SchedulingSpec:
    """The profile ``algorithm``, ``weights`` and ``saturation`` describe."""
    if policy.algorithm == "round_robin":
        return SchedulingSpec(picker=PluginSpec(type="round_robin"))
    weights = policy.weights.model_dump()
    load = []
    for scorer, (field, scale) in _LEGACY_SCALES.items():
        per_unit = weights[field] / (_PREFILL_PER if scorer == "prefill" else 1.0)
        load.append(ScorerSpec(type=scorer, weight=per_unit * scale, params={"scale": scale}))
    # Each scorer outweighs all those after it together: a conversation stays until its
    # replica is saturated, its session (where it has one) outweighing its prefix; then
    # replicas sharing a device fill their busiest engines; then load decides.
    excess = {"excess_load": policy.saturation.excess_load}
    packing = ScorerSpec(
        type="device_packing", weight=1.0 + sum(s.weight for s in load),
        params=policy.packing.model_dump(),
    )  # fmt: skip
    by_prefix = ScorerSpec(
        type="prefix_affinity", weight=1.0 + packing.weight + sum(s.weight for s in load),
        params=excess,
    )  # fmt: skip
    sticky = ScorerSpec(
        type="session_affinity",
        weight=1.0 + by_prefix.weight + packing.weight + sum(s.weight for s in load),
        params=excess,
    )
    prefill = next(s for s in load if s.type == "prefill")
    return SchedulingSpec(
        scorers=(sticky, by_prefix, packing, prefill, *(s for s in load if s is not prefill))
    )

"""Scheduling as plugins: which inference replica serves a request.

Filters narrow the candidates (health, the canary subset or traffic color, the region),
scorers rate each remaining one in [0, 1] (queue, running sequences, KV use, streams not
yet reported, prefill the prefix cache would save, session affinity), and a picker
chooses from the weighted sums (best score, or round robin as the baseline). The routing
document names the profile (profile.py); a plugin is one class registered by name
(plugins.py).
"""

from services.router.scheduling.plugins import (
    FILTERS,
    PICKERS,
    SCORERS,
    Filter,
    NoCandidates,
    Params,
    Picker,
    Scorer,
    register,
)
from services.router.scheduling.profile import PluginSpec, SchedulingSpec, ScorerSpec
from services.router.scheduling.scheduler import Scheduler
from services.router.scheduling.types import (
    Candidate,
    Decision,
    PickContext,
    PickRequest,
    SchedulingState,
)

__all__ = [
    "FILTERS",
    "PICKERS",
    "SCORERS",
    "Candidate",
    "Decision",
    "Filter",
    "NoCandidates",
    "Params",
    "PickContext",
    "PickRequest",
    "Picker",
    "PluginSpec",
    "Scheduler",
    "SchedulingSpec",
    "SchedulingState",
    "Scorer",
    "ScorerSpec",
    "register",
]

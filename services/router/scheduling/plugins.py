"""The three kinds of scheduling plugin, and their registries.

As in the Gateway API Inference Extension's endpoint picker: filters narrow the
candidates, scorers give each remaining one a score in [0, 1], and a picker chooses from
the weighted sums. A plugin is a class with a ``params`` model (its settings in the
routing document, validated with it) registered under a type name; adding one is the
class and its name, nothing else.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict

from services.router.scheduling.types import Candidate, PickContext

if TYPE_CHECKING:
    from services.router.routing import RoutingPolicy


class Params(BaseModel):
    """A plugin's settings: none, unless it declares some."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class Plugin:
    """A plugin built from its validated params and the routing document it serves in
    (the subset and region filters read the split, colors and failover order there)."""

    Settings: ClassVar[type[Params]] = Params
    # The word a decision's reasons end with when this plugin explains the pick.
    reason: ClassVar[str] = ""

    def __init__(self, params: Params, policy: RoutingPolicy) -> None:
        self.params = params
        self.policy = policy


class Filter(Plugin):
    def filter(self, ctx: PickContext, candidates: list[Candidate]) -> list[Candidate]:
        """The candidates that stay; may record why in ``ctx.reasons``."""
        raise NotImplementedError


class Scorer(Plugin):
    def score(self, ctx: PickContext, candidates: Sequence[Candidate]) -> list[float]:
        """A score in [0, 1] per candidate, higher better."""
        raise NotImplementedError

    def explains(self, ctx: PickContext, chosen: Candidate) -> bool:
        """Whether this scorer is why ``chosen`` won (its ``reason`` then names the pick)."""
        return False


class Picker(Plugin):
    def pick(
        self, ctx: PickContext, candidates: Sequence[Candidate], scores: Sequence[float]
    ) -> Candidate:
        raise NotImplementedError


class NoCandidates(Exception):
    """A filter left nothing; the message says what was wanted."""


P = TypeVar("P", bound=Plugin)
FILTERS: dict[str, type[Filter]] = {}
SCORERS: dict[str, type[Scorer]] = {}
PICKERS: dict[str, type[Picker]] = {}
_REGISTRIES: dict[type[Plugin], dict[str, Any]] = {
    Filter: FILTERS,
    Scorer: SCORERS,
    Picker: PICKERS,
}


def register(name: str) -> Callable[[type[P]], type[P]]:
    """Class decorator: makes the plugin known to routing documents as ``name``."""

    def add(cls: type[P]) -> type[P]:
        for kind, registry in _REGISTRIES.items():
            if issubclass(cls, kind):
                registry[name] = cls
                return cls
        raise TypeError(f"{cls.__name__} is not a Filter, Scorer or Picker")

    return add

"""What an unreachable dependency means for a request: the tenant's fail mode decides.

``closed`` refuses (the dependency's UNAVAILABLE goes to the client); ``open`` carries on
without it, counted and logged, so that an operator sees every request served that way.
"""

from __future__ import annotations

import logging
from typing import Literal

from prometheus_client import Counter

from llmmesh.runtime.errors import Unavailable

log = logging.getLogger(__name__)

Dependency = Literal["policy", "context"]
FailMode = Literal["closed", "open"]

FAIL_OPEN = {
    "policy": Counter(
        "llm_router_policy_fail_open_total",
        "Requests let through unchecked, in part or whole (policy down)",
        ["tenant"],
    ),
    "context": Counter(
        "llm_router_context_fail_open_total",
        "Requests answered without their session, or not recorded (store down)",
        ["tenant"],
    ),
}


def fail_open(
    err: Unavailable, mode: FailMode, dependency: Dependency, tenant: str, consequence: str
) -> None:
    """Re-raises ``err`` unless the tenant's ``mode`` is open; then counts and logs what
    the request goes on without (``consequence``)."""
    if mode == "closed":
        raise err
    FAIL_OPEN[dependency].labels(tenant).inc()
    log.warning(
        f"{dependency} unreachable; {consequence} (the tenant fails open)",
        extra={"fields": {"tenant": tenant, "error": err.message}},
    )

"""OpenAI's rate-limit headers, from the tenant's budgets as its request's admission left
them: what a client (or a gateway in front of the mesh) paces itself by.

A budget is a bucket refilled continuously, so its reset is the time until it is full
again at its rate. With several routers sharing budgets through allowances, the requests
left are as of this router's last grant: a pace to go by, not a promise.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.router.shared.budgets import Refusal

if TYPE_CHECKING:  # the tenants module builds refusals' headers with this one
    from services.router.tenants import Lease, TenantSpec


def rate_limit_headers(lease: Lease) -> dict[str, str]:
    """``x-ratelimit-{limit,remaining,reset}-{requests,tokens}`` for the budgets the tenant
    has (none for a budget it has not); the limits of the buckets that admitted it (a
    router's share of them while the shared store is out of reach)."""
    spec, share = lease.tenant, lease.share
    return {
        **_budget("requests", _scaled(spec.requests_per_minute, share), lease.requests_left),
        **_budget("tokens", _scaled(spec.tokens_per_minute, share), lease.tokens_left),
    }


def refused_headers(spec: TenantSpec, refusal: Refusal, prompt_tokens: int) -> dict[str, str]:
    """The headers of the budget that refused a request (what it holds is what the request
    needs less what the wait refills); none for a refusal by open streams."""
    limit, need = {
        "requests": (spec.requests_per_minute, 1),
        "tokens": (spec.tokens_per_minute, prompt_tokens),
    }.get(refusal.limit, (None, 0))
    per_minute = _scaled(limit, refusal.share)
    if per_minute is None:
        return {}
    return _budget(refusal.limit, per_minute, need - refusal.retry_after_s * per_minute / 60.0)


def _scaled(per_minute: float | None, share: float) -> float | None:
    return None if per_minute is None else per_minute * share


def _budget(kind: str, per_minute: float | None, left: float | None) -> dict[str, str]:
    if per_minute is None or left is None:
        return {}
    held = min(max(left, 0.0), per_minute)  # a stream may overdraw the bucket
    return {
        f"x-ratelimit-limit-{kind}": _number(per_minute),
        f"x-ratelimit-remaining-{kind}": f"{int(held)}",
        f"x-ratelimit-reset-{kind}": duration((per_minute - held) * 60.0 / per_minute),
    }


def _number(value: float) -> str:
    return f"{value:.0f}" if value.is_integer() else f"{value:.3f}".rstrip("0")


def duration(seconds: float) -> str:
    """A duration as OpenAI's headers write it: ``17ms``, ``1.5s``, ``6m0s``."""
    milliseconds = round(seconds * 1000)
    if milliseconds < 1000:
        return f"{milliseconds}ms"
    minutes, rest = divmod(round(seconds, 2), 60.0)
    text = f"{rest:.2f}".rstrip("0").rstrip(".") + "s"
    return f"{minutes:.0f}m{text}" if minutes else text

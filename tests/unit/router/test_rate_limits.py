"""OpenAI's rate-limit headers, from what a request's admission left in its tenant's
budgets."""

from __future__ import annotations

import asyncio

import pytest
import redis.exceptions

from llmmesh.runtime.errors import ResourceExhausted
from services.router.rate_limits import duration, rate_limit_headers
from services.router.shared.budgets import Admitted, Limits, MemoryBudgets
from services.router.shared.resilient import SharedBudgets
from services.router.tenants import Lease, Tenants, TenantsDocument, TenantSpec


def admitted(prompt_tokens: int = 0, **budgets: float) -> tuple[Tenants, Lease]:
    tenants = Tenants(enabled=True)
    tenants.apply(TenantsDocument(tenants=(TenantSpec(id="t", **budgets),)))  # type: ignore[arg-type]
    return tenants, asyncio.run(tenants.admit("t", "llm", prompt_tokens))


def test_each_admission_shows_what_it_left_and_when_the_bucket_is_full_again() -> None:
    tenants, lease = admitted(40, requests_per_minute=3, tokens_per_minute=1000)
    headers = rate_limit_headers(lease)
    assert headers["x-ratelimit-limit-requests"] == "3"
    assert headers["x-ratelimit-remaining-requests"] == "2"
    assert headers["x-ratelimit-reset-requests"] in ("19.99s", "20s")  # a request: 20 s
    assert headers["x-ratelimit-limit-tokens"] == "1000"
    assert headers["x-ratelimit-remaining-tokens"] == "960"
    assert headers["x-ratelimit-reset-tokens"] in ("2.4s", "2.39s")  # 40 of 1000 a minute
    second = asyncio.run(tenants.admit("t", "llm", 10))
    assert rate_limit_headers(second)["x-ratelimit-remaining-requests"] == "1"
    assert rate_limit_headers(second)["x-ratelimit-remaining-tokens"] == "950"


def test_tokens_generated_come_off_what_is_shown_and_an_overdraft_shows_none_left() -> None:
    _, lease = admitted(10, tokens_per_minute=100)
    lease.charge(60)
    assert rate_limit_headers(lease)["x-ratelimit-remaining-tokens"] == "30"
    lease.charge(50)  # past the budget: the stream ends, the bucket is overdrawn
    headers = rate_limit_headers(lease)
    assert headers["x-ratelimit-remaining-tokens"] == "0"
    assert headers["x-ratelimit-reset-tokens"] == "1m0s"


def test_a_budget_the_tenant_does_not_have_has_no_headers() -> None:
    _, unlimited = admitted()
    assert rate_limit_headers(unlimited) == {}
    _, requests_only = admitted(requests_per_minute=600)
    assert {name.rsplit("-", 1)[-1] for name in rate_limit_headers(requests_only)} == {"requests"}


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0.0, "0ms"), (0.0174, "17ms"), (0.9996, "1s"), (1.5, "1.5s"), (179.56, "2m59.56s")],
)
def test_durations_are_written_as_openai_writes_them(seconds: float, text: str) -> None:
    assert duration(seconds) == text


def test_a_refusal_shows_the_budget_that_refused_it() -> None:
    tenants, _ = admitted(900, requests_per_minute=3, tokens_per_minute=1000)
    with pytest.raises(ResourceExhausted) as over_tokens:
        asyncio.run(tenants.admit("t", "llm", 200))  # 100 left of 1,000 a minute
    shown = over_tokens.value.rate_limits
    assert (shown["x-ratelimit-limit-tokens"], shown["x-ratelimit-remaining-tokens"]) == (
        "1000",
        "100",
    )
    assert shown["x-ratelimit-reset-tokens"] in ("54s", "53.99s")  # 900 refill in 54 s
    assert not any("requests" in name for name in shown)  # only the budget that refused
    for _ in range(2):
        asyncio.run(tenants.admit("t", "llm", 1))
    with pytest.raises(ResourceExhausted) as over_requests:
        asyncio.run(tenants.admit("t", "llm", 1))
    assert over_requests.value.rate_limits["x-ratelimit-remaining-requests"] == "0"


class OutOfReach:
    """A shared store (Redis) that cannot be reached."""

    async def admit(self, tenant: str, limits: Limits, prompt_tokens: int) -> Admitted:
        raise redis.exceptions.ConnectionError("refused")


def test_a_router_on_its_own_shows_its_share_of_the_limits() -> None:
    """With the shared store out of reach and two routers in the fleet, this router admits
    on half of each limit: the headers say so, and what is left is of that half."""
    budgets = SharedBudgets(MemoryBudgets(), OutOfReach(), fleet_size=lambda: 2)  # type: ignore[arg-type]
    tenants = Tenants(enabled=True, budgets=budgets)
    spec = TenantSpec(id="t", requests_per_minute=10, tokens_per_minute=1000)
    tenants.apply(TenantsDocument(tenants=(spec,)))
    headers = rate_limit_headers(asyncio.run(tenants.admit("t", "llm", 100)))
    assert (headers["x-ratelimit-limit-requests"], headers["x-ratelimit-remaining-requests"]) == (
        "5",
        "4",
    )
    assert (headers["x-ratelimit-limit-tokens"], headers["x-ratelimit-remaining-tokens"]) == (
        "500",
        "400",
    )
    with pytest.raises(ResourceExhausted) as refused:
        asyncio.run(tenants.admit("t", "llm", 450))
    assert refused.value.rate_limits["x-ratelimit-limit-tokens"] == "500"

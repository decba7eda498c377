"""The tenant directory: keys, models, budgets, streams, reloads."""

from __future__ import annotations

import asyncio

import pytest

from llmmesh.runtime.errors import (
    InvalidArgument,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
)
from llmmesh.waiting import poll_until_async
from services.router.shared.budgets import Admitted, Limits, MemoryBudgets, TokenBucket
from services.router.shared.resilient import SharedBudgets
from services.router.tenants import Lease, Tenants, TenantsDocument, TenantSpec, hash_key

KEY = "s3cret-key-42"


def directory(**spec: object) -> Tenants:
    tenants = Tenants(enabled=True)
    tenants.apply(
        TenantsDocument(tenants=(TenantSpec(id="t", api_key_hashes=(hash_key(KEY),), **spec),))  # type: ignore[arg-type]
    )
    return tenants


def admit(tenants: Tenants, model: str, prompt_tokens: int) -> Lease:
    """Admitted by this router's memory: charging and releasing need no event loop."""
    return asyncio.run(tenants.admit("t", model, prompt_tokens))


def test_without_a_document_everyone_is_the_default_tenant() -> None:
    assert Tenants("dev").authenticate(None) == "dev"


def test_keys_are_checked_and_only_hashes_are_kept() -> None:
    tenants = directory()
    assert tenants.authenticate(f"Bearer {KEY}") == "t"
    assert tenants.authenticate(f"bearer  {KEY} ") == "t"
    for bad in (None, "", KEY, "Bearer nope", f"Basic {KEY}"):
        with pytest.raises(Unauthenticated):
            tenants.authenticate(bad)
    assert KEY not in repr(tenants.spec("t"))


def test_a_streams_credentials_are_checked_again_once_the_directory_changes() -> None:
    tenants = directory()
    signed_in = tenants.signed_in(f"Bearer {KEY}")
    assert signed_in.tenant() == "t"
    other = TenantSpec(id="u", api_key_hashes=(hash_key("another-key"),))
    tenants.apply(TenantsDocument(tenants=(other,)))  # the stream's key is revoked
    with pytest.raises(Unauthenticated):
        signed_in.tenant()
    with pytest.raises(Unauthenticated):
        tenants.signed_in("Bearer nope")  # refused when the stream opens


def test_enabled_without_a_document_lets_nobody_in() -> None:
    with pytest.raises(Unauthenticated):
        Tenants(enabled=True).authenticate(f"Bearer {KEY}")


def test_models_are_restricted() -> None:
    tenants = directory(models=("llm",))
    admit(tenants, "llm", 1).release()
    with pytest.raises(PermissionDenied, match="llm_canary"):
        admit(tenants, "llm_canary", 1)


def test_concurrent_streams_are_capped_and_released_once() -> None:
    tenants = directory(max_concurrent_streams=1)
    lease = admit(tenants, "llm", 1)
    with pytest.raises(ResourceExhausted):
        admit(tenants, "llm", 1)
    lease.release()
    lease.release()  # idempotent: does not free a slot twice
    admit(tenants, "llm", 1)
    with pytest.raises(ResourceExhausted):
        admit(tenants, "llm", 1)


def test_request_budget_refuses_with_the_time_until_refill() -> None:
    tenants = directory(requests_per_minute=2)
    for _ in range(2):
        admit(tenants, "llm", 1).release()
    with pytest.raises(ResourceExhausted) as info:
        admit(tenants, "llm", 1)
    assert 0 < info.value.retry_after_s <= 30


def test_tokens_are_charged_as_they_stream() -> None:
    tenants = directory(tokens_per_minute=100)
    lease = admit(tenants, "llm", 40)  # the prompt
    assert lease.charge(50)
    assert not lease.charge(20)  # 110 > 100: the stream must finish
    lease.release()
    with pytest.raises(ResourceExhausted):
        admit(tenants, "llm", 5)
    with pytest.raises(InvalidArgument, match="prompt"):
        admit(tenants, "llm", 101)  # could never pass


def test_complete_mode_lets_running_streams_finish() -> None:
    lease = admit(directory(tokens_per_minute=10, on_budget_exhausted="complete"), "llm", 5)
    assert lease.charge(50)


def test_bucket_refills_continuously_up_to_capacity() -> None:
    bucket = TokenBucket(capacity=60, level=0, updated=0.0)
    assert bucket.refill(10.0) == pytest.approx(10)
    assert bucket.refill(1000.0) == 60
    bucket.level = -6
    assert bucket.seconds_until(4, 1000.0) == pytest.approx(10)


def test_a_reload_keeps_what_was_spent_and_open_streams() -> None:
    tenants = directory(tokens_per_minute=100, max_concurrent_streams=2)
    lease = admit(tenants, "llm", 90)
    tenants.apply(
        TenantsDocument(
            tenants=(
                TenantSpec(
                    id="t",
                    api_key_hashes=(hash_key("k2"),),
                    tokens_per_minute=200,
                    max_concurrent_streams=1,
                ),
            )
        )
    )
    with pytest.raises(Unauthenticated):
        tenants.authenticate(f"Bearer {KEY}")  # the old key is gone
    with pytest.raises(ResourceExhausted, match="streams"):
        admit(tenants, "llm", 1)  # the open stream still counts
    lease.release()
    assert tenants.authenticate("Bearer k2") == "t"
    admit(tenants, "llm", 10)  # what was left carries over: spent stays spent


def test_invalid_documents_are_refused_whole() -> None:
    tenants = directory()
    assert not tenants.offer("tenants: [{id: t, api_key_hashes: [plain-key]}]", "file")
    assert not tenants.offer("tenants: [{id: a}, {id: a}]", "file")
    assert not tenants.offer("tenants: [{id: a, tier: gold}]", "file")
    assert tenants.authenticate(f"Bearer {KEY}") == "t"


def test_an_invalid_tenants_document_is_refused_and_counted() -> None:
    from prometheus_client import REGISTRY

    from services.router.tenants import Tenants as Directory

    def rejected() -> float:
        labels = {"document": "tenants", "source": "test"}
        return REGISTRY.get_sample_value("llm_documents_rejected_total", labels) or 0.0

    directory, before = Directory(), rejected()
    assert directory.offer("tenants: [{id: ok}]", "test")
    assert not directory.offer("tenants: [{id: 'no spaces'}]", "test")
    assert rejected() == before + 1
    assert directory.spec("ok").id == "ok"  # the valid one stays in force


class SlowShared:
    """A shared budget store that answers later, as Redis would: what it was charged."""

    def __init__(self) -> None:
        self.charges: list[int] = []
        self.released = 0
        self.left = 1000.0

    async def admit(self, tenant: str, limits: Limits, prompt_tokens: int) -> Admitted:
        return Admitted(self.left)

    async def charge(self, tenant: str, limits: Limits, tokens: int) -> float:
        self.charges.append(tokens)
        self.left -= tokens + 100  # another router spent 100 meanwhile
        return self.left

    async def release(self, tenant: str, limits: Limits | None = None, tokens: int = 0) -> None:
        if tokens:
            self.charges.append(tokens)  # the last charge goes with the release
        self.released += 1

    async def cancel(self, tenant: str, limits: Limits, prompt_tokens: int) -> None:
        self.charges.append(-prompt_tokens)
        self.released += 1


def test_a_shared_budget_is_charged_in_batches_and_learns_what_others_spent() -> None:
    spec = TenantSpec(id="t", tokens_per_minute=1000)

    async def scenario() -> tuple[SlowShared, list[bool]]:
        store = SlowShared()
        lease = Lease(spec, store, 1000.0, charge_interval_s=0)
        verdicts = [lease.charge(10)]  # sent at once: no charge is on its way

        async def answered() -> bool:  # 1000 - 10 - the other router's 100
            return store.charges == [10]

        assert await poll_until_async(answered, 5)
        # The first 400 goes out; the rest wait for its answer, counted here meanwhile.
        verdicts += [lease.charge(400) for _ in range(3)]
        lease.release()  # settles what is pending, then frees the stream

        async def settled() -> bool:
            return store.released == 1

        assert await poll_until_async(settled, 5)
        return store, verdicts

    store, verdicts = asyncio.run(scenario())
    assert store.charges == [10, 400, 800] and store.released == 1
    # 890 left after the first answer: 490, 90, then over.
    assert verdicts == [True, True, True, False]


def test_an_admission_in_this_routers_memory_is_answered_at_once() -> None:
    """No loop turn on a request's way when the budgets need no round trip: the lease,
    or the refusal, is there as soon as it is asked for."""

    async def scenario() -> None:
        tenants = directory(max_concurrent_streams=1, models=("llm",))
        admitted = tenants.admit_soon("t", "llm", 1)
        assert admitted.done() and isinstance(admitted.result(), Lease)
        refused = tenants.admit_soon("t", "llm", 1)  # the one stream is taken
        assert refused.done() and isinstance(refused.exception(), ResourceExhausted)
        denied = tenants.admit_soon("t", "llm_canary", 1)
        assert denied.done() and isinstance(denied.exception(), PermissionDenied)
        admitted.result().release()

    asyncio.run(scenario())


def test_an_admission_by_a_shared_store_is_under_way_and_then_answered() -> None:
    async def scenario() -> None:
        tenants = Tenants(enabled=True, budgets=SharedBudgets(MemoryBudgets(), SlowShared()))
        tenants.apply(TenantsDocument(tenants=(TenantSpec(id="t", max_concurrent_streams=4),)))
        admitting = tenants.admit_soon("t", "llm", 1)
        assert not admitting.done()
        lease = await admitting
        assert isinstance(lease, Lease)
        lease.release()

    asyncio.run(scenario())


def test_each_tenant_has_its_own_prefix_cache_unless_it_shares_a_group() -> None:
    """The engines' cache salt: a digest per tenant (no tenant named in it), the same for
    the tenants of one prefix_cache_group."""
    tenants = Tenants(enabled=True)
    specs = [
        TenantSpec(id="a"),
        TenantSpec(id="b"),
        TenantSpec(id="c", prefix_cache_group="org"),
        TenantSpec(id="d", prefix_cache_group="org"),
    ]
    tenants.apply(TenantsDocument(tenants=tuple(specs)))
    salts = {spec.id: tenants.cache_salt(spec.id) for spec in specs}
    assert len({salts["a"], salts["b"], salts["c"]}) == 3 and salts["c"] == salts["d"]
    assert all(s.isalnum() and "org" not in s for s in salts.values())
    # A client's own salt partitions its tenant's cache further, never reaching another's.
    own = tenants.cache_salt("a", "user-1")
    assert own not in salts.values() and own != tenants.cache_salt("b", "user-1")
    assert tenants.cache_salt("c", "user-1") == tenants.cache_salt("d", "user-1")
    with pytest.raises(ValueError, match="prefix_cache_group"):
        TenantSpec(id="e", prefix_cache_group="tenant:a")  # cannot pose as a tenant's own

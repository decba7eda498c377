"""Tenants: who is calling (API keys), what they may use, and what they may spend.

Only SHA-256 hashes of API keys are stored. Budgets are token buckets that refill
continuously: requests per minute, and tokens per minute charged as they happen (the
prompt at admission, generated tokens as they are relayed), kept in this router's
memory or shared by every router through Redis (services/router/shared/).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import re
import time
from collections.abc import Coroutine, Iterator, Sequence
from typing import Any, Literal

import yaml
from prometheus_client import Gauge
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from llmmesh.runtime.documents import offer
from llmmesh.runtime.errors import (
    InvalidArgument,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
)
from llmmesh.types import Truncation
from services.router.admission import ADMISSION_OUTCOMES
from services.router.rate_limits import refused_headers
from services.router.shared.budgets import Admitted, Budgets, Limits, Refusal
from services.router.shared.resilient import SharedBudgets

log = logging.getLogger(__name__)

BUDGET_REMAINING = Gauge(
    "llm_router_tenant_tokens_remaining", "Tokens left in the tenant's budget", ["tenant"]
)
BEARER = "bearer "
API_KEY = re.compile(r"[!-~]{1,512}")  # printable ASCII, no spaces
Tier = Literal["critical", "standard", "sheddable"]


def hash_key(api_key: str) -> str:
    """The stored form of an API key."""
    return "sha256:" + hashlib.sha256(api_key.encode()).hexdigest()


class TenantSpec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    api_key_hashes: tuple[str, ...] = Field(default=(), description="hash_key() of each key")
    tier: Tier = "standard"
    requests_per_minute: float | None = Field(default=None, gt=0)
    tokens_per_minute: float | None = Field(default=None, gt=0)  # prompt + generated
    max_concurrent_streams: int | None = Field(default=None, ge=1)
    models: tuple[str, ...] = ()  # models it may use; empty: every model
    policy_set: str = "default"
    # Policy service unreachable: refuse the request ("closed") or let it through,
    # flagged in the logs and llm_router_policy_fail_open_total ("open").
    policy_fail_mode: Literal["closed", "open"] = "closed"
    # When the token budget runs out mid-stream: finish the stream (finish_reason
    # "budget") or let streams already running complete.
    on_budget_exhausted: Literal["finish", "complete"] = "finish"
    # Sessions: how a history too long for the model is cut (a request may choose
    # another), how long an idle session lives (0: the context service's default), and
    # whether a request is answered without its history when the session store is
    # unreachable ("open") or refused with UNAVAILABLE ("closed").
    # key_sentences by default: it kept the most of what a conversation had said (the
    # truncation section of docs/benchmarks.md: 31% of planted facts retained against
    # 22% with the whole history and at most 7% for any other strategy, at 42% of the
    # whole history's prompt tokens).
    truncation: Truncation = Truncation.KEY_SENTENCES
    # The engines' prefix caches, and the router's index of them, are partitioned by this
    # name: tenants with the same group share cached prefixes (one organisation's keys,
    # say); by default each tenant is its own, so that no tenant can read or time another's
    # cached prompts (a prompt that repeats another tenant's prefix is computed afresh).
    prefix_cache_group: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    session_ttl_s: int = Field(default=0, ge=0, le=366 * 86_400)
    context_fail_mode: Literal["closed", "open"] = "closed"

    @model_validator(mode="after")
    def _hashes_well_formed(self) -> TenantSpec:
        for h in self.api_key_hashes:
            if not (h.startswith("sha256:") and len(h) == 71):
                raise ValueError("api_key_hashes: each must be 'sha256:' and 64 hex digits")
        return self


class TenantsDocument(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    tenants: tuple[TenantSpec, ...] = ()

    @model_validator(mode="after")
    def _unique(self) -> TenantsDocument:
        ids = [t.id for t in self.tenants]
        hashes = [h for t in self.tenants for h in t.api_key_hashes]
        if len(set(ids)) != len(ids) or len(set(hashes)) != len(hashes):
            raise ValueError("tenant ids and API keys must be unique")
        return self


def parse_tenants(text: str | bytes) -> TenantsDocument:
    """Raises ValueError naming what is wrong."""
    try:
        return TenantsDocument.model_validate(yaml.safe_load(text) or {})
    except (yaml.YAMLError, ValidationError) as err:
        raise ValueError(str(err)) from None


class Lease:
    """A stream admitted for a tenant: charges its generated tokens to the store that
    admitted it, and frees its stream slot there once.

    A store that can charge at once (this router's memory) is charged with every chunk.
    A shared one (Redis) is charged at most every ``charge_interval_s``, in the
    background: between charges the stream counts against the tenant's tokens left as
    of the last answer, so N routers overshoot a budget by at most one interval's tokens.
    """

    def __init__(
        self,
        spec: TenantSpec,
        store: Budgets,
        tokens_left: float | None,
        charge_interval_s: float = 0.0,
        *,
        requests_left: float | None = None,
        share: float = 1.0,
    ) -> None:
        self._spec = spec
        self._limits = limits_of(spec)
        self._store = store
        self._left = tokens_left
        self.requests_left = requests_left  # as the admission left it
        self.share = share  # of the tenant's limits the admitting buckets hold
        self._interval = charge_interval_s
        self._pending = 0
        self._charged_at = time.monotonic()
        self._charging: asyncio.Task[None] | None = None
        self._released = False

    @property
    def tenant(self) -> TenantSpec:
        return self._spec

    @property
    def tokens_left(self) -> float | None:
        """The tenant's tokens left as this stream knows them (None: no token budget)."""
        return self._left

    def charge(self, tokens: int) -> bool:
        """Charges generated tokens; False when the stream must finish for the budget."""
        if self._left is None or tokens <= 0:
            return True
        charge_now = getattr(self._store, "charge_now", None)
        if charge_now is not None:
            self._left = charge_now(self._spec.id, self._limits, tokens)
        else:
            self._left -= tokens
            self._pending += tokens
            if time.monotonic() - self._charged_at >= self._interval:
                self._flush()
        BUDGET_REMAINING.labels(self._spec.id).set(max(self._left or 0.0, 0.0))
        return (self._left or 0.0) > 0 or self._spec.on_budget_exhausted == "complete"

    def _flush(self) -> None:
        if self._charging is not None and not self._charging.done():
            return  # the next chunk sends what came meanwhile
        tokens, self._pending, self._charged_at = self._pending, 0, time.monotonic()
        self._charging = _background(self._charge(tokens))

    async def _charge(self, tokens: int) -> None:
        left = await self._store.charge(self._spec.id, self._limits, tokens)
        if left is not None and self._left is not None:
            self._left = left - self._pending  # what this stream spent since it asked

    def adjust(self, tokens: int) -> None:
        """Charges (or, negative, gives back) the difference between the prompt's tokens
        as admitted, an estimate, and as they came out."""
        if self._left is None or not tokens:
            return
        charge_now = getattr(self._store, "charge_now", None)
        if charge_now is not None:
            self._left = charge_now(self._spec.id, self._limits, tokens)
            return
        self._left -= tokens
        self._pending += tokens
        self._flush()

    def cancel(self, prompt_tokens: int) -> None:
        """The request went no further than admission (refused by policy, say): as if it
        had never been admitted."""
        if self._released:
            return
        self._released = True
        cancel_now = getattr(self._store, "cancel_now", None)
        if cancel_now is not None:
            cancel_now(self._spec.id, self._limits, prompt_tokens)
            return
        _background(self._store.cancel(self._spec.id, self._limits, prompt_tokens))

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        release_now = getattr(self._store, "release_now", None)
        if release_now is not None:
            release_now(self._spec.id)
            return
        pending, self._pending = self._pending, 0
        _background(self._store.release(self._spec.id, self._limits, pending))


_BACKGROUND: set[asyncio.Task[None]] = set()


def _background(work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
    """Runs ``work`` on its own; a failure is logged (the store falls back by itself)."""
    task = asyncio.get_running_loop().create_task(work)
    _BACKGROUND.add(task)

    def done(finished: asyncio.Task[None]) -> None:
        _BACKGROUND.discard(finished)
        error = None if finished.cancelled() else finished.exception()
        if error is not None:
            log.warning("a budget charge failed", extra={"fields": {"error": repr(error)}})

    task.add_done_callback(done)
    return task


def limits_of(spec: TenantSpec) -> Limits:
    return Limits(spec.requests_per_minute, spec.tokens_per_minute, spec.max_concurrent_streams)


class Tenants:
    """The tenant directory. Unless ``enabled``, every caller is ``default_tenant``,
    unlimited (a development setup); enabled, every call needs a known API key (and none
    is known until a document is applied)."""

    def __init__(
        self,
        default_tenant: str = "default",
        *,
        enabled: bool = False,
        budgets: SharedBudgets | None = None,
    ) -> None:
        self._default = TenantSpec(id=default_tenant)
        self._enabled = enabled
        self._specs: dict[str, TenantSpec] = {}
        self._by_key_hash: dict[str, str] = {}
        self._budgets = budgets or SharedBudgets.local()
        self.version = 0  # directories applied: credentials checked before may not hold now

    def apply(self, document: TenantsDocument) -> None:
        """Replaces the directory; budgets and open streams stay with their tenant ids."""
        self._specs = {spec.id: spec for spec in document.tenants}
        self._by_key_hash = {h: t.id for t in document.tenants for h in t.api_key_hashes}
        self._enabled = True
        self.version += 1
        log.info("tenants applied", extra={"fields": {"tenants": sorted(self._specs)}})

    def offer(self, text: str | bytes, source: str) -> bool:
        """Applies a document if it is valid; otherwise logs, counts and keeps the current
        one."""
        return offer("tenants", source, lambda: self.apply(parse_tenants(text)))

    def signed_in(self, authorization: str | None) -> SignedIn:
        """A caller's credentials, checked now (for a stream of many requests)."""
        return SignedIn(self, authorization)

    def authenticate(self, authorization: str | None) -> str:
        """The tenant id behind an ``authorization: Bearer <key>`` value."""
        if not self._enabled:
            return self._default.id
        if not authorization or not authorization.lower().startswith(BEARER):
            raise Unauthenticated("missing credentials: send 'authorization: Bearer <api key>'")
        key = authorization[len(BEARER) :].strip()
        if not API_KEY.fullmatch(key):  # never echoed: it may be a real key, mistyped
            raise Unauthenticated("malformed API key: expected 1-512 printable ASCII characters")
        digest = hash_key(key)
        tenant = self._by_key_hash.get(digest)
        known = self._specs[tenant].api_key_hashes if tenant else ()
        if tenant is None or not any(hmac.compare_digest(digest, h) for h in known):
            raise Unauthenticated("unknown API key")
        return tenant

    def cache_salt(self, tenant: str, requested: str = "") -> str:
        """The engines' prefix-cache partition for ``tenant``'s requests: a digest of its
        group (the tenant itself by default) and of the client's own salt, if it sent one
        (vLLM's cache_salt, a partition within the tenant's), so that the salt names no
        tenant in the engines' logs and no client can reach another tenant's partition."""
        digest = hashlib.blake2b(digest_size=16, person=b"llm-mesh-prefix")
        for part in (self.cache_group(tenant), requested):
            digest.update(len(part).to_bytes(4, "little") + part.encode("utf-8", "surrogatepass"))
        return digest.hexdigest()

    def cache_group(self, tenant: str) -> str:
        """The tenants whose requests may share prefix caches: ``tenant`` alone unless its
        spec names a group."""
        spec = self.spec(tenant)
        return spec.prefix_cache_group or f"tenant:{spec.id}"

    def spec(self, tenant: str) -> TenantSpec:
        if not self._enabled:
            return self._default
        spec = self._specs.get(tenant)
        if spec is None:  # removed since it authenticated
            raise Unauthenticated("unknown API key")
        return spec

    async def admit(self, tenant: str, model: str, prompt_tokens: int) -> Lease:
        """Checks model, concurrency and budgets; charges the request and its prompt."""
        spec = self.spec(tenant)
        with _counted(spec):
            self._check(spec, model, prompt_tokens)
        return await self._charged(spec, prompt_tokens)

    async def _charged(self, spec: TenantSpec, prompt_tokens: int) -> Lease:
        """The budgets' answer for a request that passed the checks."""
        with _counted(spec):
            store, outcome = await self._budgets.admit(spec.id, limits_of(spec), prompt_tokens)
            return self._lease(spec, store, outcome, prompt_tokens)

    def admit_soon(self, tenant: str, model: str, prompt_tokens: int) -> asyncio.Future[Lease]:
        """``admit`` under way: already done (the lease, or the refusal) when the budgets
        answer in this process, so that awaiting it costs the request no loop turn; a
        task when they need a round trip (Redis)."""
        spec = self.spec(tenant)
        admitted: asyncio.Future[Lease] = asyncio.get_running_loop().create_future()
        try:
            with _counted(spec):
                self._check(spec, model, prompt_tokens)
                answered = self._budgets.admit_now(spec.id, limits_of(spec), prompt_tokens)
                if answered is None:
                    return asyncio.ensure_future(self._charged(spec, prompt_tokens))
                admitted.set_result(self._lease(spec, *answered, prompt_tokens))
        except (PermissionDenied, ResourceExhausted, InvalidArgument) as refused:
            admitted.set_exception(refused)
        return admitted

    def _check(self, spec: TenantSpec, model: str, prompt_tokens: int) -> None:
        self.may_use(spec.id, model)
        if spec.tokens_per_minute is not None and prompt_tokens > spec.tokens_per_minute:
            raise InvalidArgument(
                "prompt",
                f"{prompt_tokens} tokens exceed the tenant's budget of "
                f"{spec.tokens_per_minute:g} tokens per minute",
            )

    def _lease(
        self, spec: TenantSpec, store: Budgets, outcome: Admitted | Refusal, prompt_tokens: int
    ) -> Lease:
        if isinstance(outcome, Refusal):
            raise _exhausted(spec, outcome, prompt_tokens)
        if outcome.tokens_left is not None:
            BUDGET_REMAINING.labels(spec.id).set(max(outcome.tokens_left, 0.0))
        interval = self._budgets.charge_interval_s
        return Lease(
            spec,
            store,
            outcome.tokens_left,
            interval,
            requests_left=outcome.requests_left,
            share=outcome.share,
        )

    def usable(self, tenant: str, models: Sequence[str]) -> list[str]:
        """Those of ``models`` the tenant may use, in order."""
        allowed = self.spec(tenant).models
        return [m for m in models if not allowed or m in allowed]

    def may_use(self, tenant: str, model: str) -> None:
        """PermissionDenied unless the tenant may use the model."""
        spec = self.spec(tenant)
        if spec.models and model not in spec.models:
            raise PermissionDenied(f"tenant '{spec.id}' may not use model '{model}'")


@contextlib.contextmanager
def _counted(spec: TenantSpec) -> Iterator[None]:
    """Counts an admission refused, by why."""
    try:
        yield
    except PermissionDenied:
        ADMISSION_OUTCOMES.labels(spec.id, spec.tier, "model_denied").inc()
        raise
    except (ResourceExhausted, InvalidArgument):
        ADMISSION_OUTCOMES.labels(spec.id, spec.tier, "over_budget").inc()
        raise


def _exhausted(spec: TenantSpec, refusal: Refusal, prompt_tokens: int) -> ResourceExhausted:
    wait = refusal.retry_after_s
    if refusal.limit == "streams":
        return ResourceExhausted(f"tenant '{spec.id}' has {refusal.detail}, its limit", wait)
    per_minute = "requests" if refusal.limit == "requests" else "tokens"
    limits = refused_headers(spec, refusal, prompt_tokens)
    return ResourceExhausted(
        f"tenant '{spec.id}' is over its {per_minute} per minute", wait, limits
    )


class SignedIn:
    """A stream's tenant: its credentials checked when the stream opens, and again for a
    request after the directory changed (a key may have been revoked meanwhile); in
    between, a request costs no check of its own."""

    def __init__(self, tenants: Tenants, authorization: str | None) -> None:
        self._tenants = tenants
        self._authorization = authorization
        self._tenant = tenants.authenticate(authorization)
        self._version = tenants.version

    def tenant(self) -> str:
        """The tenant; Unauthenticated if the current directory no longer knows the key."""
        if self._tenants.version != self._version:
            self._tenant = self._tenants.authenticate(self._authorization)
            self._version = self._tenants.version
        return self._tenant

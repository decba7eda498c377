"""Tenants: who is calling (API keys), what they may use, and what they may spend.

Only SHA-256 hashes of API keys are stored. Budgets are token buckets that refill
continuously: requests per minute, and tokens per minute charged as they happen (the
prompt at admission, every generated token as it is relayed), so one long stream cannot
overshoot a budget by more than the chunk in flight.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import time
from dataclasses import dataclass, field
from typing import Literal

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
    truncation: Truncation = Truncation.LAST_TURNS
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


@dataclass
class TokenBucket:
    """``capacity`` per minute, refilled continuously; the level may go below zero when a
    charge arrives after the fact (tokens already generated)."""

    capacity: float
    level: float
    updated: float = field(default_factory=time.monotonic)

    @property
    def rate_per_s(self) -> float:
        return self.capacity / 60.0

    def refill(self, now: float) -> float:
        self.level = min(self.capacity, self.level + (now - self.updated) * self.rate_per_s)
        self.updated = now
        return self.level

    def seconds_until(self, amount: float, now: float) -> float:
        return max(0.0, (amount - self.refill(now)) / self.rate_per_s)


@dataclass
class TenantState:
    spec: TenantSpec
    requests: TokenBucket | None = None
    tokens: TokenBucket | None = None
    streams: int = 0

    def resize(self, spec: TenantSpec) -> None:
        """Applies a changed spec, keeping what was spent."""
        self.spec = spec
        self.requests = _bucket(spec.requests_per_minute, self.requests)
        self.tokens = _bucket(spec.tokens_per_minute, self.tokens)


def _bucket(per_minute: float | None, old: TokenBucket | None) -> TokenBucket | None:
    if per_minute is None:
        return None
    if old is None:
        return TokenBucket(per_minute, per_minute)
    return TokenBucket(per_minute, min(old.level, per_minute), old.updated)


class Lease:
    """A stream admitted for a tenant: charges its tokens, frees its slot once."""

    def __init__(self, tenant: TenantState) -> None:
        self._tenant = tenant
        self._released = False

    @property
    def tenant(self) -> TenantSpec:
        return self._tenant.spec

    def charge(self, tokens: int) -> bool:
        """Charges generated tokens; False when the stream must finish for the budget."""
        bucket = self._tenant.tokens
        if bucket is None or tokens <= 0:
            return True
        bucket.refill(time.monotonic())
        bucket.level -= tokens
        BUDGET_REMAINING.labels(self.tenant.id).set(max(bucket.level, 0.0))
        return bucket.level > 0 or self.tenant.on_budget_exhausted == "complete"

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._tenant.streams -= 1


class Tenants:
    """The tenant directory. Unless ``enabled``, every caller is ``default_tenant``,
    unlimited (a development setup); enabled, every call needs a known API key (and none
    is known until a document is applied)."""

    def __init__(self, default_tenant: str = "default", *, enabled: bool = False) -> None:
        self._default = TenantState(TenantSpec(id=default_tenant))
        self._enabled = enabled
        self._states: dict[str, TenantState] = {}
        self._by_key_hash: dict[str, str] = {}

    def apply(self, document: TenantsDocument) -> None:
        """Replaces the directory; a tenant that stays keeps its budgets and streams."""
        states = {}
        for spec in document.tenants:
            state = self._states.get(spec.id) or TenantState(spec)
            state.resize(spec)
            states[spec.id] = state
        self._states = states
        self._by_key_hash = {h: t.id for t in document.tenants for h in t.api_key_hashes}
        self._enabled = True
        log.info("tenants applied", extra={"fields": {"tenants": sorted(states)}})

    def offer(self, text: str | bytes, source: str) -> bool:
        """Applies a document if it is valid; otherwise logs, counts and keeps the current
        one."""
        return offer("tenants", source, lambda: self.apply(parse_tenants(text)))

    def authenticate(self, authorization: str | None) -> str:
        """The tenant id behind an ``authorization: Bearer <key>`` value."""
        if not self._enabled:
            return self._default.spec.id
        if not authorization or not authorization.lower().startswith(BEARER):
            raise Unauthenticated("missing credentials: send 'authorization: Bearer <api key>'")
        key = authorization[len(BEARER) :].strip()
        if not API_KEY.fullmatch(key):  # never echoed: it may be a real key, mistyped
            raise Unauthenticated("malformed API key: expected 1-512 printable ASCII characters")
        digest = hash_key(key)
        tenant = self._by_key_hash.get(digest)
        known = self._states[tenant].spec.api_key_hashes if tenant else ()
        if tenant is None or not any(hmac.compare_digest(digest, h) for h in known):
            raise Unauthenticated("unknown API key")
        return tenant

    def spec(self, tenant: str) -> TenantSpec:
        return self._state(tenant).spec

    def admit(self, tenant: str, model: str, prompt_tokens: int) -> Lease:
        """Checks model, concurrency and budgets; charges the request and its prompt."""
        state = self._state(tenant)
        spec, now = state.spec, time.monotonic()
        try:
            self._check(state, model, prompt_tokens, now)
        except PermissionDenied:
            ADMISSION_OUTCOMES.labels(spec.id, spec.tier, "model_denied").inc()
            raise
        except (ResourceExhausted, InvalidArgument):
            ADMISSION_OUTCOMES.labels(spec.id, spec.tier, "over_budget").inc()
            raise
        if state.requests is not None:
            state.requests.level -= 1
        if state.tokens is not None:
            state.tokens.level -= prompt_tokens
            BUDGET_REMAINING.labels(spec.id).set(max(state.tokens.level, 0.0))
        state.streams += 1
        return Lease(state)

    def may_use(self, tenant: str, model: str) -> None:
        """PermissionDenied unless the tenant may use the model."""
        spec = self.spec(tenant)
        if spec.models and model not in spec.models:
            raise PermissionDenied(f"tenant '{spec.id}' may not use model '{model}'")

    def _check(self, state: TenantState, model: str, prompt_tokens: int, now: float) -> None:
        spec = state.spec
        self.may_use(spec.id, model)
        if spec.max_concurrent_streams is not None and state.streams >= spec.max_concurrent_streams:
            raise ResourceExhausted(
                f"tenant '{spec.id}' has {state.streams} streams open, its limit", 1.0
            )
        if state.requests is not None and state.requests.refill(now) < 1:
            wait = state.requests.seconds_until(1, now)
            raise ResourceExhausted(f"tenant '{spec.id}' is over its requests per minute", wait)
        if state.tokens is not None:
            if prompt_tokens > state.tokens.capacity:
                raise InvalidArgument(
                    "prompt",
                    f"{prompt_tokens} tokens exceed the tenant's budget of "
                    f"{state.tokens.capacity:g} tokens per minute",
                )
            if state.tokens.refill(now) < prompt_tokens:
                wait = state.tokens.seconds_until(prompt_tokens, now)
                raise ResourceExhausted(f"tenant '{spec.id}' is over its tokens per minute", wait)

    def _state(self, tenant: str) -> TenantState:
        if not self._enabled:
            return self._default
        state = self._states.get(tenant)
        if state is None:  # removed since it authenticated
            raise Unauthenticated("unknown API key")
        return state

"""Tenants as both sides of the routing service know them: who holds which API keys (by
digest only), their priority class and weight, their limits, and the quota standing an
admission decision reports for OpenAI's x-ratelimit-* headers (docs/tenants.md)."""

# baton: pure

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from enum import StrEnum

from baton.budgets import Budget

KEY_PREFIX = "sk-baton-"
KEY_ID_HEX = 12  # digits of a key's digest that name it in lists, events and revocations
# The tenant of a shim's flat --api-keys-file (or $BATON_API_KEYS): unlimited unless control
# defines a tenant of this name, whose limits and class then apply to those keys too.
FILE_TENANT = "default"
WINDOW_S = 60.0  # requests and tokens per minute are counted over the last 60 s


class Priority(StrEnum):
    INTERACTIVE = "interactive"
    STANDARD = "standard"
    BATCH = "batch"

    @property
    def band(self) -> int:
        """0 is served first."""
        return _BANDS[self]


_BANDS = {Priority.INTERACTIVE: 0, Priority.STANDARD: 1, Priority.BATCH: 2}


def digest(key: str) -> bytes:
    """What is kept of a key. A plain SHA-256 is enough: keys are 256 random bits made by
    control (control/api/admin.py; a guess is as hard as the key), and it is cheap on every
    request."""
    return hashlib.sha256(key.strip().encode()).digest()


def key_id(key_digest: bytes) -> str:
    return key_digest.hex()[:KEY_ID_HEX]


@dataclass(frozen=True, slots=True)
class Limits:
    """Absent (None) is no limit; `models` empty is every model."""

    concurrent: int | None = None
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    models: frozenset[str] = frozenset()

    def allows(self, model: str) -> bool:
        return not self.models or model in self.models

    def rates(self) -> tuple[tuple[str, int | None], ...]:
        """The numeric limits by their config names (None: absent)."""
        return (("concurrent", self.concurrent),
                ("requests_per_minute", self.requests_per_minute),
                ("tokens_per_minute", self.tokens_per_minute))  # fmt: skip


@dataclass(frozen=True, slots=True)
class TenantKey:
    digest: bytes
    created: float  # unix seconds

    @property
    def key_id(self) -> str:
        return key_id(self.digest)


@dataclass(frozen=True, slots=True)
class Tenant:
    id: str
    priority: Priority = Priority.STANDARD
    weight: int = 1
    limits: Limits = field(default_factory=Limits)
    keys: tuple[TenantKey, ...] = ()
    # Spend limits per period (baton/budgets.py). The tuple is kept as the tenant is: the
    # spend ledger's fast path knows a tenant's budgets unchanged by its identity.
    budgets: tuple[Budget, ...] = ()


class Limited(StrEnum):
    """Which limit refused a request."""

    REQUESTS = "requests"
    TOKENS = "tokens"
    CONCURRENT = "concurrent"
    BUDGET = "budget"  # a spend budget (Reason.TENANT_BUDGET)


@dataclass(frozen=True, slots=True)
class Quota:
    """A tenant's standing as one admission left it: OpenAI's rate-limit headers, and on a
    refusal what refused it and when a retry can be admitted. 0 limits: no such limit."""

    limit_requests: int = 0
    remaining_requests: int = 0
    reset_requests_s: float = 0.0
    limit_tokens: int = 0
    remaining_tokens: int = 0
    reset_tokens_s: float = 0.0
    retry_after_s: float = 0.0
    limited_by: Limited | None = None
    reset_at: float = 0.0  # BUDGET: when the budget's period resets (unix seconds)


def id_problem(tenant_id: str) -> str | None:
    """Why `tenant_id` cannot name a tenant (it is a metric label and a CLI argument)."""
    if not tenant_id or len(tenant_id) > 64:
        return "a tenant id is 1 to 64 characters"
    if not all(c.isascii() and (c.isalnum() or c in "-_.") for c in tenant_id):
        return "a tenant id is letters, digits, '-', '_' and '.'"
    return None

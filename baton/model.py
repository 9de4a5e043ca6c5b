"""Frozen domain types both sides of the routing service share: backends, their health, request
shapes, decisions, snapshots, pairings and their verdicts. No wire types here: baton/wire.py maps
them to the contract."""

# baton: pure

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import NewType

from baton.pricing import PriceTable
from baton.tenancy import Quota, Tenant

BackendId = NewType("BackendId", str)


class BackendKind(StrEnum):
    VLLM = "vllm"
    SGLANG = "sglang"
    OPENAI = "openai"


class Role(StrEnum):
    SERVE = "serve"
    DRAFT = "draft"
    TARGET = "target"


class HealthState(StrEnum):
    HEALTHY = "healthy"
    DEMOTED = "demoted"
    DRAINING = "draining"
    DOWN = "down"


class Reason(StrEnum):
    """Why a routing decision was made (span attribute and metric label)."""

    SPREAD = "spread"
    PIN_HIT = "pin-hit"
    SPILL = "spill"
    REPIN = "repin"
    DEGRADED = "degraded"
    FAILOVER = "failover"
    NO_BACKEND = "no-backend"
    UNKNOWN_MODEL = "unknown-model"
    # A follow-up of a stored response (shape.owner_key): sent to the backend holding it...
    OWNER = "owner"
    # ...or refused: its owner is dead, drained or removed (the detail says which)...
    OWNER_GONE = "owner-gone"
    # ...or no backend is known to hold it (never stored through Baton, deleted, or aged out).
    OWNER_UNKNOWN = "owner-unknown"
    # The lowest predicted time to first token (policy ttft; the detail holds the estimate).
    PREDICTED = "predicted"
    # Refused for the request's tenant (baton/tenancy.py): at a limit (the decision's quota
    # says which), a model it may not use, or a tenant removed since the shim's snapshot.
    TENANT_LIMITED = "tenant-limited"
    TENANT_MODEL = "tenant-model"
    TENANT_UNKNOWN = "tenant-unknown"
    # ...or at a spend budget (baton/budgets.py): the quota says until when.
    TENANT_BUDGET = "tenant-budget"
    # Not yet: the fleet is saturated and the request waits in its priority band; control
    # answers again when its turn comes, within the decision's `wait_s`...
    QUEUED = "queued"
    # ...or refuses it then: its wait reached the bound, or a higher band's request took its
    # place in a full queue.
    SHED = "shed"


# The cheap GET each kind of backend answers: control's health probes, the shim's standby
# connections. A generic OpenAI-compatible server need not have /health; /v1/models is in the API.
PROBE_PATH = {
    BackendKind.VLLM: "/health",
    BackendKind.SGLANG: "/health",
    BackendKind.OPENAI: "/v1/models",
}


# vLLM serves a request carrying it on that data-parallel rank (its engine core).
DATA_PARALLEL_RANK_HEADER = "X-data-parallel-rank"


@dataclass(frozen=True, slots=True)
class Backend:
    id: BackendId
    url: str
    model: str
    kind: BackendKind = BackendKind.VLLM
    role: Role = Role.SERVE
    api_key_env: str = ""  # env var with the backend's own key (see call_headers)
    # The output parsers the engine runs (vLLM --reasoning-parser / --tool-call-parser names;
    # "" = none). A resume goes through an endpoint that runs no parser, so the shim must know
    # which parsed structure to keep across a failover, or refuse a resume it cannot keep.
    reasoning_parser: str = ""
    tool_parser: str = ""
    # Where the engine publishes its KV-cache events (ZMQ PUB, control connects) and its
    # replay socket for missed batches; "" = none. Control alone reads them
    # (control/fleet/kv_subscribers.py).
    kv_events: str = ""
    kv_events_replay: str = ""
    # One rank of a data-parallel vLLM (`--data-parallel-size`, one API server for all ranks):
    # every call to it names the rank (DATA_PARALLEL_RANK_HEADER), its load is that rank's
    # series on /metrics, its kv_events that rank's stream. None: the engine is one cache.
    data_parallel_rank: int | None = None

    def call_headers(self, environ: Mapping[str, str]) -> dict[str, str]:
        """What every call to the backend carries: its own key from the caller's environment,
        never a client's (none when it has none, or the variable is unset here); and for one
        rank of a data-parallel engine, that rank, which vLLM then serves the call on."""
        key = environ.get(self.api_key_env, "") if self.api_key_env else ""
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        if self.data_parallel_rank is not None:
            headers[DATA_PARALLEL_RANK_HEADER] = str(self.data_parallel_rank)
        return headers

    def clashes_with(self, other: Backend) -> bool:
        """Both would be one rank of one data-parallel engine: the same url, with equal
        ranks or one without a rank beside one with (two without, on one url, stay allowed:
        the engine balances them itself)."""
        mine, theirs = self.data_parallel_rank, other.data_parallel_rank
        if self.url != other.url or (mine is None and theirs is None):
            return False
        return mine is None or theirs is None or mine == theirs

    @property
    def serves_clients(self) -> bool:
        """Drafts only serve through a speculative pair, never a client directly."""
        return self.role is not Role.DRAFT


@dataclass(frozen=True, slots=True)
class Health:
    state: HealthState
    reason: str
    since: float  # unix seconds, from the injected clock


@dataclass(frozen=True, slots=True)
class BackendStatus:
    backend: Backend
    health: Health
    # Drained with --migrate: shims hand this backend's in-flight streams to others.
    migrating: bool = False
    max_model_len: int = 0  # the engine's context length (/v1/models); 0: not read yet
    kv_block_size: int = 0  # tokens per KV block, from its KV events; 0: none seen
    # LoRA adapters the engine holds as control knows them (sorted by name), and
    # how many it may hold at once (vLLM's max_lora); 0: not an adapter engine, or not read.
    adapters: tuple[str, ...] = ()
    max_adapters: int = 0
    # Where the backend came from: "config" (the config file), "cli" (added at run time), or
    # a discovery source ("k8s:NAMESPACE/SERVICE", "k8s:NAMESPACE/SELECTOR", "dns:NAME").
    source: str = ""

    def serves_adapters(self) -> bool:
        return self.max_adapters > 0 or bool(self.adapters)

    @property
    def routable(self) -> bool:
        return self.health.state is HealthState.HEALTHY


# A prompt's characters per token before anything better is known (English text, BPE):
# control learns each model's own from the engines' usage (control/routing/prefill.py).
CHARS_PER_TOKEN = 4.0


@dataclass(frozen=True, slots=True)
class RequestShape:
    """What the shim tells control about a request: sizes and hashes, never prompt text."""

    model: str
    message_count: int = 0
    prefix_chain: tuple[bytes, ...] = ()
    assistant_turns: tuple[bool, ...] = ()
    prompt_chars: int = 0
    greedy: bool = True
    stream: bool = False
    spec_eligible: bool = False
    sets_temperature: bool = True
    # The stored object (a response id) the request must reach the owner of: a
    # previous_response_id, or a retrieve/delete/cancel. Empty: any backend may serve it.
    owner_key: str = ""
    # A client's explicit conversation key (vLLM's `session_id`, or an x-session-id header):
    # pins the conversation by it, across shims. Empty: none.
    session: str = ""
    # The tenant whose key the request came with (never the key); empty: an open shim.
    tenant: str = ""
    # The client's cap on generated tokens (0: none given), reserved against its tenant's
    # tokens per minute until the engine's usage is known.
    max_tokens: int = 0

    def tokens_estimate(self, chars_per_token: float = CHARS_PER_TOKEN) -> int:
        """The tokens the request may cost before the engine says: its prompt from its
        characters, and its cap on output (a tenant's charge, a place in a band's share)."""
        return round(self.prompt_chars / chars_per_token) + self.max_tokens


@dataclass(frozen=True, slots=True)
class RouteRequest:
    request_id: str
    shape: RequestShape
    exclude: frozenset[BackendId] = field(default_factory=frozenset)


@dataclass(frozen=True, slots=True)
class Pairing:
    """Serve this request by speculative decoding: draft on `draft`, verify on the primary."""

    pair_id: str
    draft: Backend
    num_draft_tokens: int
    params_hash: str
    gate_required: bool = False


@dataclass(frozen=True, slots=True)
class Estimate:
    """What a predicting policy expects of its primary: control records it, so that the
    request's observed time to first token teaches the prefill rates. Control's own: it
    does not cross the wire."""

    backend_id: BackendId
    ttft_ms: float
    uncached_tokens: float
    backlog_ms: float
    outside: float


@dataclass(frozen=True, slots=True)
class Decision:
    """Primary backend first, then ordered fallbacks; empty when no backend can serve."""

    backends: tuple[Backend, ...]
    reason: Reason
    snapshot_version: int
    detail: str = ""
    pairing: Pairing | None = None
    estimate: Estimate | None = None  # a predicting policy's, for its primary
    quota: Quota | None = None  # the tenant's standing, for rate-limit headers
    wait_s: float = 0.0  # QUEUED: the longest control will hold it before it answers again


@dataclass(frozen=True, slots=True)
class Adapter:
    """A LoRA adapter: `name` as clients send it in `model`, the `base` model it applies to,
    and the `source` (a path on the engine's machine, or what its resolver takes) an engine
    loads it from."""

    name: str
    base: str
    source: str = ""


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Immutable, versioned view of the fleet; a higher version supersedes a lower one."""

    version: int
    backends: tuple[BackendStatus, ...]
    tenants: tuple[Tenant, ...] = ()
    # The shims control counts as live (watching its snapshots): while control is away each
    # enforces this share of every tenant's limits (baton/ledger.py).
    shims: int = 0
    # The LoRA adapters clients may name: declared by the operator or found on the engines.
    adapters: tuple[Adapter, ...] = ()
    # Prices per model (baton/pricing.py): shims price requests against tenants' budgets
    # while control is away.
    prices: PriceTable = field(default_factory=PriceTable)

    def adapter(self, model: str) -> Adapter | None:
        """The adapter a request's `model` names, if it names one."""
        for a in self.adapters:
            if a.name == model:
                return a
        return None

    def serving(self, model: str) -> tuple[BackendStatus, ...]:
        """Backends that serve `model` to clients (drafts only serve through a pair). An
        adapter is served by its base's adapter engines, which hold it or can load it."""
        adapter = self.adapter(model) if self.adapters else None
        if adapter is not None:
            return tuple(
                b
                for b in self.backends
                if b.backend.model == adapter.base
                and b.backend.role is not Role.DRAFT
                and b.serves_adapters()
            )
        return tuple(
            b
            for b in self.backends
            if b.backend.model == model and b.backend.role is not Role.DRAFT
        )

    def get(self, backend_id: str) -> BackendStatus | None:
        for b in self.backends:
            if b.backend.id == backend_id:
                return b
        return None


class PairState(StrEnum):
    ACTIVE = "active"
    PROBATION = "probation"
    DETACHED = "detached"


class Verdict(StrEnum):
    ACCEPT = "accept"
    PROBATION = "probation"
    REJECT = "reject"


@dataclass(frozen=True, slots=True)
class SpecStats:
    """What one speculatively served request tells control about its pairing."""

    pair_id: str
    target_id: str
    rounds: int
    drafted: int
    accepted: int
    repeated_ngram: bool = False
    schema_violation: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestOutcome:
    """How one request ended, as the shim reports it: control releases its load, pins the
    reply where it was served and judges the pair that served it."""

    request_id: str
    backend_id: str
    model: str
    ok: bool
    http_status: int
    ttft_ms: float = 0.0
    total_ms: float = 0.0
    reply_chain_hash: bytes = b""  # chat: the next turn's prefix, to pin where it was served
    message_count: int = 0
    spec: SpecStats | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    blocks: PrefixBlocks | None = None
    # Of the prompt tokens, those the engine had cached (its usage's
    # prompt_tokens_details.cached_tokens; 0 where it says none), priced apart.
    cached_tokens: int = 0
    # The request's tenant (shape.tenant): a request a shim admitted while control was away
    # is charged to its tenant's budgets when its end is reported.
    tenant: str = ""

    @property
    def engine_refused(self) -> bool:
        """The engine answered a 4xx (not a client that left, 499): it generated nothing."""
        return 400 <= self.http_status < 500 and self.http_status != 499


@dataclass(frozen=True, slots=True)
class PrefixBlocks:
    """A request's KV-cache blocks as baton.blocks keys (hashes, never token ids): of its
    prompt and reply together; the first `prompt_blocks` are the prompt's."""

    prompt_chain_hash: bytes
    keys: tuple[int, ...]
    prompt_blocks: int
    block_size: int


class ResumePath(StrEnum):
    TOKEN = "token"  # prompt ids + generated ids: token-exact
    TEXT = "text"  # the text so far, for engines without token ids


class Failure(StrEnum):
    """Why a backend failed a request, as the shim classifies it; control demotes on it
    (never on REJECTED, REFUSED or MIGRATE) and audits it. On the wire: FailureClass."""

    CONNECT = "connect"  # refused, unreachable, DNS: nothing was sent
    DISCONNECT = "disconnect"  # the connection closed before a response status arrived
    TIMEOUT = "timeout"
    STATUS_5XX = "status_5xx"
    OVERLOADED = "status_429"
    TRUNCATED = "truncated"  # stream ended before [DONE]
    ERROR_EVENT = "error_event"  # an in-band error chunk on a 200 stream
    STALL = "stall"  # no chunk within the first-token / inter-token timeout
    GARBAGE = "garbage"  # an event that is not the JSON we expect
    # A resume answered 4xx: the backend refused this request, which says nothing about
    # its health, so it is skipped but never demoted.
    REJECTED = "status_4xx"
    # The engine ended a choice with finish_reason "abort" or "error": the text up to there
    # is real, the finish is the engine's failure.
    FINISH_ABORT = "finish_abort"
    FINISH_ERROR = "finish_error"
    # A resume that cannot be faithful (guided output, a tool call in flight...): not the
    # backend's fault either.
    REFUSED = "refused"
    # Not a failure: the backend was drained with --migrate and its streams move elsewhere.
    MIGRATE = "migrate"
    # A class this control does not know (a newer shim's): still a failure of the backend.
    UNKNOWN = "failure"

    @classmethod
    def finish(cls, reason: str) -> Failure:
        """The failure a failed finish_reason ("abort", "error") stands for."""
        return cls(f"finish_{reason}")

    @classmethod
    def parse(cls, value: str) -> Failure:
        """A class sent as a string (by shims that predate FailureClass)."""
        try:
            return cls(value)
        except ValueError:
            return cls.UNKNOWN



class SeamMode(StrEnum):
    """How a token-path resume's seam is checked (`baton shim --seam-mode`)."""

    # Resume from the exact prefix and check the overlap in a side request: no added gap.
    PARALLEL = "parallel"
    # Resume m tokens early and check the regenerated overlap in the stream itself.
    INLINE = "inline"


class AttemptEnd(StrEnum):
    """How one resumed stream ended (dataplane/relay/resume/resumed.py)."""

    FINISHED = "finished"  # the engine ended it
    STOPPED = "stopped"  # Baton matched a stop string; the engine is still generating
    DIVERGENT = "divergent"  # the inline seam check found other text: redo from the prefix
    FAILED = "failed"  # the attempt's backend failed too (its result says how)


class Seam(StrEnum):
    """The seam check's verdict on a resume."""

    VERIFIED = "verified"
    DIVERGENT = "divergent"
    UNCHECKED = "unchecked"
    SAMPLED = "sampled"


class FailoverOutcome(StrEnum):
    RESUMED = "resumed"
    FAILED = "failed"  # this resume failed too; another attempt follows
    REFUSED = "refused"  # the request cannot be resumed faithfully
    EXHAUSTED = "exhausted"  # attempts or time ran out, or no backend was left


@dataclass(frozen=True, slots=True, kw_only=True)
class FailoverReport:
    """How one choice's failover ended; becomes one audit event in control."""

    request_id: str
    from_backend: str
    to_backend: str
    failure: Failure
    choice: int
    tokens_sent: int
    path: ResumePath | None  # None: no resume was attempted
    seam: Seam | None
    gap_ms: float
    attempt: int
    outcome: FailoverOutcome
    detail: str = ""
    trace_id: str = ""
    tenant: str = ""  # the request's tenant id (never its key)

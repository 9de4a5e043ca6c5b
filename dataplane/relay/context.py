"""One client stream's request and the parts of the shim it runs with, built once by the proxy
and read by the relay and by every part of a failover (the chooser, the resumer, the migration,
the reporter), instead of each taking the same dozen arguments."""

# baton: pure

from __future__ import annotations

from dataclasses import dataclass

from baton.model import Backend, RequestShape
from baton.tracing import OFF, Tracing
from dataplane.metrics import ShimMetrics
from dataplane.relay.background import Background
from dataplane.relay.resume.markers import MarkerCache
from dataplane.request import ClientRequest
from dataplane.settings import ResumeSettings, Timeouts


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamContext:
    request_id: str
    client: ClientRequest
    shape: RequestShape
    # The route decision's backends in order: control's preference for where to resume.
    fallbacks: tuple[Backend, ...]
    settings: ResumeSettings
    timeouts: Timeouts
    metrics: ShimMetrics
    background: Background
    tracing: Tracing = OFF
    markers: MarkerCache | None = None  # each model's think tags (chat with a reasoning parser)

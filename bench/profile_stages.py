"""Where a router's CPU goes, per stage of a request: py-spy's raw samples (one line per
distinct stack, `frame;frame;... count`, outermost first) attributed to the stages issue 28
names. Pure: bench/profile.py records the samples.

A sample goes to the first stage, in the order below, that any frame of its stack belongs to:
the order puts the specific before the general (the handler is an ancestor of everything, so
"HTTP server" comes last). A stack with no frame of any stage is time the event loop spent in
C (uvloop's polling and socket calls, gRPC's completion queue) under `Runner.run`. Start-up
(imports) and other threads are left out: they are not a request's cost."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

LOOP = "event loop, sockets, gRPC core (C)"


@dataclass(frozen=True, slots=True)
class Stage:
    name: str
    frames: re.Pattern[str]


def _stage(name: str, pattern: str) -> Stage:
    return Stage(name, re.compile(pattern))


SHIM = (
    _stage("route RPC, shim side", r"dataplane/link/|grpc/|baton/wire|baton/frames"),
    _stage("tracing (off)", r"baton/tracing|upstream/genai|opentelemetry"),
    _stage("metrics", r"prometheus_client|dataplane/metrics|Proxy\._finished"),
    _stage("parse + validation", r"apis/|edge/limits|BaseRequest\.(read|json)"),
    _stage("request shape + prefix hash", r"edge/shape|prefix_chain|apis/chat|_exchange \("),
    _stage("relaying the response", r"dataplane/relay/|_relay_whole|_relay_stream|check_answer"
           r"|StreamResponse\.write|ClientResponse\.read|StreamReader"),
    _stage("upstream client", r"dataplane/upstream/|aiohttp/client|aiohttp/connector"
           r"|aiohttp/payload|aiohappyeyeballs"),
    _stage("HTTP server + middleware", r"aiohttp/|dataplane/edge/"
           r"|<locals>\.relay \(bench/floor_proxy"),
)  # fmt: skip

CONTROL = (
    _stage("audit row", r"control/audit/"),
    _stage("metrics", r"prometheus_client|control/metrics"),
    _stage("decision (router, policy)", r"control/routing/|control/fleet/|control/pairs/"
           r"|baton/spread|baton/model"),
    _stage("wire conversion", r"baton/wire|control/api/convert|baton/frames"),
    _stage("RouteStream servicer (route socket or gRPC)", r"control/api/"),
    _stage("gRPC server (Python)", r"grpc/"),
)  # fmt: skip


def attribute(lines: Iterable[str], stages: tuple[Stage, ...]) -> Counter[str]:
    """Samples per stage (LOOP for the event loop's own C time)."""
    counts: Counter[str] = Counter()
    for line in lines:
        stack, _, n = line.rstrip().rpartition(" ")
        if not stack or not n.isdigit():
            continue
        if "Runner.run" not in stack or "_find_and_load" in stack:
            continue  # another thread, or start-up
        frames = stack.split(";")
        hit = next((s.name for s in stages if any(s.frames.search(f) for f in frames)), LOOP)
        counts[hit] += int(n)
    return counts


def per_request(counts: Counter[str], cpu_us_per_request: float) -> dict[str, float]:
    """The process's measured CPU per request, split in the samples' proportions."""
    total = sum(counts.values())
    if not total:
        return {}
    return {name: cpu_us_per_request * n / total for name, n in counts.most_common()}

"""vLLM's KV-cache admin routes on the sim: where its events are published, and a reset.

* ``GET /kv_event_sources``: the publisher's config per data-parallel rank, as vLLM
  0.32 answers it (``{"0": {"enable_kv_cache_events": true, "publisher": "zmq",
  "endpoint": ..., "replay_endpoint": ..., "buffer_steps": ..., "hwm": ...,
  "max_queue_size": ..., "topic": ...}, "1": {...}}``), with the endpoints as bound
  (rank R's moved by R as vLLM moves them, a port 0 bind shows its port); ``{}`` when
  events are off. A subscriber (or a test) reads the endpoints here.
* ``POST /reset_prefix_cache``: vLLM's (a dev-mode route there): ``{"success": bool}``;
  it resets every rank's cache and fails while running requests hold blocks on any. A
  reset publishes ``AllBlocksCleared`` (on each rank's publisher).
"""

from __future__ import annotations

from aiohttp import web

from sim.http_common import ok
from sim.state import STATE, SimState


def add_routes(app: web.Application) -> None:
    app.router.add_get("/kv_event_sources", kv_event_sources)
    app.router.add_post("/reset_prefix_cache", reset_prefix_cache)
    app.on_cleanup.append(_close_publishers)


async def kv_event_sources(request: web.Request) -> web.Response:
    return ok(sources(request.app[STATE]))


def sources(state: SimState) -> dict[str, dict[str, object]]:
    """Each rank's publisher, keyed by its rank as a string (vLLM's JSON keys)."""
    return {str(e.rank): e.kv_events.source() for e in state.engines if e.kv_events is not None}


async def reset_prefix_cache(request: web.Request) -> web.Response:
    # Every rank resets: vLLM's DP client calls the utility on all engines and answers
    # all(results) (v1/engine/core_client.py reset_prefix_cache_async).
    done = [engine.cache.reset() for engine in request.app[STATE].engines]
    return ok({"success": all(done)})


async def _close_publishers(app: web.Application) -> None:
    app[STATE].close()

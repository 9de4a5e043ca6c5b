"""vLLM's KV-cache admin routes on the sim: where its events are published, and a reset.

* ``GET /kv_event_sources``: the publisher's config per data-parallel rank, as vLLM
  0.32 answers it (``{"0": {"enable_kv_cache_events": true, "publisher": "zmq",
  "endpoint": ..., "replay_endpoint": ..., "buffer_steps": ..., "hwm": ...,
  "max_queue_size": ..., "topic": ...}}``), with the endpoints as bound (a port 0
  bind shows its port); ``{}`` when events are off. A subscriber (or a test) reads
  the endpoints here.
* ``POST /reset_prefix_cache``: vLLM's (a dev-mode route there): ``{"success": bool}``;
  it fails while running requests hold blocks. A reset publishes ``AllBlocksCleared``.
"""

from __future__ import annotations

from aiohttp import web

from sim.server import STATE, ok


def add_routes(app: web.Application) -> None:
    app.router.add_get("/kv_event_sources", kv_event_sources)
    app.router.add_post("/reset_prefix_cache", reset_prefix_cache)
    app.on_cleanup.append(_close_publisher)


async def kv_event_sources(request: web.Request) -> web.Response:
    pub = request.app[STATE].kv_events
    return ok({} if pub is None else {"0": pub.source()})


async def reset_prefix_cache(request: web.Request) -> web.Response:
    return ok({"success": request.app[STATE].cache.reset()})


async def _close_publisher(app: web.Application) -> None:
    pub = app[STATE].kv_events
    if pub is not None:
        pub.close()

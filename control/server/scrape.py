"""Prometheus scrapes control over plain HTTP on its own port."""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest


async def serve_metrics(registry: CollectorRegistry, listen: str) -> tuple[web.AppRunner, int]:
    """/metrics of `registry` at `listen` (HOST:PORT); the runner (to clean up) and its port."""

    async def scrape(request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    app = web.Application()
    app.router.add_get("/metrics", scrape)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    host, _, port = listen.rpartition(":")
    site = web.TCPSite(runner, host or "127.0.0.1", int(port))
    await site.start()
    return runner, int(runner.addresses[0][1])

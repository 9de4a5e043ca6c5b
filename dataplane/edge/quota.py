"""A tenant's standing at the edge, in OpenAI's conventions: the x-ratelimit-* headers on
every answer to a tenant with request or token limits (control's refusals, the 429s among
them, are dataplane/refusals.py's)."""

from __future__ import annotations

from aiohttp import web

from baton.tenancy import Quota
from dataplane.refusals import quota_headers

TENANT = web.RequestKey("tenant", str)  # the tenant whose key the request came with
QUOTA = web.RequestKey("quota", Quota)  # its standing, as control's admission left it


async def add_quota_headers(request: web.Request, response: web.StreamResponse) -> None:
    """aiohttp's on_response_prepare: an admitted request's answer, whichever way it is
    sent (whole, streamed, an error), says where its tenant stands."""
    q = request.get(QUOTA)
    if q is not None and q.limited_by is None:
        response.headers.update(quota_headers(q))

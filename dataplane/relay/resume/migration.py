"""A stream leaving a backend drained with --migrate: when control may be asked where to
move it, and what it answered. Asked at a chunk boundary, before the stream stops, so a
migration with nowhere to go leaves a healthy stream where it is."""

from __future__ import annotations

import logging
import time

from baton.model import Backend, Failure
from dataplane.link.needs import FailoverAdvice
from dataplane.relay.context import StreamContext
from dataplane.relay.resume.choose import Chooser
from dataplane.relay.resume.plan import refusal
from dataplane.relay.stitch import Stitcher

log = logging.getLogger("baton.shim.stream")
# A stream on a migrating backend with nowhere to go keeps streaming there; control is asked
# again at most this often (it may have a backend by then).
MIGRATION_RETRY_S = 1.0


class Migration:
    def __init__(
        self, ctx: StreamContext, *, control: FailoverAdvice, chooser: Chooser, stitcher: Stitcher
    ) -> None:
        self._control = control
        self._chooser = chooser
        self._client = ctx.client
        self._stitcher = stitcher
        self._rid = ctx.request_id
        self._fallbacks = ctx.fallbacks
        self._ask_after = 0.0  # when control may next be asked where to migrate

    def due(self, backend_id: str) -> bool:
        """Is `backend_id` drained with migration, and may control be asked where to go
        (at most every MIGRATION_RETRY_S)? A set lookup at every chunk; the clock only
        while the backend migrates."""
        return backend_id in self._control.fleet.migrating and time.monotonic() >= self._ask_after

    async def target(self, backend: Backend) -> Backend | None:
        """Control's choice for a stream leaving `backend`; None: stay. A drain with
        --migrate never turns a healthy stream into an error. (Control releases the
        request's load on `backend` either way; it is counted again when it ends.)"""
        self._ask_after = time.monotonic() + MIGRATION_RETRY_S
        unfinished = self._stitcher.unfinished()
        if not unfinished:
            return None  # a stream whose choices all finished is left to send its last events
        why = next(filter(None, (refusal(self._client, p) for p in unfinished)), None)
        if why is not None:
            # It would end in an error event; finishing here is what a plain drain does.
            log.info("request %s: not migrating off %s: %s", self._rid, backend.id, why)
            self._ask_after = float("inf")
            return None
        gone = {backend.id, *self._control.fleet.migrating}
        preferred = [b.id for b in self._fallbacks if b.id not in gone]
        target = await self._chooser.ask(backend, Failure.MIGRATE, [], preferred)
        if target is None:
            log.warning(
                "request %s: %s is migrating but no backend can take its stream; staying",
                self._rid,
                backend.id,
            )
        return target

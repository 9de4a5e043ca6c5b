"""One /v1/responses generation: sim.run's lifecycle, the Responses shapes and events.

Admission, prefill, pacing, metrics and the faults are sim.run's (a Responses stream
breaks exactly where a chat stream would: ``die-after=N`` cuts it after N tokens).
Where the two APIs differ, this follows vLLM 0.32:

* ``error-after``: vLLM cannot frame an engine error as a Responses event (its
  streaming error JSON fails its own event validation), so the stream just breaks;
  the sim cuts the connection the same way (the non-streaming answer is a 500).
* ``abort-after``: the open item is closed and ``response.completed`` follows with
  status "completed" (vLLM's simple path reports only the length limit).

A finished response is stored (when ``store`` is on) before its last event is sent.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import TYPE_CHECKING, Any

from aiohttp import web

from sim import responses as r
from sim import responses_events as ev
from sim.faults import FaultKind, FaultSpec
from sim.responses_api import ResponsesRequest
from sim.run import FLUSH_EVERY, Run, end_abruptly

if TYPE_CHECKING:
    from sim.engine import EngineRank
    from sim.lora import Adapter
    from sim.state import SimState


class ResponsesRun(Run):
    def __init__(
        self, state: SimState, engine: EngineRank, req: ResponsesRequest, faults: FaultSpec,
        adapter: Adapter | None = None,
    ) -> None:
        model = state.cfg.limits.model if adapter is None else adapter.name
        meta = r.Meta(
            id=req.response_id, created=int(time.time()), model=model,
            fingerprint=state.fingerprint, chat=True, return_token_ids=False,
            include_usage=False,
        )  # fmt: skip
        super().__init__(state, engine, req.gen, faults, meta, adapter)
        self.rreq = req
        self.item_id = "msg_" + os.urandom(8).hex()

    # -- the response object ---------------------------------------------------
    def _response(
        self, status: str, output: list[dict[str, Any]], use: ev.Usage | None = None
    ) -> dict[str, Any]:
        seq = self.seqs[0]
        return ev.response_object(
            self.rreq, model=self.meta.model, created_at=self.meta.created, status=status,
            output=output, use=use,
            messages=None if use is None else (seq.token_ids, seq.output_text()),
        )  # fmt: skip

    def _finished(self, output: list[dict[str, Any]]) -> dict[str, Any]:
        seq = self.seqs[0]
        use = ev.Usage(len(self.req.prompt_ids), len(seq.token_ids), self.cached_tokens)
        body = self._response(ev.final_status(seq.finish_reason), output, use)
        if self.rreq.store:
            self.state.responses.put(body, self.rreq.messages)
        return body

    def _full_body(self) -> dict[str, object]:
        """Non-streaming (sim.run.Run.complete): always one message item, as vLLM."""
        return self._finished([ev.message_item(self.item_id, self.seqs[0].output_text())])

    # -- streaming -------------------------------------------------------------
    async def stream(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        await self._prefill()
        w = ev.EventWriter()
        buf = w.start(self._response("in_progress", []))
        seq, item, parts = self.seqs[0], self.item_id, list[str]()
        paced = self.state.cfg.cost.decode_ms_per_step > 0
        step_no = 0
        while not seq.finished:
            if step_no and (paced or len(buf) >= FLUSH_EVERY):
                await resp.write(b"".join(buf))
                buf.clear()
                if paced:
                    await asyncio.sleep(self._step_delay())
            step_no += 1
            if self._check_faults and (kind := self.faults.due(self.emitted)) is not None:
                await resp.write(b"".join(buf))
                buf.clear()
                if await self._fault(request, kind):
                    break
            e = seq.step()
            self.emitted += 1
            if e.text:  # vLLM sends no event for a token that releases no text
                if not parts:
                    buf.extend(w.open_message(item))
                parts.append(e.text)
                buf.append(w.delta(item, e.text))
            self._stepped()
        text = "".join(parts)
        if parts:
            buf.extend(w.close_message(item, text))
        buf.append(w.completed(self._finished([ev.message_item(item, text)] if parts else [])))
        await resp.write(b"".join(buf))
        self._settle()
        return resp

    async def _fault(self, request: web.Request, kind: FaultKind) -> bool:
        """Apply a due fault; True when generation stops here (abort)."""
        if kind is FaultKind.STALL:
            await asyncio.sleep(self.faults.stall_for)
            return False
        if kind is FaultKind.ABORT:
            self.seqs[0].finish_reason = "abort"
            return True
        if kind is FaultKind.ERROR:
            self.outcome = "error"
            end_abruptly(request, FaultKind.DIE)
        end_abruptly(request, kind)

"""One generation request's life on the server: admit, prefill, decode, faults (its
bookkeeping on the engine rank: sim.run_engine).

Plumbing around the pure parts (Sequence, CostParams, FaultSpec, responses).
With every cost at 0 the hot path never sleeps, and a stream is written in a
few large writes; with a decode cost each step is flushed as it is produced so
streaming is real.
"""

from __future__ import annotations

import asyncio
import os
import socket
import struct
from typing import TYPE_CHECKING, NoReturn

import orjson
from aiohttp import web

from sim import responses as r
from sim.adjust import adjusted
from sim.cells import EXCEEDED
from sim.faults import FaultKind, FaultSpec
from sim.generation import Sequence, TokenEvent
from sim.logprobs import RunLogprobs, Style
from sim.protocol import GenRequest
from sim.reasoning import R1Stream
from sim.run_engine import EngineUse
from sim.scoring import prompt_logprobs
from sim.stream_merge import Merged
from sim.tool_script import ToolCallPlan
from sim.tools import ToolStream

if TYPE_CHECKING:
    from sim.engine import EngineRank
    from sim.lora import Adapter
    from sim.state import SimState

FLUSH_EVERY = 64  # chunks buffered per write when nothing is paced


class Dropped(Exception):
    """The connection was cut on purpose (die/reset fault); nothing more to send."""


class Run(EngineUse):
    def __init__(
        self, state: SimState, engine: EngineRank, req: GenRequest, faults: FaultSpec,
        meta: r.Meta, adapter: Adapter | None = None,
    ) -> None:
        cfg = state.cfg  # the request as the server's parsers adjust it (sim.adjust)
        req = adjusted(req, cfg.model.tool_format if cfg.tool_calls else None,
                       reasoning=cfg.reasoning)  # fmt: skip
        super().__init__(state, engine, req, adapter)
        self.faults = faults
        self.meta = meta
        self.emitted = 0
        h, model = self.prompt_hash, self.model
        self.seqs = [
            Sequence(model, req.prompt_ids, req.params, index=i, prompt_hash=h,
                     tool=self._plan())
            for i in range(req.n)
        ]  # fmt: skip
        self._check_faults = not faults.empty
        self._prompt_logprobs: r.PromptLogprobs | None = None
        tok = state.tokenizer
        self._parsers: list[R1Stream] | None = None
        self._tool_parsers: list[ToolStream] | None = None
        think = None
        if meta.reasoning and tok.think_start is not None and tok.think_end is not None:
            think = (tok.think_start, tok.think_end)
        self._parsed = meta.tools or think is not None  # chat deltas come from a parser
        if meta.tools:
            fmt, tools = state.cfg.model.tool_format, req.tool.tools if req.tool else ()
            self._tool_parsers = [
                ToolStream(think, include_reasoning=meta.include_reasoning, fmt=fmt, tools=tools)
                for _ in range(req.n)
            ]
        elif think is not None:
            self._parsers = [
                R1Stream(*think, include_reasoning=meta.include_reasoning) for _ in range(req.n)
            ]
        self._lp = None if req.logprobs is None else RunLogprobs(
            model, self._lp_style(), req.logprobs, req.n,
            # vLLM hides them where the reasoning is hidden (they would spell it out).
            hidden=self._parsed and not meta.include_reasoning,
        )  # fmt: skip

    def _lp_style(self) -> Style:
        return "chat" if self.meta.chat else "completion"

    def _step(self, i: int, seq: Sequence) -> TokenEvent:
        return seq.step() if self._lp is None else self._lp.step(i, seq)

    def _logprobs(self, i: int, *, drop: bool = False) -> dict[str, object] | None:
        """Choice i's logprobs for the tokens since its last chunk (None: not asked)."""
        return None if self._lp is None else self._lp.take(i, drop=drop)

    def _token_chunk(
        self, i: int, text: str, ids: list[int], finish: str | None,
        stop_reason: str | int | None = None, prompt: list[int] | None = None,
        delta: dict[str, object] | None = None, usage: dict[str, object] | None = None,
        logprobs: dict[str, object] | None = None,
    ) -> dict[str, object]:
        """One streamed chunk of choice i (a subclass writes another API's shape)."""
        return r.token_chunk(self.meta, i, text, ids, finish, stop_reason, prompt, delta, usage,
                             logprobs)  # fmt: skip

    def _usage_chunk(self) -> dict[str, object]:
        return r.usage_chunk(self.meta, len(self.req.prompt_ids), self._generated())

    def _plan(self) -> ToolCallPlan | None:
        """Tool-call mode: what the prompt's ids make the model write (sim.tool_script)."""
        if self.state.tokenizer.tool_call_start is None:
            return None
        plan = ToolCallPlan(self.model, self.req.prompt_ids)
        return plan if plan.active else None

    # -- non-streaming -------------------------------------------------------
    async def complete(self, request: web.Request) -> web.Response:
        if self.req.rejected is not None:
            self.outcome = "error"
            return self._error(400, self.req.rejected, "BadRequestError")
        await self._prefill()
        k = self.req.prompt_logprobs
        if k is not None:
            scored = prompt_logprobs(self.model, self.req.prompt_ids, k)
            self._prompt_logprobs = r.prompt_logprobs(scored, self.state.tokenizer.texts)
        tight = self.state.cfg.cost.decode_ms_per_step <= 0 and self.engine.cells is None
        if not self._check_faults and tight and self._lp is None:
            # Nothing to pace or inject: generate each choice in one tight loop.
            for seq in self.seqs:
                seq.run_to_end()
            self._stepped()
            self._settle()
            return _json(200, self._full_body())
        seqs, step_no = self.seqs, 0
        while any(not s.finished for s in seqs):
            if step_no:
                delay = self._step_delay()
                if delay > 0:
                    await asyncio.sleep(delay)
            step_no += 1
            for i, seq in enumerate(seqs):
                if seq.finished:
                    continue
                if self._exceeded():
                    self.outcome = "error"
                    return self._error(500, EXCEEDED, "server_error")
                if self._check_faults and (kind := self.faults.due(self.emitted)) is not None:
                    if kind is FaultKind.STALL:
                        await asyncio.sleep(self.faults.stall_for)
                    elif kind is FaultKind.ERROR:
                        self.outcome = "error"
                        return self._error(500, "injected fault: engine error")
                    elif kind is FaultKind.ABORT:
                        self.outcome = "abort"
                        return _json(200, self._full_body())
                    else:
                        end_abruptly(request, kind)
                self._step(i, seq)
                self.emitted += 1
            self._stepped()
        self._settle()
        return _json(200, self._full_body())

    def _error(self, status: int, message: str, type_: str = "InternalServerError") -> web.Response:
        """A non-streamed generation that failed (the API's error shape)."""
        return _json(status, r.error_body(message, type_, status))

    def _full_body(self) -> dict[str, object]:
        results = [
            r.ChoiceResult(s.output_text(), s.token_ids, s.finish_reason or "abort", s.stop_reason,
                           self._logprobs(i))
            for i, s in enumerate(self.seqs)
        ]  # fmt: skip
        return r.full_response(self.meta, self.req.prompt_ids, results, self._prompt_logprobs)

    # -- streaming -----------------------------------------------------------
    def _stream_response(self) -> web.StreamResponse:
        """What the chat chunks are written to (a subclass may translate them)."""
        return web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )

    def _usage_so_far(self, seq: Sequence) -> dict[str, object] | None:
        if not self.meta.continuous_usage:
            return None
        return r.stream_usage(len(self.req.prompt_ids), len(seq.token_ids))

    async def stream(self, request: web.Request) -> web.StreamResponse:
        resp = self._stream_response()
        await resp.prepare(request)
        if self.req.rejected is not None:  # before the first output: no role chunk either
            self.outcome = "error"
            await resp.write(r.error_event(self.req.rejected, "BadRequestError", 400) + r.DONE)
            return resp
        await self._prefill()
        meta, req, seqs = self.meta, self.req, self.seqs
        paced = self.state.cfg.cost.decode_ms_per_step > 0
        buf: list[bytes] = []
        if meta.chat:
            buf.extend(r.sse(r.role_chunk(meta, i, req.prompt_ids)) for i in range(req.n))
        first = [not meta.chat] * req.n  # completions carry prompt ids on the first token
        # vLLM's stream_interval: several tokens per chunk. A reasoning or tool parser then
        # runs once over the merged delta, as vLLM's does (a skipped special end tag among
        # other tokens is mis-split there: sim.reasoning).
        merged = (
            [Merged(req.stream_interval) for _ in range(req.n)]
            if req.stream_interval > 1 else None
        )  # fmt: skip
        step_no = 0
        while any(not s.finished for s in seqs):
            if step_no:
                if paced:
                    await resp.write(b"".join(buf))
                    buf.clear()
                    await asyncio.sleep(self._step_delay())
                elif len(buf) >= FLUSH_EVERY:
                    await resp.write(b"".join(buf))
                    buf.clear()
            step_no += 1
            for i, seq in enumerate(seqs):
                if seq.finished:
                    continue
                if self._exceeded():
                    self.outcome = "error"
                    buf.append(r.error_event(EXCEEDED, "server_error") + r.DONE)
                    await resp.write(b"".join(buf))
                    return resp
                if self._check_faults and (kind := self.faults.due(self.emitted)) is not None:
                    await resp.write(b"".join(buf))
                    buf.clear()
                    if await self._stream_fault(request, resp, kind):
                        return resp
                ev = self._step(i, seq)
                self.emitted += 1
                prompt = req.prompt_ids if first[i] else None
                first[i] = False
                delta, finish = None, ev.finish_reason
                text, ids = ev.text, [ev.token_id]
                if merged is not None:
                    text, ids, prompt = merged[i].take(text, ids, prompt, finish is not None)
                    if not ids:
                        continue  # waits for the chunk's other tokens
                logprobs = self._logprobs(i)
                if self._tool_parsers is not None:
                    tp = self._tool_parsers[i]
                    delta = tp.delta(text, tuple(ids), finished=finish is not None)
                    finish = tp.finish_reason(finish)
                elif self._parsers is not None:
                    delta = self._parsers[i].delta(text, tuple(ids))
                if delta is None and self._parsed:
                    # vLLM skips the chunk, unless it ends the choice or the
                    # client asked for token ids (then: an empty delta).
                    if finish is None and not meta.return_token_ids and logprobs is None:
                        continue
                    delta = {}
                buf.append(
                    r.sse(self._token_chunk(i, text, ids, finish, ev.stop_reason, prompt, delta,
                                            self._usage_so_far(seq), logprobs))
                )
            self._stepped()
        if meta.include_usage:
            buf.append(r.sse(self._usage_chunk()))
        buf.append(r.DONE)
        await resp.write(b"".join(buf))
        self._settle()
        return resp

    def _abort_delta(self, i: int) -> dict[str, object] | None:
        if self._tool_parsers is not None:
            return self._tool_parsers[i].delta("", (), finished=True) or {}
        if self._parsers is None:
            return None
        return self._parsers[i].delta("", ()) or {}

    def _generated(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)

    async def _stream_fault(
        self, request: web.Request, resp: web.StreamResponse, kind: FaultKind
    ) -> bool:
        """Apply a due fault; True when the stream is over."""
        if kind is FaultKind.STALL:
            await asyncio.sleep(self.faults.stall_for)
            return False
        if kind is FaultKind.ERROR:
            self.outcome = "error"
            await resp.write(r.error_event("injected fault: engine error") + r.DONE)
            return True
        if kind is FaultKind.ABORT:
            self.outcome = "abort"
            out = [
                r.sse(self._token_chunk(i, "", [], "abort", delta=self._abort_delta(i),
                                        usage=self._usage_so_far(s),
                                        logprobs=self._logprobs(i, drop=True)))
                for i, s in enumerate(self.seqs)
                if not s.finished
            ]  # fmt: skip
            if self.meta.include_usage:
                out.append(r.sse(self._usage_chunk()))
            await resp.write(b"".join(out) + r.DONE)
            return True
        end_abruptly(request, kind)


def end_abruptly(request: web.Request, kind: FaultKind) -> NoReturn:
    """exit / die / reset: end the process or the connection right now."""
    if kind is FaultKind.EXIT:
        os._exit(1)
    transport = request.transport
    if transport is not None:
        if kind is FaultKind.RESET:
            sock = transport.get_extra_info("socket")
            if sock is not None:
                # Linger 0: close() sends RST instead of FIN.
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        transport.abort()
    raise Dropped


def _json(status: int, body: object) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")

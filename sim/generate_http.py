"""``POST /inference/v1/generate``, vLLM 0.32's token-in/token-out endpoint, on the sim.

vLLM 0.32 serves it only behind ``--enable-scale-out`` (or on a ``--tokens-only``
server): without the flag the route exists and answers 403 PermissionDeniedError
"Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to enable
them." The sim mirrors that (``--enable-scale-out``). Like vLLM's, the route sits under
``/inference``, so ``--api-key`` guards it.

The generation is sim.run's for a /v1/completions request with the same prompt ids
(same model, KV cache, pacing, stream_interval merging, and the X-Sim-Fault / --fault
seams cut it the same way); only the shapes differ (sim.generate_api). The request id is
``generate-tokens-`` + the X-Request-Id header, else the body's request_id, else 16 hex.
"""

from __future__ import annotations

import os
import time

from aiohttp import web

from sim import generate_api as g
from sim import responses as r
from sim.engine import EngineRank
from sim.faults import FaultSpec
from sim.generation import Sequence
from sim.http_common import error_type, garbage, json_body, request_faults, serve_run
from sim.logprobs import Style
from sim.lora import Adapter
from sim.protocol import ApiError, GenRequest
from sim.run import Run
from sim.state import STATE, SimState

DISABLED = (
    "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to "
    "enable them."
)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/inference/v1/generate", generate)


async def generate(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    if not state.cfg.enable_scale_out:
        raise ApiError(403, DISABLED, "PermissionDeniedError")
    faults = request_faults(request, state)
    if faults.status is not None:
        raise ApiError(faults.status, "injected fault", error_type(faults.status))
    if faults.garbage:
        return await garbage(request)
    body = await json_body(request)
    adapter = state.loras.resolve(body.get("model"))  # a LoRA adapter's name runs under it
    spec = g.parse_generate(body, state.tokenizer, state.loras.limits(adapter))
    base = request.headers.get("X-Request-Id") or spec.request_id or os.urandom(8).hex()
    req = spec.req
    meta = r.Meta(
        id="generate-tokens-" + base,
        created=int(time.time()),
        model=state.cfg.limits.model if adapter is None else adapter.name,
        fingerprint=state.fingerprint,
        chat=False,
        return_token_ids=req.return_token_ids,
        include_usage=req.include_usage,
        continuous_usage=req.continuous_usage,
    )
    run = GenerateRun(state, state.engine_for(request), req, faults, meta, spec.mode, adapter)
    return await serve_run(request, run, req.stream)


class GenerateRun(Run):
    """A completions run that writes /inference/v1/generate's shapes."""

    def __init__(
        self, state: SimState, engine: EngineRank, req: GenRequest, faults: FaultSpec,
        meta: r.Meta, mode: g.Mode, adapter: Adapter | None = None,
    ) -> None:
        self.mode: g.Mode = mode  # before Run's init: it asks _lp_style
        self._prompt_due = req.return_token_ids  # the first chunk of all carries them
        super().__init__(state, engine, req, faults, meta, adapter)

    def _lp_style(self) -> Style:
        return self.mode

    def _token_chunk(
        self, i: int, text: str, ids: list[int], finish: str | None,
        stop_reason: str | int | None = None, prompt: list[int] | None = None,
        delta: dict[str, object] | None = None, usage: dict[str, object] | None = None,
        logprobs: dict[str, object] | None = None,
    ) -> dict[str, object]:
        prompt_ids = self.req.prompt_ids if self._prompt_due else None
        self._prompt_due = False
        return g.stream_chunk(self.meta.id, self.mode, i, text, ids, finish, stop_reason,
                              logprobs, prompt_ids, usage)  # fmt: skip

    def _usage_so_far(self, seq: Sequence) -> dict[str, object] | None:
        if not self.meta.continuous_usage:
            return None
        return g.usage_info(len(self.req.prompt_ids), len(seq.token_ids))

    def _usage_chunk(self) -> dict[str, object]:
        return g.usage_chunk(self.meta.id, self.mode, len(self.req.prompt_ids), self._generated())

    def _full_body(self) -> dict[str, object]:
        choices = [
            g.Choice(s.output_text(), s.token_ids, s.finish_reason or "abort", s.stop_reason,
                     self._logprobs(i))
            for i, s in enumerate(self.seqs)
        ]  # fmt: skip
        return g.full_response(
            self.meta.id, self.mode, self.meta.model, self.meta.created, self.req.prompt_ids,
            choices, return_token_ids=self.req.return_token_ids,
            prompt_logprobs=self._prompt_logprobs,
        )  # fmt: skip

"""aiohttp wiring of the pooling endpoints: /v1/embeddings, /score, /rerank (sim.pooling).

vLLM serves these from a pooling runner (``--runner pooling``); the sim serves them
next to generation from the same tokenizer. Ids follow vLLM's prefixes ("embd-",
"score-" for both score and rerank), and an ``X-Request-Id`` header names the
request as in vLLM. Nothing here is paced or fault-injected beyond ``status`` and
``garbage``: a pooling call is one forward pass.
"""

from __future__ import annotations

import os
import time
from typing import Any

from aiohttp import web

from sim import pooling as p
from sim.http_common import error_type, json_body, ok, request_faults
from sim.protocol import ApiError, bad_request, check_model, optional_field
from sim.state import STATE, SimState
from sim.tokenizer import BOS


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/embeddings", embeddings)
    for path in ("/score", "/v1/score"):
        app.router.add_post(path, score)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        app.router.add_post(path, rerank)


async def _body(request: web.Request) -> tuple[SimState, dict[str, Any]]:
    state = request.app[STATE]
    faults = request_faults(request, state)
    if faults.status is not None:
        raise ApiError(faults.status, "injected fault", error_type(faults.status))
    body = await json_body(request)
    check_model(body, state.cfg.limits)
    return state, body


def _request_id(request: web.Request, prefix: str) -> str:
    return f"{prefix}-{request.headers.get('X-Request-Id') or os.urandom(16).hex()}"


def _check_length(state: SimState, n: int) -> None:
    limit = state.cfg.limits.max_model_len
    if n > limit:
        raise bad_request(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{n} tokens in the input for embedding generation. Please reduce the length of "
            "the input."
        )


async def embeddings(request: web.Request) -> web.Response:
    state, body = await _body(request)
    if "messages" in body:
        raise bad_request("chat-message embeddings are not supported by the sim", "messages")
    fmt = body.get("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise bad_request("'encoding_format' must be 'float' or 'base64' (the sim does not "
                          "send bytes)", "encoding_format")  # fmt: skip
    if body.get("embed_dtype", "float32") != "float32":
        raise bad_request("the sim encodes float32 only", "embed_dtype")
    dim = state.cfg.embedding_dim
    dims = p.check_dimensions(body.get("dimensions"), state.cfg.limits.model, dim)
    add_special = optional_field(body, "add_special_tokens", bool, True)
    inputs = p.embedding_inputs(body.get("input"), state.tokenizer, add_special)
    for ids in inputs:
        _check_length(state, len(ids))
    seed = state.cfg.model.seed
    vectors = [p.encode_vector(p.embed(ids, seed, dim, dims), fmt) for ids in inputs]
    return ok(p.embedding_response(
        _request_id(request, "embd"), int(time.time()), state.cfg.limits.model, vectors,
        sum(len(ids) for ids in inputs),
    ))  # fmt: skip


def _pair_scores(state: SimState, pairs: list[tuple[str, str]]) -> tuple[list[float], int]:
    """Scores of each pair and the prompt tokens (BOS + both texts per pair, as a
    cross-encoder reads them)."""
    tok, seed, dim = state.tokenizer, state.cfg.model.seed, state.cfg.embedding_dim
    scores, tokens = [], 0
    for a, b in pairs:
        ia, ib = tok.encode(a), tok.encode(b)
        n = 1 + len(ia) + len(ib)
        _check_length(state, n)
        tokens += n
        scores.append(p.score(p.embed([BOS, *ia], seed, dim), p.embed([BOS, *ib], seed, dim)))
    return scores, tokens


async def score(request: web.Request) -> web.Response:
    state, body = await _body(request)
    scores, tokens = _pair_scores(state, p.score_pairs(body))
    return ok(p.score_response(
        _request_id(request, "score"), int(time.time()), state.cfg.limits.model, scores, tokens
    ))  # fmt: skip


async def rerank(request: web.Request) -> web.Response:
    state, body = await _body(request)
    query, docs, top_n = p.rerank_request(body)
    scores, tokens = _pair_scores(state, [(query, d) for d in docs])
    return ok(p.rerank_response(
        _request_id(request, "score"), state.cfg.limits.model, docs, scores, top_n, tokens
    ))  # fmt: skip

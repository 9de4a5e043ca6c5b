"""Embeddings, scores and reranking of the toy model, in vLLM 0.32's shapes (pure).

A text's embedding is the normalised sum of one fixed vector per token id (drawn
from a Random seeded by the token id and the model seed): the same tokens give the
same vector on every replica (the chip seed plays no part), and texts sharing
tokens point the same way, so similarity means something. ``dimensions`` is
honoured like a Matryoshka model's: the first d coordinates, renormalised.

Scores (``/score``, ``/rerank``) are (1 + cosine) / 2 of the two texts'
embeddings, in [0, 1] like a cross-encoder's sigmoid. Shapes follow
vllm/entrypoints/pooling/{embed,scoring}/protocol.py; inputs and their errors
follow the request models there (``_validate_score_input_lens`` for the 1:1,
1:N, N:N rule).
"""

# baton: pure

from __future__ import annotations

import base64
import math
import struct
from collections.abc import Mapping, Sequence
from functools import lru_cache
from random import Random
from typing import Any

from sim.protocol import bad_request
from sim.tokenizer import BOS, Tokenizer


@lru_cache(maxsize=65536)
def _token_vector(token_id: int, model_seed: int, dim: int) -> tuple[float, ...]:
    rng = Random(token_id * 1_000_003 + model_seed * 7_919 + dim)
    return tuple(rng.gauss(0.0, 1.0) for _ in range(dim))


def _normalised(v: Sequence[float]) -> list[float]:
    norm = math.sqrt(sum(x * x for x in v)) or 1.0
    return [x / norm for x in v]


def embed(
    ids: Sequence[int], model_seed: int, dim: int, dimensions: int | None = None
) -> list[float]:
    acc = [0.0] * dim
    for t in ids:
        for i, x in enumerate(_token_vector(t, model_seed, dim)):
            acc[i] += x
    full = _normalised(acc)
    return full if dimensions is None else _normalised(full[:dimensions])


def score(a: Sequence[float], b: Sequence[float]) -> float:
    cos = sum(x * y for x, y in zip(a, b, strict=True))
    return max(0.0, min(1.0, (1.0 + cos) / 2.0))


def encode_vector(v: Sequence[float], fmt: str) -> list[float] | str:
    """``float``: float32 values as numbers; ``base64``: little-endian float32 bytes
    (what the OpenAI client decodes)."""
    packed = struct.pack(f"<{len(v)}f", *v)
    if fmt == "float":
        return list(struct.unpack(f"<{len(v)}f", packed))  # float32 values, as vLLM's
    return base64.b64encode(packed).decode()


def embedding_inputs(
    raw: object, tok: Tokenizer, add_special_tokens: bool
) -> list[list[int]]:
    """``input``: a string, strings, token ids or lists of token ids -> one id list each."""
    if isinstance(raw, str):
        items: list[object] = [raw]
    elif isinstance(raw, list) and raw and all(type(t) is int for t in raw):
        items = [raw]
    elif isinstance(raw, list) and raw:
        items = list(raw)
    else:
        raise bad_request("'input' must be a non-empty string, list of strings, list of "
                          "token ids or list of token-id lists", "input")  # fmt: skip
    out: list[list[int]] = []
    for item in items:
        if isinstance(item, str):
            ids = tok.encode(item)
            out.append([BOS, *ids] if add_special_tokens else ids)
        elif isinstance(item, list) and item and all(type(t) is int for t in item):
            if not tok.valid_ids(item):
                raise bad_request(
                    f"'input' token ids must be integers in [0, {tok.vocab_size})", "input"
                )
            out.append(item)
        else:
            raise bad_request("'input' items must be all strings or all token-id lists", "input")
    return out


def check_dimensions(dimensions: object, model: str, dim: int) -> int | None:
    if dimensions is None:
        return None
    if type(dimensions) is not int:
        raise bad_request("'dimensions' must be an integer", "dimensions")
    if not 1 <= dimensions <= dim:
        raise bad_request(  # vLLM's wording (PoolingParams._set_default_parameters)
            f"Model {model!r} only supports dimensions in range [1, {dim}], got {dimensions}.",
            "dimensions",
        )
    return dimensions


def usage(prompt_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens, "completion_tokens": 0,
        "prompt_tokens_details": None, "completion_tokens_details": None,
    }  # fmt: skip


def embedding_response(
    rid: str, created: int, model: str, vectors: Sequence[list[float] | str], tokens: int
) -> dict[str, Any]:
    return {
        "id": rid, "object": "list", "created": created, "model": model,
        "data": [{"index": i, "object": "embedding", "embedding": v}
                 for i, v in enumerate(vectors)],
        "usage": usage(tokens),
    }  # fmt: skip


# -- scoring -------------------------------------------------------------------
_SCORE_KEYS = (("text_1", "text_2"), ("queries", "documents"), ("queries", "items"),
               ("data_1", "data_2"))  # fmt: skip


def _texts(raw: object, name: str) -> list[str]:
    if isinstance(raw, str):
        return [raw]
    if isinstance(raw, list) and all(isinstance(t, str) for t in raw):
        return list(raw)
    raise bad_request(f"'{name}' must be a string or a list of strings (the sim's model "
                      "reads text only)", name)  # fmt: skip


def score_pairs(body: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The (first, second) text pairs a /score body asks for."""
    for k1, k2 in _SCORE_KEYS:
        if k1 in body and k2 in body:
            one, two = _texts(body[k1], k1), _texts(body[k2], k2)
            break
    else:
        raise bad_request("a score request needs 'text_1' and 'text_2' (or 'queries' and "
                          "'documents')", "text_1")  # fmt: skip
    if len(one) > 1 and len(one) != len(two):
        raise bad_request("Input lengths must be either 1:1, 1:N or N:N")  # vLLM's wording
    if not one:
        raise bad_request("At least one text element must be given")
    if not two:
        raise bad_request("At least one text_pair element must be given")
    return [(one[0] if len(one) == 1 else one[i], t) for i, t in enumerate(two)]


def score_response(
    rid: str, created: int, model: str, scores: Sequence[float], tokens: int
) -> dict[str, Any]:
    return {
        "id": rid, "object": "list", "created": created, "model": model,
        "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
        "usage": usage(tokens),
    }  # fmt: skip


def rerank_request(body: Mapping[str, Any]) -> tuple[str, list[str], int]:
    query = body.get("query")
    if not isinstance(query, str):
        raise bad_request("'query' must be a string (the sim's model reads text only)", "query")
    if "documents" not in body:
        raise bad_request("Field required: 'documents'", "documents")
    docs = _texts(body["documents"], "documents")
    top_n = body.get("top_n", 0)
    if type(top_n) is not int or top_n < 0:
        raise bad_request("'top_n' must be an integer >= 0", "top_n")
    return query, docs, top_n


def rerank_response(
    rid: str, model: str, docs: Sequence[str], scores: Sequence[float], top_n: int, tokens: int
) -> dict[str, Any]:
    """Best first; ``top_n`` 0 (the default) keeps them all."""
    order = sorted(range(len(docs)), key=lambda i: scores[i], reverse=True)
    if 0 < top_n < len(order):
        order = order[:top_n]
    results = [
        {"index": i, "document": {"text": docs[i], "multi_modal": None},
         "relevance_score": scores[i]}
        for i in order
    ]  # fmt: skip
    return {
        "id": rid, "model": model, "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        "results": results,
    }  # fmt: skip

"""Per-request engine timings, for benchmarks that need the engine's own view of a request
(e.g. the physical floor of a failover gap: how long the new backend itself took to produce
the resume's first token, under the load it had at that moment). Pure: the key and the record
format; the server writes the lines."""

# baton: pure

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

import orjson


def prompt_key(ids: Sequence[int]) -> str:
    """Identifies a request by its exact prompt ids (a resume's prompt is prompt + sent ids)."""
    return hashlib.sha1(array("q", ids).tobytes()).hexdigest()[:20]


def record(ids: Sequence[int], ttft_s: float) -> bytes:
    return orjson.dumps({"prompt": prompt_key(ids), "n": len(ids), "ttft_ms": ttft_s * 1e3}) + b"\n"

"""What an engine says of its LoRA adapters (vLLM 0.32, docs/research/vllm-lora-cpu.md):

- `GET /v1/models` lists each adapter it holds as a model whose `parent` is the base model and
  whose `root` is the path it was loaded from (vLLM's serving_models: `lora_path`);
- `vllm:lora_requests_info` on /metrics carries `max_lora` (its --max-loras) as a label. Each
  label set it was ever set with stays on the page, valued the time it was last current, so
  the newest sample is the one read. An engine with --enable-lora has the gauge's HELP and
  TYPE lines from its start, but a sample only once it has run a request under an adapter:
  until then it is an adapter engine whose max_lora is not known. One without --enable-lora
  has no such gauge.

A base model's own entry is not an adapter; an adapter of another base is not this backend's.
"""

from __future__ import annotations

from dataclasses import dataclass

import aiohttp
import orjson

from baton.model import Backend
from control.signals.engine_load import page_samples
from control.signals.published import UNANSWERED, fetch_metrics_page, get_text

LORA_INFO = "vllm:lora_requests_info"


@dataclass(frozen=True, slots=True)
class EngineAdapters:
    listed: dict[str, str]  # adapter name -> the source it was loaded from
    lora: bool  # its page has the LoRA gauge: it runs with --enable-lora
    max_lora: int | None  # None: the engine does not say (yet)


def adapters_in_models(body: object, base: str) -> dict[str, str]:
    """The adapters of `base` in a /v1/models answer: name -> root (its source)."""
    data = body.get("data") if isinstance(body, dict) else None
    out: dict[str, str] = {}
    for m in data if isinstance(data, list) else ():
        if isinstance(m, dict) and m.get("parent") == base and isinstance(m.get("id"), str):
            root = m.get("root")
            out[m["id"]] = root if isinstance(root, str) else ""
    return out


def max_lora(page: str) -> int | None:
    """`max_lora` of the newest vllm:lora_requests_info sample on a /metrics page."""
    found = page_samples(page, (LORA_INFO,)) or []
    newest = max(found, key=lambda s: s.value, default=None)
    raw = newest.labels.get("max_lora", "") if newest is not None else ""
    return int(raw) if raw.isdigit() else None


async def fetch_adapters(
    session: aiohttp.ClientSession, backend: Backend, timeout: float
) -> EngineAdapters | None:
    """The backend's adapters and max_lora; None when its engine does not answer /v1/models."""
    try:
        status, text = await get_text(session, backend, "/v1/models", timeout)
        body = orjson.loads(text) if status == 200 else None
    except (*UNANSWERED, orjson.JSONDecodeError):
        return None
    if body is None:
        return None
    page = await fetch_metrics_page(session, backend, timeout) or ""
    return EngineAdapters(adapters_in_models(body, backend.model),
                          f"# TYPE {LORA_INFO} " in page, max_lora(page))  # fmt: skip

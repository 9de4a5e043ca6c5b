"""LoRA adapters as vLLM 0.32 serves them (``vllm serve --enable-lora``): the pure part.

* The API server's registry (entrypoints/openai/models/serving.py, OpenAIServingModels):
  adapters by name, each with an int id from one counter starting at 1 (a reload in place
  keeps its id; an unload and a new load take a new one). Its checks, in vLLM's order and
  words, are ``Registry.check_load`` / ``check_unload``.
* An adapter's identity: the toy has no weights to add a low-rank update to, so an adapter
  starts the history hash elsewhere (ToyModel.with_adapter) by a digest of the files vLLM
  reads (``adapter_config.json`` and the first of ``WEIGHT_FILES``). The same directory gives
  the same tokens on every replica whatever it is called; another one, other tokens.
* One engine's loaded adapters (lora/worker_manager.py, LRUCacheWorkerLoRAManager, by int
  id): at most max_cpu_loras, the least recently used evicted by the next load; a request
  whose adapter is not loaded loads it again from its path (sim.run_engine pays for it).
  An adapter loaded with load_inplace keeps the flag, and vLLM's add_adapter reloads such
  an adapter from disk whenever its batch runs (every step); the sim reloads it once per
  request.
* vllm:lora_requests_info (v1/metrics/stats.py LoRARequestStates): see LoraRequestStates.
* KV: block hashes of a request under an adapter take ``("lora", name, path)`` as an extra
  key (v1/core/kv_cache_utils.py), so the same tokens under two adapters share no block;
  ``kv_key`` is that key as the sim's block hash folds it in (sim.kvcache).
"""

# baton: pure

from __future__ import annotations

import hashlib
import json
import re
from collections import OrderedDict
from dataclasses import dataclass, field

from sim.config import LoraModule
from sim.protocol import ApiError

CONFIG_FILE = "adapter_config.json"
# What vLLM's LoRAModel.from_local_checkpoint reads, the first that exists.
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin", "adapter_model.pt")
_REQUIRED = ("lora_alpha", "r", "target_modules")  # PEFTHelper's fields without defaults
NOT_ENABLED = "LoRA is not enabled. Use --enable-lora to enable LoRA."


def _digest64(*parts: bytes) -> int:
    """63 bits of sha256 over length-prefixed parts: the same in every process (str and
    bytes hashes are salted per process, so hash() would not do)."""
    d = hashlib.sha256()
    for part in parts:
        d.update(len(part).to_bytes(8, "big"))
        d.update(part)
    return int.from_bytes(d.digest()[:8], "big") >> 1


def weights_identity(config: bytes, weights: bytes) -> int:
    """What an adapter does to the model, from the bytes of its files."""
    return _digest64(config, weights)


@dataclass(frozen=True, slots=True)
class Adapter:
    """One registered adapter (vLLM's LoRARequest)."""

    name: str
    int_id: int  # vLLM's lora_int_id: what the engine caches it by, and KV events' lora_id
    path: str  # lora_path as given: the card's root, and part of the KV extra key
    identity: int  # weights_identity of its files when it was loaded
    parent: str  # the card's parent: the base model it was loaded for
    load_inplace: bool = False  # loaded with load_inplace: the engine reloads it (AdapterCache)
    kv_key: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "kv_key", _digest64(b"lora", self.name.encode(),
                                                     self.path.encode()))  # fmt: skip


def check_config(raw: bytes, max_lora_rank: int) -> None:
    """adapter_config.json as vLLM's PEFTHelper checks it (the checks the sim's adapters can
    fail); ValueError with its message otherwise."""
    try:
        cfg = json.loads(raw)
    except ValueError as e:
        raise ValueError(str(e)) from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{CONFIG_FILE} must hold a JSON object")
    missing = [k for k in _REQUIRED if k not in cfg]
    if missing:  # vLLM prints a set (in no fixed order); sorted here
        raise ValueError(f"Missing required configuration fields: {{{repr(missing)[1:-1]}}}")
    ranks = [cfg["r"], *dict(cfg.get("rank_pattern") or {}).values()]
    for r in ranks:
        if type(r) is not int or r <= 0:
            raise ValueError(f"LoRA rank `r` must be a positive integer, got {r}.")
    errors = []
    if cfg.get("use_dora"):
        errors.append("vLLM does not yet support DoRA.")
    if max(ranks) > max_lora_rank:
        errors.append(f"LoRA rank {max(ranks)} is greater than max_lora_rank {max_lora_rank}.")
    if cfg.get("bias", "none") != "none":
        errors.append("Adapter bias is not supported.")
    if errors:
        raise ValueError(" ".join(errors))


def not_found(name: str, path: str) -> ApiError:
    """vLLM's LoRAAdapterNotFoundError as its error response renders it: a 404."""
    return ApiError(404, sanitized(f"Loading lora {name} failed: No adapter found for {path}"),
                    "NotFoundError")  # fmt: skip


def load_failed(reason: str) -> ApiError:
    """Any other failure of the engine's add_lora: a 500 with the utility call's words."""
    return ApiError(500, sanitized(f"Call to add_lora method failed: {reason}"),
                    "InternalServerError")  # fmt: skip


def sanitized(message: str) -> str:
    """vLLM's sanitize_message: error messages lose memory addresses, traceback lines and
    file paths (so a missing adapter's path shows as ``<path>``)."""
    message = re.sub(r" at 0x[0-9a-fA-F]+>", ">", message)
    message = re.sub(r'\n?\s*File "[^"]+", line \d+, in \S+(\n\s+.*)?', "", message)
    message = re.sub(
        r"/(?:home|usr|opt|var|tmp|root|lib|mnt|srv)(?:/[\w.\-]+)+", "<path>", message
    )
    message = re.sub(r"(?:/[\w\-]+)+/[\w\-]+\.\w+", "<path>", message)
    return message.strip()


class Registry:
    """The API server's adapters by name: what /v1/models lists and requests may name."""

    __slots__ = ("base", "_by_name", "_last_id")

    def __init__(self, base: str) -> None:
        self.base = base
        self._by_name: dict[str, Adapter] = {}  # insertion order: the cards' order
        self._last_id = 0

    def get(self, name: str) -> Adapter | None:
        return self._by_name.get(name)

    def adapters(self) -> list[Adapter]:
        return list(self._by_name.values())

    def next_id(self) -> int:
        """vLLM's lora_id_counter: also taken by every failed resolve_lora (sim.lora_runtime)."""
        self._last_id += 1
        return self._last_id

    def id_for(self, name: str) -> int:
        """A reload in place keeps the adapter's id; anything else takes the next."""
        known = self._by_name.get(name)
        return known.int_id if known is not None else self.next_id()

    def check_load(self, name: str, path: str, inplace: bool) -> None:
        if not name or not path:
            raise _invalid("Both 'lora_name' and 'lora_path' must be provided.")
        if name == self.base:
            raise _invalid(f"The lora adapter '{name}' conflicts with a served base model.")
        if not inplace and name in self._by_name:
            raise _invalid(
                f"The lora adapter '{name}' has already been loaded. If you want to load the "
                "adapter in place, set 'load_inplace' to True."
            )

    def check_unload(self, name: str) -> None:
        if not name:
            raise _invalid("'lora_name' needs to be provided to unload a LoRA adapter.")
        if name not in self._by_name:
            raise ApiError(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")

    def add(self, adapter: Adapter) -> None:
        self._by_name[adapter.name] = adapter  # a reload in place keeps its card's place

    def remove(self, name: str) -> None:
        del self._by_name[name]


def _invalid(message: str) -> ApiError:
    return ApiError(400, message, "InvalidUserInput")


class AdapterCache:
    """One engine's loaded adapters by int id, least recently used first (vLLM's
    LRUCacheWorkerLoRAManager with capacity max_cpu_loras).

    vLLM touches every adapter of the running batch at every step, so an adapter with a
    running request is never the least recent; the sim touches at a request's start and
    end and skips running adapters when it evicts, which comes to the same."""

    __slots__ = ("capacity", "_lru", "_running")

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._running: dict[int, int] = {}  # int id -> requests running with it

    def __contains__(self, int_id: int) -> bool:
        return int_id in self._lru

    @property
    def loaded(self) -> list[int]:
        """Int ids, least recently used first."""
        return list(self._lru)

    def add(self, adapter: Adapter, *, force: bool = False) -> bool:
        """vLLM's add_adapter: load it unless it is loaded (``force``: load_inplace, which
        reloads it anyway), evicting the least recent if the cache is full; True when it
        loaded (a cost to pay)."""
        key = adapter.int_id
        if key in self._lru and not force:
            self._lru.move_to_end(key)
            return False
        self._lru.pop(key, None)
        if len(self._lru) + 1 > self.capacity:
            victim = next((k for k in self._lru if k not in self._running), None)
            if victim is not None:  # all running: vLLM too is over capacity for a while
                del self._lru[victim]
        self._lru[key] = None
        return True

    def start(self, adapter: Adapter) -> bool:
        """A request with it was scheduled: loaded if need be (True: it loaded)."""
        loaded = self.add(adapter, force=adapter.load_inplace)
        self._running[adapter.int_id] = self._running.get(adapter.int_id, 0) + 1
        return loaded

    def finish(self, adapter: Adapter) -> None:
        key = adapter.int_id
        left = self._running.get(key, 0) - 1
        if left > 0:
            self._running[key] = left
        else:
            self._running.pop(key, None)
        if key in self._lru:
            self._lru.move_to_end(key)


class LoraRequestStates:
    """What vLLM 0.32's API server knows of the requests under each adapter, and the labels
    of vllm:lora_requests_info it renders from that.

    A request counts from its first output (the engine's QUEUED and SCHEDULED events ride on
    it, so one waiting to be scheduled is not seen at all) to its end. Both labels then list
    the same names: LoRARequestStates.update_scheduler_stats fills both dicts for every
    adapter with a request, and the logger joins the keys, so the counts (0 or not) are
    lost. Names are in the order they got their first live request."""

    __slots__ = ("_requests",)

    def __init__(self) -> None:
        self._requests: dict[str, set[int]] = {}

    def running(self, name: str, request: int) -> None:
        self._requests.setdefault(name, set()).add(request)

    def finished(self, name: str, request: int) -> None:
        live = self._requests.get(name)
        if live is None:
            return
        live.discard(request)
        if not live:
            del self._requests[name]

    def labels(self) -> tuple[str, str]:
        """(waiting_lora_adapters, running_lora_adapters) as vLLM 0.32 writes them."""
        names = ",".join(self._requests)
        return names, names


def parse_lora_modules(values: list[str]) -> tuple[LoraModule, ...]:
    """vLLM's --lora-modules: ``name=path`` or a JSON object ``{"name", "path",
    "base_model_name"?}`` each; ValueError with vLLM's words."""
    out = []
    for item in values:
        if not item:
            continue
        if "=" in item and "," not in item:
            name, path = item.split("=", 1)
            out.append(LoraModule(name, path))
            continue
        try:
            raw = json.loads(item)
        except ValueError:
            raise ValueError(f"Invalid JSON format for --lora-modules: {item}") from None
        known = {"name", "path", "base_model_name", "is_3d_lora_weight"}
        if not isinstance(raw, dict) or not {"name", "path"} <= raw.keys() <= known:
            raise ValueError(f"Invalid fields for --lora-modules: {item}")
        out.append(LoraModule(str(raw["name"]), str(raw["path"]), raw.get("base_model_name")))
    return tuple(out)

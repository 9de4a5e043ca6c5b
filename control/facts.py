"""What a backend says about itself that a speculative pair depends on (pure).

Read from the backend's `GET /server_info` at bind time and whenever it rejoins, never taken
from config: a replica restarted with another generation config must not keep the facts of
the one before.
"""

# baton: pure

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import orjson

from control.exceptions import FactsError

FACTS_PATH = "/server_info"


@dataclass(frozen=True, slots=True)
class Sampling:
    """The backend's default sampling params: what applies when a request leaves them out."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off (vLLM's -1 is normalised to 0)
    seed: int | None = None

    @property
    def params_hash(self) -> str:
        canonical = orjson.dumps(
            {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
             "seed": self.seed},
            option=orjson.OPT_SORT_KEYS,
        )  # fmt: skip
        return "sha256:" + hashlib.sha256(canonical).hexdigest()


@dataclass(frozen=True, slots=True)
class Facts:
    vocab_hash: str
    block_size: int
    sampling: Sampling
    eos_token_id: int | None = None

    @property
    def params_hash(self) -> str:
        return self.sampling.params_hash


def facts_from_server_info(body: Mapping[str, Any]) -> Facts:
    try:
        params = body["default_sampling_params"]
        top_k = int(params.get("top_k") or 0)
        seed = params.get("seed")
        return Facts(
            vocab_hash=str(body["vocab_hash"]),
            block_size=int(body["block_size"]),
            sampling=Sampling(
                temperature=float(params.get("temperature", 0.0)),
                top_p=float(params.get("top_p", 1.0)),
                top_k=max(top_k, 0),
                seed=None if seed is None else int(seed),
            ),
            eos_token_id=None if (eos := body.get("eos_token_id")) is None else int(eos),
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise FactsError(f"server_info lacks {exc}") from exc


class Violation(NamedTuple):
    invariant: str  # the name a refusal carries: vocab_hash, block_size, params_hash
    detail: str


def pair_violations(draft: Facts, target: Facts) -> list[Violation]:
    """Every invariant a draft/target pairing breaks (empty: they may pair). Verification
    compares the draft's tokens with the target's logits, so the sampling params must match
    too: otherwise acceptance measures argmax agreement, not speculative correctness."""
    found = []
    if draft.vocab_hash != target.vocab_hash:
        found.append(Violation("vocab_hash", f"{_short(draft.vocab_hash)} != "
                                             f"{_short(target.vocab_hash)}"))  # fmt: skip
    if draft.block_size != target.block_size:
        found.append(Violation("block_size", f"{draft.block_size} != {target.block_size}"))
    if draft.params_hash != target.params_hash:
        found.append(Violation("params_hash", f"sampling {_params(draft)} != {_params(target)}"))
    return found


def _short(h: str) -> str:
    return h.removeprefix("sha256:")[:12]


def _params(f: Facts) -> str:
    s = f.sampling
    return f"(temperature={s.temperature:g}, top_p={s.top_p:g}, top_k={s.top_k}, seed={s.seed})"

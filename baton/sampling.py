"""The sampling parameters the router sets on every call it makes for a speculative pair.

Both engines of a pair are told every parameter that shapes a greedy choice, at its neutral
value, so that neither engine's generation-config defaults (vLLM's `--generation-config`,
a model's generation_config.json, llama-server's sampler chain) can enter: the draft's
tokens and the target's scores come from the same rule. The params hash a pair is bound
under is the hash of these parameters; control compares it at bind and at the gate, and the
shim sends them (dataplane/spec/rounds.py)."""

# baton: pure

from __future__ import annotations

import hashlib
from typing import Any

import orjson

from baton.model import BackendKind

# The meaning, in vLLM's names: greedy, no truncation, a fixed seed, no penalties.
PAIR_PARAMS: dict[str, Any] = {
    "temperature": 0.0,
    "top_p": 1.0,
    "top_k": 0,  # off (vLLM 0.32: 0 disables, -1 is accepted too)
    "min_p": 0.0,
    "seed": 0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
}
PAIR_PARAMS_HASH = "sha256:" + hashlib.sha256(
    orjson.dumps(PAIR_PARAMS, option=orjson.OPT_SORT_KEYS)
).hexdigest()

# llama-server spells two of them its own way; the meaning (and so the hash) is the same.
_LLAMA_NAMES = {"repetition_penalty": "repeat_penalty"}


def pair_params(kind: BackendKind) -> dict[str, Any]:
    """PAIR_PARAMS as the engine of `kind` takes them in a completion request's body."""
    if kind is BackendKind.OPENAI:
        return {_LLAMA_NAMES.get(k, k): v for k, v in PAIR_PARAMS.items()}
    return dict(PAIR_PARAMS)

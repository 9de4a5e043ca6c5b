"""A conversation's prefix chain: h_i = H_key(h_{i-1} || canonical(message_i)). Two
conversations share h_i exactly when their first i messages are identical, which is what
prefix affinity needs; only these keyed hashes leave the shim, never prompt text.

h_0 is `chain_root(adapter)`: empty for the base model, a hash of its name for a LoRA
adapter, so the same messages under two adapters (or none) share no hash, as their KV-cache
blocks share none on an engine. Every later hash, the reply's included, carries it."""

# baton: pure

from __future__ import annotations

import hashlib
from typing import Any

import orjson

DEFAULT_KEY = b"baton-prefix-v1"
DIGEST_SIZE = 16
# blake2b's personalisation for adapters' roots (message hashes have none): no root is ever
# also some messages' hash.
_ROOT_PERSON = b"baton.lora.chain"


HASHED_KEYS = ("role", "content", "name", "tool_calls", "tool_call_id")


def canonical(message: Any) -> bytes:
    """A message as the model sees it, so that the assistant turn a client echoes back
    (as a plain dict, or an SDK object dumped with None fields) hashes like the reply we
    pinned: key order, empty fields and text-part splitting don't change the hash."""
    if not isinstance(message, dict):
        return orjson.dumps(message, option=orjson.OPT_SORT_KEYS)
    kept = {k: message[k] for k in HASHED_KEYS if message.get(k) not in (None, "", [])}
    content = kept.get("content")
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" for p in content
    ):
        kept["content"] = "".join(str(p.get("text", "")) for p in content)
    return orjson.dumps(kept, option=orjson.OPT_SORT_KEYS)


def chain_root(adapter: str | None, key: bytes = DEFAULT_KEY) -> bytes:
    """h_0 for a request to LoRA adapter `adapter` (its name); b"" for the base model (None
    or ""), whose chains hash as they always have."""
    if not adapter:
        return b""
    return hashlib.blake2b(adapter.encode(), digest_size=DIGEST_SIZE, key=key,
                           person=_ROOT_PERSON).digest()  # fmt: skip


def prefix_chain(
    messages: list[Any], key: bytes = DEFAULT_KEY, root: bytes = b""
) -> tuple[bytes, ...]:
    """`root`: h_0 (chain_root)."""
    chain: list[bytes] = []
    prev = root
    for m in messages:
        prev = hashlib.blake2b(prev + canonical(m), digest_size=DIGEST_SIZE, key=key).digest()
        chain.append(prev)
    return tuple(chain)


def reply_hash(chain: tuple[bytes, ...], reply: str, key: bytes = DEFAULT_KEY) -> bytes:
    """The chain hash the next turn will carry for this assistant reply (its adapter, if any,
    is in chain[-1]: a reply follows at least one message)."""
    prev = chain[-1] if chain else b""
    message = {"role": "assistant", "content": reply}
    return hashlib.blake2b(prev + canonical(message), digest_size=DIGEST_SIZE, key=key).digest()

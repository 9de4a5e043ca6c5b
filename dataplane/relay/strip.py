"""What the client gets of an engine's chunk: the engine's bytes, less the token ids Baton
asked for and the client did not; a chunk Baton must edit is parsed and serialised again.

On the per-token path: one find and one join for vLLM's `,"token_ids":[...]` (a regular
expression over the chunk cost three times that), the general pattern only where that is
not the whole story (a first chunk's prompt ids, spaces, a null)."""

# baton: pure

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from dataplane.sse import sse
from dataplane.upstream.chunks import FAILED_FINISH, as_dict

# `,"token_ids":[1,2]`, `,"prompt_token_ids":[...]` or `: null` as engines write them (never
# the first key). Integer arrays can't hide in a JSON string: a quote is escaped there, so
# `,"` never starts inside one.
TOKEN_FIELDS = re.compile(rb',\s*"(?:prompt_)?token_ids"\s*:\s*(?:\[[\d,\s]*\]|null)')
_KEY = b',"token_ids":['


def strip_ids(raw: bytes) -> bytes | None:
    """`raw` less its token-id fields; None when some could not be cut out as bytes (the
    caller then edits the parsed chunk and serialises it again)."""
    at = raw.find(_KEY)
    if at >= 0:
        end = raw.find(b"]", at + len(_KEY))
        cut = raw[:at] + raw[end + 1 :]
        if b"token_ids" not in cut:
            return cut
        raw = cut
    cut = TOKEN_FIELDS.sub(b"", raw)
    return cut if b"token_ids" not in cut else None


def client_event(data: bytes, raw: bytes, strip: bool, obj: dict[str, Any] | None = None) -> bytes:
    """The event for the client: `raw` as the engine sent it, less the token ids when `strip`
    (the client did not ask for them). `obj`: the chunk as edited (then serialised again)."""
    if obj is None:
        if raw and strip:
            cut = strip_ids(raw)
            if cut is not None:
                return cut
        if not strip and raw:
            return raw
        obj = as_dict(data)
    if strip:
        obj.pop("prompt_token_ids", None)
        for ch in obj.get("choices") or ():
            ch.pop("token_ids", None)
            ch.pop("prompt_token_ids", None)
    return sse(obj)


def edited(data: bytes, fixed: Mapping[int, dict[str, Any]], strip: bool) -> bytes:
    """The chunk with the deltas Baton split by ids in place of the parser's (`fixed`, by
    choice index), and an engine's failed finish taken out: the text in it is real and goes
    to the client; the stream fails over after it."""
    obj = as_dict(data)
    for ch in obj.get("choices") or ():
        if ch.get("index") in fixed:
            ch["delta"] = fixed[ch["index"]]
        if ch.get("finish_reason") in FAILED_FINISH:
            ch["finish_reason"] = None
            ch.pop("stop_reason", None)
    return client_event(b"", b"", strip, obj)

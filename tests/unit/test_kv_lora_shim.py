"""Prefix affinity and sessions per LoRA adapter (issue 42), the shim's side: a request whose
model is an adapter (as the shim's snapshot knows it) has a prefix chain rooted at the
adapter, a session key scoped to it and block keys from its root, so control's pins, sessions
and KV lookups never take one adapter's (or the base's) cache for another's; a base model's
request hashes exactly as it always has."""

from __future__ import annotations

import hashlib
from typing import Any

from baton.model import Adapter, RequestShape, Snapshot
from dataplane.edge.handlers import _exchange
from dataplane.edge.shape import adapter_of, session_key, shape_of, with_request
from dataplane.prefix_chain import DEFAULT_KEY, canonical, chain_root, prefix_chain, reply_hash
from dataplane.request import ClientRequest, Endpoint

SYSTEM = {"role": "system", "content": "You are terse."}
USER = {"role": "user", "content": "the same long question"}
MESSAGES = [SYSTEM, USER]
SNAPSHOT = Snapshot(1, (), adapters=(Adapter("sql", "toy", "/a/sql"), Adapter("chat", "toy")))


def chat(model: str, messages: list[Any] = MESSAGES, **extra: Any) -> ClientRequest:
    body = {"model": model, "messages": messages, "temperature": 0, "stream": True, **extra}
    return ClientRequest(Endpoint.CHAT, body, model, True, True)


def test_the_base_models_chain_is_the_one_it_always_had() -> None:
    """h_1 = H(canonical(m_1)), h_i = H(h_{i-1} || canonical(m_i)): computed here without
    the module's chain code, so a change to the base's hashes shows."""
    h1 = hashlib.blake2b(canonical(SYSTEM), digest_size=16, key=DEFAULT_KEY).digest()
    h2 = hashlib.blake2b(h1 + canonical(USER), digest_size=16, key=DEFAULT_KEY).digest()
    assert chain_root(None) == chain_root("") == b""
    assert prefix_chain(MESSAGES) == prefix_chain(MESSAGES, root=chain_root(None)) == (h1, h2)
    assert shape_of(chat("toy")).prefix_chain == (h1, h2)
    assert shape_of(chat("toy"), adapter=None) == shape_of(chat("toy"))


def test_each_adapter_chains_apart_from_the_base_and_from_each_other() -> None:
    base = shape_of(chat("toy")).prefix_chain
    sql = shape_of(chat("sql"), adapter="sql").prefix_chain
    other = shape_of(chat("chat"), adapter="chat").prefix_chain
    assert len(base) == len(sql) == len(other) == 2
    # No prefix of one is a prefix of another: pins and the blocks a prefix implies stay apart.
    assert not set(base) & set(sql) and not set(sql) & set(other) and not set(base) & set(other)
    assert shape_of(chat("sql"), adapter="sql").prefix_chain == sql  # stable
    # Conversations under one adapter still share their common prefix.
    longer = shape_of(chat("sql", [*MESSAGES, {"role": "assistant", "content": "ok"}]),
                      adapter="sql").prefix_chain  # fmt: skip
    assert longer[:2] == sql


def test_a_reply_pins_the_next_turn_under_its_adapter() -> None:
    sql = shape_of(chat("sql"), adapter="sql").prefix_chain
    turn = [*MESSAGES, {"role": "assistant", "content": "SELECT 1"}]
    next_turn = shape_of(chat("sql", turn), adapter="sql").prefix_chain
    assert reply_hash(sql, "SELECT 1") == next_turn[-1]
    assert reply_hash(shape_of(chat("toy")).prefix_chain, "SELECT 1") != next_turn[-1]


def test_the_snapshot_says_which_models_are_adapters() -> None:
    assert adapter_of(SNAPSHOT, "sql") == "sql"
    assert adapter_of(SNAPSHOT, "toy") is None  # a base model
    assert adapter_of(SNAPSHOT, "nobody") is None
    assert adapter_of(Snapshot(1, ()), "sql") is None  # no adapters published (yet)


def test_a_session_id_is_pinned_per_adapter() -> None:
    assert session_key("s1", None) == "s1"  # the base: the client's own key, as before
    assert session_key("", "sql") == ""  # no session named: none made up
    keys = {session_key("s1", None), session_key("s1", "sql"), session_key("s1", "chat")}
    assert len(keys) == 3
    shape = RequestShape(model="sql")
    assert with_request(shape, "s1", "", "sql").session == session_key("s1", "sql")
    assert with_request(shape, "s1", "t") == RequestShape(model="sql", session="s1", tenant="t")
    assert with_request(shape, "", "", "sql") is shape


def test_an_exchange_for_an_adapter_carries_it_into_its_shape_and_blocks() -> None:
    sql = _exchange(chat("sql"), b"{}", "s1", {}, "", adapter_of(SNAPSHOT, "sql"))
    base = _exchange(chat("toy"), b"{}", "s1", {}, "", adapter_of(SNAPSHOT, "toy"))
    assert sql.adapter == "sql" and base.adapter is None
    assert sql.shape.prefix_chain == shape_of(chat("sql"), adapter="sql").prefix_chain
    assert base.shape.prefix_chain == shape_of(chat("toy")).prefix_chain
    assert sql.shape.session == session_key("s1", "sql") and base.shape.session == "s1"

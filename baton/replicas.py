"""Control replicas as every part sees them (docs/replicas.md): where control is, as a shim
and the CLI are told (`--control A,B,C`), and how a replica that does not lead says so.
Control writes these refusals (control/api/leader_gate.py, control/api/admin.py); the shim
(dataplane/link/) and the CLI (clients/client.py) read them. One definition, so the three
never drift apart.

A replica that is not the leader refuses with FAILED_PRECONDITION, says NOT_LEADER in the
details, and names the leader's HOST:PORT in trailing metadata (LEADER_METADATA) when it
knows it. An admin write that the leader's store (etcd) refused carries STORE_METADATA:
the leader answered, so no other replica is worth asking."""

# baton: pure

from __future__ import annotations

from collections.abc import Iterable

LEADER_METADATA = "baton-leader"
STORE_METADATA = "baton-store"
NOT_LEADER = "is not the leader"
# gRPC schemes whose target is itself a comma-separated list of addresses: kept whole.
LIST_SCHEMES = ("ipv4:", "ipv6:")


def split_targets(text: str) -> tuple[str, ...]:
    """`A,B,C` -> (A, B, C): blanks dropped, a repeat kept once, the order as given. Raises
    ValueError when no address is left."""
    if text.strip().startswith(LIST_SCHEMES):
        return (text.strip(),)  # one gRPC target that balances over its own list
    out = tuple(dict.fromkeys(t for part in text.split(",") if (t := part.strip())))
    if not out:
        raise ValueError(f"no control address in {text!r} (want HOST:PORT[,HOST:PORT...])")
    return out


def not_leader(replica: str, leader: str = "", address: str = "") -> str:
    """A refusal's details: which replica refused, and who leads where, when it knows."""
    if not leader:
        return f"control replica {replica} {NOT_LEADER}: no leader elected yet"
    return f"control replica {replica} {NOT_LEADER}: the leader is {leader} at {address}"


def leader_in(metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
    """The leader's address a refusal's trailing metadata names ("" when it names none)."""
    for key, value in metadata or ():
        if key == LEADER_METADATA:
            return value.decode() if isinstance(value, bytes) else value
    return ""


def says_not_leader(details: str | None, leader: str) -> bool:
    """Whether a FAILED_PRECONDITION is a replica's "not the leader" refusal (nothing was
    applied; ask the leader) rather than control refusing the call itself."""
    return bool(leader) or NOT_LEADER in (details or "")


def from_store(metadata: Iterable[tuple[str, str | bytes]] | None) -> bool:
    """Whether an error's trailing metadata says the leader's store refused it."""
    return any(key == STORE_METADATA for key, _ in metadata or ())

"""Where control is, as a shim is told (`--control A,B,C`): one address, or the addresses of
control replicas on one store, of which one leads and the others refuse routing.

A replica that is not the leader refuses with FAILED_PRECONDITION, says so in the details,
and names the leader's address in trailing metadata (`baton-leader`) when it knows it. The
shim then looks for the leader in PROBE ORDER: the one named first, then the address it was
talking to (a control restarted in place is back there), then the others as given."""

# baton: pure

from __future__ import annotations

from collections.abc import Iterable, Sequence

LEADER_KEY = "baton-leader"  # trailing metadata of a refusal: the leader's HOST:PORT
NOT_LEADER = "is not the leader"  # in a refusal's details, with or without LEADER_KEY
# gRPC schemes whose target is itself a comma-separated list of addresses: kept whole.
LIST_SCHEMES = ("ipv4:", "ipv6:")


def split_targets(text: str) -> tuple[str, ...]:
    """`A,B,C` -> (A, B, C): blanks dropped, a repeat kept once, the order as given. Raises
    ValueError when no address is left."""
    if text.strip().startswith(LIST_SCHEMES):
        return (text.strip(),)  # one gRPC target that balances over its own list
    out: list[str] = []
    for part in text.split(","):
        if (target := part.strip()) and target not in out:
            out.append(target)
    if not out:
        raise ValueError(f"no control address in {text!r} (want HOST:PORT[,HOST:PORT...])")
    return tuple(out)


def probe_order(targets: Sequence[str], current: str, leader: str = "") -> tuple[str, ...]:
    """The addresses to ask for the leader, most likely first: `leader` (named by a refusal;
    maybe none of `targets`, when replicas advertise another name for themselves), then
    `current`, then the rest in turn after it."""
    start = targets.index(current) if current in targets else 0
    turn = [*targets[start:], *targets[:start]]
    first = [leader] if leader else []
    if current not in turn:
        first.append(current)
    return tuple(dict.fromkeys([*first, *turn]))


def leader_in(metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
    """The leader's address a refusal's trailing metadata names ("" when it names none)."""
    for key, value in metadata or ():
        if key == LEADER_KEY:
            return value.decode() if isinstance(value, bytes) else value
    return ""


def says_not_leader(details: str | None, leader: str) -> bool:
    """Whether a FAILED_PRECONDITION is a replica's "not the leader" refusal (nothing was
    applied; ask the leader) rather than control refusing the call itself."""
    return bool(leader) or NOT_LEADER in (details or "")

"""Where a shim looks for the leading control replica (its `--control A,B,C`, read by
baton/replicas.py's split_targets), in PROBE ORDER: the one a refusal named first, then the
address it was talking to (a control restarted in place is back there), then the others as
given."""

# baton: pure

from __future__ import annotations

from collections.abc import Sequence


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

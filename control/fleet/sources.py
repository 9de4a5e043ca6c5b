"""Where a backend came from: an operator's (the config file, `baton backends add`) or a
discovery source's (control/discovery/). Only an operator's backends are configuration:
saved across restarts and in etcd; a discovered one is its source's to add and remove."""

# baton: pure

from __future__ import annotations

CONFIG, CLI = "config", "cli"
OPERATED = frozenset({CONFIG, CLI})


def by(source: str) -> str | None:
    """The source an audit event names: a discovery's; none for an operator's change."""
    return None if source in OPERATED else source

"""How the services read a backend's facts: injected, so tests and benches can stand in."""

# baton: pure

from __future__ import annotations

from collections.abc import Awaitable, Callable

from baton.model import Backend
from control.facts import Facts

ReadFacts = Callable[[Backend], Awaitable[Facts]]

"""How the services read a backend's facts: injected, so tests and benches can stand in."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from control.facts import Facts
from control.model import Backend

ReadFacts = Callable[[Backend], Awaitable[Facts]]

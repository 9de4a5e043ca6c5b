"""Stop strings matched by Baton, across the seam of a resume whose text Baton derives (the
resume request carries none: over a mid-character prompt the engine could stop early)."""

# baton: pure

from __future__ import annotations


class StopMatcher:
    """After a seam the engine cannot see a stop string that starts before it, so the shim
    matches stop strings itself over held-back + new text, holding back a possible prefix."""

    def __init__(self, stops: list[str], include: bool, pending: str = "") -> None:
        self._stops = [s for s in stops if s]
        self._include = include
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._buf = pending

    def feed(self, text: str) -> tuple[str, str | None]:
        """(text safe to send now, the stop string that ended the output or None)."""
        self._buf += text
        hits = [(self._buf.find(s), s) for s in self._stops if s in self._buf]
        if hits:
            at, stop = min(hits)
            out = self._buf[: at + len(stop)] if self._include else self._buf[:at]
            self._buf = ""
            return out, stop
        cut = max(0, len(self._buf) - self._hold)
        out, self._buf = self._buf[:cut], self._buf[cut:]
        return out, None

    def flush(self) -> str:
        out, self._buf = self._buf, ""
        return out

"""Fault specs (pure): parsed from ``--fault`` and the ``X-Sim-Fault`` header.

Syntax: comma-separated ``key=value`` (whitespace ignored), e.g.
``die-after=5`` or ``stall-after=3,stall-seconds=2``. The word ``none`` clears
the process-wide faults for one request. Token-count faults fire *before* the
(N+1)-th generated token is sent, so a request that finishes within N tokens
is unaffected and the client has seen exactly N tokens when it fires.
"""

# baton: pure

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from enum import StrEnum


class FaultKind(StrEnum):
    EXIT = "exit"  # os._exit(1): the engine process dies
    RESET = "reset"  # TCP RST (SO_LINGER 0)
    DIE = "die"  # abrupt close without the chunked terminator or [DONE]
    ERROR = "error"  # in-stream error event, then [DONE] (vLLM engine-dead shape)
    ABORT = "abort"  # a chunk with finish_reason "abort", then [DONE]
    STALL = "stall"  # stop sending for stall_seconds, connection kept open


class FaultSpecError(ValueError):
    pass


# Precedence when several faults are due at the same token count.
_AFTER_KEYS: tuple[tuple[str, FaultKind], ...] = (
    ("exit_after", FaultKind.EXIT),
    ("reset_after", FaultKind.RESET),
    ("die_after", FaultKind.DIE),
    ("error_after", FaultKind.ERROR),
    ("abort_after", FaultKind.ABORT),
    ("stall_after", FaultKind.STALL),
)


@dataclass(frozen=True, slots=True)
class FaultSpec:
    die_after: int | None = None
    reset_after: int | None = None
    exit_after: int | None = None
    stall_after: int | None = None
    stall_seconds: float | None = None  # None -> DEFAULT_STALL_SECONDS
    error_after: int | None = None
    abort_after: int | None = None
    status: int | None = None  # answer at once with this HTTP status
    garbage: bool | None = None  # 200 text/event-stream of non-JSON lines, then close
    clear: bool = False  # "none": ignore the process-wide spec

    @property
    def empty(self) -> bool:
        return all(getattr(self, f.name) in (None, False) for f in fields(self))

    @property
    def stall_for(self) -> float:
        return DEFAULT_STALL_SECONDS if self.stall_seconds is None else self.stall_seconds

    def due(self, emitted: int) -> FaultKind | None:
        """The fault to fire before sending the next token, ``emitted`` tokens in."""
        for attr, kind in _AFTER_KEYS:
            if getattr(self, attr) == emitted:
                return kind
        return None

    def over(self, base: FaultSpec) -> FaultSpec:
        """This (per-request) spec layered over ``base`` (process-wide)."""
        if self.clear:
            return replace(self, clear=False)
        changes = {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.name != "clear" and getattr(self, f.name) is not None
        }
        return replace(base, **changes)


DEFAULT_STALL_SECONDS = 3600.0
NO_FAULTS = FaultSpec()

_INT_KEYS = {
    "die-after": "die_after",
    "reset-after": "reset_after",
    "exit-after": "exit_after",
    "stall-after": "stall_after",
    "error-after": "error_after",
    "abort-after": "abort_after",
    "status": "status",
}


def parse_fault_spec(text: str) -> FaultSpec:
    """Parse the spec syntax above; raises FaultSpecError with a readable message."""
    text = text.strip()
    if not text:
        return NO_FAULTS
    values: dict[str, object] = {}
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        if item == "none":
            values["clear"] = True
            continue
        key, sep, raw = item.partition("=")
        key, raw = key.strip(), raw.strip()
        if key == "garbage" and not sep:
            values["garbage"] = True
        elif key == "garbage":
            values["garbage"] = raw not in ("0", "false", "no")
        elif key == "stall-seconds":
            values["stall_seconds"] = _number(key, raw, float)
        elif key in _INT_KEYS:
            values[_INT_KEYS[key]] = _number(key, raw, int)
        else:
            known = sorted([*_INT_KEYS, "stall-seconds", "garbage", "none"])
            raise FaultSpecError(f"unknown fault key {key!r}; known: {', '.join(known)}")
    spec = FaultSpec(**values)  # type: ignore[arg-type]
    if spec.status is not None and not 100 <= spec.status <= 599:
        raise FaultSpecError("status must be an HTTP status code (100..599)")
    return spec


def _number(key: str, raw: str, kind: type[int] | type[float]) -> int | float:
    try:
        value = kind(raw)
    except ValueError:
        raise FaultSpecError(f"{key} needs a number, got {raw!r}") from None
    if value < 0:
        raise FaultSpecError(f"{key} must be >= 0")
    return value

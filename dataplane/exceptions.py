"""Every exception the shim raises on purpose, in one tree (the model is httpx's
_exceptions.py). Each says what failed and carries what its handler needs:

    ShimError
    ├── OpenAIError (errors.py)   what the client is told: an OpenAI-shaped body and status
    ├── BackendFailed             a backend failed us; `failure` is its class (failover.Failure)
    │   ├── AttemptFailed         before the response status arrived, or a one-shot call
    │   │                         (/tokenize, /detokenize, a speculative round)
    │   ├── StreamFailed          mid-stream: EOF before [DONE], a reset, a stall, garbage...
    │   └── DraftFailed           a speculative pair's draft: the request goes on target-only
    ├── Refused                   the request cannot be resumed faithfully (says why)
    └── ControlError              the control plane
        ├── ControlUnavailable    it did not answer in time (the shim decides alone, or fails)
        ├── ControlRefused        UNAUTHENTICATED: this shim's token is not control's
        └── StreamBroken          the RouteStream to it broke (routestream.py)

Handlers catch the narrowest class they can act on; nothing catches ShimError wholesale."""

# baton: pure

from __future__ import annotations


class ShimError(Exception):
    pass


class BackendFailed(ShimError):
    def __init__(self, failure: str, detail: str = "") -> None:
        super().__init__(f"{failure}: {detail}" if detail else failure)
        self.failure = failure
        self.detail = detail


class AttemptFailed(BackendFailed):
    pass


class StreamFailed(BackendFailed):
    pass


class DraftFailed(BackendFailed):
    pass


class Refused(ShimError):
    """The message says why (it is sent to the client)."""


class ControlError(ShimError):
    pass


class ControlUnavailable(ControlError):
    """Control did not answer in time (and the shim cannot decide alone); says why."""


class ControlRefused(ControlError):
    """Control answered UNAUTHENTICATED: this shim's token is missing or not control's."""


class StreamBroken(ControlError):
    pass

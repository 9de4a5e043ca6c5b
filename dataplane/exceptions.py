"""Every exception the shim raises on purpose, in one tree (the model is httpx's
_exceptions.py). Each says what failed and carries what its handler needs:

    ShimError
    ├── OpenAIError               what the client is told: an OpenAI-shaped body and status
    ├── BackendFailed             a backend failed us; `failure` is its class (Failure)
    │   ├── AttemptFailed         before the response status arrived, or a one-shot call
    │   │                         (/tokenize, /detokenize, a speculative round)
    │   ├── StreamFailed          mid-stream: EOF before [DONE], a reset, a stall, garbage...
    │   └── DraftFailed           a speculative pair's draft: the request goes on target-only
    ├── Refused                   the request cannot be resumed faithfully (says why)
    └── ControlError              the control plane
        ├── ControlUnavailable    it did not answer in time (the shim decides alone, or fails)
        ├── ControlRefused        UNAUTHENTICATED: this shim's token is not control's
        └── StreamBroken          the RouteStream to it broke (dataplane/link/routestream.py)

Handlers catch the narrowest class they can act on; nothing catches ShimError wholesale.

OpenAIError is what clients (the OpenAI SDKs) read: `{"error": {"message", "type", "param",
"code"}}`, with the HTTP status they map to their own exception classes, so both must be
right: one table below gives each kind its status. On the Anthropic Messages API's paths the
same error is told in Anthropic's shape and statuses (a second table: OpenAIError.for_path)."""

# baton: pure

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum

import orjson

from baton.model import Failure
from dataplane.sse import DONE_EVENT


class ShimError(Exception):
    pass


class ErrorKind(StrEnum):
    INVALID_JSON = "invalid_json"
    INVALID_REQUEST = "invalid_request_error"
    BODY_TOO_LARGE = "request_too_large"
    MODEL_NOT_FOUND = "model_not_found"
    NOT_FOUND = "not_found"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    NO_BACKEND = "no_backend_available"
    CONTROL_UNAVAILABLE = "control_plane_unavailable"
    BACKEND_FAILED = "backend_failed"
    UPSTREAM_TIMEOUT = "upstream_timeout"
    UNAUTHORIZED = "invalid_api_key"
    HEADERS_TOO_LARGE = "request_header_fields_too_large"
    TOO_MANY_STREAMS = "too_many_concurrent_streams"
    SHUTTING_DOWN = "shim_shutting_down"
    # A stored response's follow-up: its backend is gone, or no backend is known to hold it.
    RESPONSE_OWNER_GONE = "response_owner_gone"
    RESPONSE_NOT_FOUND = "response_not_found"
    # A tenant's (baton/tenancy.py): a model it may not use; one of its limits reached.
    MODEL_NOT_ALLOWED = "model_not_allowed"
    RATE_LIMITED = "rate_limit_exceeded"
    # The fleet was saturated and the request's wait in its priority band reached its bound.
    FLEET_SATURATED = "fleet_saturated"
    # The tenant reached a spend budget: OpenAI's own code for a quota that ran out.
    INSUFFICIENT_QUOTA = "insufficient_quota"


# kind -> (HTTP status, OpenAI error `type`)
STATUS: dict[ErrorKind, tuple[int, str]] = {
    ErrorKind.INVALID_JSON: (400, "invalid_request_error"),
    ErrorKind.INVALID_REQUEST: (400, "invalid_request_error"),
    ErrorKind.BODY_TOO_LARGE: (413, "invalid_request_error"),
    ErrorKind.MODEL_NOT_FOUND: (404, "invalid_request_error"),
    ErrorKind.NOT_FOUND: (404, "invalid_request_error"),
    ErrorKind.METHOD_NOT_ALLOWED: (405, "invalid_request_error"),
    ErrorKind.NO_BACKEND: (503, "service_unavailable"),
    ErrorKind.CONTROL_UNAVAILABLE: (503, "service_unavailable"),
    ErrorKind.BACKEND_FAILED: (502, "server_error"),
    ErrorKind.UPSTREAM_TIMEOUT: (504, "server_error"),
    ErrorKind.UNAUTHORIZED: (401, "invalid_request_error"),
    ErrorKind.HEADERS_TOO_LARGE: (431, "invalid_request_error"),
    ErrorKind.TOO_MANY_STREAMS: (429, "rate_limit_error"),
    ErrorKind.SHUTTING_DOWN: (503, "service_unavailable"),
    ErrorKind.RESPONSE_OWNER_GONE: (404, "invalid_request_error"),
    ErrorKind.RESPONSE_NOT_FOUND: (404, "invalid_request_error"),
    ErrorKind.MODEL_NOT_ALLOWED: (403, "invalid_request_error"),
    # OpenAI says which limit in `type` ("requests" or "tokens"): OpenAIError's error_type.
    ErrorKind.RATE_LIMITED: (429, "requests"),
    ErrorKind.FLEET_SATURATED: (429, "rate_limit_error"),
    ErrorKind.INSUFFICIENT_QUOTA: (429, "insufficient_quota"),
}


# kind -> (HTTP status, Anthropic error `type`), on the Messages API's paths. Load Baton sheds
# is 529 overloaded_error, as Anthropic's API answers when it is overloaded (its SDK retries
# it with backoff); 429 rate_limit_error is what Anthropic means by a client's own rate limit,
# which a shim's capacity is not.
ANTHROPIC: dict[ErrorKind, tuple[int, str]] = {
    ErrorKind.INVALID_JSON: (400, "invalid_request_error"),
    ErrorKind.INVALID_REQUEST: (400, "invalid_request_error"),
    ErrorKind.BODY_TOO_LARGE: (413, "request_too_large"),
    ErrorKind.MODEL_NOT_FOUND: (404, "not_found_error"),
    ErrorKind.NOT_FOUND: (404, "not_found_error"),
    ErrorKind.METHOD_NOT_ALLOWED: (405, "invalid_request_error"),
    ErrorKind.NO_BACKEND: (529, "overloaded_error"),
    ErrorKind.CONTROL_UNAVAILABLE: (529, "overloaded_error"),
    ErrorKind.BACKEND_FAILED: (500, "api_error"),
    ErrorKind.UPSTREAM_TIMEOUT: (504, "timeout_error"),
    ErrorKind.UNAUTHORIZED: (401, "authentication_error"),
    ErrorKind.HEADERS_TOO_LARGE: (431, "invalid_request_error"),
    ErrorKind.TOO_MANY_STREAMS: (529, "overloaded_error"),
    ErrorKind.SHUTTING_DOWN: (529, "overloaded_error"),
    ErrorKind.RESPONSE_OWNER_GONE: (404, "not_found_error"),
    ErrorKind.RESPONSE_NOT_FOUND: (404, "not_found_error"),
    ErrorKind.MODEL_NOT_ALLOWED: (403, "permission_error"),
    ErrorKind.RATE_LIMITED: (429, "rate_limit_error"),
    ErrorKind.FLEET_SATURATED: (529, "overloaded_error"),
    # Anthropic answers a spend limit the organization set with a 400, not a 429
    # (docs.anthropic.com, API errors): its SDK does not retry it.
    ErrorKind.INSUFFICIENT_QUOTA: (400, "invalid_request_error"),
}
ANTHROPIC_PATHS = "/v1/messages"  # the prefix of the paths whose clients speak Anthropic's API


class ErrorShape(StrEnum):
    """Whose error body a client reads (each API says which: dataplane/apis/)."""

    OPENAI = "openai"
    ANTHROPIC = "anthropic"

    @staticmethod
    def of_path(path: str) -> ErrorShape:
        return ErrorShape.ANTHROPIC if path.startswith(ANTHROPIC_PATHS) else ErrorShape.OPENAI


class OpenAIError(ShimError):
    def __init__(
        self,
        kind: ErrorKind,
        message: str,
        param: str | None = None,
        *,
        headers: Mapping[str, str] | None = None,
        error_type: str | None = None,
        anthropic_message: str | None = None,
    ) -> None:
        """`headers`: extra response headers (Retry-After with a 429). `error_type`: the
        OpenAI body's `type` when it is not the kind's own (a rate limit's "tokens").
        `anthropic_message`: what Anthropic's API says instead, where its words differ."""
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.anthropic_message = anthropic_message
        self.param = param
        self.headers = headers
        self.error_type = error_type

    @property
    def status(self) -> int:
        return STATUS[self.kind][0]

    def body(self) -> dict[str, object]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type or STATUS[self.kind][1],
                "param": self.param,
                "code": self.kind.value,
            }
        }

    def json(self) -> bytes:
        return orjson.dumps(self.body())

    def shaped(self, shape: ErrorShape) -> tuple[int, bytes]:
        """Status and body in the shape its client reads: Anthropic's
        `{"type": "error", "error": {"type", "message"}}`, or OpenAI's."""
        if shape is ErrorShape.OPENAI:
            return self.status, self.json()
        return ANTHROPIC[self.kind][0], self._anthropic()

    def for_path(self, path: str) -> tuple[int, bytes]:
        """shaped() for a request on `path` (one no API was chosen for: a 404, a 405...)."""
        return self.shaped(ErrorShape.of_path(path))

    def _anthropic(self) -> bytes:
        error = {"type": ANTHROPIC[self.kind][1],
                 "message": self.anthropic_message or self.message}  # fmt: skip
        return orjson.dumps({"type": "error", "error": error})

    def sse(self) -> bytes:
        """The same error as an SSE event, for streams whose headers are already sent."""
        return b"data: " + self.json() + b"\n\n" + DONE_EVENT

    def stream_end(self, path: str) -> bytes:
        """The end of a stream whose headers are already sent, in the shape of `path`'s API:
        Anthropic's `event: error` (no message_stop follows it), else sse()."""
        if not path.startswith(ANTHROPIC_PATHS):
            return self.sse()
        return b"event: error\ndata: " + self._anthropic() + b"\n\n"


def bad_request(message: str, param: str | None) -> OpenAIError:
    """A 400 naming the parameter at fault: what every API's validation raises."""
    return OpenAIError(ErrorKind.INVALID_REQUEST, message, param)


class BackendFailed(ShimError):
    def __init__(self, failure: Failure, detail: str = "") -> None:
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

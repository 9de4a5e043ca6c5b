"""What the shim must know of one API, in one Protocol (`Api`), and what the one passthrough
relay must know of an engine's own stream in that API (`EngineStream`). The implementations
are one module per API beside this one; table.py maps each endpoint to its API."""

# baton: pure

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from dataplane.exceptions import ErrorShape
from dataplane.request import ClientRequest, token_limit
from dataplane.sse import ClientStream
from dataplane.upstream.genai import Attributes

# What a relayed stream's failure says when its API's replay rules name no reason (a stream
# they would replay is served as chat instead, so this is only a fallback).
RELAYED = "it is relayed as the engine sends it"


@dataclass(frozen=True, slots=True)
class AsChat:
    """A request served as the chat request that generates the same tokens, so it gets
    chat's token-exact failover: the chat request (validated), its bytes, and the client's
    stream in its own API's events around the relay's chat stream."""

    client: ClientRequest
    raw: bytes
    events: Callable[[ClientStream], ClientStream]


@dataclass(frozen=True, slots=True)
class Prompt:
    """What a generating request's prefix is hashed from, in its messages' order (its hashes
    and sizes go to control, never its text: dataplane/edge/shape.py)."""

    messages: list[Any]
    turns: tuple[bool, ...]  # which of them are the assistant's
    chars: int  # the text's length, for the prefill estimate


class EngineStream(Protocol):
    """An engine's own stream in one API, as the passthrough relay reads it (one a stream,
    for streams Baton cannot replay elsewhere: dataplane/apis/passthrough.py)."""

    noun: str  # what the API streams ("message", "response"), for the failure it reports
    why: str  # why the request cannot be resumed on another engine, told with a failure
    deltas: int  # content events relayed so far (the failover report's tokens_sent)

    def see(self, obj: Mapping[str, Any]) -> str:
        """The event's type, noting what the shim needs of it."""
        ...

    def announces(self, obj: Mapping[str, Any]) -> str | None:
        """The id of a stored response this event announces: control must hear who holds it
        before the client learns it (None: none)."""
        ...

    def end(self, kind: str) -> bool | None:
        """None: more follows an event of this type; True: the engine completed the stream;
        False: it ended it with its own failure."""
        ...

    def failure(self, message: str) -> bytes:
        """The API's own end of a stream the shim must cut: the error events its clients
        read (never a silent truncation)."""
        ...

    def result(self) -> tuple[Attributes, int, int]:
        """The span's GenAI result attributes, prompt tokens and completion tokens."""
        ...


class Api(Protocol):
    """One API at the edge: how its requests are checked, served and answered."""

    @property
    def errors(self) -> ErrorShape:
        """Whose error body its clients read."""
        ...

    @property
    def forwarded(self) -> tuple[str, ...]:
        """The client's headers that go to the engine with a request."""
        ...

    @property
    def pins(self) -> bool:
        """Whether a served answer's text pins the next turn's prefix where it was served."""
        ...

    def check(self, body: Mapping[str, Any]) -> None:
        """Raises OpenAIError (400) naming the parameter at fault. What a router must trust
        (types it reads, required fields); the engine validates the rest."""
        ...

    def prompt(self, body: Mapping[str, Any]) -> Prompt:
        """What a checked body's prefix is hashed from (a generating API's)."""
        ...

    def owner_key(self, body: Mapping[str, Any]) -> str:
        """The stored object the request must reach the holder of ("" for none)."""
        ...

    def output_cap(self, body: Mapping[str, Any]) -> int | None:
        """The client's cap on generated tokens (None: the engine's default)."""
        ...

    def as_chat(self, client: ClientRequest) -> AsChat | None:
        """The chat request this one is served as; None: serve it on its own endpoint."""
        ...

    def answer(self, obj: Any) -> str | None:
        """Checks a whole 200 answer (AttemptFailed(GARBAGE) when it cannot be relayed as a
        success); returns the assistant's text when it pins the next turn."""
        ...

    def owned(self, client: ClientRequest, answer: Mapping[str, Any]) -> str | None:
        """The id of a stored response in a whole answer: control hears who holds it before
        the client does (None: nothing is stored)."""
        ...

    def engine_stream(self, client: ClientRequest) -> EngineStream | None:
        """How to read the engine's own stream of `client`; None: it is a chat or completions
        stream, relayed (and resumed on failure) by dataplane/relay/stream.py."""
        ...


class Plain:
    """Defaults for an API that is served on its own endpoint, stores nothing and streams
    chat chunks (or does not stream)."""

    errors = ErrorShape.OPENAI
    forwarded: tuple[str, ...] = ()
    pins = False

    def prompt(self, body: Mapping[str, Any]) -> Prompt:
        return Prompt([], (), 0)  # a one-shot call: nothing to pin, no prefix to hash

    def owner_key(self, body: Mapping[str, Any]) -> str:
        return ""

    def output_cap(self, body: Mapping[str, Any]) -> int | None:
        return token_limit(body)

    def as_chat(self, client: ClientRequest) -> AsChat | None:
        return None

    def owned(self, client: ClientRequest, answer: Mapping[str, Any]) -> str | None:
        return None

    def engine_stream(self, client: ClientRequest) -> EngineStream | None:
        return None

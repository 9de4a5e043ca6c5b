"""The shim's data-plane limits and optional API keys: what one client may ask of a shim
before any work is done for it. Each refusal is an OpenAIError, so clients get the JSON
shape and the status their SDK maps to the right exception (401, 413, 429, 431, 400).

Checked in order of cost: headers and keys, the declared body size and the in-flight cap
(middleware, before the body is read: a shed request costs no parsing and no routing), then
the message count once the body is parsed."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path

from baton.tenancy import FILE_TENANT, digest
from dataplane.exceptions import ErrorKind, OpenAIError
from dataplane.request import ClientRequest, Endpoint
from dataplane.settings import Limits

API_KEYS_ENV = "BATON_API_KEYS"
# Paths anyone may call with no key: load balancer health checks and Prometheus scrapes.
OPEN_PATHS = frozenset({"/health", "/health/live", "/health/ready", "/metrics"})


def parse_keys(lines: Iterable[str]) -> frozenset[bytes]:
    """One key per line or comma-separated; blank lines and `#` comments ignored."""
    keys = set()
    for line in lines:
        for key in line.split("#", 1)[0].split(","):
            if key.strip():
                keys.add(digest(key.strip()))
    return frozenset(keys)


def load_keys(path: str | None, env: dict[str, str] | None = None) -> frozenset[bytes]:
    """From `--api-keys-file` if given, else from $BATON_API_KEYS; raises OSError for a file
    that cannot be read and ValueError for one with no keys (a typo must not open the shim)."""
    if path:
        keys = parse_keys(Path(path).read_text().splitlines())
        if not keys:
            raise ValueError(f"{path} holds no API keys")
        return keys
    return parse_keys([(env if env is not None else os.environ).get(API_KEYS_ENV, "")])


def header_bytes(method: str, path: str, raw_headers: Iterable[tuple[bytes, bytes]]) -> int:
    """The size of the request head as sent: request line and `name: value\\r\\n` lines."""
    size = len(method) + len(path) + len(" HTTP/1.1\r\n") + 1
    return size + sum(len(k) + len(v) + 4 for k, v in raw_headers)


def check_head(
    limits: Limits,
    method: str,
    path: str,
    raw_headers: Iterable[tuple[bytes, bytes]],
    authorization: str | None,
    content_length: int | None,
    max_body_bytes: int,
    api_key: str | None = None,
    tenant_keys: Mapping[bytes, str] | None = None,
) -> str:
    """What can be refused before reading the body. Raises OpenAIError. Returns the tenant
    whose key the request came with: one of control's tenants (`tenant_keys`, by digest, from
    its snapshot), the flat key file's (FILE_TENANT), or "" when the shim is open (no keys
    anywhere). `api_key`: an `x-api-key` header, as the Anthropic SDK sends its key; either
    way of sending a key is checked against the same keys."""
    size = header_bytes(method, path, raw_headers)
    if size > limits.max_header_bytes:
        raise OpenAIError(
            ErrorKind.HEADERS_TOO_LARGE,
            f"request headers are {size} bytes; the limit is {limits.max_header_bytes}",
        )
    tenant = ""
    if (limits.key_digests or tenant_keys) and path not in OPEN_PATHS:
        tenant = _tenant(limits.key_digests, tenant_keys or {}, authorization, api_key)
    if content_length is not None and content_length > max_body_bytes:
        raise OpenAIError(
            ErrorKind.BODY_TOO_LARGE,
            f"request body is {content_length} bytes; the limit is {max_body_bytes}",
        )
    return tenant


def _tenant(
    file_keys: frozenset[bytes],
    tenant_keys: Mapping[bytes, str],
    authorization: str | None,
    api_key: str | None,
) -> str:
    scheme, _, bearer = (authorization or "").partition(" ")
    sent = [bearer] if scheme.lower() == "bearer" else []
    for key in (*sent, *([api_key] if api_key else [])):
        d = digest(key)
        tenant = tenant_keys.get(d) or (FILE_TENANT if d in file_keys else None)
        if tenant is not None:
            return tenant
    # Never echo the key back: it may be a real key for something else.
    raise OpenAIError(
        ErrorKind.UNAUTHORIZED,
        "Incorrect or missing API key. Send `Authorization: Bearer <key>` "
        "(or `x-api-key: <key>`).",
    )


def check_request(limits: Limits, client: ClientRequest) -> None:
    """After validation, before any hashing or routing: the message count."""
    if client.endpoint is Endpoint.CHAT:
        count = len(client.body["messages"])
        if count > limits.max_messages:
            raise OpenAIError(
                ErrorKind.INVALID_REQUEST,
                f"'messages' has {count} entries; the limit is {limits.max_messages}",
                "messages",
            )


class StreamSlots:
    """Generation requests in flight on this shim (the in-flight cap). Not a lock: one event
    loop owns it, and acquire/release never await, so a plain counter is exact (the health
    heartbeat reads it on the same loop)."""

    def __init__(self, limits: Limits) -> None:
        self._limits = limits
        self.in_use = 0

    def acquire(self) -> None:
        """Raises OpenAIError (429 with Retry-After) when every slot is taken."""
        if self.in_use >= self._limits.max_streams:
            raise OpenAIError(
                ErrorKind.TOO_MANY_STREAMS,
                f"this shim is serving its limit of {self._limits.max_streams} concurrent "
                "requests; retry shortly",
                headers={"Retry-After": str(self._limits.retry_after)},
            )
        self.in_use += 1

    def release(self) -> None:
        self.in_use -= 1

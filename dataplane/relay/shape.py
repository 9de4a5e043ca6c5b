"""What a stream is before its chunks say more: the identity its first chunk gives it (every
chunk of the client's stream carries the same), and how many choices the request asks for
(so one that fails before its first chunk is known to be unfinished too)."""

# baton: pure

from __future__ import annotations

from dataclasses import dataclass

from dataplane.request import ClientRequest, Endpoint


@dataclass(slots=True)
class Identity:
    id: str = ""
    created: int = 0
    model: str = ""
    system_fingerprint: str | None = None


def expected_choices(client: ClientRequest) -> int:
    n = client.body.get("n") or 1
    prompt = client.body.get("prompt")
    if client.endpoint is Endpoint.COMPLETIONS and isinstance(prompt, list) and prompt:
        if isinstance(prompt[0], str | list):
            return n * len(prompt)  # a batch of prompts: n choices each
    return int(n)

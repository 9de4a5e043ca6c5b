"""The first attempt's body to a token-id engine: the client's bytes with return_token_ids
spliced in (never re-serialised), which an engine reads as the client's body plus the key."""

from __future__ import annotations

import dataclasses
import json

from baton.model import BackendKind
from dataplane.relay.stream import with_token_ids
from dataplane.request import Endpoint
from tests.factories import backend, client_request

VLLM = dataclasses.replace(backend("a"), kind=BackendKind.VLLM)


def test_the_key_is_spliced_into_the_clients_own_bytes() -> None:
    client = client_request(Endpoint.COMPLETIONS, prompt="héllo \\u00e9 {}")
    raw = json.dumps(client.body, ensure_ascii=False, indent=1).encode() + b"\n\t "
    body = with_token_ids(client, VLLM, raw)
    assert body.startswith(raw.rstrip()[:-1])  # the client's bytes, as they came
    assert json.loads(body) == {**client.body, "return_token_ids": True}


def test_a_clients_own_false_is_overridden_as_engines_read_a_repeated_key() -> None:
    client = client_request(Endpoint.CHAT, return_token_ids=False)
    body = with_token_ids(client, VLLM, json.dumps(client.body).encode())
    assert json.loads(body)["return_token_ids"] is True  # json, like engines: the last wins


def test_whole_answers_and_other_engines_get_the_bytes_untouched() -> None:
    raw = b'{"model": "m", "prompt": "x"}'
    whole = dataclasses.replace(client_request(Endpoint.COMPLETIONS), stream=False)
    assert with_token_ids(whole, VLLM, raw) is raw
    llama = dataclasses.replace(backend("b"), kind=BackendKind.OPENAI)
    assert with_token_ids(client_request(Endpoint.COMPLETIONS), llama, raw) is raw

from __future__ import annotations

from typing import Any

import pytest

from sim.protocol import ApiError, Limits, parse_chat, parse_completion
from sim.tokenizer import BOS, build_tokenizer

TOK = build_tokenizer()
LIMITS = Limits(model="toy", max_model_len=64, default_max_tokens=16, default_temperature=0.0)
MSGS = [{"role": "user", "content": "hi"}]


def test_chat_defaults() -> None:
    req = parse_chat({"model": "toy", "messages": MSGS}, TOK, LIMITS)
    assert req.kind == "chat" and not req.stream and req.n == 1
    assert req.params.max_tokens == 16 and req.params.temperature == 0.0
    assert req.prompt_ids == TOK.encode("<|bos|><|user|>hi<|end|><|assistant|>")
    assert req.role == "assistant"


def test_chat_options() -> None:
    body = {
        "messages": [*MSGS, {"role": "assistant", "content": "par"}],
        "add_generation_prompt": False,
        "continue_final_message": True,
        "max_completion_tokens": 5,
        "max_tokens": 9,
        "stream": True,
        "stream_options": {"include_usage": True},
        "n": 2,
        "stop": "x",
        "seed": 7,
        "temperature": 1,
        "return_token_ids": True,
        "logprobs": True,  # accepted, ignored
        "some_future_field": 1,
    }
    req = parse_chat(body, TOK, LIMITS)
    assert req.params.max_tokens == 5  # max_completion_tokens wins
    assert req.include_usage and req.return_token_ids and req.n == 2
    assert req.params.stop == ("x",) and req.params.seed == 7
    assert req.params.temperature == 1.0
    assert req.role == "assistant"


def test_completion_prompt_forms() -> None:
    text = parse_completion({"prompt": "hello"}, TOK, LIMITS)
    assert text.prompt_ids == [BOS, *TOK.encode("hello")]
    assert parse_completion({"prompt": [5, 6, 7]}, TOK, LIMITS).prompt_ids == [5, 6, 7]
    assert parse_completion({"prompt": [[5, 6]]}, TOK, LIMITS).prompt_ids == [5, 6]
    assert parse_completion({"prompt": ["hello"]}, TOK, LIMITS).prompt_ids == text.prompt_ids
    raw = parse_completion({"prompt": "hello", "add_special_tokens": False}, TOK, LIMITS)
    assert raw.prompt_ids == TOK.encode("hello")


@pytest.mark.parametrize(
    ("body", "status", "fragment"),
    [
        ({"model": "gpt-9", "prompt": "x"}, 404, "does not exist"),
        ({}, 400, "prompt"),
        ({"prompt": []}, 400, "empty"),
        ({"prompt": [1, -2]}, 400, "token ids"),
        ({"prompt": [1, 10**6]}, 400, "token ids"),
        ({"prompt": ["a", "b"]}, 400, "one prompt"),
        ({"prompt": "x", "max_tokens": 0}, 400, "at least 1"),
        ({"prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
        ({"prompt": "x", "max_tokens": True}, 400, "max_tokens"),
        ({"prompt": "x", "max_tokens": 1000}, 400, "maximum context length is 64"),
        ({"prompt": "x", "temperature": -1}, 400, "temperature"),
        ({"prompt": "x", "top_p": 0}, 400, "top_p"),
        ({"prompt": "x", "n": 0}, 400, "'n'"),
        ({"prompt": "x", "stop": 5}, 400, "stop"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream=True"),
        ({"prompt": "x", "stream": "yes"}, 400, "stream"),
    ],
)
def test_completion_errors(body: dict[str, Any], status: int, fragment: str) -> None:
    with pytest.raises(ApiError) as err:
        parse_completion(body, TOK, LIMITS)
    assert err.value.status == status
    assert fragment in err.value.message
    shape = err.value.body()["error"]
    assert set(shape) == {"message", "type", "param", "code"} and shape["code"] == status


def test_chat_errors() -> None:
    with pytest.raises(ApiError, match="messages"):
        parse_chat({"model": "toy"}, TOK, LIMITS)
    with pytest.raises(ApiError, match="Cannot set both"):
        parse_chat({"messages": MSGS, "continue_final_message": True}, TOK, LIMITS)
    long = [{"role": "user", "content": "word " * 100}]
    with pytest.raises(ApiError, match="maximum context length"):
        parse_chat({"messages": long}, TOK, LIMITS)


GEN_CONFIG = Limits(
    model="toy", max_model_len=64, default_max_tokens=16, default_temperature=0.7,
    default_top_p=0.9, default_top_k=40, default_seed=11,
)


def test_server_generation_config_fills_omitted_fields() -> None:
    req = parse_completion({"prompt": "hi"}, TOK, GEN_CONFIG)
    p = req.params
    assert (p.temperature, p.top_p, p.top_k, p.seed) == (0.7, 0.9, 40, 11)


def test_explicit_sampling_fields_beat_the_server_config() -> None:
    body = {"prompt": "hi", "temperature": 0, "top_p": 1.0, "top_k": 0, "seed": 3}
    p = parse_completion(body, TOK, GEN_CONFIG).params
    assert (p.temperature, p.top_p, p.top_k, p.seed) == (0.0, 1.0, 0, 3)


def test_prompt_logprobs_parse() -> None:
    assert parse_completion({"prompt": [1, 2]}, TOK, LIMITS).prompt_logprobs is None
    req = parse_completion({"prompt": [1, 2], "prompt_logprobs": 0}, TOK, LIMITS)
    assert req.prompt_logprobs == 0
    req = parse_completion({"prompt": [1], "prompt_logprobs": 20}, TOK, LIMITS)
    assert req.prompt_logprobs == 20


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": [1, 2], "prompt_logprobs": -1},
        {"prompt": [1, 2], "prompt_logprobs": 21},
        {"prompt": [1, 2], "prompt_logprobs": True},
        {"prompt": [1, 2], "prompt_logprobs": 1.5},
        {"prompt": [1, 2], "prompt_logprobs": 1, "stream": True},
    ],
)
def test_prompt_logprobs_rejects(body: dict[str, Any]) -> None:
    with pytest.raises(ApiError) as e:
        parse_completion(body, TOK, LIMITS)
    assert e.value.status == 400 and e.value.param == "prompt_logprobs"


def test_prompt_logprobs_on_chat_is_refused_not_ignored() -> None:
    with pytest.raises(ApiError) as e:
        parse_chat({"messages": MSGS, "prompt_logprobs": 1}, TOK, LIMITS)
    assert e.value.status == 400 and e.value.param == "prompt_logprobs"

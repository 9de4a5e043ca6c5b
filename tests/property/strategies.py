"""Shared hypothesis strategies: arbitrary JSON, and OpenAI request bodies that are valid,
nearly valid (one field swapped for anything) or garbage."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

# JSON as orjson can round-trip it: 64-bit ints, finite floats, any text.
scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)
json_values: st.SearchStrategy[Any] = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)

ROLES = ["system", "user", "assistant", "tool", "developer", "function"]
text_part = st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=30)})
image_part = st.fixed_dictionaries(
    {
        "type": st.just("image_url"),
        "image_url": st.fixed_dictionaries({"url": st.text(max_size=10)}),
    }
)
content = st.text(max_size=40) | st.lists(text_part | image_part, min_size=1, max_size=3)
message = st.fixed_dictionaries({"role": st.sampled_from(ROLES), "content": content})
messages = st.lists(message, min_size=1, max_size=5)
token_ids = st.lists(st.integers(0, 50_000), min_size=1, max_size=20)
prompt = (
    st.text(max_size=40)
    | st.lists(st.text(max_size=10), min_size=1, max_size=3)
    | token_ids
    | st.lists(token_ids, min_size=1, max_size=3)
)

# Parameters a client may send, each with its valid values.
optional_params: dict[str, st.SearchStrategy[Any]] = {
    "stream": st.booleans(),
    "temperature": st.sampled_from([0, 0.0, 0.7, 1, 2.0]),
    "top_p": st.floats(0.01, 1.0),
    "top_k": st.integers(-1, 100),
    "seed": st.integers(0, 2**31),
    "max_tokens": st.integers(1, 4096),
    "max_completion_tokens": st.integers(1, 4096),
    "min_tokens": st.integers(0, 8),
    "n": st.integers(1, 4),
    "best_of": st.integers(1, 4),
    "stop": st.text(min_size=1, max_size=5) | st.lists(st.text(min_size=1, max_size=5), max_size=3),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "frequency_penalty": st.floats(-2, 2),
    "presence_penalty": st.floats(-2, 2),
    "logprobs": st.booleans(),
    "continue_final_message": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "return_token_ids": st.booleans(),
}


@st.composite
def valid_body(draw: st.DrawFn, chat: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": draw(st.text(min_size=1, max_size=10))}
    body["messages" if chat else "prompt"] = draw(messages if chat else prompt)
    names = draw(st.lists(st.sampled_from(sorted(optional_params)), unique=True, max_size=6))
    for name in names:
        body[name] = draw(optional_params[name])
    return body


@st.composite
def mutated_body(draw: st.DrawFn, chat: bool) -> dict[str, Any]:
    """A valid body with a few fields (top level or inside a message) replaced by any JSON:
    where the type bugs hide."""
    body = draw(valid_body(chat))
    keys = [*optional_params, "model", "messages", "prompt", "stop", "n"]
    for _ in range(draw(st.integers(1, 3))):
        where = draw(st.sampled_from(["top", "message", "part"]))
        if where == "top" or not chat:
            body[draw(st.sampled_from(keys))] = draw(json_values)
            continue
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs or not isinstance(msgs[0], dict):
            continue
        m = msgs[draw(st.integers(0, len(msgs) - 1))]
        if not isinstance(m, dict):
            continue
        if where == "message":
            m[draw(st.sampled_from(["role", "content", "tool_calls", "name"]))] = draw(json_values)
        else:
            part = draw(text_part | image_part)
            part[draw(st.sampled_from(["type", "text", "image_url"]))] = draw(json_values)
            m["content"] = [part]
    return body

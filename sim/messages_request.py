"""The Messages API's request models, vLLM 0.32's entrypoints/anthropic/protocol.py (pure).

``check_messages`` and ``check_count`` validate a body as ``AnthropicMessagesRequest``
and ``AnthropicCountTokensRequest`` do (field types, required fields, their
validators) and return it coerced, every field of the model present (None when left
out); a bad body raises sim.schema's 400 (OpenAI shape, type "Bad Request"). The
rules, by field:

* ``model`` (a non-empty string) and ``messages`` are required, and ``max_tokens``
  (an integer > 0) for /v1/messages; a message is ``{"role": "user" | "assistant" |
  "system", "content": a string or a list of content blocks}``; a block has a
  ``type`` among BLOCK_TYPES; tool_addition/tool_removal blocks need a ``tool`` and
  only a system message may hold them.
* ``thinking`` is ``{"type": "enabled", "budget_tokens": >= 1024}``, ``{"type":
  "disabled"}`` or ``{"type": "adaptive"}``; an enabled budget must be below
  max_tokens (unless kv_transfer_params.do_remote_decode).
* ``tool_choice`` is ``{"type": "auto" | "any" | "tool" | "none", "name",
  "disable_parallel_tool_use"}`` ("tool" needs the name); a tool is ``{"name",
  "description", "input_schema": an object, "strict", "defer_loading"}`` and its
  schema gets ``"type": "object"`` when it has no type.
* ``stop_sequences``: at most 4 strings (VLLM_MAX_STOP_STRINGS); ``temperature``,
  ``top_p`` numbers, ``top_k`` an integer, ``stream`` a boolean, ``metadata`` an object.

Every other field is ignored (pydantic's default), ``n``, ``stream_options`` and
``return_token_ids`` included.
"""

# baton: pure

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sim.schema import (
    BAD,
    Checker,
    Field,
    Loc,
    boolean,
    integer,
    invalid,
    list_of,
    literal,
    mapping,
    number,
    obj,
    str_or,
    string,
)

BLOCK_TYPES = (
    "text", "image", "tool_use", "tool_result", "tool_reference", "thinking",
    "redacted_thinking", "tool_addition", "tool_removal",
)  # fmt: skip
TOOL_CHANGES = ("tool_addition", "tool_removal")
MAX_STOP_STRINGS = 4  # envs.VLLM_MAX_STOP_STRINGS
MIN_BUDGET_TOKENS = 1024
Body = dict[str, Any]

_tool = obj(
    ("name", string, True), ("description", string, False), ("input_schema", mapping, True),
    ("strict", boolean, False), ("defer_loading", boolean, False),
)  # fmt: skip


def tool(c: Checker, v: object, loc: Loc) -> Any:
    out = _tool(c, v, loc)
    if out is not BAD and "type" not in out["input_schema"]:
        out["input_schema"]["type"] = "object"  # vLLM's validate_input_schema
    return out


def _tool_change(c: Checker, v: object, loc: Loc) -> Any:
    """A tool_addition/tool_removal block's ``tool``: a reference or a definition."""
    body = c.model(v, loc)
    if body is None:
        return BAD
    if body.get("type") == "tool_reference":
        return c.fields(
            body, (*loc, "tool_reference"), (("type", string, True), ("name", string, True))
        )
    if body.get("type") == "tool_definition":
        return c.fields(
            body, (*loc, "tool_definition"), (("type", string, True), ("definition", tool, True))
        )
    return c.tag_error(loc, body, ("tool_reference", "tool_definition"))


_block = obj(
    ("type", literal(*BLOCK_TYPES), True), ("text", string, False),
    ("source", mapping, False), ("id", string, False), ("tool_use_id", string, False),
    ("name", string, False), ("input", mapping, False),
    ("content", str_or(list_of(mapping)), False), ("is_error", boolean, False),
    ("tool_name", string, False), ("thinking", string, False), ("signature", string, False),
    ("data", string, False), ("tool", _tool_change, False),
)  # fmt: skip


def block(c: Checker, v: object, loc: Loc) -> Any:
    out = _block(c, v, loc)
    if out is BAD or out["type"] not in TOOL_CHANGES:
        return out
    if out["tool"] is None:
        return c.value_error(loc, f"tool is required for {out['type']} blocks", v)
    if out["type"] == "tool_removal" and out["tool"]["type"] != "tool_reference":
        return c.value_error(loc, "tool_removal only accepts a tool_reference", v)
    return out


content = str_or(list_of(block))  # str | list[AnthropicContentBlock]


def _no_tool_changes(c: Checker, value: Any, loc: Loc, raw: object) -> Any:
    for b in value if isinstance(value, list) else ():
        if b["type"] in TOOL_CHANGES:
            return c.value_error(
                loc, f'{b["type"]} blocks are only allowed in messages with role "system"', raw
            )
    return value


_message = obj(("role", literal("user", "assistant", "system"), True), ("content", content, True))


def message(c: Checker, v: object, loc: Loc) -> Any:
    out = _message(c, v, loc)
    if out is BAD or out["role"] == "system":
        return out
    return out if _no_tool_changes(c, out["content"], loc, v) is not BAD else BAD


def system(c: Checker, v: object, loc: Loc) -> Any:
    out = content(c, v, loc)
    return BAD if out is BAD else _no_tool_changes(c, out, loc, v)


_tool_choice = obj(
    ("type", literal("auto", "any", "tool", "none"), True), ("name", string, False),
    ("disable_parallel_tool_use", boolean, False),
)  # fmt: skip


def tool_choice(c: Checker, v: object, loc: Loc) -> Any:
    out = _tool_choice(c, v, loc)
    if out is not BAD and out["type"] == "tool" and not out["name"]:
        return c.value_error(loc, "tool_choice.name is required when type is 'tool'", v)
    return out


def _budget(c: Checker, v: object, loc: Loc) -> Any:
    n = integer(c, v, loc)
    if n is not BAD and n < MIN_BUDGET_TOKENS:
        return c.fail("greater_than_equal", loc, "Input should be greater than or equal to "
                      f"{MIN_BUDGET_TOKENS}", v, {"ge": MIN_BUDGET_TOKENS})  # fmt: skip
    return n


_DISPLAY: Field = ("display", literal("summarized", "omitted", "updates"), False)
_THINKING: dict[str, tuple[Field, ...]] = {
    "enabled": (("type", string, True), ("budget_tokens", _budget, True), _DISPLAY),
    "disabled": (("type", string, True),),
    "adaptive": (("type", string, True), _DISPLAY),
}


def thinking(c: Checker, v: object, loc: Loc) -> Any:
    """A union discriminated by ``type``: the member's fields are checked under its tag."""
    body = c.model(v, loc)
    if body is None:
        return BAD
    kind = body.get("type")
    if isinstance(kind, str) and kind in _THINKING:
        return c.fields(body, (*loc, kind), _THINKING[kind])
    return c.tag_error(loc, body, tuple(_THINKING))


output_config = obj(
    ("effort", literal("low", "medium", "high", "xhigh", "max"), False),
    ("format", obj(("schema", mapping, False), ("type", literal("json_schema"), False)), False),
)  # fmt: skip


def _stops(c: Checker, v: object, loc: Loc) -> Any:
    stops = list_of(string)(c, v, loc)
    if stops is not BAD and len(stops) > MAX_STOP_STRINGS:
        return c.fail(
            "too_long", loc, f"List should have at most {MAX_STOP_STRINGS} items after "
            f"validation, not {len(stops)}", v,
            {"field_type": "List", "max_length": MAX_STOP_STRINGS, "actual_length": len(stops)},
        )  # fmt: skip
    return stops


def _model(c: Checker, v: object, loc: Loc) -> Any:
    name = string(c, v, loc)
    return c.value_error(loc, "Model is required", v) if name == "" else name


def _max_tokens(c: Checker, v: object, loc: Loc) -> Any:
    n = integer(c, v, loc)
    return c.value_error(loc, "max_tokens must be positive", v) if n is not BAD and n <= 0 else n


def _salt(c: Checker, v: object, loc: Loc) -> Any:
    salt = string(c, v, loc)
    if salt == "":
        return c.fail("string_too_short", loc, "String should have at least 1 character", v,
                      {"min_length": 1})  # fmt: skip
    return salt


_SHARED: dict[str, Field] = {
    f[0]: f for f in (
        ("model", _model, True), ("messages", list_of(message), True),
        ("output_config", output_config, False), ("thinking", thinking, False),
        ("system", system, False), ("tool_choice", tool_choice, False),
        ("tools", list_of(tool), False), ("chat_template_kwargs", mapping, False),
    )
}  # fmt: skip
# In the models' field order (the order pydantic reports errors in).
MESSAGES_FIELDS: tuple[Field, ...] = (
    _SHARED["model"], _SHARED["messages"], ("max_tokens", _max_tokens, True),
    ("metadata", mapping, False), _SHARED["output_config"], _SHARED["thinking"],
    ("stop_sequences", _stops, False), ("stream", boolean, False), _SHARED["system"],
    ("temperature", number, False), _SHARED["tool_choice"], _SHARED["tools"],
    ("top_k", integer, False), ("top_p", number, False), ("cache_salt", _salt, False),
    ("watermarking", boolean, False), ("kv_transfer_params", mapping, False),
    ("ec_transfer_params", mapping, False), ("vllm_xargs", mapping, False),
    _SHARED["chat_template_kwargs"],
)  # fmt: skip
COUNT_FIELDS: tuple[Field, ...] = tuple(_SHARED[name] for name in (
    "model", "messages", "output_config", "system", "thinking", "tool_choice", "tools",
    "chat_template_kwargs",
))  # fmt: skip


def check_messages(body: Mapping[str, Any]) -> Body:
    """An AnthropicMessagesRequest, coerced; raises the 400 for anything it rejects."""
    c = Checker()
    req = c.fields(body, (), MESSAGES_FIELDS)
    if req is BAD:
        raise invalid(c.errors)
    budget = (req["thinking"] or {}).get("budget_tokens")
    remote = (req["kv_transfer_params"] or {}).get("do_remote_decode")
    if budget is not None and budget >= req["max_tokens"] and not remote:
        c.value_error((), "thinking.budget_tokens must be less than max_tokens", body)
        raise invalid(c.errors)
    return dict(req)


def check_count(body: Mapping[str, Any]) -> Body:
    """An AnthropicCountTokensRequest, coerced; raises the 400 for anything it rejects."""
    c = Checker()
    req = c.fields(body, (), COUNT_FIELDS)
    if req is BAD:
        raise invalid(c.errors)
    return dict(req)

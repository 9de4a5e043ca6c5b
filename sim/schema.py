"""Request bodies checked the way vLLM 0.32's FastAPI/pydantic layer checks them (pure).

Some vLLM endpoints (the Messages API's, sim.messages_request) declare their body
as a pydantic model, so FastAPI validates it before the handler runs and a bad body
is a 400 from vLLM's RequestValidationError handler
(serve/exception_handling/handlers/validation.py), always in the OpenAI shape::

    {"error": {"message": "1 validation error:\\n  {'type': 'missing', 'loc':
     'body.max_tokens', 'msg': 'Field required', 'input': '<dict of 2 items>'}",
     "type": "Bad Request", "param": "body.max_tokens", "code": 400}}

``Checker`` coerces as pydantic's lax mode does ("5" -> 5 for an int, 1 -> True
for a bool, 5.0 -> 5) and records pydantic's error (type, loc, msg, the input as
vLLM summarises it, ctx); ``invalid`` renders them as that handler does: one line
per error, at most 10, the first error's loc as ``param``.
"""

# baton: pure

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from sim.protocol import ApiError

Loc = tuple[str | int, ...]
BAD: Any = object()  # a value that failed its check (its error is recorded)

_MAX_REPORTED_ERRORS = 10
_MAX_INPUT_CHARS = 200
_MAX_ERROR_CHARS = 1000
_TRUE = ("1", "on", "t", "true", "y", "yes")
_FALSE = ("0", "f", "false", "n", "no", "off")
_WHOLE = re.compile(r"[+-]?\d+(\.0*)?")


def invalid(errors: Sequence[dict[str, Any] | str]) -> ApiError:
    """vLLM's validation_exception_handler: the 400 for these pydantic errors."""
    label = "error" if len(errors) == 1 else "errors"
    shown = errors[:_MAX_REPORTED_ERRORS]
    message = f"{len(errors)} validation {label}:\n" + "".join(f"  {_format(e)}\n" for e in shown)
    if len(errors) > len(shown):
        message += f"  ...and {len(errors) - len(shown)} more {label}\n"
    first = errors[0] if errors else None
    param = first["loc"] if isinstance(first, dict) else None
    return ApiError(400, message.rstrip(), "Bad Request", param)


def _format(err: dict[str, Any] | str) -> str:
    text = str(err)
    return text[:_MAX_ERROR_CHARS] + "...[truncated]" if len(text) > _MAX_ERROR_CHARS else text


def not_json(raw: bytes) -> ApiError:
    """An unparsable body: FastAPI's json_invalid error, at the offending character."""
    try:
        json.loads(raw)
    except json.JSONDecodeError as e:
        err = {"type": "json_invalid", "loc": f"body.{e.pos}", "msg": "JSON decode error",
               "input": "<dict of 0 items>", "ctx": {"error": e.msg}}  # fmt: skip
        return invalid([err])
    except UnicodeDecodeError:
        pass
    return invalid(["Invalid JSON body"])


WRONG_MEDIA_TYPE = "Unsupported Media Type: Only 'application/json' is allowed"


class Checker:
    """Collects pydantic-style errors while one body's fields are coerced."""

    def __init__(self) -> None:
        self.errors: list[dict[str, Any]] = []

    def fail(self, kind: str, loc: Loc, msg: str, value: object, ctx: object = None) -> Any:
        err: dict[str, Any] = {"type": kind, "loc": ".".join(map(str, ("body", *loc))),
                               "msg": msg, "input": _summary(value)}  # fmt: skip
        if ctx is not None:
            err["ctx"] = ctx
        self.errors.append(err)
        return BAD

    def value_error(self, loc: Loc, message: str, value: object) -> Any:
        """A model's own validator refused the value (pydantic's "Value error, ...")."""
        return self.fail("value_error", loc, f"Value error, {message}", value,
                         {"error": ValueError(message)})  # fmt: skip

    def model(self, v: object, loc: Loc) -> Mapping[str, Any] | None:
        """A nested object's input, or None (its error recorded)."""
        if isinstance(v, Mapping):
            return v
        self.fail(
            "model_attributes_type",
            loc,
            "Input should be a valid dictionary or object to extract fields from",
            v,
        )
        return None

    def fields(self, body: Mapping[str, Any], loc: Loc, spec: Sequence[Field]) -> Any:
        """The object's fields coerced (None for those left out or null), or BAD."""
        out: dict[str, Any] = {}
        ok = True
        for name, check, required in spec:
            value = body.get(name)
            if name not in body and required:
                self.fail("missing", (*loc, name), "Field required", body)
                ok = False
            elif value is not None or required:
                value = check(self, value, (*loc, name))
                ok = ok and value is not BAD
            out[name] = value
        return out if ok else BAD

    def tag_error(self, loc: Loc, body: Mapping[str, Any], tags: Sequence[str]) -> Any:
        """A discriminated union (on "type") that matched no member."""
        if "type" not in body:
            return self.fail("union_tag_not_found", loc,
                             "Unable to extract tag using discriminator 'type'", body,
                             {"discriminator": "'type'"})  # fmt: skip
        expected = ", ".join(f"'{t}'" for t in tags)
        return self.fail(
            "union_tag_invalid", loc, f"Input tag '{body['type']}' found using 'type' does not "
            f"match any of the expected tags: {expected}", body,
            {"discriminator": "'type'", "tag": str(body["type"]), "expected_tags": expected},
        )  # fmt: skip


Check = Callable[[Checker, Any, Loc], Any]
Field = tuple[str, Check, bool]  # name, check, required


# -- field checks: (checker, value, loc) -> the coerced value, or BAD ----------------------
def string(c: Checker, v: object, loc: Loc) -> Any:
    if isinstance(v, str):
        return v
    return c.fail("string_type", loc, "Input should be a valid string", v)


def integer(c: Checker, v: object, loc: Loc) -> Any:
    if isinstance(v, int):
        return int(v)
    if isinstance(v, float):
        if v.is_integer():
            return int(v)
        return c.fail(
            "int_from_float",
            loc,
            "Input should be a valid integer, got a number with a fractional part",
            v,
        )
    if isinstance(v, str):
        if _WHOLE.fullmatch(v.strip()):
            return int(float(v)) if "." in v else int(v)
        return c.fail(
            "int_parsing",
            loc,
            "Input should be a valid integer, unable to parse string as an integer",
            v,
        )
    return c.fail("int_type", loc, "Input should be a valid integer", v)


def number(c: Checker, v: object, loc: Loc) -> Any:
    if isinstance(v, int | float):
        return float(v)
    if isinstance(v, str):
        try:
            return float(v.strip())
        except ValueError:
            return c.fail(
                "float_parsing",
                loc,
                "Input should be a valid number, unable to parse string as a number",
                v,
            )
    return c.fail("float_type", loc, "Input should be a valid number", v)


def boolean(c: Checker, v: object, loc: Loc) -> Any:
    if isinstance(v, bool):
        return v
    if isinstance(v, int | float) and v in (0, 1):
        return bool(v)
    if isinstance(v, str) and v.strip().lower() in _TRUE + _FALSE:
        return v.strip().lower() in _TRUE
    if isinstance(v, int | float | str):
        return c.fail(
            "bool_parsing", loc, "Input should be a valid boolean, unable to interpret input", v
        )
    return c.fail("bool_type", loc, "Input should be a valid boolean", v)


def mapping(c: Checker, v: object, loc: Loc) -> Any:
    if isinstance(v, Mapping):
        return dict(v)
    return c.fail("dict_type", loc, "Input should be a valid dictionary", v)


def list_of(item: Check) -> Check:
    def check(c: Checker, v: object, loc: Loc) -> Any:
        if not isinstance(v, list):
            return c.fail("list_type", loc, "Input should be a valid list", v)
        out = [item(c, x, (*loc, i)) for i, x in enumerate(v)]
        return BAD if any(x is BAD for x in out) else out

    return check


def str_or(other: Check) -> Check:
    """``str | other``: when both fail, the string branch's error comes first."""

    def check(c: Checker, v: object, loc: Loc) -> Any:
        if isinstance(v, str):
            return v
        trial = Checker()
        out = other(trial, v, loc)
        if out is BAD:
            string(c, v, loc)
            c.errors.extend(trial.errors)
        return out

    return check


def literal(*options: str) -> Check:
    quoted = [f"'{o}'" for o in options]
    expected = quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " or " + quoted[-1]

    def check(c: Checker, v: object, loc: Loc) -> Any:
        if v in options:
            return v
        return c.fail("literal_error", loc, f"Input should be {expected}", v,
                      {"expected": expected})  # fmt: skip

    return check


def obj(*spec: Field) -> Check:
    """A nested model with these fields."""

    def check(c: Checker, v: object, loc: Loc) -> Any:
        body = c.model(v, loc)
        return BAD if body is None else c.fields(body, loc, spec)

    return check


def _summary(value: object) -> object:
    """vLLM's _summarize_error_input: containers described, the rest as text."""
    if isinstance(value, list | tuple | dict):
        return f"<{type(value).__name__} of {len(value)} items>"
    text = value if isinstance(value, str) else str(value)
    return text if len(text) <= _MAX_INPUT_CHARS else text[:_MAX_INPUT_CHARS] + "...[truncated]"

"""Pure resume planning: what was generated so far per choice, whether it can be resumed
faithfully, the request that resumes it on another backend, and the seam check.

Token path: `/v1/completions` with prompt = prompt ids + generated ids, so the new backend
is conditioned on exactly the tokens the client has (re-tokenizing text can change token
boundaries, and with them the greedy continuation). Text path, for backends without token
ids: the text sent so far, as a final assistant message to continue or appended to the
prompt. Seam check: resume m tokens early and require the new backend to regenerate them."""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from dataplane.validate import ClientRequest, Endpoint


class ResumePath(StrEnum):
    TOKEN = "token"
    TEXT = "text"


class Seam(StrEnum):
    VERIFIED = "verified"
    DIVERGENT = "divergent"
    UNCHECKED = "unchecked"
    SAMPLED = "sampled"


class Refused(Exception):
    """The request cannot be resumed faithfully; the message says why (sent to the client)."""


# Constrained decoding: the grammar state at the seam is the engine's, not ours to rebuild.
GUIDED_FIELDS = (
    "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs",
    "json_schema", "regex", "ebnf", "structural_tag",
)  # fmt: skip
# Copied to the resume request unchanged (vLLM/SGLang sampling extras included).
SAMPLING_FIELDS = (
    "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos",
    "repetition_penalty", "skip_special_tokens", "spaces_between_special_tokens",
    "include_stop_str_in_output", "bad_words", "allowed_token_ids", "logit_bias", "priority",
    "user",
)  # fmt: skip
RECENT_CHUNKS = 64  # per choice, for choosing the seam overlap; bounds memory


def static_refusal(body: Mapping[str, Any]) -> str | None:
    """Why this request could never be resumed faithfully, whatever was generated."""
    for name in GUIDED_FIELDS:
        if body.get(name):
            return f"guided decoding ({name}) cannot be resumed faithfully"
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") in ("json_object", "json_schema"):
        return "JSON-constrained output (response_format) cannot be resumed faithfully"
    for name in ("frequency_penalty", "presence_penalty"):
        if body.get(name):
            # They count generated tokens, which a resume turns into prompt tokens.
            return f"{name} cannot be resumed faithfully"
    if body.get("logprobs") or body.get("top_logprobs"):
        return "logprobs cannot be resumed faithfully"
    if (body.get("best_of") or 1) > 1:
        return "best_of cannot be resumed"
    return None


@dataclass(slots=True)
class ChoiceProgress:
    """What one choice has produced so far. Mutable; owned by one request's stitcher."""

    index: int
    prompt_ids: list[int] | None = None
    token_ids: list[int] = field(default_factory=list)
    pieces: list[str] = field(default_factory=list)  # text sent to the client, in order
    # (token count, text) of the latest chunks that carried tokens, newest last.
    recent: deque[tuple[int, str]] = field(default_factory=lambda: deque(maxlen=RECENT_CHUNKS))
    # The texts of the latest chunks, newest last (the text path's overlap: one chunk is one
    # token on the engines that stream without ids).
    recent_text: deque[str] = field(default_factory=lambda: deque(maxlen=RECENT_CHUNKS))
    content_chunks: int = 0  # token estimate where ids are unknown (text path)
    # Text chunks without ids after some with ids: a text-path resume (a token-id engine
    # failed over to one without ids); counted on top of the ids.
    untracked_chunks: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    tool_call: bool = False

    @property
    def text(self) -> str:
        if len(self.pieces) > 1:
            self.pieces[:] = ["".join(self.pieces)]
        return self.pieces[0] if self.pieces else ""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, text: str, ids: list[int] | None) -> None:
        if text:
            self.pieces.append(text)
            self.recent_text.append(text)
            self.content_chunks += 1
            if not ids and self.token_ids:
                self.untracked_chunks += 1
        if ids:
            self.token_ids.extend(ids)
            self.recent.append((len(ids), text))

    @property
    def generated(self) -> int:
        if self.token_ids:
            return len(self.token_ids) + self.untracked_chunks
        return self.content_chunks


def overlap(progress: ChoiceProgress, m: int) -> tuple[int, str]:
    """The fewest trailing chunks holding at least m tokens that start at a settled boundary:
    the chunk before them released text (engines hold text back at incomplete UTF-8 or a
    possible stop string), so their texts joined are what the client got for those tokens.
    (0, "") when no such boundary lies within the recent chunks."""
    if m <= 0:
        return 0, ""
    chunks = list(progress.recent)
    covers_all = sum(n for n, _ in chunks) == len(progress.token_ids)
    tokens = 0
    for i in range(len(chunks) - 1, -1, -1):
        tokens += chunks[i][0]
        if tokens < m:
            continue
        settled = bool(chunks[i - 1][1]) if i > 0 else covers_all
        if settled:
            return tokens, "".join(text for _, text in chunks[i:])
    return 0, ""


@dataclass(frozen=True, slots=True)
class ResumePlan:
    path: ResumePath
    endpoint: Endpoint
    body: dict[str, Any]
    overlap_ids: tuple[int, ...]
    overlap_text: str
    seam: Seam  # the verdict if nothing is checked; VERIFIED means "check the overlap"
    needs_held_text: bool  # token path with stop strings: text the engine held back is lost
    overlap_tokens: int = 0  # tokens the overlap spans: what a side check asks for

    @property
    def checks(self) -> bool:
        return bool(self.overlap_ids or self.overlap_text)


def _remaining(body: Mapping[str, Any], generated: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    limit = body.get("max_completion_tokens") or body.get("max_tokens")
    if limit is not None:
        # Never negative, even when a misbehaving backend sent more than it was asked for.
        out["max_tokens"] = max(0, limit - generated)
    if body.get("min_tokens"):
        out["min_tokens"] = max(0, body["min_tokens"] - generated)
    return out


def plan_resume(
    client: ClientRequest,
    progress: ChoiceProgress,
    *,
    token_path: bool,
    seam_tokens: int,
    exact: bool = False,
) -> ResumePlan:
    """Raises Refused. `exact`: resume from the exact prefix, no overlap (after a divergent
    seam, so the continuation is conditioned on what the client saw)."""
    why = static_refusal(client.body)
    if why:
        raise Refused(why)
    if progress.tool_call:
        raise Refused("a tool call was being streamed; it cannot be resumed faithfully")
    body = client.body
    has_stops = bool(body.get("stop"))
    m = seam_tokens if not exact else 0
    if token_path and progress.prompt_ids is not None:
        return _token_plan(client, progress, m, has_stops)
    return _text_plan(client, progress, m if not has_stops else 0)


def _token_plan(
    client: ClientRequest, progress: ChoiceProgress, m: int, has_stops: bool
) -> ResumePlan:
    body = client.body
    # Sampled decoding cannot be checked token by token, and with stop strings the
    # engine's held-back text makes chunk texts unreliable for the overlap.
    if not client.greedy:
        seam, m = Seam.SAMPLED, 0
    elif has_stops or m <= 0:
        seam, m = Seam.UNCHECKED, 0
    else:
        seam = Seam.VERIFIED
    n_overlap, overlap_text = overlap(progress, m)
    if seam is Seam.VERIFIED and n_overlap == 0:
        seam = Seam.UNCHECKED
    kept = progress.token_ids[: len(progress.token_ids) - n_overlap]
    assert progress.prompt_ids is not None  # noqa: S101 - checked by the caller
    request: dict[str, Any] = {k: body[k] for k in SAMPLING_FIELDS if k in body}
    request.update(
        model=client.model,
        prompt=progress.prompt_ids + kept,
        stream=True,
        return_token_ids=True,
        n=1,
        **_remaining(body, len(kept)),
    )
    return ResumePlan(
        ResumePath.TOKEN,
        Endpoint.COMPLETIONS,
        request,
        tuple(progress.token_ids[len(kept) :]),
        overlap_text,
        seam,
        needs_held_text=has_stops and bool(progress.token_ids),
        overlap_tokens=n_overlap,
    )


def _text_overlap(progress: ChoiceProgress, m: int) -> str:
    """The last m chunks' text, when the client has more than that (else nothing to check).
    Only chunks of this choice's text path count: ids mean token-path chunks."""
    chunks = progress.recent_text
    if m <= 0 or len(chunks) <= m or progress.token_ids:
        return ""
    text = "".join(list(chunks)[-m:])
    return text if progress.text.endswith(text) else ""


def _text_plan(client: ClientRequest, progress: ChoiceProgress, m: int = 0) -> ResumePlan:
    body = dict(client.body)
    for name in ("return_token_ids", "stream_options", "n"):
        body.pop(name, None)
    # Greedy text resumes can be checked like token ones, by text: resume m chunks early and
    # the new backend must regenerate exactly the text the client already has for them.
    overlap_text = _text_overlap(progress, m) if client.greedy else ""
    n_overlap = m if overlap_text else 0
    sent = progress.text[: len(progress.text) - len(overlap_text)]
    body.update(stream=True, n=1, stream_options={"include_usage": True})
    body.update(_remaining(client.body, progress.generated - n_overlap))
    seam = (
        Seam.VERIFIED if overlap_text else Seam.UNCHECKED if client.greedy else Seam.SAMPLED
    )
    plan = functools.partial(
        ResumePlan, overlap_text=overlap_text, seam=seam, needs_held_text=False,
        overlap_tokens=n_overlap, overlap_ids=(),
    )  # fmt: skip
    if not progress.text and not progress.token_ids:
        # Nothing of this choice reached the client: start it again as asked.
        return plan(ResumePath.TEXT, client.endpoint, body)
    if client.endpoint is Endpoint.CHAT:
        messages = list(body["messages"])
        last = messages[-1] if messages else {}
        if body.get("continue_final_message") and last.get("role") == "assistant":
            # The client prefilled the assistant turn; the sent text extends it (as one more
            # text part when the prefill came as parts).
            prefill = last.get("content") or ""
            if isinstance(prefill, list):
                extended: str | list[Any] = [*prefill, {"type": "text", "text": sent}]
            else:
                extended = prefill + sent
            messages[-1] = {**last, "content": extended}
        else:
            messages.append({"role": "assistant", "content": sent})
        body.update(messages=messages, continue_final_message=True, add_generation_prompt=False)
        return plan(ResumePath.TEXT, Endpoint.CHAT, body)
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise Refused("a token-id or batched prompt cannot be resumed as text")
    body["prompt"] = prompt + sent
    body.pop("echo", None)
    return plan(ResumePath.TEXT, Endpoint.COMPLETIONS, body)


class SeamCheck:
    """Compares the new backend's first tokens with the overlap the client already has.
    feed() returns what to send once verified (the part after the overlap), None while
    still deciding; `verdict` is DIVERGENT when the new backend disagrees."""

    def __init__(self, overlap_ids: tuple[int, ...], overlap_text: str) -> None:
        self._want = overlap_ids
        self._text_want = overlap_text
        self._ids: list[int] = []
        self._text: list[str] = []
        self.verdict: Seam | None = None if overlap_ids or overlap_text else Seam.UNCHECKED

    def feed(self, ids: list[int], text: str, finished: bool) -> tuple[list[int], str] | None:
        if self.verdict is not None:
            return ids, text
        self._ids.extend(ids)
        self._text.append(text)
        got = self._ids[: len(self._want)]
        if got != list(self._want[: len(got)]):
            self.verdict = Seam.DIVERGENT
            return None
        joined = "".join(self._text)
        if not self._text_want.startswith(joined[: len(self._text_want)]):
            self.verdict = Seam.DIVERGENT  # already other text: no need to wait for the rest
            return None
        if len(self._ids) < len(self._want) or len(joined) < len(self._text_want):
            if finished:  # ended inside the overlap: the old backend had gone on
                self.verdict = Seam.DIVERGENT
            return None
        if not joined.startswith(self._text_want):
            self.verdict = Seam.DIVERGENT
            return None
        self.verdict = Seam.VERIFIED
        return self._ids[len(self._want) :], joined[len(self._text_want) :]

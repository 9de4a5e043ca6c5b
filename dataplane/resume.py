"""Pure resume planning: what was generated so far per choice, whether it can be resumed
faithfully, the request that resumes it on another backend, and the seam check.

Token path: `/v1/completions` with prompt = prompt ids + generated ids, so the new backend
is conditioned on exactly the tokens the client has (re-tokenizing text can change token
boundaries, and with them the greedy continuation). Text path, for backends without token
ids: the text sent so far, as a final assistant message to continue or appended to the
prompt. Seam check: resume m tokens early and require the new backend to regenerate them."""

# baton: pure

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from dataplane.detok import whole
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
# A seam check regenerates at most this many tokens (the overlap starts at a character
# boundary, which may lie further back than m when chunks carry several tokens).
MAX_OVERLAP = 64


def static_refusal(body: Mapping[str, Any]) -> str | None:
    """Why this request could never be resumed faithfully, whatever was generated."""
    for name in GUIDED_FIELDS:
        if body.get(name):
            return f"guided decoding ({name}) cannot be resumed faithfully"
    if body.get("tools") and body.get("tool_choice", "auto") != "none":
        # A tool call after the seam would reach the client as content: a resume runs on an
        # endpoint with no tool parser, and Baton does not parse tool calls itself.
        return "tool calls cannot be resumed faithfully (a resume runs no tool parser)"
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
    # Character boundaries the client's text is known to end at, newest last: (tokens, text
    # length) after a one-token chunk that carried text. Byte-level engines (vLLM, the sim)
    # release a token's text only once the bytes so far decode to whole characters, so after
    # such a chunk nothing of those tokens is held back; a chunk of several tokens may hold
    # its last ones back. (0, 0) is the start of the generation. A resume whose prompt ends
    # at one of these behaves like a fresh request; past the last one the client may lack
    # the text of some tokens (half a character), which Baton then derives itself.
    settled: deque[tuple[int, int]] = field(
        default_factory=lambda: deque([(0, 0)], maxlen=RECENT_CHUNKS)
    )
    # False with stop strings: the engine holds back text that could start one, so a chunk's
    # text says nothing of where the client's text ends.
    settles: bool = True
    text_len: int = 0
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
    # Reasoning (dataplane/reasoning.py): the delta field it came in ("" = none seen yet),
    # whether it is still open, and whether its end tag's token was generated while its
    # text has not come yet. `pieces` hold the engine's raw text, tag included, as a
    # resume's /v1/completions would decode it; the reply (content) starts at reply_start.
    reasoning_field: str = ""
    reasoning: bool = False
    end_pending: bool = False
    reply_start: int = 0
    # Structure in the stream that no resume can keep (a parser Baton cannot follow): why.
    unfollowed: str = ""

    @property
    def text(self) -> str:
        if len(self.pieces) > 1:
            self.pieces[:] = ["".join(self.pieces)]
        return self.pieces[0] if self.pieces else ""

    @property
    def reply(self) -> str:
        """The answer's content: what the next turn of the conversation sends back."""
        return self.text[self.reply_start :]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, text: str, ids: list[int] | None, *, settled: bool = False) -> None:
        """One chunk's text and ids, as the client got them. `settled`: the caller knows the
        text covers every one of the ids (Baton decoded them itself)."""
        if text:
            self.pieces.append(text)
            self.recent_text.append(text)
            self.text_len += len(text)
            self.content_chunks += 1
            if not ids and self.token_ids:
                self.untracked_chunks += 1
        if ids:
            self.token_ids.extend(ids)
            if self.settles and (settled or (text and len(ids) == 1)):
                self.settled.append((len(self.token_ids), self.text_len))

    @property
    def generated(self) -> int:
        if self.token_ids:
            return len(self.token_ids) + self.untracked_chunks
        return self.content_chunks

    def held(self, *, from_start: bool = False) -> Held | None:
        """The tokens since the last known character boundary and the client's text for
        them, when the client may lack some of their text; None when it has all of it.
        `from_start`: since the start of the generation (stop strings: an engine holds
        back text without regard to boundaries)."""
        at, text_at = (0, 0) if from_start or not self.settles else self.settled[-1]
        if not self.token_ids or (at == len(self.token_ids) and not from_start):
            return None
        return Held(tuple(self.token_ids[at:]), self.text[text_at:])


@dataclass(frozen=True, slots=True)
class Held:
    """A resume's prompt ends past the last character boundary the client's text is known to
    end at (or the engine held text back for a stop string). The resumed engine cannot be
    trusted with the text there: vLLM, primed with a prompt that ends mid-character, sends
    the whole prompt's text in its first chunk. So Baton derives it: the client gets
    decode(ids + the new ids)[len(sent):] once that decodes to whole characters."""

    ids: tuple[int, ...]  # generated since the boundary: in the resume's prompt already
    sent: str  # what the client has of their text


def overlap(progress: ChoiceProgress, m: int) -> tuple[int, str]:
    """The fewest trailing tokens, at least m, that start at a known character boundary
    (ChoiceProgress.settled), and the client's text since it: a resume that starts there
    is primed like a fresh request, and must regenerate exactly those tokens and text.
    (0, "") when no such boundary is recent enough."""
    if m <= 0 or not progress.settles:
        return 0, ""
    total = len(progress.token_ids)
    for at, text_at in reversed(progress.settled):
        n = total - at
        if n > MAX_OVERLAP:
            break
        if n >= m:
            return n, progress.text[text_at:]
    return 0, ""


@dataclass(frozen=True, slots=True)
class ResumePlan:
    path: ResumePath
    endpoint: Endpoint
    body: dict[str, Any]
    overlap_ids: tuple[int, ...]
    overlap_text: str
    seam: Seam  # the verdict if nothing is checked; VERIFIED means "check the overlap"
    # Token path, prompt past the last known character boundary (or stop strings): the
    # resumed text is derived from ids, and stop strings are matched by Baton.
    held: Held | None = None
    overlap_tokens: int = 0  # tokens the overlap spans: what a side check asks for

    @property
    def checks(self) -> bool:
        return bool(self.overlap_ids or self.overlap_text)


def tokens_allowed(body: Mapping[str, Any], generated: int) -> int | None:
    """Tokens the client still allows a choice that has `generated` (None: no limit). Never
    negative, even when a misbehaving backend sent more than it was asked for."""
    limit = body.get("max_completion_tokens") or body.get("max_tokens")
    return None if limit is None else max(0, int(limit) - generated)


def _remaining(body: Mapping[str, Any], generated: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    left = tokens_allowed(body, generated)
    if left is not None:
        out["max_tokens"] = left
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
    why = refusal(client, progress)
    if why:
        raise Refused(why)
    body = client.body
    has_stops = bool(body.get("stop"))
    m = seam_tokens if not exact else 0
    if token_path and progress.prompt_ids is not None:
        return _token_plan(client, progress, m, has_stops)
    return _text_plan(client, progress, m if not has_stops else 0)


def refusal(client: ClientRequest, progress: ChoiceProgress) -> str | None:
    """Why this choice cannot be resumed faithfully now, or None."""
    why = static_refusal(client.body)
    if why:
        return why
    if progress.tool_call:
        return "a tool call was being streamed; it cannot be resumed faithfully"
    return progress.unfollowed or None


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
    # An overlap starts at a character boundary and its text is checked against the
    # client's: the engine's text after it is then proven in step. An exact resume past the
    # last known boundary derives its text from ids (Held): the engine's would be wrong (the
    # prompt-window quirk). One at a boundary takes the engine's text, which a side check
    # then compares with the ids' (Resumer._verify): any difference makes it divergent.
    held = progress.held(from_start=has_stops) if n_overlap == 0 else None
    assert progress.prompt_ids is not None  # noqa: S101 - checked by the caller
    request: dict[str, Any] = {k: body[k] for k in SAMPLING_FIELDS if k in body}
    if held is not None:
        # Matched by Baton over the derived text: the engine would match them over its own,
        # which after a cut mid-character starts with the prompt's text.
        request.pop("stop", None)
        request.pop("include_stop_str_in_output", None)
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
        held=held,
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
    if progress.reasoning_field:
        raise Refused("a reasoning stream cannot be resumed as text (its split would be lost)")
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
        ResumePlan, overlap_text=overlap_text, seam=seam, overlap_tokens=n_overlap,
        overlap_ids=(),
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



class HeldText:
    """The text of a resume whose prompt ends past the client's last known character
    boundary (ResumePlan.held). The caller decodes `ids` with the new engine's tokenizer
    whenever the engine says it released text (it does so only at whole characters) and
    feeds the result to resolve(); from the first resolved release on, the engine's own text
    is right again (its detokenizer restarted at a character boundary)."""

    def __init__(self, held: Held) -> None:
        self.ids = list(held.ids)
        self._sent = held.sent
        self.verdict: Seam | None = None  # DIVERGENT: the decoded text is not the client's

    def add(self, ids: list[int]) -> None:
        self.ids.extend(ids)

    def resolve(self, decoded: str, finished: bool) -> str | None:
        """What the client lacks, from decoded = decode(ids): None while that ends inside a
        character (a byte-level engine releases nothing then either). At the end the caller
        passes the text up to the last character boundary (the rest is never released)."""
        if not (finished or whole(decoded)):
            return None
        if not decoded.startswith(self._sent):
            # The new engine decodes the client's tokens to other text (another tokenizer):
            # what follows cannot continue the client's text faithfully.
            self.verdict = Seam.DIVERGENT
        return decoded[len(self._sent) :]

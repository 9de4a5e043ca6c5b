"""The resume plan, made once per failover: whether the choice can be resumed faithfully
(refusal(), which builds no plan), and if so the request that resumes it on another backend.

Token path: `/v1/completions` with prompt = prompt ids + generated ids, so the new backend
is conditioned on exactly the tokens the client has (re-tokenizing text can change token
boundaries, and with them the greedy continuation). Text path, for backends without token
ids: the text sent so far, as a final assistant message to continue or appended to the
prompt. The seam overlap (resume m tokens early, require the new backend to regenerate
them) is chosen here and checked in dataplane/relay/resume/seam.py."""

# baton: pure

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from baton.model import ResumePath, Seam
from dataplane.exceptions import Refused
from dataplane.relay.progress import ChoiceProgress, Held, id_array, overlap
from dataplane.relay.resume import generate
from dataplane.request import ClientRequest, Endpoint, token_limit

# Constrained decoding: the grammar state at the seam is the engine's, not ours to rebuild.
GUIDED_FIELDS = (
    "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs",
    "json_schema", "regex", "ebnf", "structural_tag",
)  # fmt: skip
# Copied to the resume request unchanged (vLLM/SGLang sampling extras included, and vLLM's
# stream_interval: the client's chunking goes on after the seam).
SAMPLING_FIELDS = (
    "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos",
    "repetition_penalty", "skip_special_tokens", "spaces_between_special_tokens",
    "include_stop_str_in_output", "bad_words", "allowed_token_ids", "logit_bias", "priority",
    "user", "stream_interval",
)  # fmt: skip


def static_refusal(body: Mapping[str, Any]) -> str | None:
    """Why this request could never be resumed faithfully, whatever was generated."""
    for name in GUIDED_FIELDS:
        if body.get(name):
            return f"guided decoding ({name}) cannot be resumed faithfully"
    choice = body.get("tool_choice")
    if body.get("tools") and (choice == "required" or isinstance(choice, dict)):
        # vLLM serves these by guided decoding into its own JSON format: the grammar's state
        # at the seam is the engine's. ("auto" is followed: dataplane/relay/tools/.)
        return ("tool_choice 'required' or a named tool (guided decoding) cannot be resumed "
                "faithfully")
    if body.get("tools") and choice != "none" and any(_strict(t) for t in body["tools"]):
        # vLLM (VLLM_ENFORCE_STRICT_TOOL_CALLING, on by default) constrains a strict tool's
        # call with a structural tag: the same grammar-state problem.
        return "a strict tool (guided decoding of its arguments) cannot be resumed faithfully"
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") in ("json_object", "json_schema"):
        return "JSON-constrained output (response_format) cannot be resumed faithfully"
    for name in ("frequency_penalty", "presence_penalty"):
        if body.get(name):
            # They count generated tokens, which a resume turns into prompt tokens.
            return f"{name} cannot be resumed faithfully"
    if (body.get("best_of") or 1) > 1:
        return "best_of cannot be resumed"
    return None

def _strict(tool: Any) -> bool:
    fn = tool.get("function") if isinstance(tool, Mapping) else None
    return isinstance(fn, Mapping) and fn.get("strict") is True


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
    # False: the overlap starts where the client's text may end mid-character (no boundary
    # known near enough), so only its ids are checked; the text is derived from ids (held).
    overlap_has_text: bool = True
    path_override: str = ""  # the engine path, where it is not the endpoint's (generate.PATH)

    @property
    def engine_path(self) -> str:
        return self.path_override or self.endpoint.value

    @property
    def checks(self) -> bool:
        return bool(self.overlap_ids or self.overlap_text)

def tokens_allowed(body: Mapping[str, Any], generated: int) -> int | None:
    """Tokens the client still allows a choice that has `generated` (None: no limit). Never
    negative, even when a misbehaving backend sent more than it was asked for."""
    limit = token_limit(body)
    return None if limit is None else max(0, limit - generated)

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
    extra: Mapping[str, Any] | None = None,
    tools: bool = False,
) -> ResumePlan:
    """Raises Refused. `exact`: resume from the exact prefix, no overlap (after a divergent
    seam, so the continuation is conditioned on what the client saw). `extra`: fields the
    token path's request sets beyond the client's (Stitcher.resume_fields); `tools`: Baton
    follows the stream's tool calls, which it can only do from ids."""
    why = refusal(client, progress)
    if why:
        raise Refused(why)
    body = client.body
    has_stops = bool(body.get("stop"))
    m = seam_tokens if not exact else 0
    k = generate.logprobs_wanted(client)
    if token_path and progress.prompt_ids is not None:
        if k is not None and not exact:
            # The tokens the client lacks decode with the context vLLM gives them in an
            # uninterrupted stream (generate.CONTEXT): at least that many are regenerated.
            m = max(m, min(generate.CONTEXT, len(progress.token_ids)))
        return _token_plan(client, progress, m, has_stops, extra or {}, k)
    if k is not None:
        raise Refused("a stream with logprobs resumes only on an engine that streams token ids")
    if tools:
        raise Refused("a stream with tool calls resumes only on an engine that streams token ids")
    return _text_plan(client, progress, m if not has_stops else 0)

def refusal(client: ClientRequest, progress: ChoiceProgress) -> str | None:
    """Why this choice cannot be resumed faithfully now, or None."""
    why = static_refusal(client.body)
    if why:
        return why
    if generate.logprobs_wanted(client) is not None:
        why = generate.refusal(client)
        if why:
            return why
    if progress.tool_call:
        return "a tool call was being streamed; it cannot be resumed faithfully"
    return progress.unfollowed or None

def _token_plan(
    client: ClientRequest,
    progress: ChoiceProgress,
    m: int,
    has_stops: bool,
    extra: Mapping[str, Any],
    k: int | None = None,
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
    has_text = True
    if seam is Seam.VERIFIED and n_overlap == 0:
        if len(progress.token_ids) > m:
            # No character boundary near enough (an engine that merges tokens into chunks
            # of several ids tells none): check the last m ids alone.
            n_overlap, has_text = m, False
        else:
            seam = Seam.UNCHECKED
    n_kept = len(progress.token_ids) - n_overlap
    # The prompt and the kept ids, 4 bytes an id (a Python list would hold 36): a resume's
    # plan lives as long as the resumed stream (json_body serialises it).
    assert progress.prompt_ids is not None  # noqa: S101 - checked by the caller
    prompt = id_array(progress.prompt_ids)
    prompt.extend(progress.token_ids[:n_kept])
    # An overlap at a character boundary has its text checked against the client's: the
    # engine's text after it is then proven in step. A resume whose prompt may end past the
    # last known boundary (an exact one there, or an overlap checked by ids alone) derives
    # its text from ids (Held): the engine's would be wrong (the prompt-window quirk). An
    # exact one at a boundary takes the engine's text, which a side check then compares with
    # the ids' (sidecheck.SideCheck): any difference makes it divergent.
    if n_overlap == 0:
        held = progress.held(from_start=has_stops)
    else:
        held = None if has_text else progress.since_boundary()
    request: dict[str, Any] = {k: body[k] for k in SAMPLING_FIELDS if k in body}
    request.update(extra)
    if held is not None:
        # Matched by Baton over the derived text: the engine would match them over its own,
        # which after a cut mid-character starts with the prompt's text.
        request.pop("stop", None)
        request.pop("include_stop_str_in_output", None)
    if k is not None:
        # Logprobs: vLLM's token-in/token-out endpoint gives them in chat's shape.
        sampling = {**extra, **_remaining(body, n_kept)}
        request = generate.body(client, prompt, k, sampling)
        if held is not None:  # stop strings matched by Baton, as below
            request["sampling_params"].pop("stop", None)
            request["sampling_params"].pop("include_stop_str_in_output", None)
        path = generate.PATH
    else:
        request.update(
            model=client.model,
            prompt=prompt,
            stream=True,
            return_token_ids=True,
            n=1,
            **_remaining(body, n_kept),
        )
        path = ""
    return ResumePlan(
        ResumePath.TOKEN,
        Endpoint.COMPLETIONS,
        request,
        tuple(progress.token_ids[n_kept:]),
        overlap_text,
        seam,
        held=held,
        overlap_tokens=n_overlap,
        overlap_has_text=has_text,
        path_override=path,
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

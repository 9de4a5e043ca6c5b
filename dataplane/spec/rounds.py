"""A speculative round's calls to the engines, each a short non-streaming request: the
draft's k tokens, the target's own next token after each prefix of the draft (k + 1
one-token completions at once, in one request to vLLM: plan.py says why), the target
alone when there is no usable draft, and the target's /tokenize and /detokenize.

With --spec-lookahead (off by default), while the target verifies a round the draft already
proposes the next one (Ahead), from the context as it will be if the target takes the whole
proposal: the two engines work at once, and a round the target takes whole starts with its
proposal drafted."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from baton.model import Backend, BackendKind, Failure, Pairing
from baton.sampling import pair_params
from dataplane.exceptions import AttemptFailed, DraftFailed
from dataplane.request import ClientRequest, Endpoint
from dataplane.settings import Timeouts
from dataplane.spec.plan import Judged, judge
from dataplane.upstream.engine import detokenize, post_json


class Ahead:
    """The draft's next proposal, asked while the target verifies this round's: drafted after
    the context and the whole of this proposal, so its first token is the draft's guess at
    the target's bonus token and the rest is the next proposal. It is good only for the
    context it guessed: the whole proposal taken, and the bonus guessed right."""

    def __init__(self, draft: Backend, ctx: Sequence[int], proposal: Sequence[int],
                 call: Coroutine[Any, Any, list[int]]) -> None:  # fmt: skip
        self.draft_id = draft.id
        self._base = len(ctx) + len(proposal)  # the context it was drafted after
        self._proposal = list(proposal)
        self._task = asyncio.ensure_future(call)
        # A proposal nobody takes may fail unseen: its error is read so that it is not logged.
        self._task.add_done_callback(lambda t: t.cancelled() or t.exception())

    def cancel(self) -> None:
        self._task.cancel()

    async def take(self, ctx: Sequence[int], draft: Backend, k: int) -> list[int] | None:
        """Up to k drafted tokens after `ctx`, when `ctx` is the one guessed; else None (and
        the call is stopped, so the draft's engine is free for the fresh one)."""
        base = self._base
        guessed = (
            draft.id == self.draft_id
            and len(ctx) == base + 1
            and list(ctx[base - len(self._proposal) : base]) == self._proposal
        )
        if not guessed or self._task.cancelled():
            self.cancel()
            return None
        try:
            ids = await self._task
        except DraftFailed:
            return None  # drafted anew, where a failure is the round's to handle
        if not ids or ids[0] != ctx[-1]:
            return None  # the target's bonus was not the draft's guess
        return ids[1 : 1 + k] or None


@dataclass(frozen=True, slots=True)
class Round:
    """One round's result and where its time went."""

    judged: Judged
    drafted: int
    ahead: Ahead | None  # the next proposal, in flight (only after a proposal taken whole)
    from_ahead: bool  # this round's proposal was drafted while the last round verified
    started: float  # monotonic
    draft_s: float  # waiting for the draft's proposal
    verify_s: float  # waiting for the target's verification


class Rounds:
    def __init__(self, session: aiohttp.ClientSession, timeouts: Timeouts) -> None:
        self._session = session
        self._timeouts = timeouts

    async def round(
        self,
        ctx: list[int],
        pairing: Pairing,
        target: Backend,
        remaining: int,
        *,
        k: int,
        ahead: Ahead | None = None,
        k_ahead: int = 0,
    ) -> Round:
        """One round on the pair after `ctx`, drafting up to k tokens (taken from `ahead`
        where it guessed this context). With k_ahead, the draft proposes up to k_ahead tokens
        of the next round meanwhile. Raises DraftFailed (the draft failed: go on target-only)
        or AttemptFailed (the target failed)."""
        started = time.monotonic()
        k = max(1, min(k, remaining))
        draft = pairing.draft
        draft_ids = await ahead.take(ctx, draft, k) if ahead is not None else None
        from_ahead = draft_ids is not None
        if draft_ids is None:
            draft_ids = await self._draft(draft, ctx, k)
        drafted_at = time.monotonic()
        # Tokens left after this round if the target takes the whole proposal and its bonus.
        left = remaining - len(draft_ids) - 1
        nxt = None
        if k_ahead > 0 and left > 0:
            call = self._draft(draft, ctx + draft_ids, min(k_ahead, left) + 1)
            nxt = Ahead(draft, ctx, draft_ids, call)
        try:
            judged = await self._judged(target, ctx, draft_ids, remaining)
        except BaseException:
            if nxt is not None:
                nxt.cancel()
            raise
        if nxt is not None and (judged.finished or judged.accepted < len(draft_ids)):
            nxt.cancel()  # a guess at a context that will not be
            nxt = None
        return Round(judged, len(draft_ids), nxt, from_ahead, started,
                     drafted_at - started, time.monotonic() - drafted_at)  # fmt: skip

    async def _draft(self, draft: Backend, ctx: list[int], k: int) -> list[int]:
        """The draft's greedy k tokens after `ctx` (fewer where it ends the sequence)."""
        try:
            proposal = await self._complete(draft, ctx, k)
        except AttemptFailed as exc:
            raise DraftFailed(exc.failure, exc.detail) from exc
        ids = _ints(proposal.get("token_ids"))
        if ids is None:
            raise DraftFailed(Failure.GARBAGE, "draft sent no token_ids")
        return ids

    async def _judged(
        self, target: Backend, ctx: list[int], draft_ids: list[int], remaining: int
    ) -> Judged:
        # The target's own next token after each prefix of the draft, all at once.
        prefixes = [ctx + draft_ids[:i] for i in range(len(draft_ids) + 1)]
        answers = await self._verify(target, prefixes)
        own = []
        for answer in answers:
            ids = _ints(answer.get("token_ids"))
            if ids is None:
                raise AttemptFailed(Failure.GARBAGE, "target sent no token_ids")
            own.append((ids[0] if ids else None, answer.get("finish_reason")))
        try:
            return judge(draft_ids, own, remaining)
        except ValueError as exc:
            raise AttemptFailed(Failure.GARBAGE, f"target's answer: {exc}") from None

    async def _verify(self, target: Backend, prefixes: list[list[int]]) -> list[dict[str, Any]]:
        """The target's one next token after each prefix. vLLM takes them as one request
        with a batch of prompts (one engine request each, added at once: one trip through its
        API server instead of k + 1, which cost about a target step each), answered one choice
        per prompt by index. Other kinds get k + 1 concurrent calls (SGLang's batch answer is
        not one this was checked against; llama-server pairs are refused)."""
        if target.kind is not BackendKind.VLLM:
            calls = (self._complete(target, prefix, 1) for prefix in prefixes)
            return list(await asyncio.gather(*calls))
        body: dict[str, Any] = {
            **pair_params(target.kind),
            "model": target.model,
            "prompt": prefixes,
            "max_tokens": 1,
            "return_token_ids": True,
        }
        choices = (await self._post(target, "/v1/completions", body)).get("choices")
        if not isinstance(choices, list) or len(choices) != len(prefixes):
            raise AttemptFailed(Failure.GARBAGE, f"a batch of {len(prefixes)} prompts answered "
                                "with another number of choices")  # fmt: skip
        by_index: dict[int, dict[str, Any]] = {}
        for choice in choices:
            index = choice.get("index") if isinstance(choice, dict) else None
            if not isinstance(index, int) or isinstance(index, bool) or index in by_index:
                raise AttemptFailed(Failure.GARBAGE, "a batch's choice without its own index")
            by_index[index] = choice
        if sorted(by_index) != list(range(len(prefixes))):
            raise AttemptFailed(Failure.GARBAGE, "a batch's choices are not one per prompt")
        return [by_index[i] for i in range(len(prefixes))]

    async def target_only(self, ctx: list[int], target: Backend, remaining: int) -> Judged:
        """No usable draft: the target generates the rest greedily in one call."""
        choice = await self._complete(target, ctx, remaining)
        ids = _ints(choice.get("token_ids"))
        if ids is None:
            raise AttemptFailed(Failure.GARBAGE, "target sent no token_ids")
        finish = choice.get("finish_reason")
        return Judged(0, tuple(ids[:remaining]), "stop" if finish == "stop" else "length")

    async def _complete(self, backend: Backend, prompt: list[int], n: int) -> dict[str, Any]:
        # Every sampling parameter, so that no engine default enters (baton/sampling.py).
        body: dict[str, Any] = {
            **pair_params(backend.kind),
            "model": backend.model,
            "prompt": prompt,
            "max_tokens": n,
            "return_token_ids": True,
        }
        answer = await self._post(backend, "/v1/completions", body)
        try:
            choice = answer["choices"][0]
        except (KeyError, IndexError, TypeError):
            raise AttemptFailed(Failure.GARBAGE, "completion without choices") from None
        if not isinstance(choice, dict):
            raise AttemptFailed(Failure.GARBAGE, "completion choice is not an object")
        return choice

    async def prompt_ids(self, target: Backend, client: ClientRequest) -> list[int]:
        """The prompt as the target's token ids (its own /tokenize, chat template included)."""
        body = client.body
        prompt = body.get("prompt")
        if client.endpoint is Endpoint.COMPLETIONS and (given := _ints(prompt)) is not None:
            return list(given)
        ask: dict[str, Any] = {"model": target.model}
        if client.endpoint is Endpoint.CHAT:
            ask.update(messages=body["messages"], add_generation_prompt=True)
        elif isinstance(prompt, str):
            ask["prompt"] = prompt
        else:
            raise AttemptFailed(Failure.GARBAGE, "prompt is neither text nor token ids")
        ids = _ints((await self._post(target, "/tokenize", ask)).get("tokens"))
        if ids is None:
            raise AttemptFailed(Failure.GARBAGE, "tokenize sent no tokens")
        return ids

    async def detokenize(self, target: Backend, ids: list[int]) -> str:
        return await detokenize(self._session, target, target.model, ids, self._timeouts.connect)

    async def _post(self, backend: Backend, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return await post_json(self._session, backend, path, body, self._timeouts)


def _ints(v: Any) -> list[int] | None:
    """A list of token ids, or None when it is anything else."""
    if isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        return v
    return None

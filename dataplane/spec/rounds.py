"""A speculative round's calls to the engines, each a short non-streaming request: the
draft's k tokens, the target's own next token after each prefix of the draft (k + 1
one-token completions at once, in one request to vLLM: plan.py says why), the target
alone when there is no usable draft, and the target's /tokenize and /detokenize."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

from baton.model import Backend, BackendKind, Failure, Pairing
from baton.sampling import pair_params
from dataplane.exceptions import AttemptFailed, DraftFailed
from dataplane.request import ClientRequest, Endpoint
from dataplane.settings import Timeouts
from dataplane.spec.plan import Judged, judge
from dataplane.upstream.engine import detokenize, post_json


class Rounds:
    def __init__(self, session: aiohttp.ClientSession, timeouts: Timeouts) -> None:
        self._session = session
        self._timeouts = timeouts

    async def round(
        self, ctx: list[int], pairing: Pairing, target: Backend, remaining: int
    ) -> tuple[Judged, int]:
        """One round on the pair after `ctx`: the judged tokens and how many were drafted.
        Raises DraftFailed (the draft failed: go on target-only) or AttemptFailed (the
        target failed)."""
        k = max(1, min(pairing.num_draft_tokens, remaining))
        try:
            proposal = await self._complete(pairing.draft, ctx, k)
        except AttemptFailed as exc:
            raise DraftFailed(exc.failure, exc.detail) from exc
        draft_ids = _ints(proposal.get("token_ids"))
        if draft_ids is None:
            raise DraftFailed(Failure.GARBAGE, "draft sent no token_ids")
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
            judged = judge(draft_ids, own, remaining)
        except ValueError as exc:
            raise AttemptFailed(Failure.GARBAGE, f"target's answer: {exc}") from None
        return judged, len(draft_ids)

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

"""The proposal drafted ahead (dataplane/spec/rounds.py: Ahead): taken only for the context it
guessed, stopped otherwise; a wrong guess or a failed draft costs a fresh proposal, never a
token the target did not choose (the round still verifies whatever it is given)."""

from __future__ import annotations

import asyncio

from baton.model import Failure, Role
from dataplane.exceptions import DraftFailed
from dataplane.spec.rounds import Ahead
from tests.factories import backend

DRAFT = backend("d", Role.DRAFT)
CTX = [1, 2, 3]
PROPOSAL = [10, 11]


async def _answer(ids: list[int]) -> list[int]:
    return ids


async def _fails() -> list[int]:
    raise DraftFailed(Failure.CONNECT, "draft gone")


def test_a_whole_take_with_the_guessed_bonus_starts_the_next_round_drafted() -> None:
    async def main() -> list[int] | None:
        ahead = Ahead(DRAFT, CTX, PROPOSAL, _answer([12, 20, 21, 22]))
        # The target took the whole proposal and its own bonus was 12, the draft's guess.
        return await ahead.take([*CTX, *PROPOSAL, 12], DRAFT, k=2)

    assert asyncio.run(main()) == [20, 21]


def test_another_bonus_a_cut_proposal_or_another_draft_is_not_taken() -> None:
    async def take(ctx: list[int], draft_id: str = "d") -> list[int] | None:
        ahead = Ahead(DRAFT, CTX, PROPOSAL, _answer([12, 20, 21]))
        return await ahead.take(ctx, backend(draft_id, Role.DRAFT), k=2)

    assert asyncio.run(take([*CTX, *PROPOSAL, 13])) is None  # the bonus was 13
    assert asyncio.run(take([*CTX, 10, 99])) is None  # the target cut the proposal
    assert asyncio.run(take([*CTX, 10, 11, 12], draft_id="d2")) is None  # re-paired


def test_a_guess_not_taken_stops_its_call_and_a_failed_one_is_drafted_anew() -> None:
    async def main() -> tuple[bool, list[int] | None]:
        never = asyncio.get_running_loop().create_future()
        ahead = Ahead(DRAFT, CTX, PROPOSAL, never)  # type: ignore[arg-type]
        assert await ahead.take([*CTX, 10, 99], DRAFT, k=2) is None
        await asyncio.sleep(0)
        failed = Ahead(DRAFT, CTX, PROPOSAL, _fails())
        return never.cancelled(), await failed.take([*CTX, *PROPOSAL, 12], DRAFT, k=2)

    stopped, after_failure = asyncio.run(main())
    assert stopped  # the draft's engine is not left working on a context that will not be
    assert after_failure is None

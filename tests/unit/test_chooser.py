"""Where a failover resumes (dataplane/relay/resume/choose.py, Chooser): on the route's next
fallback at once, control told once the resumed stream flows; on control's answer only when
no fallback can take it; nowhere when control has none or is away. The resumer is a fake
that opens (or refuses) resumes without any engine."""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Iterator
from typing import Any, cast

import pytest

from baton.model import Backend, Failure, SeamMode
from dataplane.exceptions import AttemptFailed, ControlUnavailable, Refused
from dataplane.relay.background import Background
from dataplane.relay.progress import ChoiceProgress
from dataplane.relay.resume import choose
from dataplane.relay.resume.attempt import Resumer, Started
from dataplane.relay.resume.choose import Chooser
from dataplane.relay.resume.plan import ResumePlan
from dataplane.request import Endpoint
from dataplane.settings import ResumeSettings
from tests.factories import backend, client_request
from tests.unit.relay_fakes import FakeControl, run, settle, stream_context

A, B, C, D = (backend(b) for b in "abcd")


@pytest.fixture(autouse=True)
def patient_timer(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The held-back Failover call's own timer never fires during a test unless the test
    says so: what a test sees then depends on the writes alone, never on how fast it ran."""
    monkeypatch.setattr(choose, "CONTROL_AFTER_S", 3600.0)
    yield


class Upstream:
    """An opened resume's response: only whether it was closed matters here."""

    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


class FakeResumer:
    """Opens a resume on any backend but those in `refuse` (Refused) and `fail`
    (AttemptFailed); records every start."""

    def __init__(self, refuse: Collection[str] = (), fail: Collection[str] = ()) -> None:
        self.refuse, self.fail = set(refuse), set(fail)
        self.starts: list[tuple[str, int, bool]] = []
        self.opened: list[Started] = []

    async def start(self, b: Backend, p: ChoiceProgress, *, exact: bool) -> Started:
        self.starts.append((b.id, p.index, exact))
        await asyncio.sleep(0)  # a start is a network call: others run meanwhile
        if b.id in self.refuse:
            raise Refused("not this one")
        if b.id in self.fail:
            raise AttemptFailed(Failure.REJECTED, "resume answered 400")
        started = Started(cast(ResumePlan, None), cast(Any, Upstream()), None)
        self.opened.append(started)
        return started


def choice(index: int = 0, sent: int = 2) -> ChoiceProgress:
    p = ChoiceProgress(index)
    for n in range(sent):
        p.add(f"w{n} ", None)
    return p


def chooser(
    control: FakeControl,
    resumer: FakeResumer,
    fallbacks: tuple[Backend, ...] = (B, C),
    seam_mode: SeamMode = SeamMode.PARALLEL,
    **body: object,
) -> tuple[Chooser, Background]:
    settings = ResumeSettings(seam_mode=seam_mode)
    ctx = stream_context(client_request(Endpoint.CHAT, **body), fallbacks, settings)
    return Chooser(ctx, control=control, resumer=cast(Resumer, resumer)), ctx.background


def test_the_next_fallback_takes_the_resume_at_once_and_control_hears_after_two_writes() -> None:
    async def scenario() -> None:
        control, resumer = FakeControl(), FakeResumer()
        ch, background = chooser(control, resumer)
        where, opened = await ch.choose(A, Failure.TRUNCATED, [], [choice()])
        # The resume is open on the route's next fallback before control said anything.
        assert where == B and list(opened) == [0] and resumer.starts == [("b", 0, True)]
        assert control.calls == []
        ch.wrote()
        await asyncio.sleep(0)
        assert control.calls == []  # one write: the resumed stream may not flow yet
        ch.wrote()
        await control.until(lambda: bool(control.calls))
        call = control.calls[0]
        # Control hears which backend failed and how (it demotes it), and where it went.
        assert (call.failed, call.failure, call.preferred) == ("a", "truncated", ["b", "c"])
        await settle(background)  # its answer only keeps the books
        ch.wrote()
        assert len(control.calls) == 1  # told once

    run(scenario)


def test_the_failed_excluded_and_migrating_backends_are_passed_over() -> None:
    async def scenario() -> None:
        control, resumer = FakeControl(migrating=[C]), FakeResumer()
        ch, _ = chooser(control, resumer, fallbacks=(A, B, C, D))
        where, opened = await ch.choose(A, Failure.STALL, ["b"], [choice()])
        assert where == D and list(opened) == [0]
        assert [s[0] for s in resumer.starts] == ["d"]
        ch.speak()
        await control.until(lambda: bool(control.calls))
        assert control.calls[0].preferred == ["d"] and control.calls[0].exclude == ["b"]

    run(scenario)


@pytest.mark.parametrize("why", ["refused", "failed"])
def test_when_the_fallback_cannot_take_it_controls_answer_is_waited_for(why: str) -> None:
    async def scenario() -> None:
        control = FakeControl(answers=[D])
        resumer = FakeResumer(refuse={"b"}) if why == "refused" else FakeResumer(fail={"b"})
        ch, _ = chooser(control, resumer)
        where, opened = await ch.choose(A, Failure.DISCONNECT, [], [choice()])
        # Control's choice, asked and answered before the resume; it opens there later.
        assert where == D and opened == {}
        assert [(c.failed, c.preferred) for c in control.calls] == [("a", ["b", "c"])]
        assert [s[0] for s in resumer.starts] == ["b"]  # only the route's next fallback tried
        assert resumer.opened == []

    run(scenario)


@pytest.mark.parametrize("answer", [None, ControlUnavailable], ids=["none left", "control away"])
def test_no_fallback_left_and_nothing_from_control_means_nowhere(answer: object) -> None:
    async def scenario() -> None:
        control = FakeControl(answers=[answer])  # type: ignore[list-item]
        resumer = FakeResumer()
        ch, _ = chooser(control, resumer, fallbacks=(A, B))
        where, opened = await ch.choose(A, Failure.TRUNCATED, ["b"], [choice()])
        assert where is None and opened == {}
        assert resumer.starts == [] and len(control.calls) == 1

    run(scenario)


def test_every_pending_choice_opens_on_the_fallback_together() -> None:
    async def scenario() -> None:
        control, resumer = FakeControl(), FakeResumer()
        ch, _ = chooser(control, resumer, n=3)
        where, opened = await ch.choose(A, Failure.TRUNCATED, [], [choice(0), choice(2)])
        assert where == B and sorted(opened) == [0, 2]
        assert sorted(s[1] for s in resumer.starts) == [0, 2]
        assert not any(cast(Upstream, s.upstream).closed for s in opened.values())

    run(scenario)


def test_one_choice_refused_there_leaves_no_resume_open_and_asks_control() -> None:
    async def scenario() -> None:
        control = FakeControl(answers=[C])

        class HalfRefusing(FakeResumer):
            async def start(self, b: Backend, p: ChoiceProgress, *, exact: bool) -> Started:
                if p.index == 1:
                    self.starts.append((b.id, p.index, exact))
                    raise AttemptFailed(Failure.REJECTED, "context too short")
                return await super().start(b, p, exact=exact)

        resumer = HalfRefusing()
        ch, _ = chooser(control, resumer, n=2)
        where, opened = await ch.choose(A, Failure.TRUNCATED, [], [choice(0), choice(1)])
        assert where == C and opened == {}
        # The choice that did open on b is closed again: no generation left running there.
        assert [cast(Upstream, s.upstream).closed for s in resumer.opened] == [True]
        assert len(control.calls) == 1

    run(scenario)


def test_a_choice_with_every_token_sent_opens_nothing() -> None:
    async def scenario() -> None:
        control, resumer = FakeControl(), FakeResumer()
        ch, _ = chooser(control, resumer, max_tokens=2)
        where, opened = await ch.choose(A, Failure.TRUNCATED, [], [choice(sent=2)])
        # Nothing to generate: no engine is asked (the relay ends the choice itself).
        assert where == B and opened == {} and resumer.starts == []

    run(scenario)


def test_the_held_back_call_goes_on_its_own_when_no_write_comes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(choose, "CONTROL_AFTER_S", 0.0)

    async def scenario() -> None:
        control, resumer = FakeControl(), FakeResumer()
        ch, _ = chooser(control, resumer)
        await ch.choose(A, Failure.STALL, [], [choice()])
        await control.until(lambda: bool(control.calls))  # its timer sends it
        ch.wrote()
        ch.wrote()
        ch.speak()
        assert len(control.calls) == 1

    run(scenario)


def test_a_second_failure_sends_the_first_ones_call_before_its_own() -> None:
    async def scenario() -> None:
        control, resumer = FakeControl(), FakeResumer()
        ch, _ = chooser(control, resumer, fallbacks=(B, C))
        await ch.choose(A, Failure.TRUNCATED, [], [choice()])
        await ch.choose(B, Failure.STALL, ["a"], [choice()])
        await control.until(lambda: len(control.calls) == 1)
        assert control.calls[0].failed == "a"  # the first failure's, sent as the next began
        ch.speak()
        await control.until(lambda: len(control.calls) == 2)
        assert (control.calls[1].failed, control.calls[1].preferred) == ("b", ["c"])

    run(scenario)


@pytest.mark.parametrize(("mode", "exact"), [(SeamMode.PARALLEL, True), (SeamMode.INLINE, False)])
def test_the_seam_mode_decides_whether_resumes_open_at_the_exact_prefix(
    mode: SeamMode, exact: bool
) -> None:
    async def scenario() -> None:
        control, resumer = FakeControl(), FakeResumer()
        ch, _ = chooser(control, resumer, seam_mode=mode)
        await ch.choose(A, Failure.TRUNCATED, [], [choice()])
        assert resumer.starts == [("b", 0, exact)]
        ch.speak()

    run(scenario)

"""Streams for the real suite's byte and reasoning tests: a direct (uninterrupted) stream on
one engine, and several concurrent streams through Baton while the replica serving them is
SIGKILLed mid-stream. Text is kept per delta field (`content` / `text`, `reasoning`,
`reasoning_content`), so a stream that moves text from one field to another is caught."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import openai

from clients.client import AdminClient
from scripts.engines.replicas import Engine
from tests.integration.harness import Fleet, metric, wait_until
from tests.real.conftest import Pool, events, sdk

REPLACEMENT = "\ufffd"
KILL_AFTER = 5  # chunks the first stream of a round has before its replica is killed
# The delta fields a chat stream carries text in (vLLM 0.32 names reasoning `reasoning`).
CHAT_FIELDS = ("content", "reasoning", "reasoning_content")


@dataclass(frozen=True)
class Case:
    endpoint: str  # "chat" | "completions"
    prompt: str  # the user message, or the completion prompt
    # vLLM's stream_interval: tokens per chunk. Chunks of several ids tell Baton no
    # character boundary, so a seam far into such a stream is checked by ids alone.
    stream_interval: int | None = None

    def __str__(self) -> str:
        merged = f" ({self.stream_interval} per chunk)" if self.stream_interval else ""
        return f"{self.endpoint}:{self.prompt!r}{merged}"


@dataclass
class Streamed:
    case: Case
    request_id: str = ""
    texts: dict[str, str] = field(default_factory=dict)  # delta field -> its text
    ids: list[int] = field(default_factory=list)  # token ids (direct streams, or asked for)
    # Chat only: each chunk's token ids and its text per delta field.
    chunks: list[tuple[list[int], dict[str, str]]] = field(default_factory=list)
    stream_ids: set[str] = field(default_factory=set)
    finish: str | None = None
    completion_tokens: int | None = None
    error: str = ""  # what the SDK raised mid-stream
    chunks_seen: int = 0

    @property
    def text(self) -> str:
        return "".join(self.texts.values())


def _request(
    client: openai.OpenAI,
    model: str,
    case: Case,
    tokens: int,
    extra_body: dict[str, Any] | None = None,
) -> Any:
    body = dict(extra_body or {})
    if case.stream_interval:
        body["stream_interval"] = case.stream_interval
    kw: dict[str, Any] = dict(
        model=model,
        temperature=0,
        max_tokens=tokens,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=body or None,
    )
    if case.endpoint == "chat":
        return client.chat.completions.with_raw_response.create(
            messages=[{"role": "user", "content": case.prompt}], **kw
        )
    return client.completions.with_raw_response.create(prompt=case.prompt, **kw)


def _read(raw: Any, out: Streamed, on_chunk: Callable[[int], None] | None) -> Streamed:
    out.request_id = raw.headers.get("x-request-id", "")
    try:
        for n, chunk in enumerate(raw.parse()):
            out.stream_ids.add(chunk.id)
            if chunk.usage is not None:
                out.completion_tokens = chunk.usage.completion_tokens
            for ch in chunk.choices:
                extra = ch.model_extra or {}
                ids = extra.get("token_ids") or []
                out.ids += ids
                if out.case.endpoint == "chat":
                    delta = ch.delta
                    fields = {"content": delta.content, **(delta.model_extra or {})}
                    texts = {n: fields[n] for n in CHAT_FIELDS
                             if isinstance(fields.get(n), str) and fields[n]}  # fmt: skip
                    for name, text in texts.items():
                        out.texts[name] = out.texts.get(name, "") + text
                    out.chunks.append((ids, texts))
                elif ch.text:
                    out.texts["text"] = out.texts.get("text", "") + ch.text
                out.finish = ch.finish_reason or out.finish
            out.chunks_seen = n + 1
            if on_chunk is not None:
                on_chunk(n)
    except openai.APIError as err:
        out.error = f"{type(err).__name__}: {err}"
    return out


def with_ids(base_url: str, model: str, case: Case, tokens: int) -> Streamed:
    """A greedy stream at `base_url` (an engine's or a shim's /v1) asking for its token ids,
    read per delta field; an error it ended in is in `error`."""
    raw = _request(sdk(base_url), model, case, tokens, {"return_token_ids": True})
    return _read(raw, Streamed(case), None)


def direct(engine: Engine, case: Case, tokens: int) -> Streamed:
    """An uninterrupted greedy stream straight on one engine, no Baton, with its token ids."""
    out = with_ids(engine.url + "/v1", engine.model, case, tokens)
    assert not out.error, out.error
    return out


def directs(jobs: Sequence[tuple[Engine, Case]], tokens: int) -> list[Streamed]:
    """direct() for each (engine, case), all at once: an engine batches them (one after
    another, a test's references cost it as many whole generations). Greedy ids do not depend
    on the batch; the kill rounds, which stream their cases together, rely on that too."""
    with ThreadPoolExecutor(min(len(jobs), 32) or 1) as ex:
        return list(ex.map(lambda job: direct(job[0], job[1], tokens), jobs))


def decode(ids: Sequence[int]) -> str:
    """The tiny models' text for generated byte ids (id == byte value; what vLLM streams)."""
    return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def released(ids: Sequence[int]) -> str:
    """The text vLLM streams for generated ids: it holds back text while the ids so far
    decode to a trailing U+FFFD (an incomplete character, or invalid bytes that more bytes
    might still extend), and drops what it still holds when the generation ends."""
    for m in range(len(ids), -1, -1):
        text = decode(ids[:m])
        if not text.endswith(REPLACEMENT):
            return text
    return ""


def mid_character(ref: Streamed, n: int) -> bool:
    """Whether a resume after the reference's first n tokens is primed mid-character (the
    engine holds text back there: the ids so far decode to a trailing U+FFFD)."""
    return decode(ref.ids[:n]).endswith(REPLACEMENT)


def serving(admin: AdminClient, request_id: str) -> str:
    """The replica control routed the request to; "" when the shim routed it alone (control
    did not answer within its route timeout, which on 2 busy cores happens)."""
    rows = admin.events(kind="route", request_id=request_id)
    return str(rows[0]["backend_id"]) if rows else ""


def generating(engine: Engine) -> bool:
    """Whether vLLM's API server still has a request to stream. Its running-requests gauge is
    set from the scheduler stats the engine core sends with its output, so it lags the core
    by what the API server has yet to read: a kill of the whole replica while it says so
    cuts the stream, but a kill of the core alone may interrupt nothing (see Stepped)."""
    return metric(engine.url, "vllm:num_requests_running") > 0


STEP = 0.02  # seconds a stepped replica's engine cores run between freezes
# Tries at most of a stepped kill: a try whose kill did not land (the core had finished once
# frozen) is judged whole and tried again. Full runs here each saw one test miss three tries in
# a row, a different test each time, so three was too few.
KILL_TRIES = 6


class Stepped:
    """A vLLM replica whose engine cores run only in short steps, frozen (SIGSTOP) between
    them until its API server has read all they sent, so that a client's progress through a
    stream tells where the core stands. Free-running, a tiny model's core on busy cores ends
    a long generation before the client has its first few chunks: its output is all queued
    in the API server, and a kill of the core then interrupts nothing.

    Use: `with Stepped(engine) as stepped:` around the stream, and `stepped.halt()` at the
    chunk where the kill is to land: True when the core (frozen) still holds an unfinished
    request, so that a kill lands mid-generation. On exit the cores run freely again."""

    def __init__(self, engine: Engine, step: float = STEP) -> None:
        self.engine, self._step = engine, step
        self.cores = engine.pids_named("EngineCore")
        assert self.cores, f"{engine.name}: no engine core process"
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Stepped:
        self._signal(signal.SIGSTOP)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._halt.set()
        self._thread.join()
        self._signal(signal.SIGCONT)  # a killed core ignores it

    def halt(self) -> bool:
        """Stop stepping, leave the cores frozen, and say whether a request is unfinished."""
        self._halt.set()
        self._thread.join()
        self._drain()
        return generating(self.engine)

    def _run(self) -> None:
        while not self._halt.is_set():
            self._signal(signal.SIGCONT)
            time.sleep(self._step)
            self._signal(signal.SIGSTOP)
            self._drain()

    def _drain(self) -> None:
        """Until the generated-tokens counter holds still: frozen cores send nothing new."""
        seen = metric(self.engine.url, "vllm:generation_tokens_total")
        for _ in range(100):
            time.sleep(QUIET)
            now = metric(self.engine.url, "vllm:generation_tokens_total")
            if now == seen:
                return
            seen = now

    def _signal(self, sig: int) -> None:
        for pid in self.cores:
            self.engine.signal_pid(pid, sig)


@contextmanager
def stepped_kill(
    engines: Sequence[Engine], step: float = STEP
) -> Iterator[Callable[[str], bool]]:
    """A kill of the replica serving a stream that lands mid-generation: every replica's
    cores run in steps (Stepped) for the stream, and the one named is killed whole (its
    process group) only while its frozen core holds the request unfinished (False: it had
    finished; the caller judges that stream and tries again). On exit the others run freely.
    `step`: seconds the cores run between freezes; a short stream needs short steps, or its
    core ends it within the step that brings the client to the kill."""
    with ExitStack() as stack:
        steps = {e.name: stack.enter_context(Stepped(e, step)) for e in engines}

        def kill(name: str) -> bool:
            stepped = steps.get(name)
            if stepped is None or not stepped.halt():
                return False
            stepped.engine.kill(signal.SIGKILL)
            return True

        yield kill


def failed_over(fleet: Fleet, request_id: str, timeout: float = 15.0) -> bool:
    return wait_until(lambda: bool(events(fleet, "failover", request_id)), timeout, 0.5)


def failover_event(fleet: Fleet, request_id: str) -> dict[str, Any]:
    """The request's one failover event, once its seam verdict has landed (a parallel seam
    check reports after the stream ends). Generous: vLLM replicas, control and the shim
    share 2 cores in CI."""
    found: list[dict[str, Any]] = []

    def landed() -> bool:
        found[:] = events(fleet, "failover", request_id)
        return bool(found) and all(r.get("seam") for r in found)

    if not wait_until(landed, timeout=60, interval=0.2):
        context = events(fleet, "route", request_id) + events(fleet, "retry", request_id)
        raise AssertionError(f"failover events: {found}; route/retry events: {context}")
    assert len(found) == 1, found
    return found[0]


@dataclass
class Round:
    streams: list[Streamed]
    victim: str = ""  # the replica killed ("" = the kill did not land: nothing was running)
    served: dict[str, str] = field(default_factory=dict)  # request id -> first replica


# When a round's kill may land, judged on the streams as the client has them so far: the
# streams (their ids grow as chunks arrive) and which of them the victim replica serves.
KillWhen = Callable[[Sequence[Streamed], Sequence[bool]], bool]


def after_chunks(n: int) -> KillWhen:
    """Kill once the first stream has n chunks (where it stands in tokens then depends on how
    the engine batches: a test that needs given token positions says so in its own KillWhen)."""
    return lambda streams, on_victim: streams[0].chunks_seen >= n


def kill_round(
    pool: Pool,
    fleet: Fleet,
    model: str,
    cases: Sequence[Case],
    tokens: int,
    *,
    kill_when: KillWhen | None = None,
    freeze: bool = False,
    extra_body: dict[str, Any] | None = None,
) -> Round:
    """All `cases` streamed at once through Baton. Once every stream has its first chunk, the
    replica serving the first is the victim, and its process group is SIGKILLed at the first
    chunk after which `kill_when` holds (never, if the streams end first). The kill waits on
    the streams' state, not on the clock: where they stand when it lands depends on how the
    engine batches and on the machine's speed. By default: KILL_AFTER chunks into the first.

    With `freeze`, `kill_when` is judged on a frozen engine (SIGSTOP, then until what it had
    sent has all reached the client), so that the kill lands exactly where the client's
    streams stand: the shim relays all an engine sends, and the client reads far behind a
    fast engine, so an unfrozen kill lands wherever the engine has run ahead to."""
    when = kill_when or after_chunks(KILL_AFTER)
    client = sdk(fleet.base_url)
    admin = AdminClient(fleet.control.ready, timeout=30.0)
    warm = _request(client, model, cases[0], 1)  # opens the shim's route stream to control
    _read(warm, Streamed(cases[0]), None)
    outs = [Streamed(c) for c in cases]
    changed = threading.Condition()
    firsts = [False] * len(cases)
    done = [False] * len(cases)
    result = Round([])

    def kill() -> None:
        with changed:
            if not changed.wait_for(lambda: all(firsts), 120):
                return
        # Every stream has been routed: one read of the route events says who serves which.
        routes = {str(e["request_id"]): str(e["backend_id"])
                  for e in admin.events(kind="route", limit=10_000)}  # fmt: skip
        name = routes.get(outs[0].request_id, "")
        if not name:
            return  # routed by the shim alone: which replica serves it is unknown
        on_victim = [routes.get(o.request_id) == name for o in outs]
        engine = pool.replicas.engines[name]
        if freeze:
            if _freeze_until(engine, changed, outs, on_victim, done, when):
                result.victim = name
            return
        with changed:
            ok = changed.wait_for(lambda: all(done) or when(outs, on_victim), 300)
            if not ok or all(done):
                return
            engine.kill(signal.SIGKILL)  # under the lock: no chunk callback runs in between
            result.victim = name

    def one(i: int) -> Streamed:
        def on_chunk(n: int) -> None:
            with changed:
                firsts[i] = True
                changed.notify_all()

        try:
            raw = _request(client, model, cases[i], tokens, extra_body)
            outs[i].request_id = raw.headers.get("x-request-id", "")
            return _read(raw, outs[i], on_chunk)
        finally:
            with changed:
                firsts[i] = done[i] = True  # a stream that failed must not hold the kill up
                changed.notify_all()

    try:
        with ThreadPoolExecutor(len(cases) + 1) as ex:
            killer = ex.submit(kill)
            result.streams = list(ex.map(one, range(len(cases))))
            killer.result()
        result.served = {s.request_id: serving(admin, s.request_id) for s in result.streams}
    finally:
        admin.close()
    return result


QUIET = 0.3  # seconds without a chunk on a frozen engine: what it sent has all been read
FREEZES = 60  # freeze-judge-thaw cycles at most in one round


def _freeze_until(
    engine: Engine,
    changed: threading.Condition,
    outs: Sequence[Streamed],
    on_victim: Sequence[bool],
    done: Sequence[bool],
    when: KillWhen,
) -> bool:
    """Freeze the engine, let the client read all it had sent, and judge: kill it if `when`
    holds, else thaw it until a stream it serves moves on, and again. Whether the client
    has read all is told by a quiet spell: a spell too short only means the kill lands a
    little further on, where the failover event (what the shim had sent) still tells."""

    def chunks() -> int:
        return sum(o.chunks_seen for o, v in zip(outs, on_victim, strict=True) if v)

    def moved_on(seen: int) -> Callable[[], bool]:
        return lambda: chunks() != seen or all(done)

    for _ in range(FREEZES):
        engine.kill(signal.SIGSTOP)
        with changed:
            for _ in range(100):  # bounded: a frozen engine sends nothing new
                if not changed.wait_for(moved_on(chunks()), QUIET):
                    break
            if all(done):
                engine.kill(signal.SIGCONT)
                return False
            if when(outs, on_victim):
                engine.kill(signal.SIGKILL)  # under the lock: no chunk callback runs between
                return True
            seen = chunks()
        engine.kill(signal.SIGCONT)
        with changed:
            if not changed.wait_for(moved_on(seen), 60):
                return False
    engine.kill(signal.SIGCONT)
    return False


def failovers(fleet: Fleet, r: Round) -> dict[str, dict[str, Any]]:
    """The failover event of each stream of the round the kill landed in, by request id,
    once control holds every failover the shim has counted: the shim counts one when its
    seam verdict is known (a parallel check lands after its stream ends) and reports it to
    control, buffered while control was unreachable (a busy machine makes the shim route
    alone for a while), so waiting on those two states misses none."""
    if not r.victim:
        return {}
    found: list[dict[str, Any]] = []

    def landed() -> bool:
        pending = _shim_metric(fleet, "baton_shim_seam_checks_pending")
        counted = _shim_metric(fleet, "baton_shim_failovers_total")
        found[:] = events(fleet, "failover")
        return pending == 0 and len(found) >= counted and all(e.get("seam") for e in found)

    assert wait_until(landed, timeout=90, interval=0.5), f"failover events: {found}"
    out: dict[str, dict[str, Any]] = {}
    for e in found:
        assert e["request_id"] not in out, f"two failovers of one stream: {found}"
        out[str(e["request_id"])] = e
    print(f"served: {r.served}; victim {r.victim}; failed over: {list(out)}")
    return out


def _shim_metric(fleet: Fleet, name: str) -> float:
    """A shim metric, 0 while it has no sample yet (a counter with labels has none before
    its first increment)."""
    try:
        return metric(fleet.shim.ready, name)
    except AssertionError:
        return 0.0

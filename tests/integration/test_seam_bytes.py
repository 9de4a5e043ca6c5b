"""Failover on what byte-level models really emit: characters cut across tokens, invalid
UTF-8, the engine holding back half a character, and the engine's prompt-window quirk on a
resume cut mid-character (vLLM then sends the whole prompt's text). Sims in byte-level mode
behave like that; a cut proxy fails one stream at each position in turn, and every client
stream must equal an uninterrupted one byte for byte, with no seam marked verified wrongly."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hyp_settings
from hypothesis import strategies as st

from bench.cutproxy import Arm, cut_proxies
from clients.client import AdminClient
from clients.procs import Part
from tests.factories import sdk
from tests.integration.harness import (
    MODEL,
    http,
    start_control,
    start_shim,
    start_sims,
    wait_until,
    write_config,
)

pytestmark = pytest.mark.timeout(300)

BYTES = ("--byte-level",)
TOKENS = 40
PROMPT = "once upon a time"
MESSAGES = [{"role": "user", "content": PROMPT}]
REPLACEMENT = "\ufffd"


@dataclass
class BytesFleet:
    ref: Part
    arm: Arm
    shims: dict[str, Part]  # seam mode -> shim
    admin: AdminClient
    special: bool = False  # reasoning fleets: the think tags are special tokens

    def client(self, mode: str) -> openai.OpenAI:
        return sdk(self.shims[mode].ready + "/v1")

    def ref_think_end(self) -> int:
        """The </think> token's id, as the reference engine's tokenizer has it."""
        body = json.dumps({"prompt": "</think>", "add_special_tokens": False}).encode()
        status, data = http("POST", self.ref.ready + "/tokenize", body)
        assert status == 200, data
        (end,) = json.loads(data)["tokens"]
        return int(end)

    def settled(self, failovers: int) -> None:
        """Wait until control has heard of `failovers` failovers and re-admitted every
        backend: the next request starts on a healthy fleet."""

        def ready() -> bool:
            seen = len(self.admin.events(kind="failover", limit=10_000))
            healthy = all(b.state == "healthy" for b in self.admin.list_backends())
            return seen >= failovers and healthy

        assert wait_until(ready, 30), "fleet did not settle after a failover"


@contextmanager
def seam_fleet(
    tmp: Path, sim_flags: Sequence[str], backend_extra: str = ""
) -> Iterator[BytesFleet]:
    """A reference sim, two sims behind cut proxies, control, and a shim per seam mode."""
    parts: list[Part] = []
    arm = Arm()
    try:
        ref, *sims = start_sims([sim_flags] * 3)
        parts += [ref, *sims]
        with cut_proxies([s.ready for s in sims], arm) as urls:
            config = write_config(
                tmp / "control.toml",
                [(f"s{i}", u) for i, u in enumerate(urls)],
                probe_interval=0.1,
                extra='routing = "roundrobin"\n[health]\nreadmit_after = 1\n',
                backend_extra=backend_extra,
            )
            control = start_control(config)
            parts.append(control)
            shims = {}
            for mode in ("parallel", "inline"):
                shims[mode] = start_shim(control.ready, "--seam-mode", mode)
                parts.append(shims[mode])
            with AdminClient(control.ready, timeout=10.0) as admin:
                yield BytesFleet(ref, arm, shims, admin)
    finally:
        for p in reversed(parts):
            p.stop(grace=3)


@pytest.fixture(scope="module")
def bf(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BytesFleet]:
    with seam_fleet(tmp_path_factory.mktemp("bytes"), BYTES) as f:
        yield f


def stream(c: openai.OpenAI, endpoint: str, **kw: Any) -> tuple[str, list[Any]]:
    if endpoint == "chat":
        chunks = list(c.chat.completions.create(
            model=MODEL, messages=MESSAGES, temperature=0, stream=True, **kw
        ))  # fmt: skip
        return "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices), chunks
    chunks = list(
        c.completions.create(model=MODEL, prompt=PROMPT, temperature=0, stream=True, **kw)
    )
    return "".join(ch.choices[0].text for ch in chunks if ch.choices), chunks


def _text(chunk: Any, chat: bool) -> str:
    if not chunk.choices:
        return ""
    c = chunk.choices[0]
    return (c.delta.content if chat else c.text) or ""


def held_positions(chunks: list[Any], chat: bool) -> list[int]:
    """Token counts k after which the engine had held text back (the k-th token's chunk
    carried ids but no text): a cut there ends the resume's prompt mid-character."""
    out, k = [], 0
    for ch in chunks:
        if not ch.choices:
            continue
        c = ch.choices[0]
        ids = (c.model_extra or {}).get("token_ids") or []
        if not ids:
            continue
        k += len(ids)
        text = (c.delta.content if chat else c.text) or ""
        if not text:
            out.append(k)
    return out


@pytest.mark.parametrize("mode", ["parallel", "inline"])
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_a_cut_at_every_position_of_multibyte_text_is_byte_identical(
    bf: BytesFleet, endpoint: str, mode: str
) -> None:
    want, ref_chunks = stream(
        sdk(bf.ref.ready + "/v1"), endpoint, max_tokens=TOKENS,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    # The stream is what byte-level models emit: non-ASCII, invalid bytes, held-back text.
    assert any(ord(ch) > 127 and ch != REPLACEMENT for ch in want), want
    assert REPLACEMENT in want, want
    held = held_positions(ref_chunks, endpoint == "chat")
    assert len([k for k in held if k < TOKENS]) >= 2, held
    before = len(bf.admin.events(kind="failover", limit=10_000))
    c = bf.client(mode)
    for k in range(1, TOKENS):
        bf.settled(before + k - 1)
        bf.arm.set(k)
        text, chunks = stream(
            c, endpoint, max_tokens=TOKENS, stream_options={"include_usage": True}
        )
        assert bf.arm.fired.is_set()
        assert text == want, f"cut after {k} tokens (held at {held})"
        assert PROMPT not in text
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == TOKENS
    bf.settled(before + TOKENS - 1)
    events = bf.admin.events(kind="failover", limit=10_000)[before:]
    assert len(events) == TOKENS - 1
    assert {e["path"] for e in events} == {"token"} and {e["outcome"] for e in events} == {
        "resumed"
    }
    # Identical replicas, greedy: no seam is divergent, and most are verified.
    seams = [e["seam"] for e in events]
    assert "divergent" not in seams, seams
    assert seams.count("verified") >= TOKENS - 1 - 6, seams


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_an_engine_whose_first_text_is_not_its_ids_text_makes_the_seam_divergent(
    bf: BytesFleet, endpoint: str
) -> None:
    """A resume cut at a character boundary passes the engine's own text on (deriving it
    would cost the gap a round trip); the side check then compares it with the ids' text.
    An engine that sends other text there is caught: the seam is divergent, never verified."""
    want, ref_chunks = stream(
        sdk(bf.ref.ready + "/v1"), endpoint, max_tokens=TOKENS,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    held = held_positions(ref_chunks, endpoint == "chat")
    k = next(k for k in range(8, TOKENS) if k not in held)  # a character boundary
    before = len(bf.admin.events(kind="failover", limit=10_000))
    bf.settled(before)
    bf.arm.set(k)
    bf.arm.garble_next_resume()
    text, _ = stream(bf.client("parallel"), endpoint, max_tokens=TOKENS)
    assert text != want and "X" in text  # the garbled text reached the client...
    bf.settled(before + 1)
    (event,) = bf.admin.events(kind="failover", limit=10_000)[before:]
    assert event["seam"] == "divergent", event  # ...and the seam says so


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_a_multibyte_stop_string_is_found_across_the_seam(bf: BytesFleet, endpoint: str) -> None:
    """The stop string straddles characters cut across tokens; the engine held text back
    for it before the cut, and Baton matches it over the derived text after."""
    full, _ = stream(sdk(bf.ref.ready + "/v1"), endpoint, max_tokens=TOKENS)
    at = next(i for i in range(20, len(full) - 2) if ord(full[i]) > 127 and full[i] != REPLACEMENT)
    stop = full[at - 1 : at + 1]
    want, ref_chunks = stream(
        sdk(bf.ref.ready + "/v1"), endpoint, max_tokens=TOKENS, stop=[stop],
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    assert want == full[: full.index(stop)] and ref_chunks[-1].choices[0].finish_reason == "stop"
    generated = sum(
        len((ch.choices[0].model_extra or {}).get("token_ids") or [])
        for ch in ref_chunks if ch.choices
    )  # fmt: skip
    before = len(bf.admin.events(kind="failover", limit=10_000))
    for k in range(1, generated):
        bf.settled(before + k - 1)
        bf.arm.set(k)
        text, chunks = stream(bf.client("parallel"), endpoint, max_tokens=TOKENS, stop=[stop])
        assert bf.arm.fired.is_set()
        assert text == want, f"cut after {k} of {generated} tokens"
        finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
        assert finishes[-1] == "stop" and finishes.count("stop") == 1
    bf.settled(before + generated - 1)


MERGED = 3  # tokens per chunk: vLLM's stream_interval, or what it sends when loaded
LONG = 100  # tokens: the cuts below land far past the last character boundary known


@pytest.mark.parametrize("mode", ["parallel", "inline"])
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_a_cut_far_into_merged_chunks_is_verified_by_its_ids(
    bf: BytesFleet, endpoint: str, mode: str
) -> None:
    """Chunks of several ids tell no character boundary (their last tokens may be half a
    character the engine held back), so 64 tokens into such a stream Baton knows none near
    the cut. The seam is still checked, by the overlap's ids, and its text derived from ids:
    byte-identical and verified, never merely unchecked."""
    extra = {"return_token_ids": True, "stream_interval": MERGED}
    want, ref_chunks = stream(
        sdk(bf.ref.ready + "/v1"), endpoint, max_tokens=LONG, extra_body=extra
    )
    sizes = [len((ch.choices[0].model_extra or {}).get("token_ids") or [])
             for ch in ref_chunks if ch.choices]  # fmt: skip
    assert sum(sizes) == LONG and sizes.count(MERGED) >= (LONG - 2) // MERGED, sizes
    held = held_positions(ref_chunks, endpoint == "chat")
    # Multi-byte characters out where the cuts land: a cut there may split one.
    late = "".join(_text(ch, endpoint == "chat") for ch in ref_chunks[len(ref_chunks) * 2 // 3 :])
    assert any(ord(ch) > 127 and ch != REPLACEMENT for ch in late), late
    before = len(bf.admin.events(kind="failover", limit=10_000))
    cuts = range(70, 76)  # every offset within a chunk, twice
    for n, k in enumerate(cuts):
        bf.settled(before + n)
        bf.arm.set(k)
        text, _ = stream(bf.client(mode), endpoint, max_tokens=LONG, extra_body=extra)
        assert bf.arm.fired.is_set()
        assert text == want, f"cut after {k} tokens (held at {held})"
    bf.settled(before + len(cuts))
    events = bf.admin.events(kind="failover", limit=10_000)[before:]
    assert [(e["path"], e["outcome"], e["seam"]) for e in events] == [
        ("token", "resumed", "verified")
    ] * len(cuts), events


def test_tools_in_the_request_get_an_explicit_error_not_relabelled_content(
    bf: BytesFleet,
) -> None:
    """A resume runs no tool parser: a tool call after the seam would come as content."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    before = len(bf.admin.events(kind="failover", limit=10_000))
    bf.arm.set(5)
    stream_ = bf.client("parallel").chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, stream=True, max_tokens=TOKENS,
        tools=tools,  # type: ignore[arg-type]
    )  # fmt: skip
    with pytest.raises(openai.APIError) as err:
        list(stream_)
    assert "tool" in str(err.value)
    bf.settled(before + 1)
    (event,) = bf.admin.events(kind="failover", limit=10_000)[before:]
    assert event["outcome"] == "refused" and "tool" in event["detail"]


THINK = (*BYTES, "--reasoning", "--think-tokens", "12")
MERGED = 3  # tokens per chunk (the request's stream_interval) in the merged cases


@pytest.fixture(scope="module", params=["plain", "special"])
def rf(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[BytesFleet]:
    """Think tags as ordinary added tokens (DeepSeek-R1, Qwen3: streams show their text) or
    as special tokens (streams skip their text; the parser goes by their ids)."""
    flags = THINK if request.param == "plain" else (*THINK, "--think-special")
    tmp = tmp_path_factory.mktemp(f"reasoning-{request.param}")
    with seam_fleet(tmp, flags, 'reasoning_parser = "deepseek_r1"') as f:
        f.special = request.param == "special"
        yield f


def parsed(
    c: openai.OpenAI, messages: Sequence[Any] = MESSAGES, **kw: Any
) -> tuple[str, str, list[Any]]:
    """(reasoning text, content text, chunks) of a greedy chat stream."""
    chunks = list(c.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, stream=True, max_tokens=TOKENS, **kw
    ))  # fmt: skip
    thought = content = ""
    for ch in chunks:
        if not ch.choices:
            continue
        delta = ch.choices[0].delta
        assert "reasoning_content" not in (delta.model_extra or {})  # vLLM 0.32's name only
        thought += (delta.model_extra or {}).get("reasoning") or ""
        content += delta.content or ""
    return thought, content, chunks


def token_ids(chunks: Sequence[Any]) -> list[int]:
    return [t for ch in chunks if ch.choices
            for t in (ch.choices[0].model_extra or {}).get("token_ids") or []]  # fmt: skip


@pytest.mark.parametrize("per_chunk", [1, MERGED])
@pytest.mark.parametrize("mode", ["parallel", "inline"])
def test_reasoning_and_content_survive_a_cut_at_every_position(
    rf: BytesFleet, mode: str, per_chunk: int
) -> None:
    """Cut after every token, the end tag's own position and those either side of it
    included: the client's reasoning and content are those of an uninterrupted stream of one
    token a chunk (the split by ids), the switch at the end tag's id whatever the tag's kind.

    In merged chunks a special tag shows no text, and vLLM's parser (the sim does as vLLM)
    cuts such a chunk at text.find(tag) == -1: the answer's start labelled reasoning, the
    reasoning's tail repeated as content. Baton splits that chunk by its ids instead, so
    the engine's own merged stream is not the reference: the split by ids is, always."""
    interval = {"stream_interval": per_chunk} if per_chunk > 1 else {}
    ref = sdk(rf.ref.ready + "/v1")
    by_ids = parsed(ref, extra_body={"return_token_ids": True})
    as_sent = parsed(ref, extra_body={"return_token_ids": True, **interval})
    assert by_ids[0] and by_ids[1]  # the model reasons, then answers
    ids = token_ids(by_ids[2])
    assert token_ids(as_sent[2]) == ids
    end = rf.ref_think_end()
    think_at = ids.index(end)  # the end tag's place among the generated tokens
    assert 0 < think_at < len(ids) - 4
    if rf.special and per_chunk > 1 and think_at % per_chunk not in (0, per_chunk - 1):
        assert as_sent[:2] != by_ids[:2]  # the engine mis-splits: what Baton must not relay
    # Uninterrupted through Baton: the split by ids too.
    assert parsed(rf.client(mode), extra_body=interval or None)[:2] == by_ids[:2]
    before = len(rf.admin.events(kind="failover", limit=10_000))
    landed = set()
    for k in range(1, len(ids)):
        rf.settled(before + k - 1)
        rf.arm.set(k)
        thought, content, _ = parsed(rf.client(mode), extra_body=interval or None)
        assert rf.arm.fired.is_set()
        rf.settled(before + k)
        event = rf.admin.events(kind="failover", limit=10_000)[before + k - 1]
        sent = int(event["tokens_sent"])
        assert (thought, content) == by_ids[:2], f"cut after {k} tokens ({sent} sent): {event}"
        landed.add("before" if sent < think_at else "on" if sent == think_at + 1 else
                   "after" if sent > think_at else "just before")  # fmt: skip
    seams = [e["seam"] for e in rf.admin.events(kind="failover", limit=10_000)[before:]]
    assert "divergent" not in seams, seams
    # One token a chunk, the cuts land on each side of the tag and on it; merged chunks
    # land where a chunk ends.
    assert landed >= ({"before", "just before", "on", "after"} if per_chunk == 1 else
                      {"before", "after"}), landed  # fmt: skip


PROMPTS = ("once upon a time", "the cache", "a tale of two", "hi", "where the road ends")


@hyp_settings(max_examples=40, derandomize=True, database=None, deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(prompt=st.sampled_from(PROMPTS), per_chunk=st.integers(1, 6),
       mode=st.sampled_from(["parallel", "inline"]), at=st.floats(0.0, 1.0))  # fmt: skip
def test_no_seam_is_verified_where_the_clients_fields_are_not_an_uninterrupted_streams(
    rf: BytesFleet, prompt: str, per_chunk: int, mode: str, at: float
) -> None:
    """Random prompts (the end tag lands elsewhere), chunkings and cut positions: whatever
    the verdict, the client's reasoning and content are the split by ids; so no seam is
    ever verified over other text (and the fields were never anything else here, so every
    seam that could be checked is verified)."""
    messages = [{"role": "user", "content": prompt}]
    interval = {"stream_interval": per_chunk} if per_chunk > 1 else {}
    want = parsed(sdk(rf.ref.ready + "/v1"), messages=messages,
                  extra_body={"return_token_ids": True})  # fmt: skip
    ids = token_ids(want[2])
    k = 1 + int(at * (len(ids) - 2))
    before = len(rf.admin.events(kind="failover", limit=10_000))
    rf.settled(before)
    rf.arm.set(k)
    thought, content, _ = parsed(rf.client(mode), messages=messages, extra_body=interval or None)
    assert rf.arm.fired.is_set()
    rf.settled(before + 1)
    event = rf.admin.events(kind="failover", limit=10_000)[before]
    assert event["outcome"] == "resumed", event
    assert (thought, content) == want[:2], f"cut after {k} tokens: {event}"
    assert event["seam"] in ("verified", "unchecked"), event

"""The simulated engine as a real process on 127.0.0.1:0, driven like a router would."""

from __future__ import annotations

import asyncio
import re
import select
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import openai
import orjson
import pytest

from sim.model import ModelConfig, ToyModel
from sim.tokenizer import EOS, build_tokenizer

READY = re.compile(r"^SIM READY (http://127\.0\.0\.1:\d+)$")
MSGS = [{"role": "user", "content": "What does a router do?"}]
TIMEOUT = aiohttp.ClientTimeout(total=10)


class SimProcess:
    def __init__(self, *args: str, ready_within: float = 10.0, instant: bool = True) -> None:
        """`instant`: every cost 0 (--instant overrides the pacing flags in `args`)."""
        self.started = time.monotonic()
        fast = ("--instant",) if instant else ()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sim", "--listen", "127.0.0.1:0", *fast, *args],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], ready_within)
        line = self.proc.stdout.readline().strip() if ready else ""
        match = READY.match(line)
        if not match:
            self.close()
            raise RuntimeError(f"sim did not get ready: {line!r}")
        self.ready_after = time.monotonic() - self.started
        self.url = match.group(1)

    def close(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode


@pytest.fixture(scope="module")
def sim() -> Iterator[SimProcess]:
    p = SimProcess()
    yield p
    assert p.close() == 0  # SIGTERM is a clean exit


@pytest.fixture(scope="module")
def replica_b() -> Iterator[SimProcess]:
    p = SimProcess("--chip-seed", "99")  # tie rate 0: chips cannot matter
    yield p
    p.close()


# -- tiny HTTP helpers (sync wrappers around aiohttp) ------------------------------
@dataclass
class Stream:
    status: int
    events: list[Any] = field(default_factory=list)  # parsed JSON objects, then "[DONE]"
    broken: Exception | None = None  # how the transport ended early, if it did

    @property
    def chunks(self) -> list[dict[str, Any]]:
        return [e for e in self.events if isinstance(e, dict) and "choices" in e]

    @property
    def done(self) -> bool:
        return bool(self.events) and self.events[-1] == "[DONE]"


def post(url: str, body: Any, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    async def go() -> tuple[int, Any]:
        data = body if isinstance(body, bytes) else orjson.dumps(body)
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
            async with s.post(url, data=data, headers=headers) as r:
                raw = await r.read()
                return r.status, orjson.loads(raw) if raw else None

    return asyncio.run(go())


def get(url: str) -> tuple[int, bytes]:
    async def go() -> tuple[int, bytes]:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
            async with s.get(url) as r:
                return r.status, await r.read()

    return asyncio.run(go())


def stream(
    url: str,
    body: dict[str, Any],
    headers: dict[str, str] | None = None,
    *,
    read_timeout: float = 10.0,
    stop_after_chunks: int | None = None,
) -> Stream:
    async def go() -> Stream:
        timeout = aiohttp.ClientTimeout(total=20, sock_read=read_timeout)
        async with aiohttp.ClientSession(timeout=timeout) as s:
            async with s.post(url, json={**body, "stream": True}, headers=headers) as r:
                out = Stream(r.status)
                buf = b""
                try:
                    async for piece in r.content.iter_any():
                        buf += piece
                        while b"\n\n" in buf:
                            event, buf = buf.split(b"\n\n", 1)
                            data = event.removeprefix(b"data: ")
                            out.events.append("[DONE]" if data == b"[DONE]" else orjson.loads(data))
                            if stop_after_chunks and len(out.chunks) >= stop_after_chunks:
                                return out  # leaving the block closes the connection
                except (aiohttp.ClientError, TimeoutError) as e:
                    out.broken = e
                return out

    return asyncio.run(go())


def tokenize_chat(sim: SimProcess, messages: list[dict[str, Any]], **kw: Any) -> list[int]:
    status, body = post(f"{sim.url}/tokenize", {"model": "toy", "messages": messages, **kw})
    assert status == 200
    return body["tokens"]


def complete_ids(sim: SimProcess, prompt: list[int], max_tokens: int) -> tuple[list[int], str]:
    s = stream(
        f"{sim.url}/v1/completions",
        {"model": "toy", "prompt": prompt, "max_tokens": max_tokens, "return_token_ids": True},
    )
    assert s.done and s.chunks[0]["choices"][0]["prompt_token_ids"] == prompt
    ids = [t for c in s.chunks for t in c["choices"][0]["token_ids"]]
    return ids, "".join(c["choices"][0]["text"] for c in s.chunks)


def metric(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {labels} not in /metrics")


# -- basics ----------------------------------------------------------------------
def test_info_endpoints(sim: SimProcess) -> None:
    assert get(f"{sim.url}/health") == (200, b"")
    status, raw = get(f"{sim.url}/v1/models")
    card = orjson.loads(raw)["data"][0]
    assert status == 200 and card["id"] == "toy" and card["object"] == "model"
    assert card["owned_by"] == "sim"


def test_openai_sdk_chat_and_completions(sim: SimProcess) -> None:
    client = openai.OpenAI(base_url=f"{sim.url}/v1", api_key="x", max_retries=0, timeout=10)
    full = client.chat.completions.create(model="toy", messages=MSGS, max_tokens=12)  # type: ignore[arg-type]
    assert full.id.startswith("chatcmpl-") and full.object == "chat.completion"
    assert full.choices[0].finish_reason == "length"
    assert full.usage is not None and full.usage.completion_tokens == 12
    assert full.system_fingerprint == "sim-0"
    chunks = list(
        client.chat.completions.create(
            model="toy",
            messages=MSGS,
            max_tokens=12,
            stream=True,  # type: ignore[arg-type]
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.total_tokens == full.usage.total_tokens
    comp = client.completions.create(model="toy", prompt="Once upon", max_tokens=5)
    assert comp.id.startswith("cmpl-") and comp.object == "text_completion"
    assert comp.usage is not None and comp.usage.completion_tokens == 5


def test_chat_stream_shape_with_return_token_ids(sim: SimProcess) -> None:
    s = stream(
        f"{sim.url}/v1/chat/completions",
        {
            "model": "toy",
            "messages": MSGS,
            "max_tokens": 6,
            "return_token_ids": True,
            "stream_options": {"include_usage": True},
        },
        headers={"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
    )
    assert s.status == 200 and s.done and s.broken is None
    role, *tokens, usage = s.chunks
    assert role["object"] == "chat.completion.chunk"
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert role["prompt_token_ids"] == tokenize_chat(sim, MSGS)  # top level, like vLLM
    assert len(tokens) == 6 and all(len(c["choices"][0]["token_ids"]) == 1 for c in tokens)
    assert [c["choices"][0]["finish_reason"] for c in tokens] == [None] * 5 + ["length"]
    assert [("system_fingerprint" in c) for c in s.chunks] == [False] * 7 + [True]
    ids = [c["choices"][0]["token_ids"][0] for c in tokens]
    status, detok = post(f"{sim.url}/detokenize", {"model": "toy", "tokens": ids})
    assert detok["prompt"] == "".join(c["choices"][0]["delta"]["content"] for c in tokens)
    assert usage["choices"] == [] and usage["usage"] == {
        "prompt_tokens": len(role["prompt_token_ids"]),
        "completion_tokens": 6,
        "total_tokens": len(role["prompt_token_ids"]) + 6,
    }


def test_stream_interval_merges_tokens_into_chunks_as_vllm_does(sim: SimProcess) -> None:
    """vLLM's stream_interval: the first token alone, then chunks of N, the last at once;
    the same tokens and text as one token per chunk."""
    body = {"model": "toy", "prompt": [1, 2, 3], "max_tokens": 12, "return_token_ids": True}
    one = stream(f"{sim.url}/v1/completions", body)
    merged = stream(f"{sim.url}/v1/completions", {**body, "stream_interval": 5})
    sizes = [len(c["choices"][0]["token_ids"]) for c in merged.chunks]
    assert merged.done and sizes == [1, 5, 5, 1]
    assert merged.chunks[0]["choices"][0]["prompt_token_ids"] == [1, 2, 3]
    assert [c["choices"][0]["finish_reason"] for c in merged.chunks] == [None] * 3 + ["length"]

    def joined(s: Stream) -> tuple[list[int], str]:
        ch = [c["choices"][0] for c in s.chunks]
        return [t for c in ch for t in c["token_ids"]], "".join(c["text"] for c in ch)

    assert joined(merged) == joined(one)
    status, err = post(f"{sim.url}/v1/completions", {**body, "stream_interval": 0})
    assert status == 400 and err["error"]["param"] == "stream_interval"
    # The server's --stream-interval is the least a request gets (a request raises it).
    wide = SimProcess("--stream-interval", "4")
    try:
        raised = stream(f"{wide.url}/v1/completions", {**body, "stream_interval": 2})
        assert [len(c["choices"][0]["token_ids"]) for c in raised.chunks] == [1, 4, 4, 3]
    finally:
        wide.close()


def test_non_streaming_return_token_ids_placement(sim: SimProcess) -> None:
    _, chat = post(
        f"{sim.url}/v1/chat/completions",
        {"messages": MSGS, "max_tokens": 4, "return_token_ids": True},
    )
    assert chat["prompt_token_ids"] == tokenize_chat(sim, MSGS)
    assert len(chat["choices"][0]["token_ids"]) == 4
    _, comp = post(
        f"{sim.url}/v1/completions",
        {"prompt": [1, 2, 3], "max_tokens": 4, "return_token_ids": True},
    )
    assert comp["choices"][0]["prompt_token_ids"] == [1, 2, 3]
    assert len(comp["choices"][0]["token_ids"]) == 4


def test_a_batch_of_prompts_gets_one_choice_each_in_prompt_order_as_vllm_answers(
    sim: SimProcess,
) -> None:
    """vLLM's completions take a list of prompts (speculative verification sends its k + 1
    prefixes so): one choice per prompt, by index in prompt order, usage summed."""
    prompt = tokenize_chat(sim, MSGS)
    gen, _ = complete_ids(sim, prompt, 6)
    prefixes = [prompt + gen[:i] for i in range(5)]
    status, batch = post(f"{sim.url}/v1/completions", {
        "prompt": prefixes, "max_tokens": 1, "temperature": 0, "return_token_ids": True})
    assert status == 200, batch
    assert [c["index"] for c in batch["choices"]] == [0, 1, 2, 3, 4]
    # Each the next token after its own prefix: the greedy continuation, one at a time.
    assert [c["token_ids"] for c in batch["choices"]] == [[t] for t in gen[:5]]
    assert [c["prompt_token_ids"] for c in batch["choices"]] == prefixes
    assert batch["usage"]["prompt_tokens"] == sum(len(p) for p in prefixes)
    assert batch["usage"]["completion_tokens"] == 5
    status, refused = post(f"{sim.url}/v1/completions", {
        "prompt": prefixes, "max_tokens": 1, "stream": True})
    assert status == 400 and "batch" in refused["error"]["message"]


# -- determinism and resume ----------------------------------------------------------
def test_token_exact_resume_on_another_replica(sim: SimProcess, replica_b: SimProcess) -> None:
    prompt = tokenize_chat(sim, MSGS)
    gen, text = complete_ids(sim, prompt, 80)
    assert complete_ids(replica_b, prompt, 80) == (gen, text)  # tie rate 0: identical
    for k in (1, 13, 40, 79):
        rest, rest_text = complete_ids(replica_b, prompt + gen[:k], 80 - k)
        assert rest == gen[k:]
        _, head = post(f"{sim.url}/detokenize", {"tokens": gen[:k]})
        assert head["prompt"] + rest_text == text


def test_text_resume_retokenizes_differently(sim: SimProcess) -> None:
    prompt = tokenize_chat(sim, MSGS)
    gen, text = complete_ids(sim, prompt, 60)
    partial = [*MSGS, {"role": "assistant", "content": text}]
    ids = tokenize_chat(sim, partial, add_generation_prompt=False, continue_final_message=True)
    assert ids[: len(prompt)] == prompt  # same template prefix ...
    assert ids[len(prompt) :] != gen  # ... but the text re-encodes to other tokens


def test_chips_differ_only_at_near_ties() -> None:
    a, b = SimProcess("--chip-seed", "1", "--tie-rate", "0.05"), None
    try:
        b = SimProcess("--chip-seed", "2", "--tie-rate", "0.05")
        prompt = tokenize_chat(a, MSGS)
        gen_a, _ = complete_ids(a, prompt, 300)
        gen_b, _ = complete_ids(b, prompt, 300)
    finally:
        a.close()
        if b is not None:
            b.close()
    assert gen_a != gen_b
    first = next(i for i, (x, y) in enumerate(zip(gen_a, gen_b, strict=True)) if x != y)
    model = ToyModel(ModelConfig(seed=0, tie_rate=0.05), build_tokenizer())
    assert model.near_tie(model.start(prompt + gen_a[:first]))


# -- request features ---------------------------------------------------------------
def test_continue_final_message(sim: SimProcess) -> None:
    partial = [*MSGS, {"role": "assistant", "content": "It routes"}]
    s = stream(
        f"{sim.url}/v1/chat/completions",
        {
            "messages": partial,
            "add_generation_prompt": False,
            "continue_final_message": True,
            "max_tokens": 3,
            "return_token_ids": True,
        },
    )
    assert s.done and s.chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    # The rendering of the messages with a generation prompt, then the re-encoded partial.
    expected = tokenize_chat(sim, MSGS) + build_tokenizer().encode("It routes")
    assert s.chunks[0]["prompt_token_ids"] == expected
    status, err = post(
        f"{sim.url}/v1/chat/completions", {"messages": partial, "continue_final_message": True}
    )
    assert status == 400 and "Cannot set both" in err["error"]["message"]


def test_stop_strings(sim: SimProcess) -> None:
    _, full = post(f"{sim.url}/v1/completions", {"prompt": "abc", "max_tokens": 100})
    text = full["choices"][0]["text"]
    stop = text[30:33]
    _, cut = post(f"{sim.url}/v1/completions", {"prompt": "abc", "max_tokens": 100, "stop": [stop]})
    choice = cut["choices"][0]
    assert choice["text"] == text[: text.find(stop)]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
    s = stream(f"{sim.url}/v1/completions", {"prompt": "abc", "max_tokens": 100, "stop": stop})
    assert "".join(c["choices"][0]["text"] for c in s.chunks) == choice["text"]
    assert s.chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_n_choices(sim: SimProcess) -> None:
    _, greedy = post(f"{sim.url}/v1/chat/completions", {"messages": MSGS, "n": 2, "max_tokens": 8})
    texts = [c["message"]["content"] for c in greedy["choices"]]
    assert [c["index"] for c in greedy["choices"]] == [0, 1] and texts[0] == texts[1]
    assert greedy["usage"]["completion_tokens"] == 16
    body = {"messages": MSGS, "n": 2, "max_tokens": 8, "temperature": 1.0, "seed": 5}
    _, sampled = post(f"{sim.url}/v1/chat/completions", body)
    _, again = post(f"{sim.url}/v1/chat/completions", body)
    assert sampled["choices"][0]["message"] != sampled["choices"][1]["message"]
    assert sampled["choices"] == again["choices"]  # same seed, same samples
    s = stream(f"{sim.url}/v1/chat/completions", {"messages": MSGS, "n": 2, "max_tokens": 3})
    assert sorted(c["choices"][0]["index"] for c in s.chunks) == [0] * 4 + [1] * 4


def test_tokenize_and_detokenize(sim: SimProcess) -> None:
    _, tok = post(f"{sim.url}/tokenize", {"model": "toy", "prompt": "hello world"})
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 8192
    assert tok["tokens"][0] == 256  # BOS, like add_special_tokens=True
    _, detok = post(f"{sim.url}/detokenize", {"model": "toy", "tokens": tok["tokens"]})
    assert detok["prompt"] == "<|bos|>hello world"
    status, _ = post(f"{sim.url}/detokenize", {"tokens": [10**9]})
    assert status == 400


@pytest.mark.parametrize(
    ("path", "body", "status", "etype"),
    [
        ("/v1/chat/completions", b"{not json", 400, "BadRequestError"),
        ("/v1/chat/completions", b"[1, 2]", 400, "BadRequestError"),
        ("/v1/chat/completions", {"model": "toy"}, 400, "BadRequestError"),
        ("/v1/completions", {"model": "toy"}, 400, "BadRequestError"),
        ("/v1/completions", {"model": "nope", "prompt": "x"}, 404, "NotFoundError"),
        ("/v1/audio/speech", {"model": "toy"}, 404, "NotFoundError"),
    ],
)
def test_error_shapes(sim: SimProcess, path: str, body: Any, status: int, etype: str) -> None:
    got, err = post(sim.url + path, body)
    assert got == status
    assert set(err["error"]) == {"message", "type", "param", "code"}
    assert err["error"]["type"] == etype and err["error"]["code"] == status


# -- faults ------------------------------------------------------------------------
def _fault_stream(sim: SimProcess, spec: str, **kw: Any) -> Stream:
    body = {"model": "toy", "prompt": [1, 2, 3], "max_tokens": 10, "return_token_ids": True}
    return stream(f"{sim.url}/v1/completions", body, {"X-Sim-Fault": spec}, **kw)


@pytest.mark.parametrize("spec", ["die-after=4", "reset-after=4"])
def test_die_and_reset_cut_the_stream_after_n_tokens(sim: SimProcess, spec: str) -> None:
    s = _fault_stream(sim, spec)
    assert s.status == 200 and not s.done
    assert isinstance(s.broken, aiohttp.ClientPayloadError | aiohttp.ClientOSError)
    assert len(s.chunks) == 4
    with pytest.raises(aiohttp.ClientError):  # non-streaming: cut before answering
        post(f"{sim.url}/v1/completions", {"prompt": "x", "max_tokens": 10}, {"X-Sim-Fault": spec})


def test_fault_after_the_end_never_fires(sim: SimProcess) -> None:
    s = _fault_stream(sim, "die-after=10")
    assert s.done and len(s.chunks) == 10


def test_error_after_sends_vllm_error_event_then_done(sim: SimProcess) -> None:
    s = _fault_stream(sim, "error-after=3")
    assert s.status == 200 and s.done and len(s.chunks) == 3
    err = s.events[-2]["error"]
    assert err["type"] == "InternalServerError" and err["code"] == 500
    with pytest.raises(openai.APIError):  # what the SDK makes of it
        client = openai.OpenAI(base_url=f"{sim.url}/v1", api_key="x", max_retries=0, timeout=10)
        for _ in client.completions.create(
            model="toy",
            prompt="x",
            max_tokens=9,
            stream=True,
            extra_headers={"X-Sim-Fault": "error-after=2"},
        ):
            pass


def test_abort_after_finishes_with_abort(sim: SimProcess) -> None:
    s = _fault_stream(sim, "abort-after=2")
    assert s.done and len(s.chunks) == 3
    last = s.chunks[-1]["choices"][0]
    assert last["finish_reason"] == "abort" and last["token_ids"] == []


def test_status_fault_answers_at_once(sim: SimProcess) -> None:
    status, err = post(
        f"{sim.url}/v1/chat/completions", {"messages": MSGS}, {"X-Sim-Fault": "status=503"}
    )
    assert status == 503 and err["error"]["code"] == 503


def test_garbage_fault_sends_non_json_sse(sim: SimProcess) -> None:
    async def go() -> tuple[int, str, bytes]:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
            async with s.post(
                f"{sim.url}/v1/completions",
                json={"prompt": "x", "stream": True},
                headers={"X-Sim-Fault": "garbage=1"},
            ) as r:
                return r.status, r.headers["Content-Type"], await r.read()

    status, ctype, raw = asyncio.run(go())
    assert status == 200 and ctype.startswith("text/event-stream")
    assert b"[DONE]" not in raw
    with pytest.raises(orjson.JSONDecodeError):
        orjson.loads(raw.split(b"\n\n")[0].removeprefix(b"data: "))


def test_stall_keeps_the_connection_open_without_data(sim: SimProcess) -> None:
    s = _fault_stream(sim, "stall-after=2,stall-seconds=30", read_timeout=0.5)
    assert isinstance(s.broken, aiohttp.ServerTimeoutError) and len(s.chunks) == 2


def test_bad_fault_header_is_a_400(sim: SimProcess) -> None:
    status, err = post(f"{sim.url}/v1/completions", {"prompt": "x"}, {"X-Sim-Fault": "melt=1"})
    assert status == 400 and "melt" in err["error"]["message"]


def test_process_wide_fault_and_per_request_override() -> None:
    p = SimProcess("--fault", "die-after=3")
    try:
        assert len(_fault_stream(p, "").chunks) == 3  # an empty header keeps the flag
        s = _fault_stream(p, "none")
        assert s.done and len(s.chunks) == 10
        assert len(_fault_stream(p, "die-after=5").chunks) == 5
    finally:
        p.close()


def test_exit_after_kills_the_process() -> None:
    p = SimProcess()
    try:
        s = _fault_stream(p, "exit-after=2")
        assert len(s.chunks) == 2 and not s.done and s.broken is not None
        assert p.proc.wait(5) == 1
    finally:
        p.close()


def test_slow_start_delays_ready() -> None:
    # 2 s: a lower bound that load can only help meet, and well over the ~0.4 s an idle
    # sim takes to start without it, so a slow start that did nothing fails here when
    # idle. ready_within leaves a loaded machine 20 s over the slow start.
    p = SimProcess("--slow-start", "2", ready_within=22)
    try:
        assert p.ready_after >= 2
        assert get(f"{p.url}/health")[0] == 200
    finally:
        p.close()


# -- timing, cache, metrics ----------------------------------------------------------
def test_paced_stream_disconnect_frees_the_engine() -> None:
    p = SimProcess("--decode-ms-per-step", "5", "--prefill-us-per-token", "10", instant=False)
    try:
        # 4000 tokens at 5 ms: ~20 s of generation. Tokens flow one by one: the 3 chunks
        # came, and the client left, while it was still generating (an abort, and fewer
        # than 4000 tokens generated, checked below), not once it was over.
        s = stream(
            f"{p.url}/v1/completions", {"prompt": "x", "max_tokens": 4000}, stop_after_chunks=3
        )
        assert len(s.chunks) == 3
        # Idle it stops within ms; 10 s is still half of what the generation has left.
        deadline = time.monotonic() + 10
        while True:
            text = get(f"{p.url}/metrics")[1].decode()
            if metric(text, "vllm:num_requests_running") == 0:
                break
            assert time.monotonic() < deadline, "generation kept running after disconnect"
            time.sleep(0.05)
        assert metric(text, "vllm:request_success_total", finished_reason="abort") == 1
        assert metric(text, "vllm:generation_tokens_total") < 4000
    finally:
        p.close()


def test_shared_cells_overflow_fails_every_running_sequence() -> None:
    """--kv-cells N: llama-server's unified KV cache. A request that fits alone finishes; a
    second one beside it that overflows the shared cells fails both, in-band (the stream)
    and as a 500 (not streamed), as llama-server does; the cells are free again after."""
    paced = ("--decode-ms-per-step", "20", "--prefill-us-per-token", "0")
    p = SimProcess("--kv-cells", "300", *paced, instant=False)
    try:
        prompt = list(range(10, 110))  # 100 ids
        body = {"model": "toy", "prompt": prompt, "max_tokens": 190, "ignore_eos": True}
        alone = stream(f"{p.url}/v1/completions", body, read_timeout=20)
        assert alone.done and alone.chunks[-1]["choices"][0]["finish_reason"] == "length"

        async def beside() -> tuple[list[Any], tuple[int, Any]]:
            timeout = aiohttp.ClientTimeout(total=30)
            async with aiohttp.ClientSession(timeout=timeout) as s:
                async with s.post(f"{p.url}/v1/completions", json={**body, "stream": True}) as a:
                    events, buf = [], b""
                    while len(events) < 3:  # a is running (3 of its 190 tokens out)
                        buf += await a.content.readany()
                        events = buf.split(b"\n\n")[:-1]
                    other = s.post(f"{p.url}/v1/completions", json=body)
                    async with other as b:
                        second = (b.status, await b.json())
                    buf += await a.content.read()
                    out = [e.removeprefix(b"data: ") for e in buf.split(b"\n\n") if e]
                    return [x if x == b"[DONE]" else orjson.loads(x) for x in out], second

        events, (status, second) = asyncio.run(beside())
        assert status == 500 and second["error"]["message"] == "Context size has been exceeded."
        assert events[-1] == b"[DONE]" and events[-2]["error"]["message"] == second["error"][
            "message"
        ], events[-3:]
        assert not any(
            c["choices"][0]["finish_reason"] for c in events[:-2] if isinstance(c, dict)
        )
        again = stream(f"{p.url}/v1/completions", body, read_timeout=20)
        assert again.done and again.chunks[-1]["choices"][0]["finish_reason"] == "length"
    finally:
        p.close()


def test_metrics_names_and_prefix_cache_hits(sim: SimProcess) -> None:
    long_msgs = [{"role": "system", "content": "You are a careful router. " * 20}, *MSGS]
    for _ in range(2):
        post(f"{sim.url}/v1/chat/completions", {"messages": long_msgs, "max_tokens": 2})
    status, raw = get(f"{sim.url}/metrics")
    text = raw.decode()
    assert status == 200
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:e2e_request_latency_seconds_count",
    ):
        assert metric(text, name, model_name="toy") >= 0
    assert metric(text, "vllm:prefix_cache_hits_total") >= 16 * 10  # the shared system prompt
    assert metric(text, "vllm:request_success_total", finished_reason="length") >= 2


def test_speculative_target_exports_acceptance_counters() -> None:
    p = SimProcess("--num-speculative-tokens", "3", "--spec-acceptance", "0.5")
    try:
        post(f"{p.url}/v1/completions", {"prompt": "x", "max_tokens": 200})
        text = get(f"{p.url}/metrics")[1].decode()
    finally:
        p.close()
    drafts = metric(text, "vllm:spec_decode_num_drafts_total")
    assert metric(text, "vllm:spec_decode_num_draft_tokens_total") == 3 * drafts
    accepted = metric(text, "vllm:spec_decode_num_accepted_tokens_total")
    assert drafts + accepted >= 200 and 0 < accepted < 3 * drafts
    assert metric(text, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position="0") > 0


# -- speculative pairs: scoring, drafts, server facts ------------------------------
DRAFT_RATE = 0.6


@pytest.fixture(scope="module")
def noisy_target() -> Iterator[SimProcess]:
    p = SimProcess("--chip-seed", "3", "--tie-rate", "0.2")
    yield p
    p.close()


@pytest.fixture(scope="module")
def draft() -> Iterator[SimProcess]:
    p = SimProcess("--draft-agree-rate", str(DRAFT_RATE), "--decode-ms-per-step", "0")
    yield p
    p.close()


def score(sim: SimProcess, prompt: list[int], k: int) -> dict[str, Any]:
    """One vLLM-style scoring call: prompt_logprobs plus the greedy bonus token."""
    body = {
        "prompt": prompt,
        "max_tokens": 1,
        "temperature": 0,
        "prompt_logprobs": k,
        "return_token_ids": True,
    }
    status, resp = post(f"{sim.url}/v1/completions", body)
    assert status == 200, resp
    choice: dict[str, Any] = resp["choices"][0]
    return choice


def argmax(entry: dict[str, Any]) -> int:
    return int(next(t for t, v in entry.items() if v["rank"] == 1))


def test_prompt_logprobs_shape(sim: SimProcess) -> None:
    prompt = tokenize_chat(sim, MSGS)
    choice = score(sim, prompt, 2)
    assert choice["prompt_token_ids"] == prompt and len(choice["token_ids"]) == 1
    lps = choice["prompt_logprobs"]
    assert len(lps) == len(prompt) and lps[0] is None
    for j, entry in enumerate(lps[1:], start=1):
        actual = entry[str(prompt[j])]
        assert actual["decoded_token"] == build_tokenizer().texts[prompt[j]]
        assert actual["rank"] >= 1 and actual["logprob"] < 0
        top = sorted(v["rank"] for v in entry.values())
        assert top[:2] == [1, 2] and len(entry) == (2 if actual["rank"] <= 2 else 3)


@pytest.mark.parametrize("which", ["plain", "chip-noise", "loop"])
def test_prompt_logprobs_argmax_is_the_greedy_output(
    which: str, sim: SimProcess, noisy_target: SimProcess
) -> None:
    looping = None
    if which == "loop":
        looping = SimProcess("--loop-after-len", "60", "--loop-period", "5")
    server = {"plain": sim, "chip-noise": noisy_target, "loop": looping}[which]
    assert server is not None
    try:
        prompt = tokenize_chat(server, MSGS)
        gen, _ = complete_ids(server, prompt, 201)
        choice = score(server, prompt + gen[:200], 1)
    finally:
        if looping is not None:
            looping.close()
    lps = choice["prompt_logprobs"]
    assert [argmax(e) for e in lps[len(prompt) :]] == gen[:200]
    assert choice["token_ids"] == gen[200:]  # the bonus token is the next greedy token
    if which == "loop":
        assert all(gen[i] == gen[i - 5] for i in range(max(60 - len(prompt), 5), 201))


def test_draft_agrees_with_its_target_at_the_configured_rate(
    sim: SimProcess, draft: SimProcess
) -> None:
    prompt = tokenize_chat(sim, MSGS)
    gen, _ = complete_ids(sim, prompt, 400)
    lps = score(draft, prompt + gen, 0)["prompt_logprobs"][len(prompt) :]
    agreed = sum(e[str(t)]["rank"] == 1 for e, t in zip(lps, gen, strict=True))
    assert agreed / len(gen) == pytest.approx(DRAFT_RATE, abs=0.08)
    draft_gen, _ = complete_ids(draft, prompt, 50)
    assert draft_gen != gen[:50]  # a draft, not a copy


def test_router_style_draft_verify_reproduces_target_greedy(
    sim: SimProcess, draft: SimProcess
) -> None:
    """The loop the shim runs: k draft tokens, one scoring call, accept prefix + fix/bonus."""
    prompt = tokenize_chat(sim, MSGS)
    want, _ = complete_ids(sim, prompt, 60)
    out: list[int] = []
    proposed = accepted = 0
    while len(out) < 60:
        ctx = prompt + out
        guess, _ = complete_ids(draft, ctx, 4)
        verdict = score(sim, ctx + guess, 1)
        lps = verdict["prompt_logprobs"][len(ctx) :]
        for tok, entry in zip(guess, lps, strict=True):
            proposed += 1
            if entry[str(tok)]["rank"] != 1:
                out.append(argmax(entry))  # the target's own token replaces the first miss
                break
            out.append(tok)
            accepted += 1
        else:
            out.extend(verdict["token_ids"])  # all accepted: the bonus token
    assert out[:60] == want
    assert 0.3 < accepted / proposed < 0.9


def test_prompt_logprobs_refusals(sim: SimProcess) -> None:
    base = {"prompt": [1, 2, 3], "max_tokens": 1, "prompt_logprobs": 1}
    status, err = post(f"{sim.url}/v1/completions", {**base, "stream": True})
    assert status == 400 and err["error"]["param"] == "prompt_logprobs"
    status, err = post(f"{sim.url}/v1/completions", {**base, "prompt_logprobs": 99})
    assert status == 400 and err["error"]["param"] == "prompt_logprobs"
    status, err = post(f"{sim.url}/v1/chat/completions", {"messages": MSGS, "prompt_logprobs": 1})
    assert status == 400 and err["error"]["param"] == "prompt_logprobs"


def test_pair_facts_are_published_where_and_as_vllm_publishes_them(sim: SimProcess) -> None:
    """No invented endpoint: vLLM 0.32 has no /server_info outside its dev mode, so a
    router reads the facts from /tokenize, /detokenize, /metrics and /v1/models."""
    assert get(f"{sim.url}/server_info")[0] == 404
    tok = build_tokenizer()
    ask = {"prompt": "hello world", "add_special_tokens": False, "return_token_strs": True}
    status, got = post(f"{sim.url}/tokenize", ask)
    assert status == 200 and got["tokens"] == tok.encode("hello world")
    assert got["token_strs"] == [tok.texts[i] for i in got["tokens"]]
    assert "".join(got["token_strs"]) == "hello world"
    assert "token_strs" not in post(f"{sim.url}/tokenize", {"prompt": "hi"})[1]
    status, got = post(f"{sim.url}/detokenize", {"tokens": [EOS, tok.vocab_size - 1]})
    assert status == 200 and got["prompt"].startswith("<|eos|>")
    status, err = post(f"{sim.url}/detokenize", {"tokens": [tok.vocab_size]})
    assert status == 400 and err["error"]["param"] == "tokens"  # past the vocabulary
    text = get(f"{sim.url}/metrics")[1].decode()
    assert metric(text, "vllm:cache_config_info", block_size="16") == 1
    (card,) = orjson.loads(get(f"{sim.url}/v1/models")[1])["data"]
    assert card["max_model_len"] == 8192 and card["root"] == "toy"


def test_generation_config_and_tokenizer_variant_show_in_behaviour(sim: SimProcess) -> None:
    p = SimProcess(
        "--tokenizer-variant", "1", "--block-size", "32", "--default-temperature", "0.7",
        "--default-top-p", "0.9", "--default-top-k", "40", "--default-seed", "7",
    )
    try:
        ids = post(f"{p.url}/tokenize", {"prompt": "Once upon a time, the fleet"})[1]["tokens"]
        metrics = get(f"{p.url}/metrics")[1].decode()
        body: dict[str, Any] = {"prompt": "Once upon", "max_tokens": 30}
        omitted = [post(f"{p.url}/v1/completions", body)[1] for _ in range(2)]
        explicit = post(
            f"{p.url}/v1/completions",
            {**body, "temperature": 0.7, "top_p": 0.9, "top_k": 40, "seed": 7},
        )[1]
        greedy = post(f"{p.url}/v1/completions", {**body, "temperature": 0})[1]
    finally:
        p.close()
    plain = post(f"{sim.url}/tokenize", {"prompt": "Once upon a time, the fleet"})[1]["tokens"]
    assert ids != plain  # another vocabulary cuts the same text otherwise
    assert metric(metrics, "vllm:cache_config_info", block_size="32") == 1
    texts = [r["choices"][0]["text"] for r in (*omitted, explicit, greedy)]
    assert texts[0] == texts[1] == texts[2]  # omitted fields take the server defaults
    assert texts[3] != texts[0]  # an explicit temperature 0 wins: greedy, not sampled

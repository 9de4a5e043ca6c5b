"""`python -m bench.relay_events`: what the shim's relay of a first stream costs per SSE event,
in process, with no sockets: the engine's stream read (engine.read_blocks) and each block
tracked and shaped for the client (StreamRelay._block), as StreamRelay._pump does them.

The stream is a vLLM chat stream with token ids (a role chunk, N token chunks of one id each
whose texts include multi-byte characters, a finish chunk with a fingerprint, [DONE]), read
three ways: in 64 KiB reads (a fast engine's burst, or a loaded shim's: events merged in a
read), in 4 KiB reads, and one event a read (a quiet engine's pace).

Usage: python -m bench.relay_events [--tokens N] [--reps R] [--json PATH]
       python -m bench.relay_events --instructions [--compare REV]   (needs valgrind)

Wall-clock µs move with whatever else the machine runs. `--instructions` counts CPU
instructions instead (valgrind's callgrind, the same count under any load): each read size
runs at two stream counts, and the difference divided by the extra events is the cost of one
event, start-up excluded. `--compare REV` runs the same count on commit REV (a temporary git
worktree) in the same run, and prints the ratio."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson

READS = {"64 KiB reads": 65536, "4 KiB reads": 4096, "an event a read": 0}
HEAD = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
WORDS = ["Hello", " world", ",", " the", " qu", "ick", " brown", " fox", " é", "世", "\n"]


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def stream_events(tokens: int) -> list[bytes]:
    rnd = random.Random(1)
    role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
            "finish_reason": None}  # fmt: skip
    out = [_event({**HEAD, "choices": [role], "prompt_token_ids": [1, 2, 3]})]
    for _ in range(tokens - 1):
        choice = {"index": 0, "delta": {"content": rnd.choice(WORDS)}, "logprobs": None,
                  "finish_reason": None, "token_ids": [rnd.randrange(50_000)]}  # fmt: skip
        out.append(_event({**HEAD, "choices": [choice]}))
    last = {"index": 0, "delta": {"content": "."}, "logprobs": None, "finish_reason": "stop",
            "stop_reason": None, "token_ids": [7]}  # fmt: skip
    out.append(_event({**HEAD, "choices": [last], "system_fingerprint": "fp"}))
    return [*out, b"data: [DONE]\n\n"]


def reads(events: list[bytes], size: int) -> list[bytes]:
    if size == 0:
        return events
    whole = b"".join(events)
    return [whole[at : at + size] for at in range(0, len(whole), size)]


async def relay(pieces: list[bytes]) -> int:
    """One stream through the relay's read and block loop; the bytes the client got."""
    # Imported here: the child runs in whichever checkout --compare names (its cwd).
    from baton.model import Backend, BackendId
    from dataplane.relay.stitch import Stitcher
    from dataplane.relay.stream import StreamRelay
    from dataplane.request import ClientRequest, Endpoint
    from dataplane.settings import ResumeSettings

    class Content:
        def __init__(self) -> None:
            self._it = iter(pieces)

        async def readany(self) -> bytes:
            return next(self._it, b"")

    class Upstream:
        connection = None
        content = Content()

    class Relay(StreamRelay):
        def __init__(self) -> None:  # only what the read loop touches
            body = {"model": "m", "messages": [], "stream": True}
            self.stitcher = Stitcher(ClientRequest(Endpoint.CHAT, body, "m", True, True),
                                     strip_ids=True)  # fmt: skip
            self._first = b""
            self.first_byte = None
            self._settings = ResumeSettings()
            self.sent = 0

        async def write(self, data: bytes) -> None:
            self.first_byte = self.first_byte or 1.0
            self.sent += len(data)

        def due(self, backend_id: str) -> bool:
            return False

    r = Relay()
    backend = Backend(id=BackendId("b"), url="http://127.0.0.1:1", model="m")
    await r._pump(backend, Upstream())  # type: ignore[arg-type]  # noqa: SLF001
    return r.sent


def run_streams(size: int, tokens: int, streams: int) -> float:
    """Seconds for `streams` streams read `size` bytes at a time."""
    pieces = reads(stream_events(tokens), size)

    async def go() -> float:
        t = time.perf_counter()
        for _ in range(streams):
            await relay(pieces)
        return time.perf_counter() - t

    return asyncio.run(go())


@contextlib.contextmanager
def checkout(rev: str | None) -> Iterator[Path]:
    """This working tree, or commit `rev` in a temporary git worktree."""
    here = Path(__file__).resolve().parent.parent
    if rev is None:
        yield here
        return
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(["git", "-C", str(here), "worktree", "add", "-q", "--detach", str(tree),
                        rev], check=True)  # fmt: skip
        try:
            yield tree
        finally:
            subprocess.run(["git", "-C", str(here), "worktree", "remove", "--force", str(tree)],
                           check=False)  # fmt: skip


def instructions(tree: Path, size: int, tokens: int, streams: int) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run(
            # This file run by path (the commit compared may not have it), on that tree's code.
            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={tmp}/cg.out",
             sys.executable, __file__, "--child", str(size),
             "--tokens", str(tokens), "--streams", str(streams)],
            capture_output=True, text=True, check=True, cwd=tree,
            env={**os.environ, "PYTHONPATH": str(tree)},
        )  # fmt: skip
    found = re.search(r"Collected : (\d+)", out.stderr)
    if found is None:
        raise RuntimeError(f"no callgrind total in: {out.stderr[-500:]}")
    return int(found.group(1))


def per_event(tree: Path, size: int, tokens: int) -> float:
    small, large = 1, 5
    extra = (large - small) * (tokens + 2)  # events a stream adds: role, tokens, [DONE]
    counted = [instructions(tree, size, tokens, n) for n in (small, large)]
    return (counted[1] - counted[0]) / extra


def by_instructions(tokens: int, compare: str | None, json_path: Path, only: str) -> int:
    here = Path(__file__).resolve().parent.parent
    rows: dict[str, dict[str, float]] = {}
    with contextlib.ExitStack() as stack:
        other = stack.enter_context(checkout(compare)) if compare else None
        for name, size in READS.items():
            if only and only not in name:
                continue
            row = {"this tree": per_event(here, size, tokens)}
            if other is not None:
                row[compare or ""] = per_event(other, size, tokens)
            rows[name] = row
    head = f"{'reads':<18}{'instructions/event':>20}"
    print(head + (f"{compare + ' (instr/event)':>24}{'ratio':>8}" if compare else ""))
    for name, row in rows.items():
        line = f"{name:<18}{row['this tree']:>20,.0f}"
        if compare:
            line += f"{row[compare]:>24,.0f}{row['this tree'] / row[compare]:>8.3f}"
        print(line)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps({"tokens": tokens, "compare": compare, "rows": rows}, indent=2))
    return 0


def by_clock(tokens: int, reps: int, json_path: Path) -> int:
    rows = {}
    print(f"{'reads':<18}{'µs/event (best of reps)':>26}")
    for name, size in READS.items():
        best = min(run_streams(size, tokens, 5) for _ in range(reps)) / (5 * (tokens + 2))
        rows[name] = best * 1e6
        print(f"{name:<18}{rows[name]:>26.2f}")
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps({"tokens": tokens, "us_per_event": rows}, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.relay_events", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--tokens", type=int, default=1024, help="tokens a stream")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--instructions", action="store_true", help="count, don't time")
    p.add_argument("--compare", help="with --instructions: also this commit, in the same run")
    p.add_argument("--reads", default="", help="only the read sizes whose name has this")
    p.add_argument("--json", type=Path, default=Path(__file__).parent / "results" /
                   "relay_events.json")  # fmt: skip
    p.add_argument("--child", type=int, help=argparse.SUPPRESS)  # a callgrind child's read size
    p.add_argument("--streams", type=int, default=1, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child is not None:
        run_streams(a.child, a.tokens, a.streams)
        return 0
    if a.instructions:
        return by_instructions(a.tokens, a.compare, a.json.with_suffix(".instructions.json"),
                               a.reads)  # fmt: skip
    return by_clock(a.tokens, a.reps, a.json)


if __name__ == "__main__":
    sys.exit(main())

"""``python -m sim`` / ``baton sim``: run one simulated vLLM-flavoured engine.

Prints exactly one line ``SIM READY http://HOST:PORT`` once the port is bound
(``--listen 127.0.0.1:0`` reports the real port), then serves until SIGINT or
SIGTERM and exits 0. With KV-cache events on, ``SIM KV_EVENTS <endpoint>`` (and
``SIM KV_REPLAY <endpoint>``) come first, as bound; GET /kv_event_sources says the same.
With ``--data-parallel-size N`` those two lines are rank 0's, and each rank R > 0 adds
``SIM KV_EVENTS_DP{R} <endpoint>`` (and ``SIM KV_REPLAY_DP{R} <endpoint>``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys

from sim.config import SimConfig
from sim.costmodel import CostParams
from sim.faults import FaultSpecError, parse_fault_spec
from sim.kv_wire import DEFAULT_TOPIC, KvEventsConfig, kv_events_from_json
from sim.lora_cli import add_lora_arguments, lora_from_args, runtime_lora_updating
from sim.model import MAX_THINK_TOKENS, ModelConfig
from sim.protocol import Limits
from sim.responses_store import DEFAULT_CAPACITY
from sim.server import start_server
from sim.specdecode import SpecConfig
from sim.state import STATE
from sim.tokenizer import FIRST_MERGE_ID
from sim.tool_script import FORMATS
from sim.tools import MAX_TOOL_CALL_AFTER


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument("--listen", default="127.0.0.1:8000", help="HOST:PORT (port 0 = pick one)")
    g.add_argument("--model", default="toy", help="served model name")
    g.add_argument("--max-model-len", type=int, default=8192)
    g.add_argument("--max-num-seqs", type=int, default=256,
                   help="requests decoding at once; more wait (vllm:num_requests_waiting)")
    g.add_argument("--data-parallel-size", type=int, default=1, metavar="N",
                   help="N engine ranks behind one API server, as vLLM's internal load "
                        "balancer: each its own cache, queue and KV-event publisher (ports "
                        "+R); X-data-parallel-rank pins a request, else the least loaded")
    g.add_argument("--default-max-tokens", type=int, default=64,
                   help="max_tokens when a request gives none")
    g.add_argument("--default-temperature", type=float, default=0.0,
                   help="temperature when a request gives none (the toy's generation config)")
    g.add_argument("--default-top-p", type=float, default=1.0,
                   help="top_p when a request gives none")
    g.add_argument("--default-top-k", type=int, default=0,
                   help="top_k when a request gives none (0 or -1 = off)")
    g.add_argument("--default-seed", type=int, default=None,
                   help="sampling seed when a request gives none (default: fresh entropy)")
    g.add_argument("--stream-interval", type=int, default=1, metavar="N",
                   help="tokens batched per streamed chunk, as vLLM's (a request's "
                        "stream_interval raises it)")
    g.add_argument("--slow-start", type=float, default=0.0, metavar="S",
                   help="sleep S seconds before binding the port")
    g.add_argument("--api-key", default="", metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on /v1/* and /inference/* (like vLLM)")
    g.add_argument("--enable-scale-out", action="store_true",
                   help="serve POST /inference/v1/generate (token ids in and out), as vLLM's "
                        "flag does; without it the route answers 403")
    g.add_argument("--timing-log", default="", metavar="PATH",
                   help="append each request's engine-side TTFT as a JSON line (benchmarks)")
    m = parser.add_argument_group("model")
    m.add_argument("--model-seed", type=int, default=0, help="the toy model's weights")
    m.add_argument("--chip-seed", type=int, default=0, help="this replica's numeric noise")
    m.add_argument("--tie-rate", type=float, default=0.0,
                   help="fraction of positions that are near-ties (chips may disagree there)")
    m.add_argument("--eos-rate", type=float, default=0.0,
                   help="per-position chance the model emits EOS (0 = run to max_tokens)")
    m.add_argument("--draft-agree-rate", type=float, default=1.0, metavar="P",
                   help="act as a draft of the model with this --model-seed: its argmax equals "
                        "the target's at a fraction P of positions (1.0 = the plain model)")
    m.add_argument("--tokenizer-variant", type=int, default=0, metavar="N",
                   help="non-zero: a different vocabulary")
    m.add_argument("--tokenizer-drop-merge", type=int, default=None, metavar="ID",
                   help="the same vocabulary without the merge that makes token ID (it stays "
                        "in the vocabulary, unreachable): a tokenizer that differs by one merge")
    m.add_argument("--loop-after-len", type=int, default=0, metavar="T",
                   help="degenerate model: loop once the history has T tokens (with --loop-period)")
    m.add_argument("--loop-period", type=int, default=0, metavar="L",
                   help="degenerate model: the argmax is history[-L] (0 = off)")
    m.add_argument("--byte-level", action="store_true",
                   help="byte-level BPE vocabulary (its own); the model emits multi-byte "
                        "characters, characters split across tokens and invalid UTF-8")
    m.add_argument("--reasoning", action="store_true",
                   help="<think>/</think> tokens, a template opening <think>, and chat "
                        "responses split like vLLM's --reasoning-parser deepseek_r1")
    m.add_argument("--think-special", action="store_true",
                   help="with --reasoning: the think tags are special tokens (streams skip "
                        "their text unless skip_special_tokens is off: sim.adjust)")
    m.add_argument("--think-tokens", type=int, default=32, metavar="N",
                   help="with --reasoning: </think> comes at or after N tokens of thinking")
    m.add_argument("--tool-calls", action="store_true",
                   help="tool-call tokens; a chat request offering tools (tool_choice auto) "
                        "renders them into the prompt and the model calls them, parsed like "
                        "vLLM's --enable-auto-tool-choice --tool-call-parser P")
    m.add_argument("--tool-call-parser", choices=FORMATS, default="hermes",
                   help="with --tool-calls: the format the model writes and the parser run on it")
    m.add_argument("--parallel-tool-calls", type=int, default=1, metavar="N",
                   help="with --tool-calls: calls per turn, at most (the first N tools offered; "
                        "one when a request says parallel_tool_calls false)")
    m.add_argument("--tool-call-after", type=int, default=8, metavar="N",
                   help="with --tool-calls: the call starts at or after N generated tokens "
                        "(llama3_json: at the start of the answer)")
    o = parser.add_argument_group("responses and pooling")
    o.add_argument("--responses-store", type=int, default=DEFAULT_CAPACITY, metavar="N",
                   help="keep the last N stored /v1/responses for GET and previous_response_id "
                        "(vLLM with VLLM_ENABLE_RESPONSES_API_STORE=1); 0 = vLLM's default: "
                        "store is ignored")
    o.add_argument("--responses-delete", action="store_true",
                   help="serve DELETE /v1/responses/{id} as OpenAI does (vLLM 0.32: 405)")
    o.add_argument("--embedding-dim", type=int, default=128, metavar="D",
                   help="size of /v1/embeddings vectors")
    c = parser.add_argument_group("cost model (all 0 = as fast as possible)")
    c.add_argument("--prefill-us-per-token", type=float, default=20.0,
                   help="prefill time per prompt token not in the prefix cache")
    c.add_argument("--decode-ms-per-step", type=float, default=5.0)
    c.add_argument("--batch-slowdown", type=float, default=0.02,
                   help="extra step time per additional concurrent sequence (0.02 = +2%%)")
    c.add_argument("--cache-blocks", "--kv-cache-blocks", dest="cache_blocks", type=int,
                   default=4096, metavar="N",
                   help="KV cache size in blocks, LRU-evicted prefix cache (0 = off)")
    c.add_argument("--block-size", "--kv-block-size", dest="block_size", type=int, default=16,
                   metavar="N", help="tokens per KV block")
    c.add_argument("--kv-cells", type=int, default=0, metavar="N",
                   help="running sequences share N context cells, as llama-server's slots "
                        "do (-c N); a step with none free fails them all in-band (0 = off)")
    c.add_argument("--instant", action="store_true",
                   help="zero prefill and decode time (tests, router overhead benchmarks)")
    s = parser.add_argument_group("speculative decoding (counters only; output is unchanged)")
    s.add_argument("--num-speculative-tokens", type=int, default=0,
                   help="pose as a target with a draft proposing K tokens per step (0 = off)")
    s.add_argument("--spec-acceptance", type=float, default=0.7,
                   help="chance each draft token is accepted")
    add_lora_arguments(parser)
    k = parser.add_argument_group("KV-cache events (vLLM's --kv-events-config, publisher zmq)")
    k.add_argument("--kv-events-endpoint", default="", metavar="ENDPOINT",
                   help="publish on ZMQ: tcp://*:PORT, ipc://... are bound, tcp://HOST:PORT "
                        "is connected to (the subscriber binds it); port 0 binds a free port")
    k.add_argument("--kv-events-replay-endpoint", default=None, metavar="ENDPOINT",
                   help="bound ROUTER socket serving missed batches by sequence number")
    k.add_argument("--kv-events-topic", default=DEFAULT_TOPIC, metavar="TOPIC")
    k.add_argument("--kv-events-config", default="", metavar="JSON",
                   help="vLLM's own flag: {\"enable_kv_cache_events\": true, \"publisher\": "
                        "\"zmq\", \"endpoint\": ..., \"replay_endpoint\": ..., \"topic\": ...}")
    f = parser.add_argument_group("faults")
    f.add_argument("--fault", default="", metavar="SPEC",
                   help="applied to every request, e.g. 'die-after=5'; "
                        "the X-Sim-Fault header overrides it per request")


def config_from_args(args: argparse.Namespace) -> SimConfig:
    instant = args.instant
    try:
        faults = parse_fault_spec(args.fault)
    except FaultSpecError as e:
        raise SystemExit(f"--fault: {e}") from None
    _check_ranges(args)
    kv_events = kv_events_from_args(args)
    _check_rank_endpoints(kv_events, args.data_parallel_size)
    return SimConfig(
        model=ModelConfig(
            seed=args.model_seed,
            chip_seed=args.chip_seed,
            tie_rate=args.tie_rate,
            eos_rate=args.eos_rate,
            draft_agree_rate=args.draft_agree_rate,
            loop_after_len=args.loop_after_len,
            loop_period=args.loop_period,
            think_tokens=args.think_tokens,
            tool_call_after=args.tool_call_after,
            tool_format=args.tool_call_parser,
            parallel_tool_calls=args.parallel_tool_calls,
        ),
        limits=Limits(
            model=args.model,
            max_model_len=args.max_model_len,
            default_max_tokens=args.default_max_tokens,
            default_temperature=args.default_temperature,
            default_top_p=args.default_top_p,
            # -1 and 0 both mean "off": one spelling.
            default_top_k=max(args.default_top_k, 0),
            default_seed=args.default_seed,
            stream_interval=args.stream_interval,
        ),
        cost=CostParams(
            prefill_us_per_token=0.0 if instant else args.prefill_us_per_token,
            decode_ms_per_step=0.0 if instant else args.decode_ms_per_step,
            batch_slowdown=args.batch_slowdown,
            cache_blocks=args.cache_blocks,
            block_size=args.block_size,
        ),
        faults=faults,
        max_num_seqs=args.max_num_seqs,
        spec=SpecConfig(num_tokens=args.num_speculative_tokens, acceptance=args.spec_acceptance),
        tokenizer_variant=args.tokenizer_variant,
        tokenizer_drop_merge=args.tokenizer_drop_merge,
        timing_log=args.timing_log,
        api_key=args.api_key,
        byte_level=args.byte_level,
        reasoning=args.reasoning,
        think_special=args.think_special,
        tool_calls=args.tool_calls,
        responses_store=args.responses_store,
        responses_delete=args.responses_delete,
        embedding_dim=args.embedding_dim,
        kv_events=kv_events,
        kv_cells=args.kv_cells,
        data_parallel_size=args.data_parallel_size,
        enable_scale_out=args.enable_scale_out,
        lora=lora_from_args(args),
        runtime_lora_updating=runtime_lora_updating(os.environ),
    )


def kv_events_from_args(args: argparse.Namespace) -> KvEventsConfig | None:
    if args.kv_events_config:
        try:
            raw = json.loads(args.kv_events_config)
            return kv_events_from_json(raw)
        except (ValueError, TypeError) as e:
            raise SystemExit(f"--kv-events-config: {e}") from None
    if not args.kv_events_endpoint:
        if args.kv_events_replay_endpoint:
            raise SystemExit("--kv-events-replay-endpoint needs --kv-events-endpoint")
        return None
    return KvEventsConfig(
        endpoint=args.kv_events_endpoint,
        replay_endpoint=args.kv_events_replay_endpoint,
        topic=args.kv_events_topic,
    )


def _check_ranges(args: argparse.Namespace) -> None:
    """Refuse flags a request would be refused for, rather than serve nonsense."""
    if not 0.0 <= args.draft_agree_rate <= 1.0:
        raise SystemExit("--draft-agree-rate must be in [0, 1]")
    if args.default_temperature < 0:
        raise SystemExit("--default-temperature must be >= 0")
    if args.stream_interval < 1:
        raise SystemExit("--stream-interval must be at least 1")
    if not 0.0 < args.default_top_p <= 1.0:
        raise SystemExit("--default-top-p must be in (0, 1]")
    if args.default_top_k < -1:
        raise SystemExit("--default-top-k must be -1, 0 (off) or at least 1")
    if args.responses_store < 0 or args.embedding_dim < 1:
        raise SystemExit("--responses-store must be >= 0 and --embedding-dim >= 1")
    if args.tokenizer_drop_merge is not None and args.tokenizer_drop_merge < FIRST_MERGE_ID:
        raise SystemExit(f"--tokenizer-drop-merge must name a merge's token (>= {FIRST_MERGE_ID})")
    if args.loop_after_len < 0 or args.loop_period < 0:
        raise SystemExit("--loop-after-len and --loop-period must be >= 0")
    if args.think_special and not args.reasoning:
        raise SystemExit("--think-special needs --reasoning")
    if not 0 <= args.think_tokens <= MAX_THINK_TOKENS:
        raise SystemExit(f"--think-tokens must be in [0, {MAX_THINK_TOKENS}]")
    if args.parallel_tool_calls < 1:
        raise SystemExit("--parallel-tool-calls must be at least 1")
    if not 0 <= args.tool_call_after <= MAX_TOOL_CALL_AFTER:
        raise SystemExit(f"--tool-call-after must be in [0, {MAX_TOOL_CALL_AFTER}]")
    if args.data_parallel_size < 1:
        raise SystemExit("--data-parallel-size must be at least 1")


def _check_rank_endpoints(kv: KvEventsConfig | None, size: int) -> None:
    """Every rank needs endpoints of its own; vLLM refuses (ipc) what it cannot move."""
    if kv is None:
        return
    for rank in range(1, size):
        try:
            kv.for_rank(rank)
        except ValueError as e:
            raise SystemExit(f"--data-parallel-size {size}: {e}") from None


def _split_listen(listen: str) -> tuple[str, int]:
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit():
        raise SystemExit(f"--listen must be HOST:PORT, got {listen!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


async def serve(cfg: SimConfig, host: str, port: int, slow_start: float = 0.0) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    if slow_start > 0:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), slow_start)
        if stop.is_set():
            return
    runner, bound_port = await start_server(cfg, host, port)
    for engine in runner.app[STATE].engines:
        pub = engine.kv_events
        if pub is None:
            continue
        # Before READY, so a starter has them (clients.procs Part.announced keys them by
        # the second word: KV_EVENTS, KV_EVENTS_DP1, ...).
        suffix = f"_DP{engine.rank}" if engine.rank else ""
        print(f"SIM KV_EVENTS{suffix} {pub.endpoint}", flush=True)
        if pub.replay_endpoint is not None:
            print(f"SIM KV_REPLAY{suffix} {pub.replay_endpoint}", flush=True)
    print(f"SIM READY http://{_url_host(host)}:{bound_port}", flush=True)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    host, port = _split_listen(args.listen)
    try:
        import uvloop
    except ImportError:  # optional: plain asyncio works, just slower
        asyncio.run(serve(cfg, host, port, args.slow_start))
    else:
        uvloop.run(serve(cfg, host, port, args.slow_start))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sim", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

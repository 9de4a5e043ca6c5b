"""The LoRA flags of ``python -m sim``, as vLLM's (--enable-lora, --max-loras, --max-cpu-loras,
--max-lora-rank, --lora-modules), the sim's --lora-load-ms, and vLLM's reading of
VLLM_ALLOW_RUNTIME_LORA_UPDATING (the caller passes the environment in)."""

# baton: pure

from __future__ import annotations

import argparse
from collections.abc import Mapping

from sim.config import LoraConfig
from sim.lora import parse_lora_modules

LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's MaxLoRARanks
DEFAULT_LORA_LOAD_MS = 150.0  # a small adapter's weights from local disk into the engine


def add_lora_arguments(parser: argparse.ArgumentParser) -> None:
    lo = parser.add_argument_group(
        "LoRA adapters (vLLM's; load/unload routes with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1)"
    )
    lo.add_argument("--enable-lora", action="store_true",
                    help="requests may name a loaded adapter as their model (sim.lora)")
    lo.add_argument("--max-loras", type=int, default=1, metavar="N",
                    help="distinct adapters in one running batch; a request for another waits")
    lo.add_argument("--max-cpu-loras", type=int, default=None, metavar="N",
                    help="adapters each engine keeps loaded, least recently used evicted "
                         "(default: --max-loras)")
    lo.add_argument("--max-lora-rank", type=int, choices=LORA_RANKS, default=16,
                    help="an adapter whose r is larger fails to load")
    lo.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                    help="adapters loaded at start: NAME=PATH or JSON {\"name\", \"path\"}")
    lo.add_argument("--lora-load-ms", type=float, default=None, metavar="MS",
                    help=f"loading one adapter's weights into an engine (default "
                         f"{DEFAULT_LORA_LOAD_MS:g}; 0 with --instant)")


def lora_from_args(args: argparse.Namespace) -> LoraConfig | None:
    """--enable-lora and its flags; None when LoRA is off (vLLM's max_cpu_loras rule)."""
    if not args.enable_lora:
        if args.lora_modules:  # vLLM fails to start: each static load needs LoRA
            raise SystemExit("--lora-modules needs --enable-lora")
        return None
    max_loras = args.max_loras
    max_cpu = max_loras if args.max_cpu_loras is None else args.max_cpu_loras
    if max_loras < 1:
        raise SystemExit("--max-loras must be at least 1")
    if max_cpu < max_loras:
        raise SystemExit(f"max_cpu_loras ({max_cpu}) must be >= max_loras ({max_loras}).")
    load_ms = args.lora_load_ms
    if load_ms is None:
        load_ms = 0.0 if args.instant else DEFAULT_LORA_LOAD_MS
    if load_ms < 0:
        raise SystemExit("--lora-load-ms must be >= 0")
    try:
        modules = parse_lora_modules(args.lora_modules or [])
    except ValueError as e:
        raise SystemExit(str(e)) from None
    return LoraConfig(max_loras=max_loras, max_cpu_loras=max_cpu,
                      max_lora_rank=args.max_lora_rank, load_s=load_ms / 1000.0,
                      modules=modules)  # fmt: skip


def runtime_lora_updating(env: Mapping[str, str]) -> bool:
    """vLLM's envs.VLLM_ALLOW_RUNTIME_LORA_UPDATING: "1" or "true", any case and spacing."""
    return env.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "0").strip().lower() in ("1", "true")

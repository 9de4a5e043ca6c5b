"""SimConfig: everything one sim server is started with (pure; sim.__main__ builds it
from the command line, sim.state builds the server's state from it)."""

# baton: pure

from __future__ import annotations

from dataclasses import dataclass

from sim.costmodel import CostParams
from sim.faults import NO_FAULTS, FaultSpec
from sim.kv_wire import KvEventsConfig
from sim.model import ModelConfig
from sim.protocol import Limits
from sim.responses_store import DEFAULT_CAPACITY
from sim.specdecode import SpecConfig


@dataclass(frozen=True, slots=True)
class LoraModule:
    """One of vLLM's --lora-modules: an adapter registered at start (``name=path``, or JSON
    with ``base_model_name``, which becomes its card's parent when it names the base)."""

    name: str
    path: str
    base_model_name: str | None = None


@dataclass(frozen=True, slots=True)
class LoraConfig:
    """vLLM's --enable-lora and its LoRA flags, as the sim models them (sim.lora)."""

    max_loras: int = 1  # distinct adapters in one running batch (vLLM's default)
    max_cpu_loras: int = 1  # adapters the engine keeps loaded, LRU (vLLM: max_loras)
    max_lora_rank: int = 16  # an adapter_config.json with a larger r fails to load
    load_s: float = 0.0  # loading one adapter's weights into the engine
    modules: tuple[LoraModule, ...] = ()


@dataclass(frozen=True, slots=True)
class SimConfig:
    model: ModelConfig
    limits: Limits
    cost: CostParams
    faults: FaultSpec = NO_FAULTS
    max_num_seqs: int = 256
    spec: SpecConfig = SpecConfig()
    tokenizer_variant: int = 0
    tokenizer_drop_merge: int | None = None
    timing_log: str = ""  # append one JSON line per request's first token (benchmarks)
    api_key: str = ""  # like vLLM's --api-key: /v1/* needs "Authorization: Bearer KEY"
    # A byte-level BPE vocabulary whose model emits multi-byte (and invalid) UTF-8.
    byte_level: bool = False
    # <think>/</think> tokens, a template opening "<think>", and chat responses
    # parsed like vLLM's --reasoning-parser deepseek_r1 (see sim.reasoning).
    reasoning: bool = False
    # With reasoning: the think tags are special tokens, so a stream (skip_special_tokens,
    # vLLM's default) drops their text, while the parser still goes by their ids; a request
    # with skip_special_tokens off (its own or its tool parser's: sim.adjust) shows it.
    think_special: bool = False
    # <tool_call>/</tool_call> tokens; a chat request offering tools (tool_choice
    # auto) makes a tool call, parsed like vLLM's --enable-auto-tool-choice
    # --tool-call-parser hermes (see sim.tools). Other requests are unchanged.
    tool_calls: bool = False
    # Responses kept for GET / previous_response_id (vLLM with
    # VLLM_ENABLE_RESPONSES_API_STORE=1); 0 = vLLM's default: store ignored.
    responses_store: int = DEFAULT_CAPACITY
    # DELETE /v1/responses/{id} as OpenAI answers it (vLLM 0.32 has no such route: 405).
    responses_delete: bool = False
    embedding_dim: int = 128  # /v1/embeddings vector size (vLLM's tiny Llama gives 128)
    # Publish KV-cache events on ZMQ like vLLM's --kv-events-config (sim.kv_events).
    kv_events: KvEventsConfig | None = None
    # The running sequences share this many context cells, as llama-server's slots do; an
    # overflow fails them all in-band (sim.cells). 0 = no shared limit (vLLM preempts).
    kv_cells: int = 0
    # Engine cores behind the one API server, as vLLM's --data-parallel-size with its
    # internal load balancer: each rank has its own cache, scheduler, metrics children and
    # KV-event publisher (sim.engine); X-data-parallel-rank pins a request (sim.balancer).
    data_parallel_size: int = 1
    # vLLM's --enable-scale-out: POST /inference/v1/generate (token ids in and out) is served;
    # without it the route answers 403, as vLLM 0.32's does (sim.generate_http).
    enable_scale_out: bool = False
    # vLLM's --enable-lora (None: off; requests may name only the base model).
    lora: LoraConfig | None = None
    # VLLM_ALLOW_RUNTIME_LORA_UPDATING: POST /v1/load_lora_adapter and /v1/unload_lora_adapter
    # are served (sim.lora_http); vLLM attaches them by the variable alone, --enable-lora or not.
    runtime_lora_updating: bool = False

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

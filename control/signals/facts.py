"""What a backend says about itself that a speculative pair depends on (pure).

Read from what real engines publish, per engine kind (control/signals/published.py does the
HTTP), at bind time and whenever a backend rejoins, never taken from config:
a replica restarted with another tokenizer must not keep the facts of the one before.

- **The tokenizer's identity**: a fingerprint over the whole vocabulary, swept through the
  engine's own /detokenize and /tokenize, and over a fixed probe corpus (see `Sweep`).
- **The KV block size**, where the engine reports one (vLLM's `cache_config_info`,
  SGLang's `page_size`); llama-server has no paged cache and reports none.
- **Sampling**: not read at all. The router sets every sampling parameter on each call it
  makes for a pair (baton/sampling.py), so an engine's generation-config defaults never
  enter; the params hash is the hash of what the router sends.
"""

# baton: pure

from __future__ import annotations

import hashlib
import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import orjson

from baton.model import Backend
from baton.sampling import PAIR_PARAMS_HASH
from control.exceptions import FactsError

# Texts every tokenizer is asked to cut, token strings included where the engine gives
# them: prose, code, whitespace runs, CJK, emoji and a lone surrogate-looking run, and the
# special tokens' texts of the common families (a tokenizer that adds or marks one
# differently cuts them differently).
PROBE_CORPUS: tuple[str, ...] = (
    "The quick brown fox jumps over the lazy dog. It's 3:14pm, isn't it?",
    "def resume(stream: Stream) -> None:\n    for i, tok in enumerate(stream):\n\t\tpass\n",
    "   leading spaces,\ttabs\n\n\nand  double  spaces   ",
    "日本語のテキストと中文文本，한국어도 있습니다。",
    "emoji 😀👍🏽🇫🇷 and ZWJ 👩‍👩‍👧 sequences",
    "Ünïcödé àccents, ﬁ ligatures, ＦＵＬＬＷＩＤＴＨ and \u00a0nbsp",
    "{\"json\": [1, 2.5e-3, null, true], \"k\": \"v\\n\"}",
    "<s></s><|endoftext|><|im_start|><|im_end|><|eot_id|><|begin_of_text|>"
    "<|end_of_text|><think></think><|bos|><|eos|><|end|><eos><bos><pad><unk>",
)
SWEEP_CHUNK = 512  # ids per /detokenize call of the vocabulary sweep
MAX_VOCAB = 1 << 21  # no real tokenizer has more; a bound on the search for the end


# The engine kinds whose API runs a speculative round: completions whose prompt is token ids
# and whose answer carries the generated ids (vLLM's return_token_ids), so that the draft's
# ids and the target's are compared as ids. llama-server's OpenAI API answers text only (its
# ids come from its own /completion); SGLang's is untested here. Both are refused at bind
# rather than fail at every round.
ROUND_KINDS = frozenset({"vllm"})


@dataclass(frozen=True, slots=True)
class Facts:
    tokenizer: str  # "sha256:..." over the vocabulary sweep and the probe corpus
    vocab_size: int  # the tokenizer's ids: 0 .. vocab_size - 1
    block_size: int | None  # None: the engine has no paged KV cache (llama-server)
    engine: str = "vllm"  # the backend's kind, whose API the pair's rounds speak
    # What the backend applies to the router's calls for a pair: the router's own explicit
    # parameters (baton/sampling.py), hashed. Every kind Baton speaks to takes all of them,
    # so today it is always the router's hash; it stays a fact, checked at bind and at the
    # gate, so that an engine that could not take one of them never verifies a draft.
    params_hash: str = PAIR_PARAMS_HASH


@dataclass
class Sweep:
    """The tokenizer fingerprint's inputs, in the order they are read. The vocabulary is
    swept in chunks: each chunk's ids go through /detokenize with a separator id between
    them (every token's text, special tokens' included, so one added or changed token
    changes it), and that text goes back through /tokenize (so one merge more or less,
    which changes how some token's own text is cut, changes it even when the vocabulary's
    texts are the same). The probe corpus adds the pre-tokenizer and normalizer on real
    text, with the engine's token strings where it gives them."""

    vocab_size: int = 0
    separator: int = 0
    chunks: list[tuple[str, list[int]]] = field(default_factory=list)  # text, its ids
    probes: list[tuple[list[int], list[str] | None]] = field(default_factory=list)

    def fingerprint(self) -> str:
        doc = {
            "vocab_size": self.vocab_size,
            "separator": self.separator,
            "chunks": self.chunks,
            "probes": self.probes,
        }
        return "sha256:" + hashlib.sha256(orjson.dumps(doc)).hexdigest()


def chunk_with_separator(start: int, stop: int, separator: int) -> list[int]:
    """Ids start..stop-1 with the separator between each two (and after the last)."""
    out: list[int] = []
    for i in range(start, stop):
        out += (i, separator)
    return out


# vllm:cache_config_info{block_size="128",...,engine="0"} 1.0 (one line per engine core).
_CACHE_INFO = re.compile(r'^vllm:cache_config_info\{([^}]*)\}', re.MULTILINE)
_BLOCK = re.compile(r'(?:^|,)block_size="(\d+)"')


def block_size_from_metrics(page: str) -> int:
    """The KV block size vLLM reports on its /metrics page (the sim reports it the same
    way). Every engine core of a data-parallel vLLM reports its own; they must agree."""
    sizes = set()
    for labels in _CACHE_INFO.findall(page):
        found = _BLOCK.search(labels)
        if found:
            sizes.add(int(found.group(1)))
    if not sizes:
        raise FactsError("its /metrics has no vllm:cache_config_info with a block_size")
    if len(sizes) > 1:
        raise FactsError(f"its engine cores report block sizes {sorted(sizes)}")
    return sizes.pop()


class Violation(NamedTuple):
    invariant: str  # the name a refusal carries: engine, tokenizer, block_size, params_hash
    detail: str


def pair_violations(draft: Facts, target: Facts) -> list[Violation]:
    """Every invariant a draft/target pairing breaks (empty: they may pair). The draft's
    tokens are verified against the target's scores by id, so the ids must mean the same
    text and cut the same way; the KV block size must match for the engines to share
    block-level prefix reuse; the sampling params are the router's own on both sides."""
    found = []
    cannot = [f"{side} is {f.engine}" for side, f in (("draft", draft), ("target", target))
              if f.engine not in ROUND_KINDS]  # fmt: skip
    if cannot:
        why = "a speculative round needs completions by token ids that return ids (vLLM)"
        found.append(Violation("engine", f"{', '.join(cannot)}: {why}"))
    if draft.tokenizer != target.tokenizer:
        size = (f"vocab_size {draft.vocab_size} != {target.vocab_size}"
                if draft.vocab_size != target.vocab_size
                else "the same vocab_size, other texts or cuts")  # fmt: skip
        found.append(Violation("tokenizer", f"{_short(draft.tokenizer)} != "
                                            f"{_short(target.tokenizer)} ({size})"))  # fmt: skip
    if draft.block_size != target.block_size:
        found.append(Violation("block_size", f"{_block(draft)} != {_block(target)}"))
    if draft.params_hash != target.params_hash:
        found.append(Violation("params_hash", f"{_short(draft.params_hash)} != "
                                              f"{_short(target.params_hash)}"))  # fmt: skip
    return found


def describe(violations: Sequence[Violation]) -> str:
    return "; ".join(f"{v.invariant}: {v.detail}" for v in violations)


def _short(h: str) -> str:
    return h.removeprefix("sha256:")[:12]


def _block(f: Facts) -> str:
    return "none" if f.block_size is None else str(f.block_size)


# How the services read a backend's facts: injected, so tests and benches can stand in.
# (backend, seconds it may take): the caller's own deadline bounds the whole read.
ReadFacts = Callable[[Backend, float], Awaitable[Facts]]

"""Build the tiny random Llamas the real-engine tests serve, offline (no download), in seconds.

Run with the engine venv's python (it has torch and transformers):
`make_tiny_model.py OUT_DIR [VARIANT]`, VARIANT one of tiny (the default), tiny-bytes,
tiny-think, tiny-think-special, tiny-wide, tiny-merge, tiny-added, spec-draft, spec-target-50,
spec-target-80, spec-target-95, tiny-tools, tiny-tools-llama3.

All three share the recipe (see docs/real-engines.md):
- head_dim 32: vLLM's CPU attention needs head_dim >= 32 and a multiple of 16.
- initializer_range 0.3: greedy output is a long chaotic string, not one token repeated.
- token id = byte value (byte-level BPE with no merges), so tokenization is canonical and a
  text resume of valid UTF-8 is exactly a token-id resume.
- the lm_head rows of EOS and the other specials are zeroed: a request never stops early, it
  runs to max_tokens.

The variants differ in what greedy decoding can emit:
- tiny: printable ASCII and newline only (every other row zeroed), so no UTF-8 character is
  ever split across SSE deltas.
- tiny-bytes: every byte but the C0 controls (tab and newline kept) and DEL, like a real
  byte-level BPE model (Llama 3, Qwen) that emits multi-byte characters one byte per token
  and invalid sequences (U+FFFD once decoded). A reserved residual feature, set on UTF-8
  lead bytes and read by the continuation-byte rows, makes continuation bytes follow lead
  bytes more often than not, so whole characters split across tokens are common too.
- tiny-think: ASCII like tiny, plus the added tokens <think> and </think>, NOT special (their
  text survives skip_special_tokens, as DeepSeek-R1's do), a chat template whose generation
  prompt ends with <|assistant|><think>, and weights that emit </think> exactly once, at
  position THINK_AT + 2 of the sequence (0-based, prompt included: ~480-500 tokens into
  the reply to a short chat message; at once after a longer prompt), then go on with content
  (vLLM's `--reasoning-parser deepseek_r1` splits the stream into `reasoning`, then
  `content`). How: residual features the random part of the network neither reads nor
  writes; one layer-0 head attends uniformly and reads a flag set only on <|bos|> (which
  the template starts with), so it carries 1/(position+1); the </think> row reads a
  constant feature minus that, so its logit changes sign at THINK_AT and wins the argmax
  right after. A second head attends (through a big query-key product) to any </think>
  already in the context, and the row reads that as a large penalty: it never comes twice.
  Without <|bos|> (a raw completion prompt) </think> comes first.
- tiny-think-special: tiny-think with <think> and </think> added as SPECIAL tokens (as some
  reasoning models' tokenizers mark them): the same weights and ids, but with
  skip_special_tokens (vLLM's default) a stream never shows the tags' text, while vLLM's
  parser still splits by their ids and /detokenize (no skipping) still spells them.
- tiny-think-early and tiny-think-early-special: the same two, but their generation prompt
  ends <think> and a newline (DeepSeek-R1's own template) and </think> comes early, at
  position THINK_EARLY_AT + 2 (~16 tokens into the reply to "hi"): a cut just past the
  tag lands where a loaded engine has merged the tag with the answer's first tokens.
- tiny-merge and tiny-added: tiny's weights behind a tokenizer one merge ("h" "e", and the
  token "he" it makes) or one added token ("<|extra|>") apart, for speculative pairs that
  must be refused (their ids mean other text, or a text is cut otherwise).
- spec-draft and spec-target-50/80/95: a speculative pair whose greedy agreement is known
  (SPEC_AGREEMENT), for measuring speculation at a given acceptance on real engines. The
  draft is the tiny recipe at SPEC_HIDDEN wide, one layer (cheap per token). A target is the
  draft (the same tokenizer, embeddings, layer, final norm and lm_head, bit for bit) plus
  SPEC_EXTRA random layers after it (several times the draft's cost per token), whose writes
  to the residual stream (o_proj, down_proj) are scaled by alpha: alpha 0 is the draft
  itself, a larger alpha moves the target's argmax away from the draft's more often. The
  build calibrates alpha (regula falsi) on SPEC_PROMPTS: the target's own greedy
  continuation of each, then both models teacher-forced over it, counting the generated
  positions where the draft's argmax is the target's (what a greedy speculative round
  accepts, token by token); it prints alpha and the agreement, and fails unless it is within
  SPEC_TOLERANCE of the goal. The same build gives the same alpha (a fixed seed, greedy).
- tiny-tools (vLLM `--enable-auto-tool-choice --tool-call-parser hermes`) and tiny-tools-llama3
  (`--tool-call-parser llama3_json`): an agent that calls tools. Not random: every layer's
  o_proj and down_proj are zero, so the residual stream is the current token's (one-hot)
  embedding and the lm_head is a successor table (logit TOOL_GAIN for the successor, 0 for
  every other token, so sampling follows it too). The chains run through added tokens
  (TOOL_TURNS), each token once: the chat template ends the prompt with <|step1|>, <|step2|>
  or <|step3|> for 0, 1 or 2+ tool results in the conversation, and the chain from it is
  turn 1 (hermes: content, then get_weather), turn 2 (two parallel calls: get_time, then
  get_weather) and turn 3 (a final answer), each ended by <|end|>, the EOS. The arguments
  are cut mid-string, mid-number, mid-escape (a piece ends in the backslash of \" or \n)
  and mid-character (turn 1's É is two byte tokens). A turn's text tokenizes back to its
  tokens, and a conversation that replays the turns renders as the earlier prompt, the turn
  and <|end|>, token for token (the build asserts both, and generates each turn with
  transformers). tool_chain.json beside the weights lists each turn's ids, text, content and
  calls (as the parser gives them) for the tests.
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch  # type: ignore[import-not-found]  # the engine venv has it, .venv not
from tokenizers import (  # type: ignore[import-not-found]
    AddedToken,
    Tokenizer,
    decoders,
    models,
    pre_tokenizers,
)
from transformers import (  # type: ignore[import-not-found]
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

SPECIALS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
THINK = ["<think>", "</think>"]  # ids 263 and 264 in tiny-think
VOCAB = 264  # 256 bytes + 7 specials, padded to a multiple of 8
THINK_VOCAB = 272  # + <think>, </think>, padded again
HIDDEN = 128
# Room for streams long enough that a kill lands mid-stream even on llama-server, which
# generates ~2,000 tokens/s with this model.
CONTEXT = 4096
# A final assistant message with no generation prompt renders without <|end|>, so
# "prompt + partial reply" renders as the prompt followed by the partial reply.
CHAT_TEMPLATE = (
    "<|bos|>{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% if not (loop.last and m['role'] == 'assistant' and not add_generation_prompt) %}"
    "<|end|>{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
THINK_TEMPLATE = CHAT_TEMPLATE.replace(
    "{% if add_generation_prompt %}<|assistant|>{% endif %}",
    "{% if add_generation_prompt %}<|assistant|><think>{% endif %}",
)
# tiny-think-early(-special): DeepSeek-R1's own generation prompt, <think> and a newline.
THINK_NL_TEMPLATE = THINK_TEMPLATE.replace("<think>{% endif %}", "<think>\n{% endif %}")
# ...and </think> early: at position THINK_EARLY_AT + 2, ~16 tokens into the reply to "hi".
THINK_EARLY_AT = 22
# tiny-wide (bench/kv_routing.py's real fleet): the tiny recipe, wider and deeper, so that a
# prefill costs what a cache saves (scripts/engines/README.md has the measured numbers), with
# room for an agent's growing context.
WIDE_HIDDEN, WIDE_LAYERS, WIDE_CONTEXT = 256, 2, 16384
# spec-draft and spec-target-*: heads SPEC_HIDDEN // 32 (head_dim 32).
SPEC_HIDDEN, SPEC_EXTRA = 512, 7
SPEC_AGREEMENT = {"spec-target-50": 0.50, "spec-target-80": 0.80, "spec-target-95": 0.95}
SPEC_TOLERANCE = 0.03  # what the build asserts; the search stops within SPEC_AIM
SPEC_AIM = 0.01
# Alpha as calibrated here (the build is seeded, so it lands on the same weights): tried
# first, so a fresh build measures each target once (each measure costs a minute or more on
# a loaded machine) and searches only where this machine's arithmetic lands elsewhere.
SPEC_ALPHA_FIRST = {0.50: 0.17129, 0.80: 0.0557859, 0.95: 0.0128233}
# Raw completion prompts (no chat template, as a speculative bench sends them), cut to one
# length so they run as one batch; SPEC_STEPS greedy tokens of the target after each.
SPEC_PROMPTS = [p[:40] for p in (
    "The fleet of engines served every request",
    "def resume(stream): return stream.tail()",
    "Once upon a time, a router kept a stream alive",
    "Speculative decoding drafts tokens cheaply",
    "SELECT id, name FROM backends WHERE healthy",
    "Dear team, the failover drill starts at noon",
    "for (int i = 0; i < n; i++) { total += x[i]; }",
    "<html><body><p>Tokens per second</p></body>",
    "Kubernetes pods restart when their probes fail",
    "import numpy as np\nx = np.zeros((3, 4)) + 1.5\n",
    "1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233, 377",
    "The quick brown fox jumps over the lazy dog again",
    "ERROR 2024-05-01 12:00:03 backend b7 timed out",
    "Q: What is the capital of France?\nA: Paris.\nQ:",
    "{\"model\": \"tiny\", \"max_tokens\": 64, \"stream\": true}",
    "In the beginning the router had only one backend",
)]  # fmt: skip
SPEC_STEPS = 256

# tiny-tools (vLLM --tool-call-parser hermes) and tiny-tools-llama3 (llama3_json): a Markov
# chain through added tokens. Every layer's o_proj and down_proj are zero, so the residual
# stream is the current token's embedding and the next token depends on it alone: each
# chain token has one successor (the lm_head is that table), every other token's is the EOS,
# <|end|>. The chat template opens the assistant turn with <|step1|>, <|step2|> or <|step3|>
# after 0, 1 or 2+ tool results in the conversation: the three turns of an agent loop.
# A piece is an added token (its text) or a byte token (an int: É as its two UTF-8 bytes, a
# cut mid-character); no two pieces are alike, and the text of a turn tokenizes back to
# exactly its pieces (the build asserts it), as does a conversation that replays a turn.
TOOL_STEPS = ["<|step1|>", "<|step2|>", "<|step3|>"]
TOOL_EOS = "<|end|>"  # id 262: the turn's end in the template is the EOS, as Qwen's <|im_end|>
PYTHON_TAG = "<|python_tag|>"  # llama3_json's parser wants it in the vocabulary (unused here)
E_ACUTE = list("É".encode())  # [0xC3, 0x89]
TOOL_ANSWER: list[str | int] = [
    "It is", " sunny in", " Saint-Étienne", " for 14", " days, and", " 09:30", " there."
]  # fmt: skip
TOOL_TURNS: dict[str, list[list[str | int]]] = {
    "hermes": [
        ["Let me", " check the", " weather", " first.\n", "<tool_call>",
         '\n{"name": "get_weather", ', '"arguments": {"city": "Saint-', *E_ACUTE,
         'tienne", "days": 1', "4}}\n", "</tool_call>"],
        ['<tool_call>\n{"name": "get_time", "arguments": ', '{"city": "Saint-Étienne", ',
         '"format": "HH:MM \\', '"24h\\"\\', 'nlocal"}}', "\n</tool_call>\n",
         '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', 'is", "days": 1',
         "0}}\n</tool_call>"],
        TOOL_ANSWER,
    ],
    # llama3_json takes a call only at the start of the text: no content before it.
    "llama3_json": [
        ['{"name": "get_weather", ', '"parameters": {"city": "Saint-', *E_ACUTE,
         'tienne", "days": 1', "4}}"],
        ['{"name": "get_time", "parameters": ', '{"city": "Saint-Étienne", ',
         '"format": "HH:MM \\', '"24h\\"\\', 'nlocal"}}',
         '; {"name": "get_weather", "parameters": {"city": "Par', 'is", "days": 1', "0}}"],
        TOOL_ANSWER,
    ],
}  # fmt: skip
TOOL_VARIANTS = {"tiny-tools": "hermes", "tiny-tools-llama3": "llama3_json"}
TOOL_GAIN = 30.0  # a successor's logit (every other is 0): greedy or sampled alike
# The template, per parser: the tools in the system turn, a past call as the model writes
# it (so a conversation that replays a turn renders its prompt + output token for token),
# and the opener from the number of tool results so far.
# Engines render it with trim_blocks: a newline right after a block tag is written {{ nl }}.
TOOL_SYSTEM = {
    "hermes": (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
        "{% for t in tools %}{{ nl }}{{ t | tojson }}{% endfor %}{{ nl }}</tools>\n\n"
        "For each function call, return a json object with function name and arguments "
        "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    ),
    "llama3_json": (
        "You have access to the following functions. To call functions, respond with JSON "
        'objects of the form {"name": function name, "parameters": dictionary of argument '
        'name and its value}, separated by "; ".\n\n'
        "{% for t in tools %}{{ t | tojson }}\n\n{% endfor %}"
    ),
}
TOOL_ARGS = (
    "{% if f.arguments is string %}{{ f.arguments }}{% else %}{{ f.arguments | tojson }}{% endif %}"
)
TOOL_CALL = {
    "hermes": '<tool_call>\n{"name": "{{ f.name }}", "arguments": ' + TOOL_ARGS + "}\n</tool_call>",
    "llama3_json": '{"name": "{{ f.name }}", "parameters": ' + TOOL_ARGS + "}",
}
TOOL_CALL_SEP = {"hermes": "{{ nl }}", "llama3_json": "; "}
TOOL_RESULT = {
    "hermes": "<|user|><tool_response>\n{{ m.content }}\n</tool_response><|end|>",
    "llama3_json": "<|user|>{{ m.content }}<|end|>",
}
TOOL_OPENER = "<|step{{ ([ns.results, 2] | min) + 1 }}|>"


def tool_template(parser: str) -> str:
    return (
        "{%- set ns = namespace(results=0) -%}{%- set nl = '\\n' -%}<|bos|>"
        "{%- if tools %}<|system|>{% if messages[0].role == 'system' %}"
        "{{ messages[0].content }}\n\n{% endif %}" + TOOL_SYSTEM[parser] + "<|end|>{% endif %}"
        "{%- for m in messages %}"
        "{%- if m.role == 'system' %}{% if not (tools and loop.first) %}"
        "<|system|>{{ m.content }}<|end|>{% endif %}"
        "{%- elif m.role == 'tool' %}{% set ns.results = ns.results + 1 %}"
        + TOOL_RESULT[parser] +
        "{%- elif m.role == 'assistant' %}<|assistant|>" + TOOL_OPENER + "{{ m.content or '' }}"
        "{%- for tc in m.tool_calls or [] %}"
        "{% set f = tc.function if tc.function is defined else tc %}"
        "{% if not loop.first %}" + TOOL_CALL_SEP[parser] + "{% endif %}" + TOOL_CALL[parser] +
        "{% endfor %}"
        "{%- if not (loop.last and not add_generation_prompt) %}<|end|>{% endif %}"
        "{%- else %}<|{{ m.role }}|>{{ m.content }}<|end|>"
        "{%- endif %}{%- endfor %}"
        "{%- if add_generation_prompt %}<|assistant|>" + TOOL_OPENER + "{% endif %}"
    )  # fmt: skip


ASCII = [10] + list(range(32, 127))
BYTES = [9, 10] + list(range(32, 127)) + list(range(128, 256))
LEADS = list(range(0xC2, 0xF5))  # bytes that start a 2-, 3- or 4-byte character
CONTINUATIONS = list(range(0x80, 0xC0))

# tiny-bytes: D_LEAD is LEAD_FLAG in a lead byte's embedding, NOT_LEAD in every other one,
# and the continuation rows of the lm_head read it with weight LEAD_BOOST: continuation bytes
# mostly follow a lead byte (tuned by hand on the test prompts: per 1,000 tokens about 350
# ASCII, 120 valid multi-byte characters and 300 U+FFFD; the output stays chaotic).
D_LEAD = HIDDEN - 1
LEAD_FLAG = 20.0
NOT_LEAD = -10.0
LEAD_BOOST = 4.0

# tiny-think's reserved residual dims. The residual stream of this random model has an RMS of
# 30 to 100 after its layers (r below), which the final RMSNorm divides every feature by.
D_CONST, D_BOS, D_TFLAG, D_COUNT, D_SEEN = (HIDDEN - 1 - i for i in range(5))
CONST = 0.3  # in every token's embedding, like the random entries (std 0.3)
FLAG = 1.0  # <|bos|>'s D_BOS, </think>'s D_TFLAG
THINK_AT = 500  # </think> is at (0-based) position THINK_AT + 2, prompt included
THINK_GAIN = 1e7  # how steeply the </think> logit climbs through the position THINK_AT
SEEN_QK = 10.0  # the query (D_CONST) and key (D_TFLAG) weights of the seen head


def byte_vocab() -> dict[str, int]:
    # GPT-2's printable stand-ins for the 256 bytes, in byte order: id == byte value.
    table = pre_tokenizers.ByteLevel.alphabet()
    mapping = {b: chr(b) for b in range(256) if chr(b) in table and b not in (0xAD,)}
    n = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + n)
            n += 1
    return {mapping[b]: b for b in range(256)}


def tokenizer(
    think: bool = False, special: bool = False, merge: tuple[str, str] | None = None,
    added: str | None = None, template: str | None = None,
) -> PreTrainedTokenizerFast:
    vocab = byte_vocab()
    for i, tok in enumerate(SPECIALS):
        vocab[tok] = 256 + i
    merges = []
    if merge is not None:  # tiny-merge: one merge (and the token it makes) more
        vocab[merge[0] + merge[1]] = len(vocab)
        merges.append(merge)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    if think:
        # Not special: skip_special_tokens keeps their text (DeepSeek-R1 style); special:
        # it drops it (the decoder skips them, as tokenizers' DecodeStream in vLLM does).
        tok.add_tokens([AddedToken(t, special=special, normalized=False) for t in THINK])
    if added is not None:  # tiny-added: one added (not special) token more
        tok.add_tokens([AddedToken(added, special=False, normalized=False)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        additional_special_tokens=SPECIALS[3:] + (THINK if special else []),
        chat_template=template or (THINK_TEMPLATE if think else CHAT_TEMPLATE),
        add_bos_token=False,  # the chat template writes <|bos|> itself
    )
    text = "hi there, {x}!\n"
    assert fast.decode(fast.encode(text)) == text, "tokenizer is not byte-exact"
    assert fast.encode("A") == [65], "token id must equal the byte value"
    if think:
        ids = fast.encode("<think>a</think>b")
        assert ids == [263, 97, 264, 98], ids
        shown = "ab" if special else "<think>a</think>b"
        assert fast.decode(ids, skip_special_tokens=True) == shown
        assert fast.decode(ids) == "<think>a</think>b"
    return fast


def random_model(
    vocab: int, hidden: int = HIDDEN, layers: int = 2, heads: int = 4, context: int = CONTEXT
) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2,
        head_dim=32,
        max_position_embeddings=context,
        initializer_range=0.3,
        tie_word_embeddings=False,
        bos_token_id=256,
        eos_token_id=257,
        pad_token_id=258,
        torch_dtype="float32",
    )
    return LlamaForCausalLM(config)


def rms(x: torch.Tensor, eps: float) -> float:
    """What LlamaRMSNorm divides `x` by."""
    return float((x.pow(2).mean() + eps).sqrt())


def only_rows(model: LlamaForCausalLM, keep: list[int]) -> None:
    """Zero every lm_head row but `keep`: greedy decoding can emit nothing else."""
    mask = torch.ones(model.config.vocab_size, dtype=torch.bool)
    mask[keep] = False
    model.lm_head.weight[mask] = 0.0


def reserve(model: LlamaForCausalLM, dims: list[int]) -> None:
    """Take residual dims away from the random network: no embedding, attention, MLP or
    lm_head weight reads or writes them; the variant then wires them by hand."""
    model.model.embed_tokens.weight[:, dims] = 0.0
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        for read in (a.q_proj, a.k_proj, a.v_proj, m.gate_proj, m.up_proj):
            read.weight[:, dims] = 0.0
        for write in (a.o_proj, m.down_proj):
            write.weight[dims, :] = 0.0
    model.lm_head.weight[:, dims] = 0.0


def build_tiny(model_dir: Path) -> None:
    fast = tokenizer()
    model = random_model(VOCAB)
    with torch.no_grad():
        only_rows(model, ASCII)
    save(model, fast, model_dir)


def build_altered(model_dir: Path, **change: Any) -> None:
    """tiny's weights (the same seed) behind a tokenizer one merge or one added token
    apart: vLLM serves it like tiny, and only the tokenizer tells them apart."""
    fast = tokenizer(**change)
    assert len(fast) == len(tokenizer()) + 1 <= VOCAB, len(fast)
    model = random_model(VOCAB)
    with torch.no_grad():
        only_rows(model, ASCII)
    save(model, fast, model_dir)


def build_wide(model_dir: Path) -> None:
    fast = tokenizer()
    model = random_model(VOCAB, hidden=WIDE_HIDDEN, layers=WIDE_LAYERS, heads=WIDE_HIDDEN // 32,
                         context=WIDE_CONTEXT)  # fmt: skip
    with torch.no_grad():
        only_rows(model, ASCII)
    save(model, fast, model_dir)


def build_bytes(model_dir: Path) -> None:
    fast = tokenizer()
    model = random_model(VOCAB)
    with torch.no_grad():
        only_rows(model, BYTES)
        reserve(model, [D_LEAD])
        model.model.embed_tokens.weight[:, D_LEAD] = NOT_LEAD
        model.model.embed_tokens.weight[LEADS, D_LEAD] = LEAD_FLAG
        model.lm_head.weight[CONTINUATIONS, D_LEAD] = LEAD_BOOST
    save(model, fast, model_dir)


def build_think(
    model_dir: Path, special: bool = False, at: int = THINK_AT, template: str | None = None
) -> None:
    fast = tokenizer(think=True, special=special, template=template)
    think_end = fast.convert_tokens_to_ids("</think>")
    bos = fast.convert_tokens_to_ids("<|bos|>")
    model = random_model(THINK_VOCAB)
    hd = model.config.head_dim
    with torch.no_grad():
        only_rows(model, ASCII + [think_end])
        reserve(model, [D_CONST, D_BOS, D_TFLAG, D_COUNT, D_SEEN])
        emb = model.model.embed_tokens.weight
        emb[:, D_CONST] = CONST
        emb[bos, D_BOS] = FLAG
        emb[think_end, D_TFLAG] = FLAG
        # Layer 0, KV head 1 (query heads 2 and 3) becomes the two counters.
        attn = model.model.layers[0].self_attn
        kv = slice(hd, 2 * hd)
        attn.k_proj.weight[kv] = 0.0
        attn.v_proj.weight[kv] = 0.0
        attn.q_proj.weight[2 * hd : 4 * hd] = 0.0
        attn.o_proj.weight[:, 2 * hd : 4 * hd] = 0.0
        # Query head 2 is all zero: it attends uniformly, and its value reads <|bos|>'s flag,
        # so it carries 1/(position+1) (the template starts every chat with <|bos|>).
        attn.v_proj.weight[hd + 0, D_BOS] = 1.0
        attn.o_proj.weight[D_COUNT, 2 * hd + 0] = 1.0
        # Query head 3 looks for </think>: its query reads the constant feature, the key
        # reads </think>'s flag, both on the slowest RoPE pair (dims 15/31: at 4,096 tokens'
        # distance it still turns by only 0.7 rad), so a </think> anywhere earlier takes
        # all its attention, and its value (the flag) lands on D_SEEN.
        slow = hd // 2 - 1
        attn.q_proj.weight[3 * hd + slow, D_CONST] = SEEN_QK
        attn.k_proj.weight[hd + slow, D_TFLAG] = SEEN_QK
        attn.v_proj.weight[hd + 1, D_TFLAG] = 1.0
        attn.o_proj.weight[D_SEEN, 3 * hd + 1] = 1.0
        # What the two heads carry: layer 0 reads the embeddings through its RMSNorm.
        eps = model.config.rms_norm_eps
        count = FLAG / rms(emb[bos], eps)  # D_COUNT = count / (position + 1)
        seen = FLAG / rms(emb[think_end], eps)  # D_SEEN once a </think> is in the context
        # The final RMSNorm divides every feature by the same RMS r, so the </think> logit,
        #   THINK_GAIN * CONST / r * (1 - (THINK_AT + 1.5) / (position + 1)) - penalty / r,
        # changes sign between positions THINK_AT and THINK_AT + 1 whatever r is, from about
        # -x to +x, x = THINK_GAIN * CONST / (2 * r * THINK_AT), 30 to 60 here (the random
        # logits peak near 10): </think> comes at position THINK_AT + 2.
        row = model.lm_head.weight[think_end]
        row[:] = 0.0  # no random part: the logit is exactly the one above
        row[D_CONST] = THINK_GAIN
        row[D_COUNT] = -THINK_GAIN * CONST * (at + 1.5) / count
        row[D_SEEN] = -2 * THINK_GAIN * CONST / seen
    save(model, fast, model_dir)


def spec_draft() -> LlamaForCausalLM:
    model = random_model(VOCAB, hidden=SPEC_HIDDEN, layers=1, heads=SPEC_HIDDEN // 32)
    with torch.no_grad():
        only_rows(model, ASCII)
    return model


def build_spec_draft(model_dir: Path) -> None:
    save(spec_draft(), tokenizer(), model_dir)


def agreement(draft: LlamaForCausalLM, target: LlamaForCausalLM, prompts: torch.Tensor) -> float:
    """The fraction of the target's own greedy tokens after `prompts` (a batch of one
    length) that the draft's argmax, teacher-forced over the same context, also picks."""
    n = prompts.shape[1]
    with torch.no_grad():
        out = target.generate(prompts, max_new_tokens=SPEC_STEPS, min_new_tokens=SPEC_STEPS,
                              do_sample=False, pad_token_id=target.config.pad_token_id)  # fmt: skip
        assert out.shape[1] == n + SPEC_STEPS, out.shape
        want = target(out).logits[:, n - 1 : -1].argmax(-1)
        # The cached decode and the full forward pass round differently; near-ties may differ.
        assert (want == out[:, n:]).float().mean() > 0.99
        got = draft(out).logits[:, n - 1 : -1].argmax(-1)
        return float((got == want).float().mean())


def build_spec_target(model_dir: Path, goal: float) -> None:
    draft = spec_draft()
    target = random_model(VOCAB, hidden=SPEC_HIDDEN, layers=1 + SPEC_EXTRA,
                          heads=SPEC_HIDDEN // 32)  # fmt: skip
    # The draft's tensors are the target's embeddings, layer 0, final norm and lm_head.
    missing, unexpected = target.load_state_dict(draft.state_dict(), strict=False)
    assert not unexpected and all(k.startswith("model.layers.") for k in missing), missing
    writes = [w for layer in target.model.layers[1:]
              for w in (layer.self_attn.o_proj.weight, layer.mlp.down_proj.weight)]  # fmt: skip
    base = [w.detach().clone() for w in writes]
    draft.eval()
    target.eval()
    fast = tokenizer()
    prompts = torch.tensor([fast.encode(p) for p in SPEC_PROMPTS])

    def measure(alpha: float) -> float:
        with torch.no_grad():
            for w, b in zip(writes, base, strict=True):
                w.copy_(b * alpha)
        return agreement(draft, target, prompts)

    # Agreement falls from 1 at alpha 0 (the draft itself) to ~0.06 at alpha 1 (the random
    # layers at full strength), close to exp(-4 alpha) between: regula falsi (Illinois) on
    # log agreement over alpha in [0, 1], alpha 1 taken as exp(-4) for the first guess.
    lo, hi = (0.0, -math.log(goal)), (1.0, -4.0 - math.log(goal))  # (alpha, log(agr / goal))
    best = (2.0, 0.0, 0.0)  # (|miss|, alpha, agreement)
    side = 0
    first = SPEC_ALPHA_FIRST.get(goal)
    for _ in range(12):
        alpha = hi[0] - hi[1] * (hi[0] - lo[0]) / (hi[1] - lo[1])
        if first is not None:  # the calibrated alpha; the search goes on from it if it misses
            alpha, first = first, None
        got = measure(alpha)
        print(f"  alpha {alpha:.6g}: agreement {got:.4f}", flush=True)
        best = min(best, (abs(got - goal), alpha, got))
        if abs(got - goal) <= SPEC_AIM:
            break
        miss = math.log(max(got, 1e-6) / goal)
        if miss > 0:  # too alike: alpha goes up
            lo = (alpha, miss)
            hi = (hi[0], hi[1] / 2) if side > 0 else hi
            side = 1
        else:
            hi = (alpha, miss)
            lo = (lo[0], lo[1] / 2) if side < 0 else lo
            side = -1
    if best[1] != alpha:
        _, alpha, got = best
        measure(alpha)
    print(f"alpha {alpha:.6g}: greedy agreement {got:.4f} (goal {goal})")
    assert abs(got - goal) <= SPEC_TOLERANCE, (alpha, got, goal)
    save(target, fast, model_dir)


def tool_tokenizer(parser: str) -> PreTrainedTokenizerFast:
    """The byte-level vocabulary and specials of tokenizer(), the three openers (special), and
    every str piece of TOOL_TURNS[parser] as an added token, not special (a stream shows its
    text whatever skip_special_tokens says)."""
    vocab = byte_vocab()
    for i, t in enumerate(SPECIALS):
        vocab[t] = 256 + i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    extra = TOOL_STEPS + ([PYTHON_TAG] if parser == "llama3_json" else [])
    tok.add_special_tokens(SPECIALS + extra)
    pieces = [p for turn in TOOL_TURNS[parser] for p in turn if isinstance(p, str)]
    assert len(set(pieces)) == len(pieces), "a piece twice: its successor would be ambiguous"
    tok.add_tokens([AddedToken(p, special=False, normalized=False) for p in pieces])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token=TOOL_EOS,
        pad_token="<|pad|>",
        additional_special_tokens=[s for s in SPECIALS + extra
                                   if s not in ("<|bos|>", TOOL_EOS, "<|pad|>")],  # fmt: skip
        chat_template=tool_template(parser),
        add_bos_token=False,
    )


def tool_calls_in(parser: str, text: str) -> tuple[str, list[dict[str, Any]]]:
    """(content, calls) of a turn's text as its parser reads it; a call's arguments are a
    JSON string written as json.dumps(..., ensure_ascii=False) writes it."""
    if parser == "hermes":
        at = text.find("<tool_call>")
        bodies = re.findall(r"<tool_call>\n(.*?)\n</tool_call>", text, re.DOTALL)
        content = text if at < 0 else text[:at]
    else:
        bodies = text.split("; ") if text.startswith("{") else []
        content = "" if bodies else text
    calls = []
    for body in bodies:
        obj = json.loads(body)
        args = obj["arguments" if parser == "hermes" else "parameters"]
        calls.append({"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)})
    return content, calls


def build_tools(model_dir: Path, parser: str) -> None:
    fast = tool_tokenizer(parser)
    end = fast.convert_tokens_to_ids(TOOL_EOS)
    steps = fast.convert_tokens_to_ids(TOOL_STEPS)
    turns = [[p if isinstance(p, int) else fast.convert_tokens_to_ids(p) for p in turn]
             for turn in TOOL_TURNS[parser]]  # fmt: skip
    successor: dict[int, int] = {}
    for step, turn in zip(steps, turns, strict=True):
        chain = [step, *turn, end]
        for a, b in zip(chain, chain[1:], strict=False):
            assert a not in successor, (a, b)
            successor[a] = b
    model = random_model(-(-len(fast) // 8) * 8)
    hidden = model.config.hidden_size
    assert len(successor) < hidden, "one residual dim per chain token, dim 0 for the rest"
    model.config.eos_token_id = model.generation_config.eos_token_id = end
    eps = model.config.rms_norm_eps
    with torch.no_grad():
        for layer in model.model.layers:  # nothing written to the residual stream
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight
        emb.zero_()
        head.zero_()
        # One-hot embeddings: the final RMSNorm scales the hot feature to 1 / rms.
        emb[:, 0] = 1.0
        head[end, 0] = TOOL_GAIN * rms(emb[0], eps)
        for dim, (a, b) in enumerate(successor.items(), start=1):
            emb[a, 0] = 0.0
            emb[a, dim] = 1.0
            head[b, dim] = TOOL_GAIN * rms(emb[a], eps)
    # What the model says and how its text tokenizes back, turn by turn; a conversation that
    # replays each turn (the calls as the parser reads them) renders as the earlier prompt,
    # the turn and its <|end|>.
    tools = [{"type": "function", "function": {"name": n, "description": n, "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}
        for n in ("get_weather", "get_time")]  # fmt: skip
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather and time?"}]
    chains = []
    prompt: list[int] = []
    for step, pieces, turn in zip(steps, TOOL_TURNS[parser], turns, strict=True):
        now = fast.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                       tokenize=True, return_dict=False)  # fmt: skip
        assert now[: len(prompt)] == prompt and now[-1] == step, (prompt, now)
        text = fast.decode(turn)
        assert fast.encode(text, add_special_tokens=False) == turn, (text, turn)
        for p, i in zip(pieces, turn, strict=True):
            assert isinstance(p, int) or fast.decode([i]) == p, (p, fast.decode([i]))
        out = model.generate(torch.tensor([now]), max_new_tokens=len(turn) + 5,
                             do_sample=False, pad_token_id=end)  # fmt: skip
        assert out[0, len(now) :].tolist() == [*turn, end], out[0, len(now) :].tolist()
        content, calls = tool_calls_in(parser, text)
        chains.append({"ids": [*turn, end], "text": text, "content": content, "calls": calls})
        messages.append({"role": "assistant", "content": content, "tool_calls": [
            {"id": f"c{len(messages)}{k}", "type": "function", "function": c}
            for k, c in enumerate(calls)]})  # fmt: skip
        messages += [{"role": "tool", "tool_call_id": f"c{len(messages) - 1}{k}",
                      "content": f"result {k}"} for k in range(len(calls))]  # fmt: skip
        prompt = [*now, *turn, end]
    assert [len(c["calls"]) for c in chains] == [1, 2, 0], chains
    save(model, fast, model_dir)
    # What the tests read: each opener's chain, its text and what the parser makes of it.
    info = {"parser": parser, "eos": end, "steps": steps, "turns": chains}
    (model_dir / "tool_chain.json").write_text(json.dumps(info, ensure_ascii=False, indent=1))


def save(model: LlamaForCausalLM, fast: PreTrainedTokenizerFast, model_dir: Path) -> None:
    model_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(model_dir, safe_serialization=True)
    fast.save_pretrained(model_dir)


VARIANTS: dict[str, Callable[[Path], None]] = {
    "tiny": build_tiny,
    "tiny-bytes": build_bytes,
    "tiny-think": build_think,
    "tiny-think-special": lambda d: build_think(d, special=True),
    "tiny-think-early": lambda d: build_think(d, at=THINK_EARLY_AT, template=THINK_NL_TEMPLATE),
    "tiny-think-early-special": lambda d: build_think(
        d, special=True, at=THINK_EARLY_AT, template=THINK_NL_TEMPLATE
    ),
    "tiny-wide": build_wide,
    "tiny-merge": lambda d: build_altered(d, merge=("h", "e")),
    "tiny-added": lambda d: build_altered(d, added="<|extra|>"),
    "spec-draft": build_spec_draft,
    **{name: partial(build_spec_target, goal=goal) for name, goal in SPEC_AGREEMENT.items()},
    **{name: partial(build_tools, parser=parser) for name, parser in TOOL_VARIANTS.items()},
}


if __name__ == "__main__":
    VARIANTS[sys.argv[2] if len(sys.argv) > 2 else "tiny"](Path(sys.argv[1]))

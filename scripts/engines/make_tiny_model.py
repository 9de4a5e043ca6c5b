"""Build the tiny random Llama every real-engine test serves, offline (no download).

Run with the engine venv's python (it has torch and transformers): `make_tiny_model.py OUT_DIR`.

Why it looks like this (see ../shared/research/backends.md):
- head_dim 32: vLLM's CPU attention needs head_dim >= 32 and a multiple of 16.
- initializer_range 0.3: greedy output is a long chaotic string, not one token repeated.
- token id = byte value (byte-level BPE with no merges), so tokenization is canonical and a
  text resume is exactly a token-id resume.
- lm_head rows of everything but printable ASCII and newline are zeroed: output is ASCII (no
  UTF-8 split across SSE deltas) and never EOS, so every request runs to max_tokens.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch  # type: ignore[import-not-found]  # the engine venv has it, .venv not
from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # type: ignore[import-not-found]
from transformers import (  # type: ignore[import-not-found]
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

SPECIALS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
VOCAB = 264  # 256 bytes + 7 specials, padded to a multiple of 8
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


def build(out: Path) -> None:
    vocab = byte_vocab()
    for i, tok in enumerate(SPECIALS):
        vocab[tok] = 256 + i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        additional_special_tokens=SPECIALS[3:],
        chat_template=CHAT_TEMPLATE,
        add_bos_token=False,  # the chat template writes <|bos|> itself
    )
    text = "hi there, {x}!\n"
    assert fast.decode(fast.encode(text)) == text, "tokenizer is not byte-exact"
    assert fast.encode("A") == [65], "token id must equal the byte value"

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=CONTEXT,
        initializer_range=0.3,
        tie_word_embeddings=False,
        bos_token_id=256,
        eos_token_id=257,
        pad_token_id=258,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    keep = [b for b in range(32, 127)] + [10]
    with torch.no_grad():
        mask = torch.ones(VOCAB, dtype=torch.bool)
        mask[keep] = False
        model.lm_head.weight[mask] = 0.0
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    fast.save_pretrained(out)


if __name__ == "__main__":
    build(Path(sys.argv[1]))

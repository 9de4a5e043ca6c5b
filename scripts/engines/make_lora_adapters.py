"""Build LoRA adapters for model/tiny offline with peft (no download), and check that each
one changes the model's greedy output.

Run with the engine venv's python (setup.sh's step `lora` installs peft into it):
`make_lora_adapters.py MODEL_DIR OUT_ROOT`, which writes OUT_ROOT/tiny-lora-a, -b and -c
(adapter_config.json + adapter_model.safetensors, what `vllm serve --enable-lora` loads) and,
beside each, greedy.json: the token ids transformers + peft decode greedily from each of
PROMPTS (the base model's too), for tests that compare an engine's output with them.

peft starts lora_B at zero (an adapter that changes nothing until it is trained), so the
weights here are set by hand: every lora_A and lora_B entry normal with std STD, from a seed
of the adapter's own, on the attention and MLP projections vLLM supports for Llama
(TARGETS), rank RANK. The update B @ A * (alpha / r) then has entries of std ~0.5, beside the
base's random 0.3 (make_tiny_model.py's initializer_range): the output is as chaotic as the
base's and another string. The base's lm_head is untouched, so an adapter emits ASCII only,
like tiny. The build fails unless, for every prompt, the base and the three adapters decode
four different strings.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch  # type: ignore[import-not-found]  # the engine venv has it, .venv not
from peft import LoraConfig, PeftModel, get_peft_model  # type: ignore[import-not-found]
from transformers import (  # type: ignore[import-not-found]
    AutoTokenizer,
    LlamaForCausalLM,
)

ADAPTERS = {"tiny-lora-a": 1, "tiny-lora-b": 2, "tiny-lora-c": 3}  # name -> seed
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK = 8  # vLLM's --max-lora-rank must be at least this
ALPHA = 16
STD = 0.3
# Raw completion prompts (no chat template, no BOS: token id = byte value).
PROMPTS = [
    "The router sent the request to",
    "def resume(stream):",
    "Once upon a time",
    "1, 2, 3, 5, 8,",
]
STEPS = 32  # greedy tokens after each prompt (tiny never emits its EOS)


def base_model(model_dir: Path) -> LlamaForCausalLM:
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    return model


def greedy(model: torch.nn.Module, prompts: list[list[int]]) -> list[list[int]]:
    out = []
    with torch.no_grad():
        for ids in prompts:
            gen = model.generate(torch.tensor([ids]), max_new_tokens=STEPS, do_sample=False,
                                 attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 pad_token_id=model.config.pad_token_id)  # fmt: skip
            out.append(gen[0, len(ids) :].tolist())
    return out


def build(model_dir: Path, out: Path, seed: int) -> None:
    config = LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=TARGETS,
                        bias="none", init_lora_weights=False, task_type="CAUSAL_LM")  # fmt: skip
    model = get_peft_model(base_model(model_dir), config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "lora_A" in name or "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * STD)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    (out / "README.md").unlink(missing_ok=True)  # peft's empty model card
    # peft records the base's absolute path on this machine; the name is what a reader wants.
    cfg_path = out / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["base_model_name_or_path"] = "tiny"
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def main(model_dir: Path, root: Path) -> int:
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tok.encode(p, add_special_tokens=False) for p in PROMPTS]
    assert prompts[0][:3] == list(b"The"), prompts[0]  # token id = byte value
    base = base_model(model_dir)
    outputs = {"tiny": greedy(base, prompts)}
    for name, seed in ADAPTERS.items():
        build(model_dir, root / name, seed)
        # Read back what was saved, as an engine would: the check covers the files.
        outputs[name] = greedy(PeftModel.from_pretrained(base_model(model_dir), root / name),
                               prompts)  # fmt: skip
    ok = True
    for i, p in enumerate(PROMPTS):
        texts = {n: tok.decode(o[i]) for n, o in outputs.items()}
        for n, t in texts.items():
            print(f"{p!r} {n}: {t!r}")
        if len(set(texts.values())) != len(texts):
            print(f"FAIL: {p!r}: two of {list(texts)} decode the same", file=sys.stderr)
            ok = False
    if not ok:
        return 1
    for name in ADAPTERS:
        greedy_json = {"prompts": PROMPTS, "prompt_ids": prompts, "max_tokens": STEPS,
                       "base": outputs["tiny"], "adapter": outputs[name]}  # fmt: skip
        (root / name / "greedy.json").write_text(json.dumps(greedy_json) + "\n")
    print(f"adapters {', '.join(ADAPTERS)}: each changes the greedy output of every prompt")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2])))

"""Convert a tiny model to GGUF with llama.cpp's own converter (from the llama-cpp-python
sdist), offline. Run with the engine venv's python: `hf_to_gguf.py LLAMA_CPP_DIR MODEL_DIR OUT`.

Two patches, both for the toy tokenizer (see docs/real-engines.md):
- its pre-tokenizer hash is unknown to the converter; it is GPT-2's ByteLevel regex, so it is
  declared `gpt-2`;
- llama.cpp refuses a gpt2 vocab without merges, so one dummy merge of bytes 0x00 and 0x01 is
  written; that pair never occurs in what the tests send, and no model generates it (even
  tiny-bytes, which emits any byte, emits no C0 control but tab and newline).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any


def main(llama_cpp: Path, model: Path, out: Path) -> None:
    sys.path[:0] = [str(llama_cpp), str(llama_cpp / "gguf-py")]
    import convert_hf_to_gguf  # type: ignore[import-not-found]
    import gguf  # type: ignore[import-not-found]
    from conversion import TextModel  # type: ignore[import-not-found]

    TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
    add_to_gguf = gguf.SpecialVocab.add_to_gguf

    def with_dummy_merge(self: Any, gw: Any, quiet: bool = False) -> None:
        if self.load_merges and not self.merges:
            self.merges = ["\u0100 \u0101"]
        add_to_gguf(self, gw, quiet)

    gguf.SpecialVocab.add_to_gguf = with_dummy_merge
    sys.argv = ["convert_hf_to_gguf.py", str(model), "--outfile", str(out), "--outtype", "f32"]
    convert_hf_to_gguf.main()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))

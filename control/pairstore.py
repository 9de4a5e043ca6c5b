"""Pairs bound at run time, kept in the data dir so a restarted control plane binds them again
(after reading both backends' facts anew: what was true before the restart is not trusted)."""

from __future__ import annotations

import os
from pathlib import Path

import orjson

from control.config import ConfigError, PairSpec, pair_spec


class PairFile:
    def __init__(self, path: Path) -> None:
        self.path = path

    def load(self) -> list[PairSpec]:
        try:
            raw = orjson.loads(self.path.read_bytes())
        except FileNotFoundError:
            return []
        except orjson.JSONDecodeError as exc:
            raise ConfigError(f"{self.path}: not JSON ({exc})") from None
        if not isinstance(raw, list):
            raise ConfigError(f"{self.path}: expected a list of pairs")
        return [pair_spec(r, f"{self.path}[{i}]") for i, r in enumerate(raw)]

    def save(self, pairs: list[PairSpec]) -> None:
        body = orjson.dumps(
            [{"draft": p.draft, "target": p.target, "num_draft_tokens": p.num_draft_tokens}
             for p in pairs],
            option=orjson.OPT_INDENT_2,
        )  # fmt: skip
        tmp = self.path.with_suffix(".tmp")
        tmp.write_bytes(body)
        os.replace(tmp, self.path)  # a crash leaves the old file or the new, never half

"""What every `baton` admin command prints: the table a person reads, or with --json the
data itself, for scripts."""

# baton: pure

from __future__ import annotations

import argparse
import json


def show(args: argparse.Namespace, data: object, text: str) -> None:
    print(json.dumps(data, indent=2) if args.json else text)

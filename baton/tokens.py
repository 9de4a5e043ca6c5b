"""The two bearer tokens' names and where each process finds the shim token: control, every
shim and `baton up` read them the same way (docs/operations.md#security)."""

from __future__ import annotations

import os
from pathlib import Path

ADMIN_ENV = "BATON_ADMIN_TOKEN"
SHIM_ENV = "BATON_SHIM_TOKEN"
SHIM_FILE_ENV = "BATON_SHIM_TOKEN_FILE"


class TokenError(ValueError):
    """A token file that cannot be read, or is empty; says which and why."""


def shim_token(path: str | Path | None) -> str | None:
    """BATON_SHIM_TOKEN, else the token in `path` (--shim-token-file); None: neither."""
    token = os.environ.get(SHIM_ENV) or None
    if token is not None or not path:
        return token
    try:
        token = Path(path).read_text().strip()
    except OSError as exc:
        raise TokenError(f"--shim-token-file: {exc}") from None
    if not token:
        raise TokenError(f"--shim-token-file: {path} is empty")
    return token

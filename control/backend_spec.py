"""A backend as an operator writes it (a [[backends]] table, `baton backends add`, a row of
fleet.db) made into a Backend, or refused with a ConfigError that says which field is wrong."""

# baton: pure

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from baton.model import Backend, BackendId, BackendKind, Role
from control.exceptions import ConfigError
from control.settings import PairSpec

_ZMQ_TCP = re.compile(r"tcp://([A-Za-z0-9][A-Za-z0-9_.-]*|\[[0-9A-Fa-f:.]+\]):([0-9]{1,5})")
_ZMQ_IPC = re.compile(r"ipc://(?!@$)[^\x00-\x1f\x7f]+")  # "@" alone names nothing
_SUN_PATH = 107  # bytes


def validate_zmq(endpoint: Any, where: str) -> str:
    """`tcp://HOST:PORT` (HOST a name or address control connects to, not a wildcard) or
    `ipc://PATH` (an engine on this machine)."""
    tcp = _ZMQ_TCP.fullmatch(endpoint) if isinstance(endpoint, str) else None
    if tcp is not None and 0 < int(tcp[2]) < 65536:
        return str(endpoint)
    ipc = _ZMQ_IPC.fullmatch(endpoint) if isinstance(endpoint, str) else None
    if ipc is not None and len(endpoint.removeprefix("ipc://").encode()) <= _SUN_PATH:
        return str(endpoint)
    raise ConfigError(f"{where} must be tcp://HOST:PORT (the engine's address; control "
                      f"connects) or ipc://PATH, got {endpoint!r}")  # fmt: skip


def kv_endpoints(backend_id: str, endpoint: Any, replay: Any) -> tuple[str, str]:
    """A backend's KV-event sockets, validated; "" for each it does not have. A replay
    socket alone is an error: nothing would ever ask it."""
    where = f"backend {backend_id!r}"
    if endpoint == "" and replay != "":
        raise ConfigError(f"{where}: kv_events_replay needs kv_events")
    return (validate_zmq(endpoint, f"{where}: kv_events") if endpoint != "" else "",
            validate_zmq(replay, f"{where}: kv_events_replay") if replay != "" else "")  # fmt: skip


def pair_spec(raw: Any, where: str) -> PairSpec:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be a table")
    unknown = set(raw) - {"draft", "target", "num_draft_tokens"}
    if unknown:
        raise ConfigError(f"{where}: unknown keys {sorted(unknown)}")
    draft, target, k = raw.get("draft"), raw.get("target"), raw.get("num_draft_tokens", 0)
    if not isinstance(draft, str) or not isinstance(target, str) or not draft or not target:
        raise ConfigError(f"{where}: draft and target must be backend ids")
    if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= 64:
        raise ConfigError(f"{where}: num_draft_tokens must be an integer in 0..64")
    return PairSpec(draft, target, k)


def validate_url(url: str) -> str:
    """Only plain http(s) origins; credentials in a URL would end up in logs and events."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"backend url must be http(s)://host[:port], got {_redacted(url)!r}")
    if parts.username or parts.password:
        raise ConfigError(f"backend url must not carry credentials: {_redacted(url)!r}")
    try:
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError as exc:
        raise ConfigError(f"backend url has a bad port: {_redacted(url)!r}") from exc
    return url.rstrip("/")


def _redacted(url: str) -> str:
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return parts._replace(netloc="***@" + parts.netloc.rsplit("@", 1)[1]).geturl()


def make_backend(
    id: str,
    url: str,
    model: str,
    kind: str = "vllm",
    role: str = "serve",
    api_key_env: str = "",
    reasoning_parser: str = "",
    tool_parser: str = "",
    kv_events: str = "",
    kv_events_replay: str = "",
    data_parallel_rank: Any = None,
) -> Backend:
    if not id or not isinstance(id, str):
        raise ConfigError("backend id must be a non-empty string")
    if not model or not isinstance(model, str):
        raise ConfigError(f"backend {id!r}: model must be a non-empty string")
    try:
        k = BackendKind(kind)
    except ValueError:
        raise ConfigError(
            f"backend {id!r}: kind must be one of {', '.join(BackendKind)}, got {kind!r}"
        ) from None
    try:
        r = Role(role)
    except ValueError:
        raise ConfigError(
            f"backend {id!r}: role must be one of {', '.join(Role)}, got {role!r}"
        ) from None
    if not isinstance(api_key_env, str) or (api_key_env and not _ENV_NAME.fullmatch(api_key_env)):
        raise ConfigError(
            f"backend {id!r}: api_key_env must name an environment variable, got {api_key_env!r}"
        )
    for key, name in (("reasoning_parser", reasoning_parser), ("tool_parser", tool_parser)):
        if not isinstance(name, str) or not _PARSER_NAME.fullmatch(name):
            raise ConfigError(
                f"backend {id!r}: {key} must be a parser name (lowercase letters, digits, '_' "
                f"and '-', as vLLM spells it, e.g. {_PARSER_EXAMPLE[key]!r}), got {name!r}"
            )
    kv = kv_endpoints(id, kv_events, kv_events_replay)
    rank = data_parallel_rank
    if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool)
                             or not 0 <= rank < MAX_DATA_PARALLEL_RANK):  # fmt: skip
        raise ConfigError(f"backend {id!r}: data_parallel_rank must be an integer in "
                          f"0..{MAX_DATA_PARALLEL_RANK - 1}, got {rank!r}")  # fmt: skip
    if rank is not None and k is not BackendKind.VLLM:
        raise ConfigError(f"backend {id!r}: data_parallel_rank is vLLM's (kind = \"vllm\")")
    return Backend(
        BackendId(id), validate_url(url), model, k, r, api_key_env, reasoning_parser, tool_parser,
        *kv, rank,
    )


MAX_DATA_PARALLEL_RANK = 4096  # far past any fleet's; a typo'd huge rank fails here, not per call


def data_parallel_ranks(raw: dict[str, Any]) -> list[dict[str, Any]]:
    """A backend table as the backends it declares: itself, or with `data_parallel_size = N`
    (the engine's --data-parallel-size) one per rank, `ID-rR` with `data_parallel_rank = R`
    and its KV-event endpoints moved as vLLM moves each rank's (port + R; vLLM refuses an
    ipc endpoint past rank 0), so the operator writes the engine's own settings once."""
    if "data_parallel_size" not in raw:
        return [raw]
    if not isinstance(raw["id"], str) or not raw["id"]:
        raise ConfigError("backend id must be a non-empty string")
    where = f"backend {raw['id']!r}"
    size, rest = raw["data_parallel_size"], {k: v for k, v in raw.items()
                                             if k != "data_parallel_size"}  # fmt: skip
    if (not isinstance(size, int) or isinstance(size, bool)
            or not 1 <= size <= MAX_DATA_PARALLEL_RANK):  # fmt: skip
        raise ConfigError(f"{where}: data_parallel_size must be an integer in "
                          f"1..{MAX_DATA_PARALLEL_RANK}, got {size!r}")  # fmt: skip
    if "data_parallel_rank" in rest:
        raise ConfigError(f"{where}: data_parallel_size declares every rank; "
                          "data_parallel_rank names one (give one or the other)")  # fmt: skip
    out = []
    for rank in range(size):
        one = {**rest, "id": f"{raw['id']}-r{rank}", "data_parallel_rank": rank}
        for key in ("kv_events", "kv_events_replay"):
            if one.get(key):
                one[key] = _rank_endpoint(one[key], rank, f"{where}: {key}")
        out.append(one)
    sockets = [one[k] for one in out for k in ("kv_events", "kv_events_replay") if one.get(k)]
    if len(sockets) != len(set(sockets)):
        raise ConfigError(f"{where}: its ranks' kv_events and kv_events_replay ports "
                          f"overlap (rank R uses each port + R): set them {size} or more "
                          "apart")  # fmt: skip
    return out


def _rank_endpoint(endpoint: Any, rank: int, where: str) -> Any:
    """Rank `rank`'s endpoint, as vLLM's publisher moves it (offset_endpoint_port)."""
    if rank == 0:
        return endpoint  # make_backend validates it
    tcp = _ZMQ_TCP.fullmatch(endpoint) if isinstance(endpoint, str) else None
    if tcp is None:
        raise ConfigError(f"{where}: with data_parallel_size, give the engine's "
                          "tcp://HOST:PORT (vLLM moves it by each rank; it refuses to move an "
                          f"ipc endpoint past rank 0), got {endpoint!r}")  # fmt: skip
    return f"tcp://{tcp[1]}:{int(tcp[2]) + rank}"


def check_ranks(backends: Sequence[Backend]) -> None:
    """No two backends are one rank of one data-parallel engine (Backend.clashes_with)."""
    for i, a in enumerate(backends):
        for b in backends[i + 1 :]:
            if a.clashes_with(b):
                raise ConfigError(
                    f"backends {a.id!r} and {b.id!r} share url {a.url} as the same engine: "
                    "give each its own data_parallel_rank (the engine's --data-parallel-size)"
                )


# Only a variable's name goes in config and on the wire; the key stays in each process's env.
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# An engine's output parser by name (vLLM --reasoning-parser / --tool-call-parser); "" = none.
_PARSER_NAME = re.compile(r"[a-z0-9_-]*")
_PARSER_EXAMPLE = {"reasoning_parser": "deepseek_r1", "tool_parser": "hermes"}


BACKEND_KEYS = frozenset(
    {"id", "url", "model", "kind", "role", "api_key_env", "reasoning_parser", "tool_parser",
     "kv_events", "kv_events_replay", "data_parallel_rank", "data_parallel_size"}
)  # fmt: skip

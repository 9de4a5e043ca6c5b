"""Pure rendering of admin results as aligned text tables (the CLI's non-JSON output)."""

# baton: pure

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict
from datetime import UTC, datetime
from typing import Any

from clients.client import BackendRow

# SOURCE: config, cli, or the discovery source that found it (k8s:NS/SERVICE, dns:NAME).
BACKEND_COLUMNS = ("id", "model", "kind", "role", "state", "source", "in_flight", "engine",
                   "since", "reason", "url")  # fmt: skip
# Shown only when some backend sets them (most fleets run no output parsers), before the url.
PARSER_COLUMNS = ("reasoning_parser", "tool_parser")
_URL = BACKEND_COLUMNS.index("url")
KV_COLUMN = "kv"  # shown when some backend has KV events configured: "live (120 blocks)"
# Where control reads them, each shown (after KV) only when some backend sets it.
KV_ENDPOINT_COLUMNS = ("kv_events", "kv_events_replay")


RANK_COLUMN = "rank"  # shown when some backend is one rank of a data-parallel engine
ADAPTERS_COLUMN = "adapters"  # shown when some backend serves LoRA adapters: "a,b (2/4)"


def _adapters(r: BackendRow) -> str:
    if not (r.max_adapters or r.adapters):
        return "-"
    return f"{','.join(r.adapters) or 'none'} ({len(r.adapters)}/{r.max_adapters or '?'})"


def _kv(r: BackendRow) -> str:
    if r.kv_index == "off":
        return "off"
    return f"{r.kv_index} ({r.kv_blocks} blocks)" if r.kv_index == "live" else r.kv_index


def table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> str:
    cells = [[str(r.get(c, "")) for c in columns] for r in rows]
    headers = [c.upper().replace("_", " ") for c in columns]
    widths = [max([len(h)] + [len(row[i]) for row in cells]) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    for row in cells:
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    return "\n".join(lines)


def backends(rows: Sequence[BackendRow]) -> str:
    if not rows:
        return "no backends registered (add one with `baton backends add`)"
    # A migrating drain shows in the state column: it is what the operator must wait on.
    parsers = _set_in(rows, PARSER_COLUMNS)
    kv = [KV_COLUMN] if any(r.kv_index != "off" or r.kv_events for r in rows) else []
    rank = [RANK_COLUMN] if any(r.data_parallel_rank is not None for r in rows) else []
    lora = [ADAPTERS_COLUMN] if any(r.max_adapters or r.adapters for r in rows) else []
    return table(
        [{**asdict(r), "state": f"{r.state} (migrate)" if r.migrating else r.state,
          KV_COLUMN: _kv(r), ADAPTERS_COLUMN: _adapters(r),
          RANK_COLUMN: "-" if r.data_parallel_rank is None else r.data_parallel_rank}
         for r in rows],
        (*BACKEND_COLUMNS[:_URL], *parsers, *kv, *_set_in(rows, KV_ENDPOINT_COLUMNS),
         *rank, *lora, *BACKEND_COLUMNS[_URL:]),
    )  # fmt: skip


def _set_in(rows: Sequence[BackendRow], columns: Sequence[str]) -> list[str]:
    """The optional columns some row has a value in (most fleets leave them all empty)."""
    return [c for c in columns if any(getattr(r, c) for r in rows)]


REPLICA_COLUMNS = ("replica", "address", "role")


def status(s: Mapping[str, Any]) -> str:
    head = (
        f"control {s['control']}  version {s['version']}  policy {s['routing_policy']}  "
        f"snapshot v{s['snapshot_version']}  in flight {s['in_flight']}  "
        f"up {s['uptime_seconds']}s"
    )
    lines = [head, *_replicas(s)]
    models = s["models"]
    lines.append(table(models, ("model", "backends", "healthy")) if models else "no models served")
    return "\n".join(lines)


def _replicas(s: Mapping[str, Any]) -> list[str]:
    """Control replicas, when control runs as several: who leads, who answered, the store
    (nothing for a single control)."""
    replicas = s.get("replicas") or []
    if not replicas:
        return []
    leader = s.get("leader") or "none elected"
    return [
        f"replica {s.get('replica_id') or '?'} answered  leader {leader}  "
        f"store {s.get('store') or '-'}",
        table([{**r, "replica": r["id"]} for r in replicas], REPLICA_COLUMNS),
    ]


EVENT_COLUMNS = ("time", "kind", "request_id", "backend_id", "summary")
SUMMARY_SKIP = {"v", "seq", "time", "kind", "request_id", "backend_id"}


def _flat(r: Mapping[str, Any]) -> dict[str, Any]:
    return {
        **r,
        "time": datetime.fromtimestamp(r["time"], UTC).isoformat(timespec="milliseconds"),
        "summary": " ".join(
            f"{k}={v}" for k, v in r.items() if k not in SUMMARY_SKIP and v not in ("", None)
        ),
    }


def events(rows: Sequence[Mapping[str, Any]]) -> str:
    if not rows:
        return "no matching events"
    return table([_flat(r) for r in rows], EVENT_COLUMNS)


def event_line(row: Mapping[str, Any]) -> str:
    """One event on one line (for `--follow`, where rows arrive one at a time)."""
    flat = _flat(row)
    return "  ".join(str(flat.get(c, "")) or "-" for c in EVENT_COLUMNS)


def parse_since(text: str, now: float) -> float:
    """`30s`, `5m`, `2h`, `1d` ago, or an ISO 8601 time (UTC when no zone is given)."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    if text and text[-1] in units and text[:-1].replace(".", "", 1).isdigit():
        return now - float(text[:-1]) * units[text[-1]]
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(
            f"--since wants e.g. 5m, 2h or 2026-11-29T10:00:00, not {text!r}"
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return when.timestamp()


PIN_COLUMNS = ("kind", "key", "backend_id", "depth", "hits", "last_used", "created")


def pins(rows: Sequence[Mapping[str, Any]], total: int) -> str:
    if not rows:
        return "no pins"
    return f"{total} pins (showing {len(rows)})\n" + table(rows, PIN_COLUMNS)


PAIR_COLUMNS = ("id", "model", "draft", "target", "state", "k", "baseline", "acceptance",
                "rounds", "params_hash", "reason")  # fmt: skip


def pairs(rows: Sequence[Mapping[str, Any]]) -> str:
    return table(rows, PAIR_COLUMNS) if rows else "no pairs"


TENANT_COLUMNS = ("id", "priority", "weight", "concurrent", "rpm", "tpm", "models", "budgets",
                  "keys")  # fmt: skip
USAGE_COLUMNS = ("tenant", "requests", "prompt_tokens", "completion_tokens", "cost", "refused",
                 "in_flight", "queued_seconds")  # fmt: skip
BUDGET_COLUMNS = ("tenant", "budget", "spent", "in_flight", "remaining", "resets")
KEY_NOTICE = "This key is shown once and will not be shown again: store it now (control keeps \
only its SHA-256 digest)."


def _tenant_cells(t: Mapping[str, Any]) -> dict[str, Any]:
    lim = t["limits"]

    def limit(v: int | None) -> str:
        return "-" if v is None else str(v)

    return {
        **t,
        "concurrent": limit(lim["concurrent"]),
        "rpm": limit(lim["requests_per_minute"]),
        "tpm": limit(lim["tokens_per_minute"]),
        "models": ",".join(lim["models"]) or "all",
        "budgets": " ".join(t.get("budgets", ())) or "-",
        # By key id (a prefix of the digest) and when it was made; a config key has no time.
        "keys": ", ".join(f"{k['key_id']} ({k['created'] or 'config'})" for k in t["keys"])
        or "none",
    }


def tenants(rows: Sequence[Mapping[str, Any]]) -> str:
    if not rows:
        return "no tenants (add one with `baton tenants add`)"
    return table([_tenant_cells(t) for t in rows], TENANT_COLUMNS)


def new_key(tenant: Mapping[str, Any], key: str, key_id: str, said: str) -> str:
    """A tenant with a key just made: the one time the key is printed."""
    return f"{said}\n{tenants([tenant])}\n\nkey {key_id}: {key}\n{KEY_NOTICE}"


def usage(rows: Sequence[Mapping[str, Any]]) -> str:
    if not rows:
        return "no tenants and no tenant traffic"
    out = table(
        [{**u, "refused": " ".join(f"{k}={v}" for k, v in u["refused"].items()) or "0"}
         for u in rows],
        USAGE_COLUMNS,
    )  # fmt: skip
    budgets = [{"tenant": u["tenant"], **b} for u in rows for b in u.get("budgets", ())]
    if budgets:
        out += "\n\nbudgets (this period)\n" + table(budgets, BUDGET_COLUMNS)
    unpriced = rows[0].get("unpriced_models") or ()
    if unpriced:
        out += f"\n\nno price (cost 0 against every budget): {', '.join(unpriced)}"
    return out


def adapters(rows: Sequence[Mapping[str, Any]]) -> str:
    if not rows:
        return ("no adapters (declare them in [[adapters]], or `baton adapters load NAME "
                "--base MODEL --source PATH`)")
    return table(
        [{**r, "held_by": ",".join(r["held_by"]) or "-",
          "loading_on": ",".join(r["loading_on"]) or "-",
          "declared": "yes" if r["declared"] else "found"} for r in rows],
        ("name", "base", "held_by", "loading_on", "demand_rps", "declared", "source"),
    )  # fmt: skip

from __future__ import annotations

import sqlite3
from dataclasses import replace
from pathlib import Path

import pytest

from baton.model import Backend, BackendId, BackendKind, Role
from control.exceptions import ConfigError
from control.fleet.db import SCHEMA_VERSION, Configured, FleetDB, configured, fleet, overlay
from control.settings import PairSpec


def b(bid: str, port: int = 1, role: Role = Role.SERVE) -> Backend:
    return Backend(BackendId(bid), f"http://127.0.0.1:{port}", "m", BackendKind.VLLM, role)


CONFIG = (b("a"), b("b"), b("c"))


@pytest.mark.parametrize(
    ("current", "added", "removed"),
    [
        (CONFIG, (), set()),  # nothing changed at run time: nothing to keep
        ((*CONFIG, b("d")), (b("d"),), set()),
        ((b("a"), b("c")), (), {"b"}),
        ((b("a"), b("b", port=2), b("c")), (b("b", port=2),), set()),  # removed, re-added
        ((b("x"),), (b("x"),), {"a", "b", "c"}),
    ],
)  # fmt: skip
def test_overlay_is_the_difference_and_fleet_applies_it(
    current: tuple[Backend, ...], added: tuple[Backend, ...], removed: set[str]
) -> None:
    diff = overlay(CONFIG, current)
    assert diff.added == added and diff.removed == removed
    assert sorted(fleet(CONFIG, diff), key=lambda x: x.id) == sorted(current, key=lambda x: x.id)


def test_a_backend_added_to_the_config_later_still_appears() -> None:
    saved = overlay(CONFIG, (b("a"), b("c"), b("d")))
    assert {x.id for x in fleet((*CONFIG, b("e")), saved)} == {"a", "c", "d", "e"}


def test_save_and_load_round_trip_in_a_new_connection(tmp_path: Path) -> None:
    state = configured(
        CONFIG,
        (b("a"), b("c"), b("d", role=Role.DRAFT)),
        {BackendId("a"): True, BackendId("c"): False},
        [PairSpec("d", "c", 3), PairSpec("d", "a", 5)],  # one pair per draft: the last wins
    )
    db = FleetDB(tmp_path / "data" / "fleet.db")
    db.save(state)
    db.close()
    again = FleetDB(tmp_path / "data" / "fleet.db").load()
    assert again == Configured(
        (b("d", role=Role.DRAFT),), frozenset({"b"}), {"a": True, "c": False},
        (PairSpec("d", "a", 5),),
    )  # fmt: skip


def test_each_save_replaces_the_last(tmp_path: Path) -> None:
    db = FleetDB(tmp_path / "fleet.db")
    db.save(Configured((b("x"),), frozenset({"a"}), {"x": False}, (PairSpec("x", "a"),)))
    db.save(Configured())
    assert db.load() == Configured()


def test_a_fresh_data_dir_loads_empty(tmp_path: Path) -> None:
    assert FleetDB(tmp_path / "fleet.db").load() == Configured()


def test_garbage_is_refused_loudly_not_ignored(tmp_path: Path) -> None:
    path = tmp_path / "fleet.db"
    path.write_bytes(b"not a database at all, but long enough to have a header" * 10)
    with pytest.raises(ConfigError, match="fleet database"):
        FleetDB(path)


def test_a_row_that_fails_validation_is_refused(tmp_path: Path) -> None:
    db = FleetDB(tmp_path / "fleet.db")
    db.save(Configured((Backend(BackendId("x"), "ftp://user:pw@h", "m"),)))
    with pytest.raises(ConfigError, match="http"):
        db.load()


@pytest.mark.parametrize(
    "fields",
    [
        # Output parsers, both or one.
        ({"reasoning_parser": "deepseek_r1", "tool_parser": "hermes"},
         {"reasoning_parser": "qwen3"}),
        # KV-event sockets of a backend added at run time, both or one.
        ({"kv_events": "tcp://10.0.0.7:5557", "kv_events_replay": "tcp://10.0.0.7:5558"},
         {"kv_events": "ipc:///run/vllm/kv"}),
        # Ranks of a data-parallel engine (0 is a rank, not none).
        ({"data_parallel_rank": 0}, {"data_parallel_rank": 3}),
    ],
    ids=["parsers", "kv_events", "ranks"],
)
def test_a_backends_optional_fields_survive_a_save_and_load(
    tmp_path: Path, fields: tuple[dict[str, str], dict[str, str]]
) -> None:
    saved = (replace(b("p"), **fields[0]), replace(b("q"), **fields[1]))
    db = FleetDB(tmp_path / "fleet.db")
    db.save(Configured(saved))
    db.close()
    assert FleetDB(tmp_path / "fleet.db").load().added == saved


# The `added` table's columns (after id) and one row in them, as earlier versions had it:
# version 1 had no key, 2 no parsers, 3 no KV events, 4 no ranks.
OLD_COLUMNS = ("url", "model", "kind", "role", "api_key_env", "reasoning_parser", "tool_parser",
               "kv_events", "kv_events_replay")  # fmt: skip
OLD_ROW = ("http://127.0.0.1:9", "m", "vllm", "serve", "OLD_KEY", "deepseek_r1", "hermes",
           "tcp://10.0.0.7:5557", "")  # fmt: skip
OLD_WIDTH = {1: 4, 2: 5, 3: 7, 4: 9}


@pytest.mark.parametrize("version", sorted(OLD_WIDTH))
def test_an_older_database_is_migrated_keeping_its_rows(tmp_path: Path, version: int) -> None:
    path = tmp_path / "fleet.db"
    cols = OLD_COLUMNS[: OLD_WIDTH[version]]
    old = sqlite3.connect(path)
    old.execute(f"CREATE TABLE added (id TEXT PRIMARY KEY, {', '.join(f'{c} TEXT' for c in cols)})")
    old.execute(f"INSERT INTO added (id, {', '.join(cols)}) VALUES (?{', ?' * len(cols)})",
                ("old", *OLD_ROW[: len(cols)]))  # fmt: skip
    old.execute(f"PRAGMA user_version = {version}")
    old.commit()
    old.close()

    db = FleetDB(path)
    # The old row, with empty values for what it had no column for: what it meant.
    had = cols[4:]
    kept = Backend(BackendId("old"), "http://127.0.0.1:9", "m",
                   **dict(zip(had, OLD_ROW[4:], strict=False)))  # fmt: skip
    assert db.load().added == (kept,)
    parsed = replace(b("new"), reasoning_parser="deepseek_r1", tool_parser="hermes",
                     kv_events="tcp://10.0.0.7:5557",
                     kv_events_replay="tcp://10.0.0.7:5558", data_parallel_rank=1)  # fmt: skip
    db.save(Configured((kept, parsed)))
    db.close()
    assert FleetDB(path).load().added == (kept, parsed)
    check = sqlite3.connect(path)
    assert check.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 7
    check.close()

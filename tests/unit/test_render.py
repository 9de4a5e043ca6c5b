from __future__ import annotations

import pytest

from clients import render

EVENT = {"v": 1, "seq": 3, "time": 1795950000.0, "kind": "admin", "request_id": "",
         "backend_id": "s0", "action": "drain"}  # fmt: skip


def test_table_aligns_columns_with_headers() -> None:
    text = render.table([{"a": "x", "b": 10}, {"a": "longer", "b": 2}], ("a", "b"))
    lines = text.splitlines()
    assert lines[0].split() == ["A", "B"]
    assert lines[1].index("10") == lines[2].index("2") == lines[0].index("B")


def test_event_line_and_table_show_the_kind_specific_fields() -> None:
    assert render.event_line(EVENT) == "2026-11-29T11:00:00.000+00:00  admin  -  s0  action=drain"
    assert "action=drain" in render.events([EVENT]) and render.events([]) == "no matching events"


@pytest.mark.parametrize(
    ("text", "now", "want"),
    [("30s", 1000.0, 970.0), ("5m", 1000.0, 700.0), ("2h", 10_000.0, 2800.0),
     ("2026-11-29T11:00:00", 0.0, 1795950000.0)],
)  # fmt: skip
def test_since_accepts_durations_and_times(text: str, now: float, want: float) -> None:
    assert render.parse_since(text, now) == want


def test_since_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="--since"):
        render.parse_since("yesterday-ish", 0.0)


def test_a_migrating_drain_shows_in_the_state_column() -> None:
    from clients.client import BackendRow

    row = BackendRow("s0", "http://h:1", "m", "vllm", "serve", "draining", "drained by admin",
                     "2026-01-01T00:00:00+00:00", 3, migrating=True)  # fmt: skip
    line = render.backends([row]).splitlines()[1]
    assert "draining (migrate)" in line


def test_parser_columns_show_only_when_some_backend_runs_a_parser() -> None:
    from clients.client import BackendRow

    plain = BackendRow("s0", "http://h:1", "m", "vllm", "serve", "healthy", "", "t", 0)
    assert "PARSER" not in render.backends([plain])
    parsed = BackendRow("s1", "http://h:2", "m", "vllm", "serve", "healthy", "", "t", 0,
                        reasoning_parser="deepseek_r1", tool_parser="hermes")  # fmt: skip
    head, one, two = render.backends([plain, parsed]).splitlines()
    assert head.split()[-5:] == ["REASONING", "PARSER", "TOOL", "PARSER", "URL"]
    assert two.split()[-3:] == ["deepseek_r1", "hermes", "http://h:2"]
    assert one.split()[-1] == "http://h:1"  # a backend without parsers leaves them blank


def test_kv_columns_show_the_index_and_where_its_events_come_from() -> None:
    from clients.client import BackendRow

    plain = BackendRow("s0", "http://h:1", "m", "vllm", "serve", "healthy", "", "t", 0)
    assert "KV" not in render.backends([plain])
    kv = BackendRow("s1", "http://h:2", "m", "vllm", "serve", "healthy", "", "t", 0,
                    kv_events="tcp://h:5557", kv_index="live", kv_blocks=120)  # fmt: skip
    head, one, two = render.backends([plain, kv]).splitlines()
    assert head.split()[-4:] == ["KV", "KV", "EVENTS", "URL"]  # no replay socket: no column
    assert two.split()[-5:] == ["live", "(120", "blocks)", "tcp://h:5557", "http://h:2"]
    assert one.split()[-2:] == ["off", "http://h:1"]
    replay = BackendRow("s2", "http://h:3", "m", "vllm", "serve", "healthy", "", "t", 0,
                        kv_events="tcp://h:5557", kv_events_replay="tcp://h:5558",
                        kv_index="lost")  # fmt: skip
    head, row = render.backends([replay]).splitlines()
    assert head.split()[-7:] == ["KV", "KV", "EVENTS", "KV", "EVENTS", "REPLAY", "URL"]
    assert row.split()[-4:] == ["lost", "tcp://h:5557", "tcp://h:5558", "http://h:3"]

from __future__ import annotations

from pathlib import Path

import pytest

from baton.model import BackendKind, Role
from control.config import load, parse
from control.exceptions import ConfigError


def test_loads_backends_and_settings(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(
        'routing = "roundrobin"\n[probes]\ninterval = 0.5\n'
        '[[backends]]\nid = "a"\nurl = "http://127.0.0.1:8001/"\nmodel = "m"\n'
        'kind = "sglang"\nrole = "target"\n'
    )
    cfg = load(path)
    (b,) = cfg.backends
    assert (b.id, b.url, b.kind, b.role) == (
        "a",
        "http://127.0.0.1:8001",
        BackendKind.SGLANG,
        Role.TARGET,
    )
    assert cfg.probes.interval == 0.5
    assert (b.reasoning_parser, b.tool_parser) == ("", "")  # an engine runs no parser unless said


def test_output_parsers_are_read_from_the_backend_table(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(
        '[[backends]]\nid = "a"\nurl = "http://127.0.0.1:8001"\nmodel = "m"\n'
        'reasoning_parser = "deepseek_r1"\ntool_parser = "hermes"\n'
        '[[backends]]\nid = "b"\nurl = "http://127.0.0.1:8002"\nmodel = "m"\n'
        'reasoning_parser = "qwen3"\n'
    )
    a, b = load(path).backends
    assert (a.reasoning_parser, a.tool_parser) == ("deepseek_r1", "hermes")
    assert (b.reasoning_parser, b.tool_parser) == ("qwen3", "")


@pytest.mark.parametrize("key", ["reasoning_parser", "tool_parser"])
@pytest.mark.parametrize("value", ["DeepSeek-R1", "deepseek r1", "hermes;rm", 1, True, None])
def test_a_parser_that_is_not_a_parser_name_is_refused(key: str, value: object) -> None:
    with pytest.raises(ConfigError, match=f"backend 'a': {key} must be a parser name") as info:
        parse({"backends": [{"id": "a", "url": "http://h", "model": "m", key: value}]})
    assert repr(value) in str(info.value)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"backends": [{"id": "a", "url": "ftp://h", "model": "m"}]}, "http\\(s\\)"),
        ({"backends": [{"id": "a", "url": "http://u:p@h:1", "model": "m"}]}, "credentials"),
        ({"backends": [{"id": "a", "url": "http://h:99999", "model": "m"}]}, "port"),
        ({"backends": [{"id": "a", "url": "http://h", "model": "m", "kind": "tgi"}]}, "kind"),
        ({"backends": [{"id": "a", "url": "http://h", "model": "m", "role": "x"}]}, "role"),
        ({"backends": [{"id": "a", "url": "http://h"}]}, "missing"),
        ({"backends": [{"id": "a", "url": "http://h", "model": "m", "weight": 1}]}, "unknown"),
        ({"backends": [{"id": "a", "url": "http://h", "model": "m"}] * 2}, "unique"),
        ({"routing": "magic"}, "routing"),
        ({"probes": {"intervall": 1}}, "unknown"),
    ],
)
def test_bad_config_is_refused_with_a_reason(data: dict, message: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ConfigError, match=message):
        parse(data)


def test_credentials_never_echoed() -> None:
    with pytest.raises(ConfigError) as info:
        parse({"backends": [{"id": "a", "url": "http://user:hunter2@h:1", "model": "m"}]})
    assert "hunter2" not in str(info.value)


def test_unreadable_and_invalid_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[[backends]\n")
    with pytest.raises(ConfigError, match="TOML"):
        load(bad)


def test_audit_route_events_can_be_turned_off() -> None:
    assert parse({}).audit.route_events is True
    assert parse({"audit": {"route_events": False}}).audit.route_events is False
    with pytest.raises(ConfigError, match="unknown"):
        parse({"audit": {"routes": False}})


def test_pairs_in_config_are_checked_for_shape() -> None:
    cfg = parse({"pairs": [{"draft": "d", "target": "t", "num_draft_tokens": 4}]})
    assert cfg.pairs[0].draft == "d" and cfg.pairs[0].num_draft_tokens == 4
    with pytest.raises(ConfigError, match="unknown keys"):
        parse({"pairs": [{"draft": "d", "target": "t", "temperature": 0}]})
    with pytest.raises(ConfigError, match="num_draft_tokens"):
        parse({"pairs": [{"draft": "d", "target": "t", "num_draft_tokens": -1}]})

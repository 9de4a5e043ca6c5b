from __future__ import annotations

from pathlib import Path

import pytest
import zmq

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


BASE = {"id": "a", "url": "http://10.0.0.7:8000", "model": "m"}


def test_a_backends_kv_events_are_the_engines_sockets_control_connects_to() -> None:
    raw = {**BASE, "kv_events": "tcp://10.0.0.7:5557", "kv_events_replay": "tcp://10.0.0.7:5558"}
    cfg = parse({"backends": [raw, {**BASE, "id": "i", "kv_events": "ipc:///run/vllm/kv"},
                              {**BASE, "id": "n"}]})  # fmt: skip
    a, i, n = cfg.backends
    assert (a.kv_events, a.kv_events_replay) == ("tcp://10.0.0.7:5557", "tcp://10.0.0.7:5558")
    assert (i.kv_events, i.kv_events_replay) == ("ipc:///run/vllm/kv", "")
    assert (n.kv_events, n.kv_events_replay) == ("", "")  # no events unless said
    assert parse({"kv": {"capacity": 10}}).kv.capacity == 10


# Each refused here would otherwise reach zmq's connect, which refuses it (or, for the
# wildcard, never connects): control would quietly keep no index.
BAD_ZMQ = ["tcp://*:5557", "tcp://h", "tcp://h:0", "tcp://h:65536", "http://h:5557",
           "tcp://bad host:5557", "tcp://h:5557?x=1", "tcp://h:5557/", " tcp://h:5557",
           "tcp://h\n:1", "tcp://user@h:1", "ipc://", "ipc://@", "ipc://\x00a",
           "ipc://" + "a" * 108, 5557, None]  # fmt: skip


@pytest.mark.parametrize("key", ["kv_events", "kv_events_replay"])
@pytest.mark.parametrize("value", BAD_ZMQ)
def test_a_kv_events_endpoint_control_could_not_connect_to_is_refused(
    key: str, value: object
) -> None:
    raw = {**BASE, "kv_events": "tcp://10.0.0.7:5557", key: value}
    with pytest.raises(ConfigError, match=f"backend 'a': {key} must be tcp://HOST:PORT") as info:
        parse({"backends": [raw]})
    assert repr(value) in str(info.value)


GOOD_ZMQ = ["tcp://10.0.0.7:5557", "tcp://vllm-0.internal:1", "tcp://[::1]:5557", "ipc:///tmp/kv",
            "ipc://@vllm-kv", "ipc://" + "a" * 107]  # fmt: skip


@pytest.mark.parametrize("value", GOOD_ZMQ)
def test_every_endpoint_accepted_is_one_zmq_connects_to(value: str) -> None:
    (b,) = parse({"backends": [{**BASE, "kv_events": value}]}).backends
    sock = zmq.Context.instance().socket(zmq.SUB)
    try:
        sock.connect(b.kv_events)  # raises ZMQError on what it refuses
    finally:
        sock.close(linger=0)


def test_a_fleet_that_publishes_kv_events_routes_by_predicted_ttft_unless_told() -> None:
    kv = {**BASE, "kv_events": "tcp://10.0.0.7:5557"}
    assert parse({"backends": [kv, {**BASE, "id": "n"}]}).routing == "ttft"
    assert parse({"backends": [{**BASE, "id": "n"}]}).routing == "adaptive"
    assert parse({"backends": [kv], "routing": "adaptive"}).routing == "adaptive"


def test_the_ranks_of_a_data_parallel_engine_are_backends_on_one_url() -> None:
    ranks = [{**BASE, "id": f"r{i}", "data_parallel_rank": i} for i in range(2)]
    got = parse({"backends": ranks}).backends
    assert [(b.url, b.data_parallel_rank) for b in got] == [(BASE["url"], 0), (BASE["url"], 1)]
    # Two backends on one url without ranks stay allowed: the engine balances them.
    assert len(parse({"backends": [BASE, {**BASE, "id": "b"}]}).backends) == 2


@pytest.mark.parametrize(
    ("ranks", "message"),
    [
        ((0, 0), "share url .* give each its own data_parallel_rank"),
        ((0, None), "share url .* give each its own data_parallel_rank"),
        ((-1,), "data_parallel_rank must be an integer in 0..4095"),
        ((True,), "data_parallel_rank must be an integer"),
        (("1",), "data_parallel_rank must be an integer"),
        ((4096,), "data_parallel_rank must be an integer"),
    ],
)
def test_a_rank_that_is_not_one_engine_core_is_refused(
    ranks: tuple[object, ...], message: str
) -> None:
    backends = [{**BASE, "id": f"r{i}", **({} if r is None else {"data_parallel_rank": r})}
                for i, r in enumerate(ranks)]  # fmt: skip
    with pytest.raises(ConfigError, match=message):
        parse({"backends": backends})


def test_data_parallel_size_declares_every_rank_with_the_ports_vllm_gives_them() -> None:
    # The engine's own settings, once: vllm serve --data-parallel-size 3 with events on
    # tcp://*:5557 and replay on tcp://*:5567 (vLLM moves each rank's ports by its rank).
    dp = {**BASE, "id": "node0", "data_parallel_size": 3, "kv_events": "tcp://10.0.0.7:5557",
          "kv_events_replay": "tcp://10.0.0.7:5567"}  # fmt: skip
    got = parse({"backends": [dp]}).backends
    assert [(b.id, b.data_parallel_rank, b.kv_events, b.kv_events_replay) for b in got] == [
        (f"node0-r{r}", r, f"tcp://10.0.0.7:{5557 + r}", f"tcp://10.0.0.7:{5567 + r}")
        for r in range(3)
    ]
    assert {b.url for b in got} == {BASE["url"]}
    assert parse({"backends": [dp]}).routing == "ttft"  # a fleet publishing KV events
    plain = parse({"backends": [{**BASE, "data_parallel_size": 2}]}).backends
    assert [(b.id, b.data_parallel_rank, b.kv_events) for b in plain] == [("a-r0", 0, ""),
                                                                         ("a-r1", 1, "")]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"data_parallel_size": 0}, "data_parallel_size must be an integer in 1..4096"),
        ({"data_parallel_size": "2"}, "data_parallel_size must be an integer"),
        ({"data_parallel_size": 2, "data_parallel_rank": 1}, "give one or the other"),
        # vLLM refuses to move an ipc endpoint past rank 0: the engine would not start.
        ({"data_parallel_size": 2, "kv_events": "ipc:///run/kv"}, "tcp://HOST:PORT .* ipc"),
        # Rank 1's events would be rank 0's replay socket.
        ({"data_parallel_size": 2, "kv_events": "tcp://h:5557",
          "kv_events_replay": "tcp://h:5558"}, "ports overlap .* 2 or more apart"),
    ],
)
def test_a_data_parallel_size_that_cannot_be_the_engines_is_refused(
    extra: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        parse({"backends": [{**BASE, **extra}]})


def test_a_rank_is_vllms() -> None:
    with pytest.raises(ConfigError, match="data_parallel_rank is vLLM's"):
        parse({"backends": [{**BASE, "kind": "sglang", "data_parallel_rank": 0}]})


def test_a_replay_socket_without_kv_events_is_refused() -> None:
    with pytest.raises(ConfigError, match="backend 'a': kv_events_replay needs kv_events"):
        parse({"backends": [{**BASE, "kv_events_replay": "tcp://10.0.0.7:5558"}]})


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

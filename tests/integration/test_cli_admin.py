"""The `baton` admin CLI against a real control plane, and control's gRPC surface."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from baton.v1 import routing_pb2, routing_pb2_grpc
from tests.integration.harness import MODEL, fleet, metric, start_sim

pytestmark = pytest.mark.timeout(90)


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "clients.cli", *args], capture_output=True, text=True, timeout=30
    )


def test_list_status_add_drain_undrain_remove(tmp_path: Path) -> None:
    with fleet(tmp_path, n=2) as f:
        table = f.baton("backends", "list")
        assert table.returncode == 0
        assert table.stdout.splitlines()[0].split()[:5] == ["ID", "MODEL", "KIND", "ROLE", "STATE"]
        assert {"s0", "s1"} <= {line.split()[0] for line in table.stdout.splitlines()[1:]}

        status = json.loads(f.baton("status", "--json").stdout)
        assert status["routing_policy"] == "adaptive"
        assert status["models"] == [{"model": MODEL, "backends": 2, "healthy": 2}]

        drained = f.baton("backends", "drain", "s0", "--json")
        assert json.loads(drained.stdout)["state"] == "draining"
        c = openai.OpenAI(base_url=f.base_url, api_key="x", max_retries=0)
        for _ in range(4):
            c.completions.create(model=MODEL, prompt="x", max_tokens=2)
        assert metric(f.sims["s0"].ready, "vllm:request_success_total") == 0
        assert metric(f.sims["s1"].ready, "vllm:request_success_total") == 4
        assert f.backends()["s0"]["reason"] == "drained by admin"

        assert (
            json.loads(f.baton("backends", "undrain", "s0", "--json").stdout)["state"] == "healthy"
        )

        extra = start_sim()
        f.parts.append(extra)
        parsers = ("--reasoning-parser", "deepseek_r1", "--tool-parser", "hermes")
        added = f.baton("backends", "add", "s2", "--url", extra.ready, "--model", MODEL,
                        *parsers, "--json")  # fmt: skip
        assert added.returncode == 0, added.stderr
        assert json.loads(added.stdout)["reasoning_parser"] == "deepseek_r1"
        rows = f.backends()
        assert set(rows) == {"s0", "s1", "s2"}
        parsed = {bid: (r["reasoning_parser"], r["tool_parser"]) for bid, r in rows.items()}
        assert parsed == {"s0": ("", ""), "s1": ("", ""), "s2": ("deepseek_r1", "hermes")}
        table = f.baton("backends", "list")
        head, *lines = table.stdout.splitlines()
        assert "REASONING PARSER" in head and "TOOL PARSER" in head
        (s2,) = [line.split() for line in lines if line.split()[0] == "s2"]
        assert s2[-3:] == ["deepseek_r1", "hermes", extra.ready]
        for _ in range(3):
            c.completions.create(model=MODEL, prompt="x", max_tokens=2)
        assert metric(extra.ready, "vllm:request_success_total") >= 1

        assert f.baton("backends", "remove", "s2").returncode == 0
        assert set(f.backends()) == {"s0", "s1"}

        admin = json.loads(f.baton("events", "--kind", "admin", "--json").stdout)
        assert [(e["action"], e["backend_id"]) for e in admin] == [
            ("drain", "s0"),
            ("undrain", "s0"),
            ("add", "s2"),
            ("remove", "s2"),
        ]
        table = f.baton("events", "--kind", "admin", "--since", "10m")
        assert table.returncode == 0 and "action=drain" in table.stdout
        bad = f.baton("events", "--since", "yesterday-ish")
        assert bad.returncode == 1 and "--since" in bad.stderr


def test_refusals_are_readable_with_nonzero_exit(tmp_path: Path) -> None:
    with fleet(tmp_path, n=1) as f:
        dup = f.baton("backends", "add", "s0", "--url", "http://127.0.0.1:1", "--model", "m")
        assert dup.returncode == 1 and "ALREADY_EXISTS" in dup.stderr and "s0" in dup.stderr
        bad = f.baton("backends", "add", "z", "--url", "ftp://x", "--model", "m")
        assert bad.returncode == 1 and "http(s)" in bad.stderr
        parser = f.baton("backends", "add", "z", "--url", "http://127.0.0.1:1", "--model", "m",
                         "--reasoning-parser", "DeepSeek-R1")  # fmt: skip
        assert parser.returncode == 1 and "INVALID_ARGUMENT" in parser.stderr
        assert "reasoning_parser must be a parser name" in parser.stderr
        # A KV-events socket control could never connect to, or a replay socket alone.
        kv = f.baton("backends", "add", "z", "--url", "http://127.0.0.1:1", "--model", "m",
                     "--kv-events", "tcp://*:5557")  # fmt: skip
        assert kv.returncode == 1 and "INVALID_ARGUMENT" in kv.stderr
        assert "kv_events must be tcp://HOST:PORT" in kv.stderr and "Traceback" not in kv.stderr
        alone = f.baton("backends", "add", "z", "--url", "http://127.0.0.1:1", "--model", "m",
                        "--kv-events-replay", "tcp://127.0.0.1:5558")  # fmt: skip
        assert alone.returncode == 1 and "kv_events_replay needs kv_events" in alone.stderr
        assert set(f.backends()) == {"s0"}  # nothing refused was added
        missing = f.baton("backends", "drain", "nope")
        assert missing.returncode == 1 and "NOT_FOUND" in missing.stderr


def test_unreachable_control_plane_says_so() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    out = run_cli("backends", "list", "--control", f"127.0.0.1:{port}", "--timeout", "1")
    assert out.returncode == 1
    assert "cannot reach the control plane" in out.stderr
    assert "Traceback" not in out.stderr


def test_admin_token_is_enforced_and_the_shim_with_its_own_token_serves(tmp_path: Path) -> None:
    tokens = {"BATON_ADMIN_TOKEN": "s3cret", "BATON_SHIM_TOKEN": "sh1m"}
    with fleet(tmp_path, n=1, control_env=tokens, shim_env={"BATON_SHIM_TOKEN": "sh1m"}) as f:
        denied = f.baton("backends", "list", env={"BATON_ADMIN_TOKEN": ""})
        assert denied.returncode == 1 and "UNAUTHENTICATED" in denied.stderr
        wrong = f.baton("status", env={"BATON_ADMIN_TOKEN": "guess"})
        assert wrong.returncode == 1
        ok = f.baton("backends", "list", "--json", env={"BATON_ADMIN_TOKEN": "s3cret"})
        assert ok.returncode == 0 and json.loads(ok.stdout)[0]["id"] == "s0"
        c = openai.OpenAI(base_url=f.base_url, api_key="x", max_retries=0)
        assert c.completions.create(model=MODEL, prompt="x", max_tokens=2).choices[0].text


def test_grpc_health_and_reflection(tmp_path: Path) -> None:
    with fleet(tmp_path, n=1) as f, grpc.insecure_channel(f.control.ready) as channel:
        check = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="baton.v1.RoutingService"), timeout=5
        )
        assert check.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = stub.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
        )
        names = {s.name for r in replies for s in r.list_services_response.service}
        assert {"baton.v1.RoutingService", "baton.v1.AdminService"} <= names


def test_audit_log_survives_a_control_restart_and_can_be_followed(tmp_path: Path) -> None:
    from tests.integration.harness import Fleet, start_control, write_config

    sim = start_sim()
    data = tmp_path / "data"
    config = write_config(tmp_path / "c.toml", [("s0", sim.ready)])
    ctl = start_control(config, "--data-dir", str(data))
    try:
        f = Fleet({"s0": sim}, ctl, ctl)
        assert f.baton("backends", "drain", "s0").returncode == 0
        follower = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "clients.cli",
                "events",
                "--follow",
                "--json",
                "--kind",
                "admin",
                "--control",
                ctl.ready,
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert json.loads(follower.stdout.readline())["action"] == "drain"  # type: ignore[union-attr]
            assert f.baton("backends", "undrain", "s0").returncode == 0
            live = json.loads(follower.stdout.readline())  # type: ignore[union-attr]
            assert (live["action"], live["backend_id"]) == ("undrain", "s0")
        finally:
            follower.kill()
            follower.wait()
        ctl.stop()
        ctl = start_control(config, "--data-dir", str(data))
        f = Fleet({"s0": sim}, ctl, ctl)
        actions = [
            e["action"] for e in json.loads(f.baton("events", "--kind", "admin", "--json").stdout)
        ]
        assert actions == ["drain", "undrain"]
        assert f.baton("backends", "drain", "s0").returncode == 0
        seqs = [e["seq"] for e in json.loads(f.baton("events", "--json").stdout)]
        assert seqs == sorted(set(seqs))  # numbering carried on, no duplicates
    finally:
        ctl.stop()
        sim.stop()


def test_baton_up_runs_the_fleet_with_a_token_file_and_stops_cleanly(tmp_path: Path) -> None:
    import os
    import re
    import signal

    env = {k: v for k, v in os.environ.items() if k not in TOKEN_ENV}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    up = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "clients.cli",
            "up",
            "--sim",
            "2",
            "--listen",
            "127.0.0.1:0",
            "--control-listen",
            "127.0.0.1:0",
            "--metrics-listen",
            "127.0.0.1:0",
        ],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        line = up.stdout.readline()  # type: ignore[union-attr]
        found = re.search(r"base URL: (\S+)\s+\(control: (\S+)\)", line)
        assert found, line
        base_url, control = found.groups()
        token_file = tmp_path / ".baton" / "admin-token"
        assert token_file.stat().st_mode & 0o777 == 0o600
        # A shim token of its own, which the shim presents and nothing else holds.
        shim_token_file = tmp_path / ".baton" / "shim-token"
        assert shim_token_file.stat().st_mode & 0o777 == 0o600
        shim_token = shim_token_file.read_text().strip()
        assert shim_token and shim_token != token_file.read_text().strip()
        forged = routing_pb2.ReportAttemptFailureRequest(
            request_id="x", backend_id="sim-0", failure="connect", detail="forged"
        )
        with grpc.insecure_channel(control) as channel:
            routing = routing_pb2_grpc.RoutingServiceStub(channel)
            for md in ((), (("authorization", f"Bearer {token_file.read_text().strip()}"),)):
                with pytest.raises(grpc.RpcError) as refused:
                    routing.ReportAttemptFailure(forged, metadata=md, timeout=5)
                assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
        c = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0)
        assert (
            c.chat.completions.create(
                model="baton-sim", messages=[{"role": "user", "content": "hi"}], max_tokens=4
            )
            .choices[0]
            .message.content
        )
        cli = [
            sys.executable,
            "-m",
            "clients.cli",
            "backends",
            "list",
            "--json",
            "--control",
            control,
        ]
        found_token = subprocess.run(cli, cwd=tmp_path, env=env, capture_output=True, text=True)
        assert found_token.returncode == 0, found_token.stderr
        assert sorted(r["id"] for r in json.loads(found_token.stdout)) == ["sim-0", "sim-1"]
        elsewhere = subprocess.run(
            cli, cwd=tmp_path.parent, env=env, capture_output=True, text=True
        )
        assert elsewhere.returncode == 1 and "UNAUTHENTICATED" in elsewhere.stderr
    finally:
        up.send_signal(signal.SIGTERM)
        assert up.wait(30) == 0
    # Every part it started has stopped with it.
    assert parts_of(control) == []


TOKEN_ENV = ("BATON_ADMIN_TOKEN", "BATON_SHIM_TOKEN", "BATON_SHIM_TOKEN_FILE", "BATON_DATA_DIR")


def parts_of(control: str) -> list[str]:
    """Command lines of the processes started for the control plane at `control`."""
    out = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if f"--control {control}" in cmdline or f"--listen {control}" in cmdline:
            out.append(cmdline)
    return out


def test_baton_up_starts_cleanly_again_however_the_last_one_ended(tmp_path: Path) -> None:
    """`make up` any number of times in one checkout: after Ctrl-C, after SIGTERM, and after
    a SIGKILL of its whole process group (its parts die with it, leaving no orphans)."""
    import functools
    import os
    import re
    import signal

    from tests.integration.harness import wait_until

    env = {k: v for k, v in os.environ.items() if k not in TOKEN_ENV}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    argv = [sys.executable, "-m", "clients.cli", "up", "--sim", "2", "--listen", "127.0.0.1:0",
            "--control-listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"]  # fmt: skip

    def gone(control: str) -> bool:
        return parts_of(control) == []

    log = tmp_path / "up.log"
    for ending in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL, None):
        with log.open("a") as err:
            up = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                  stderr=err, text=True, start_new_session=True)  # fmt: skip
        try:
            line = up.stdout.readline()  # type: ignore[union-attr]
            found = re.search(r"base URL: (\S+)\s+\(control: (\S+)\)", line)
            assert found, (ending, line, log.read_text()[-2000:])
            base_url, control = found.groups()
            c = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0)
            chunks = list(
                c.chat.completions.create(
                    model="baton-sim", messages=[{"role": "user", "content": "hi"}],
                    max_tokens=4, stream=True,
                )
            )  # fmt: skip
            assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
            assert chunks[-1].choices[0].finish_reason in ("length", "stop")
        finally:
            if ending is None:
                up.send_signal(signal.SIGTERM)
            elif ending == signal.SIGKILL:
                os.killpg(up.pid, signal.SIGKILL)
            else:
                up.send_signal(ending)
            up.wait(30)
        if ending != signal.SIGKILL:
            assert up.returncode == 0, (ending, log.read_text()[-2000:])
        # However it ended, every part it started goes with it.
        assert wait_until(functools.partial(gone, control), 20), parts_of(control)
    assert not (tmp_path / ".baton" / "fleet.db").exists()  # the embedded fleet is not saved

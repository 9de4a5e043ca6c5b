"""A control restart with the same --data-dir keeps what operators changed at run time:
backends added and removed, drains (with --migrate), and speculative pairs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

from clients.procs import Part
from tests.integration.harness import MODEL, start_control, start_sim, wait_until
from tests.integration.harness import cli_json as baton

AGREE = ("--draft-agree-rate", "0.4")  # a draft whose facts match the target's


def backends(control: Part) -> dict[str, dict[str, Any]]:
    return {r["id"]: r for r in baton(control, "backends", "list")}


def pairs(control: Part) -> dict[str, dict[str, Any]]:
    return {r["draft"]: r for r in baton(control, "pairs", "list")}


def test_backends_drains_and_pairs_survive_a_control_restart(tmp_path: Path) -> None:
    s0, s1, d = start_sim(), start_sim(), start_sim(*AGREE)
    parts: list[Part] = [s0, s1, d]
    config = tmp_path / "control.toml"
    config.write_text(
        "[probes]\ninterval = 0.2\n\n"
        + "".join(
            f'[[backends]]\nid = "{bid}"\nurl = "{url}"\nmodel = "{MODEL}"\n\n'
            for bid, url in (("s0", s0.ready), ("s1", s1.ready), ("s2", "http://127.0.0.1:9"))
        )
    )
    data = ("--data-dir", str(tmp_path / "data"))
    try:
        control = start_control(config, *data)
        parts.append(control)
        baton(control, "backends", "add", "d", "--url", d.ready, "--model", MODEL,
              "--role", "draft", "--reasoning-parser", "deepseek_r1")  # fmt: skip
        baton(control, "backends", "remove", "s2")
        drained = baton(control, "backends", "drain", "s1", "--migrate")
        assert drained["state"] == "draining" and drained["migrating"] is True
        assert wait_until(lambda: "d" in pairs(control) or _bind(control))
        control.stop(grace=3)

        control = start_control(config, *data)
        parts.append(control)
        fleet = backends(control)
        assert sorted(fleet) == ["d", "s0", "s1"]  # config + added - removed
        assert fleet["d"]["role"] == "draft" and fleet["d"]["url"] == d.ready
        assert (fleet["d"]["reasoning_parser"], fleet["d"]["tool_parser"]) == ("deepseek_r1", "")
        assert fleet["s1"]["state"] == "draining" and fleet["s1"]["migrating"] is True
        assert fleet["s0"]["state"] == "healthy" and not fleet["s0"]["migrating"]
        # Bound again once control has re-read both backends' facts.
        assert wait_until(lambda: pairs(control).get("d", {}).get("state") == "active")
        assert pairs(control)["d"]["target"] == "s0" and pairs(control)["d"]["k"] == 3

        # Undo everything at run time; the next restart sees the config's fleet again
        # (minus s2, still removed: the operator's latest word wins over the file).
        baton(control, "backends", "undrain", "s1")
        baton(control, "pairs", "unbind", "d")
        baton(control, "backends", "remove", "d")
        control.stop(grace=3)
        control = start_control(config, *data)
        parts.append(control)
        fleet = backends(control)
        assert sorted(fleet) == ["s0", "s1"] and fleet["s1"]["state"] != "draining"
        assert pairs(control) == {}
    finally:
        for p in reversed(parts):
            p.stop(grace=3)


def _bind(control: Part) -> bool:
    """Binding reads both backends' facts now; the draft may not have been probed yet."""
    out = subprocess.run(
        [sys.executable, "-m", "clients.cli", "pairs", "bind", "d", "s0", "-k", "3",
         "--control", control.ready],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    return out.returncode == 0


def test_a_saved_backend_with_a_config_backends_id_wins_and_control_says_so(
    tmp_path: Path,
) -> None:
    """A backend re-added at run time with other fields is saved; after a restart it replaces
    the config file's backend of the same id (the operator's latest word), and control's log
    names it and says how to go back to the file's. The start never fails on it."""
    old, new = start_sim(), start_sim()
    parts: list[Part] = [old, new]
    config = tmp_path / "control.toml"
    config.write_text(f'[[backends]]\nid = "gpu"\nurl = "{old.ready}"\nmodel = "{MODEL}"\n')
    data = ("--data-dir", str(tmp_path / "data"))
    log = tmp_path / "control.log"
    try:
        control = start_control(config, *data)
        parts.append(control)
        baton(control, "backends", "remove", "gpu")
        baton(control, "backends", "add", "gpu", "--url", new.ready, "--model", MODEL)
        control.stop(grace=3)
        with log.open("w") as err:
            control = Part("control", ["control", "--config", str(config), "--listen",
                                       "127.0.0.1:0", "--metrics-listen", "", *data],
                           stderr=err.fileno())  # fmt: skip
        parts.append(control)
        assert backends(control)["gpu"]["url"] == new.ready
        said = log.read_text()
        assert "'gpu'" in said and "replaces the config file's" in said and old.ready in said
    finally:
        for p in reversed(parts):
            p.stop(grace=3)

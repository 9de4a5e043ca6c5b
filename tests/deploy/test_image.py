"""Baton's image, built as `make image` builds it on a Debian base made without a registry
(scripts/image_base.sh: mmdebstrap), and run as containers: control, a shim and two sims,
each its own container on the host's network. A chat stream goes through the shim; the sim
serving it is SIGKILLed from outside (`podman kill`) mid-stream, and the client still gets
the uninterrupted stream, byte for byte."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from clients.procs import free_port
from tests.deploy.containers import RUN_FLAGS, Container, podman, run
from tests.factories import sdk
from tests.integration.harness import MODEL, http, metric, wait_until, write_config

# A cold build fetches every dependency's wheel (about a minute here); later ones hit the
# layer cache and pip's cache mount.
pytestmark = [pytest.mark.deploy, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
BASE = "localhost/baton-base:bookworm"
IMAGE = "localhost/baton:deploy-test"
MESSAGES = [{"role": "user", "content": "the quick brown fox"}]
TOKENS = 48
CUT = 8  # tokens the client has when the serving sim stalls (and is killed)


@pytest.fixture(scope="module")
def image() -> str:
    """The image, built by the Makefile's own target on the mmdebstrap base."""
    podman()
    steps = [
        [str(ROOT / "scripts" / "image_base.sh"), BASE],
        ["make", "-C", str(ROOT), "image", f"BASE={BASE}", f"IMAGE={IMAGE}",
         "ENGINE_FLAGS=" + " ".join(RUN_FLAGS)],
    ]  # fmt: skip
    began = int(time.time())
    for argv in steps:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=840, check=False)
        assert out.returncode == 0, (argv, out.stdout[-4000:], out.stderr[-4000:])
    # Earlier builds of Baton's, left untagged by this one: a machine that runs this often
    # would fill its disk with them. Only Baton's (its label), never other images, and not
    # this build's stages (the next build's cache).
    subprocess.run([podman(), "image", "prune", "--force",
                    "--filter", "label=org.opencontainers.image.title=baton",
                    "--filter", f"until={began}"],
                   capture_output=True, timeout=120, check=False)  # fmt: skip
    return IMAGE


@dataclass
class Deployed:
    sims: dict[str, Container]
    control: Container
    shim: Container
    admin_token: str

    def baton(self, image: str, *args: str) -> Any:
        """The admin CLI, run from the image, with --json: its parsed output."""
        out = run(image, *args, "--json", "--control", self.control.ready,
                  env={"BATON_ADMIN_TOKEN": self.admin_token})  # fmt: skip
        assert out.returncode == 0, (args, out.stderr)
        return json.loads(out.stdout)


@pytest.fixture
def deployed(image: str, tmp_path: Path) -> Iterator[Deployed]:
    """Two sims (s0 stalls after CUT tokens of each request until it is killed), control with
    both in its config file, one shim; tokens by environment, as the manifests' Secrets give
    them."""
    prefix = f"baton-test-{os.getpid()}"
    admin, shim_token = secrets.token_hex(16), secrets.token_hex(16)
    started: list[Container] = []

    def start(name: str, *args: str, **kw: Any) -> Container:
        c = Container(image, f"{prefix}-{name}", args, **kw)
        started.append(c)
        return c

    try:
        sim = ("sim", "--model", MODEL, "--prefill-us-per-token", "0",
               "--decode-ms-per-step", "0")  # fmt: skip
        stall = ("--fault", f"stall-after={CUT},stall-seconds=600")
        sims = {
            "s0": start("s0", *sim, *stall, "--listen", f"127.0.0.1:{free_port()}"),
            "s1": start("s1", *sim, "--listen", f"127.0.0.1:{free_port()}"),
        }
        config = write_config(tmp_path / "control.toml", [(k, c.ready) for k, c in sims.items()])
        control = start(
            "control", "control", "--config", "/etc/baton/control.toml",
            "--listen", f"127.0.0.1:{free_port()}", "--metrics-listen", f"127.0.0.1:{free_port()}",
            env={"BATON_ADMIN_TOKEN": admin, "BATON_SHIM_TOKEN": shim_token},
            volumes=[f"{config}:/etc/baton/control.toml:ro"],
        )  # fmt: skip
        # A stall is not what fails this stream over: the kill is.
        shim = start(
            "shim", "shim", "--control", control.ready, "--listen", f"127.0.0.1:{free_port()}",
            "--inter-token-timeout", "300", env={"BATON_SHIM_TOKEN": shim_token},
        )  # fmt: skip
        yield Deployed(sims, control, shim, admin)
    finally:
        for c in reversed(started):
            c.remove()


def test_the_image_runs_as_a_user_of_its_own(image: str) -> None:
    out = subprocess.run(
        [podman(), "image", "inspect", "--format", "{{.Config.User}} {{.Config.Entrypoint}}",
         image], capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    assert out.stdout.split() == ["10001:10001", "[baton]"]
    who = run(image, "--help")
    assert who.returncode == 0 and "control" in who.stdout and "shim" in who.stdout


def test_a_sim_killed_mid_stream_in_its_container_is_invisible(
    image: str, deployed: Deployed
) -> None:
    # What an uninterrupted stream says: the other sim, asked directly (sims are
    # deterministic, and s1 has no fault).
    want = sdk(deployed.sims["s1"].ready + "/v1").chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, max_tokens=TOKENS
    )
    want_text = want.choices[0].message.content or ""
    assert len(want_text) > 0

    shim = deployed.shim.ready
    assert http("GET", shim + "/health/live")[0] == 200
    assert wait_until(lambda: http("GET", shim + "/health/ready")[0] == 200, 30)

    s0 = deployed.sims["s0"]
    chunks = []
    text, tokens = "", 0
    stream = sdk(shim + "/v1").chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, max_tokens=TOKENS, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    for ch in stream:
        chunks.append(ch)
        if ch.choices and ch.choices[0].delta.content:
            text += ch.choices[0].delta.content
            tokens += 1
            if tokens == CUT:
                # A fresh fleet's first request goes to s0, which now holds it, stalled.
                assert wait_until(lambda: metric(s0.ready, "vllm:num_requests_running") >= 1)
                s0.kill()
                assert wait_until(lambda: not s0.alive, 30)
    assert tokens > CUT, "the stream ended before its engine was killed"
    assert text == want_text
    assert len({ch.id for ch in chunks}) == 1 and len({ch.created for ch in chunks}) == 1
    roles = [ch.choices[0].delta.role for ch in chunks if ch.choices]
    assert roles.count("assistant") == 1
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert [f for f in finishes if f] == ["length"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == TOKENS

    events: list[dict[str, Any]] = []

    def failover_recorded() -> bool:
        events[:] = deployed.baton(image, "events", "--kind", "failover")
        return len(events) >= 1

    assert wait_until(failover_recorded, 30, interval=0.5)
    (event,) = events
    assert (event["from_backend"], event["to_backend"]) == ("s0", "s1")
    assert event["tokens_sent"] == CUT and event["path"] == "token"
    assert event["seam"] == "verified" and event["outcome"] == "resumed"

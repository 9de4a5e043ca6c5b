"""A guarded fleet for the credential tests (test_admin_auth, test_shim_auth), as real
processes: control with an admin token and a shim token over serve sims t0, t1 and a draft d;
a shim with the shim token; a chat turn through it left a reply pin (reported back by the
shim); d is paired with t0 after that turn, so no spec outcome can move the pair later."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from baton.v1 import admin_pb2, admin_pb2_grpc, fleet_pb2
from clients.procs import Part
from tests.integration.harness import (
    MODEL,
    http,
    start_control,
    start_shim,
    start_sims,
    wait_until,
    write_config,
)

RPC_TIMEOUT = 5.0


@dataclass
class TokenFleet:
    control: Part
    shim: Part
    channel: grpc.Channel  # open while the fleet is
    draft_url: str
    pair_id: str


def chat(base: str, content: str = "hello", stream: bool = True) -> tuple[int, bytes]:
    body = {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "You are a careful agent. " * 20},
            {"role": "user", "content": content},
        ],
        "max_tokens": 4,
        "temperature": 0,
        "stream": stream,
    }
    return http(
        "POST",
        base + "/v1/chat/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )


@contextmanager
def token_fleet(
    path: Path, admin_token: str, shim_token: str, *, drain_t1: bool = False
) -> Iterator[TokenFleet]:
    """`drain_t1`: t1 drained before the chat turn, so the turn (and every pin) is on t0."""
    parts: list[Part] = []
    try:
        sims = dict(zip(("t0", "t1", "d"), start_sims([()] * 3), strict=True))
        parts += sims.values()
        config = write_config(
            path / "control.toml", [(b, sims[b].ready) for b in ("t0", "t1")], probe_interval=0.2
        )
        tokens = {"BATON_ADMIN_TOKEN": admin_token, "BATON_SHIM_TOKEN": shim_token}
        control = start_control(config, env=tokens)
        parts.append(control)
        shim = start_shim(control.ready, env={"BATON_SHIM_TOKEN": shim_token})
        parts.append(shim)
        with grpc.insecure_channel(control.ready) as channel:
            admin = admin_pb2_grpc.AdminServiceStub(channel)
            kw: dict[str, Any] = {
                "metadata": (("authorization", f"Bearer {admin_token}"),),
                "timeout": RPC_TIMEOUT,
            }
            draft = fleet_pb2.Backend(
                id="d", url=sims["d"].ready, model=MODEL, kind=fleet_pb2.BACKEND_KIND_VLLM,
                role=fleet_pb2.BACKEND_ROLE_DRAFT,
            )  # fmt: skip
            admin.AddBackend(admin_pb2.AddBackendRequest(backend=draft), **kw)

            def all_healthy() -> bool:
                # Settled too: control has read every engine's context length (its own, later
                # snapshot), so a test comparing the fleet before and after a call sees only
                # what the call changed.
                rows = admin.ListBackends(admin_pb2.ListBackendsRequest(), **kw).backends
                healthy = {r.backend.id for r in rows if r.state == fleet_pb2.HEALTH_STATE_HEALTHY}
                return healthy == {"t0", "t1", "d"} and all(r.max_model_len for r in rows)

            assert wait_until(all_healthy)
            if drain_t1:
                admin.DrainBackend(admin_pb2.DrainBackendRequest(id="t1"), **kw)
            status, raw = chat(shim.ready)
            assert status == 200 and b"[DONE]" in raw, raw

            def reply_pinned() -> bool:
                # The prefix pins come with the route; the reply's (depth 3) only when the
                # shim reports the outcome (over the guarded RouteStream).
                pins = admin.ListPins(admin_pb2.ListPinsRequest(), **kw).pins
                return any(p.depth == 3 and (p.backend_id == "t0" or not drain_t1) for p in pins)

            assert wait_until(reply_pinned), "the chat turn left no reply pin"
            pair = admin.BindPair(
                admin_pb2.BindPairRequest(draft_backend_id="d", target_backend_id="t0"), **kw
            ).pair
            yield TokenFleet(control, shim, channel, sims["d"].ready, pair.id)
    finally:
        for p in reversed(parts):
            p.stop(grace=3)

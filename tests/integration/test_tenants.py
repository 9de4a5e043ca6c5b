"""Tenants enforced by control's admission, through real processes: two shims over one
control and sims; the tenants made with the real CLI; clients over HTTP and the official
OpenAI SDK. A limit holds across both shims, because control counts for all of them."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest

from clients.procs import Part
from tests.integration.harness import (
    MODEL,
    Fleet,
    fleet,
    http_full,
    metric,
    once_key_taken,
    start_shim,
    wait_until,
)

pytestmark = pytest.mark.timeout(180)

SLOW = ("--decode-ms-per-step", "20")  # 100 tokens: a 2 s stream to hold a slot with


@dataclass
class Two:
    fleet: Fleet
    shims: tuple[Part, Part]

    def tenant(self, tid: str, *flags: str) -> str:
        """Adds the tenant; its key, as the CLI shows it once."""
        out = self.fleet.baton("tenants", "add", tid, *flags, "--json")
        assert out.returncode == 0, out.stderr
        return str(json.loads(out.stdout)["key"])

    def wait_known(self, key: str) -> int:
        """Until both shims take the key (they learn it from control's next snapshot); the
        tokens the calls that got through used (they count against the tenant)."""
        used = [0]

        def taken(shim: Part) -> bool:
            status, body, _ = call(shim, key, max_tokens=1)
            if status == 200:
                used[0] += body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]
            return status != 401

        for shim in self.shims:
            assert wait_until(lambda s=shim: taken(s), timeout=10)
        return used[0]


@contextmanager
def two_shims(tmp_path: Path, sim_args: tuple[str, ...] = ()) -> Iterator[Two]:
    with fleet(tmp_path, 2, sim_args=sim_args) as f:
        second = start_shim(f.control.ready)
        f.parts.append(second)
        yield Two(f, (f.shim, second))


def call(
    shim: Part,
    key: str,
    *,
    max_tokens: int = 4,
    model: str = MODEL,
    prompt: str = "hello there",
) -> tuple[int, dict[str, Any], dict[str, str]]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    status, raw, headers = http_full(
        "POST", shim.ready + "/v1/completions", json.dumps(body).encode(),
        {"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
    )  # fmt: skip
    return status, json.loads(raw), {k.lower(): v for k, v in headers.items()}


class Holder:
    """A stream held open on `shim` (its first token in) until it ends by itself."""

    def __init__(self, shim: Part, key: str, tokens: int = 100) -> None:
        self.started = threading.Event()
        self.status = 0
        self._thread = threading.Thread(target=self._run, args=(shim, key, tokens), daemon=True)
        self._thread.start()

    def _run(self, shim: Part, key: str, tokens: int) -> None:
        client = openai.OpenAI(base_url=shim.ready + "/v1", api_key=key, max_retries=0)
        try:
            stream = client.completions.create(
                model=MODEL, prompt="hold", max_tokens=tokens, temperature=0, stream=True
            )
            for _ in stream:
                self.started.set()
            self.status = 200
        except openai.APIStatusError as exc:
            self.status = exc.status_code
        finally:
            self.started.set()

    def join(self) -> int:
        self._thread.join(timeout=60)
        return self.status


def test_concurrency_holds_across_two_shims(tmp_path: Path) -> None:
    with two_shims(tmp_path, SLOW) as two:
        key = two.tenant("acme", "--concurrent", "2")
        two.wait_known(key)
        held = [Holder(two.shims[0], key), Holder(two.shims[1], key)]
        for h in held:
            assert h.started.wait(30)
        assert all(h.status == 0 for h in held), "a holder ended before the test could look"
        for shim in two.shims:
            status, body, headers = call(shim, key)
            assert status == 429, body
            assert body["error"]["code"] == "rate_limit_exceeded", body
            assert body["error"]["type"] == "requests", body
            assert int(headers["retry-after"]) >= 1
        assert [h.join() for h in held] == [200, 200]
        # The slots are free again once the shims' reports of the two ends reach control.
        assert wait_until(lambda: call(two.shims[1], key)[0] == 200, timeout=10)


def test_requests_per_minute_hold_across_two_shims(tmp_path: Path) -> None:
    with two_shims(tmp_path) as two:
        key = two.tenant("acme", "--rpm", "4")
        # The key reaches the shims with control's next snapshot; each try counts.
        deadline = time.monotonic() + 10
        while call(two.shims[0], key, max_tokens=1)[0] == 401:
            assert time.monotonic() < deadline
        assert wait_until(lambda: call(two.shims[1], key, max_tokens=1)[0] != 401, timeout=10)
        used = 2  # one each above, at least: the window's count says exactly
        statuses = []
        remaining = []
        for i in range(6):
            status, body, headers = call(two.shims[i % 2], key)
            statuses.append(status)
            if status == 200:
                remaining.append(int(headers["x-ratelimit-remaining-requests"]))
                assert headers["x-ratelimit-limit-requests"] == "4"
            else:
                assert status == 429 and body["error"]["code"] == "rate_limit_exceeded", body
                assert headers["x-ratelimit-remaining-requests"] == "0"
                assert 1 <= int(headers["retry-after"]) <= 60
                assert headers["x-ratelimit-reset-requests"].endswith("s")
        assert statuses.count(200) == 4 - used, statuses  # exact, whichever shim served
        assert statuses == sorted(statuses), statuses  # every 200 before the first 429
        assert remaining == sorted(remaining, reverse=True) and remaining[-1] == 0, remaining


def test_tokens_per_minute_hold_to_within_one_request(tmp_path: Path) -> None:
    with two_shims(tmp_path) as two:
        key = two.tenant("acme", "--tpm", "200")
        served = two.wait_known(key)
        refused = None
        for i in range(40):
            status, body, headers = call(two.shims[i % 2], key, max_tokens=16)
            if status == 429:
                refused = (body, headers)
                break
            assert status == 200, body
            served += body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]
        assert refused is not None, "the tenant was never limited"
        body, headers = refused
        assert body["error"]["type"] == "tokens", body
        assert headers["x-ratelimit-limit-tokens"] == "200"
        one_request = 16 + len("hello there") + 4  # generous: a prompt token per char
        assert 200 - one_request <= served <= 200 + one_request, served


def test_keys_models_and_removal(tmp_path: Path) -> None:
    with two_shims(tmp_path) as two:
        key = two.tenant("acme", "--models", MODEL)
        other = two.tenant("other", "--models", "not-" + MODEL)
        two.wait_known(key)
        status, body, _ = call(two.shims[0], "sk-baton-not-a-key")
        assert status == 401 and body["error"]["code"] == "invalid_api_key", body
        status, body, _ = call(two.shims[0], "")
        assert status == 401, body
        assert wait_until(lambda: call(two.shims[1], other)[0] == 403, timeout=10)
        status, body, _ = call(two.shims[0], other)
        assert status == 403 and body["error"]["code"] == "model_not_allowed", body
        assert call(two.shims[0], key)[0] == 200
        out = two.fleet.baton("tenants", "remove", "acme")
        assert out.returncode == 0, out.stderr
        removed = time.monotonic()
        for shim in two.shims:
            assert wait_until(lambda s=shim: call(s, key)[0] == 401, timeout=5)
        assert time.monotonic() - removed <= 1.0 + 0.5  # one second, and the calls' own time


def test_rotation_loses_no_request(tmp_path: Path) -> None:
    with two_shims(tmp_path) as two:
        old = two.tenant("acme")
        two.wait_known(old)
        current = [old]
        failures: list[tuple[int, Any]] = []
        done = threading.Event()

        def client() -> None:
            for i in range(400):
                if done.is_set():
                    return
                status, body, _ = call(two.shims[i % 2], current[0], max_tokens=1)
                if status != 200:
                    failures.append((status, body))

        t = threading.Thread(target=client, daemon=True)
        t.start()
        out = two.fleet.baton("tenants", "keys", "add", "acme", "--json")
        assert out.returncode == 0, out.stderr
        new = json.loads(out.stdout)["key"]
        two.wait_known(new)
        current[0] = new  # the client moves to the new key, as an operator's rollout does
        old_id = [k["key_id"] for k in json.loads(out.stdout)["tenant"]["keys"]][0]
        out = two.fleet.baton("tenants", "keys", "revoke", "acme", old_id)
        assert out.returncode == 0, out.stderr
        for shim in two.shims:
            assert wait_until(lambda s=shim: call(s, old, max_tokens=1)[0] == 401, timeout=5)
        done.set()
        t.join(timeout=60)
        assert failures == []


def test_the_sdk_backs_off_on_retry_after_and_every_request_ends(tmp_path: Path) -> None:
    with two_shims(tmp_path, SLOW) as two:
        key = two.tenant("acme", "--concurrent", "1")
        two.wait_known(key)
        holder = Holder(two.shims[0], key, tokens=60)  # about 1.2 s
        assert holder.started.wait(30)
        sdk = openai.OpenAI(base_url=two.shims[1].ready + "/v1", api_key=key)  # 2 retries
        raw = sdk.completions.with_raw_response.create(
            model=MODEL, prompt="after", max_tokens=2, temperature=0
        )
        assert raw.http_response.status_code == 200
        assert raw.retries_taken >= 1  # it was refused first, waited, and got in
        assert holder.join() == 200


def test_with_control_killed_each_shim_enforces_its_share(tmp_path: Path) -> None:
    """Control SIGKILLed: each of the two shims it last counted admits half of the tenant's
    concurrency on its own (never none, never unlimited), and says so in a metric."""
    with two_shims(tmp_path, SLOW) as two:
        key = two.tenant("acme", "--concurrent", "4")
        two.wait_known(key)
        two.fleet.control.kill()
        for shim in two.shims:
            held = [Holder(shim, key), Holder(shim, key)]
            for h in held:
                assert h.started.wait(30)
            assert all(h.status == 0 for h in held), "a holder ended before the test could look"
            status, body, headers = call(shim, key)
            assert status == 429 and body["error"]["code"] == "rate_limit_exceeded", body
            assert metric(shim.ready, "baton_shim_tenant_share") == 2
            assert [h.join() for h in held] == [200, 200]
            assert wait_until(lambda s=shim: call(s, key)[0] == 200, timeout=10)


def test_the_tenant_is_on_route_and_failover_events_and_the_key_nowhere(tmp_path: Path) -> None:
    with fleet(tmp_path, 2, per_sim=[("--fault", "die-after=5")]) as f:
        out = f.baton("tenants", "add", "acme", "--json")
        assert out.returncode == 0, out.stderr
        key = json.loads(out.stdout)["key"]
        client = openai.OpenAI(base_url=f.base_url, api_key=key, max_retries=0)

        def streamed() -> str:
            chunks = client.completions.create(
                model=MODEL, prompt="who pays", max_tokens=16, temperature=0, stream=True
            )
            return "".join(c.choices[0].text for c in chunks if c.choices)

        # The key reaches the shim with control's next snapshot.
        assert once_key_taken(streamed)
        assert wait_until(lambda: events(f, "failover"), timeout=10)
        (failover,) = events(f, "failover")
        assert failover["tenant"] == "acme" and failover["outcome"] == "resumed", failover
        routes = events(f, "route")
        assert routes and {r["tenant"] for r in routes} == {"acme"}, routes
        everything = f.baton("events", "--json")
        assert everything.returncode == 0 and key not in everything.stdout


def events(f: Fleet, kind: str) -> list[dict[str, Any]]:
    out = f.baton("events", "--kind", kind, "--json")
    assert out.returncode == 0, out.stderr
    return list(json.loads(out.stdout))


ENDPOINTS: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"model": MODEL, "max_tokens": 2,
                             "messages": [{"role": "user", "content": "hi"}]},
    "/v1/completions": {"model": MODEL, "prompt": "hi", "max_tokens": 2},
    "/v1/responses": {"model": MODEL, "input": "hi", "max_output_tokens": 2},
    "/v1/messages": {"model": MODEL, "max_tokens": 2,
                     "messages": [{"role": "user", "content": "hi"}]},
    "/v1/embeddings": {"model": MODEL, "input": "hi"},
    "/tokenize": {"model": MODEL, "prompt": "hi"},
}  # fmt: skip


def test_every_endpoint_asks_for_a_key_and_counts_against_the_tenant(tmp_path: Path) -> None:
    with fleet(tmp_path, 1) as f:
        out = f.baton("tenants", "add", "acme", "--rpm", str(len(ENDPOINTS) + 1), "--json")
        assert out.returncode == 0, out.stderr
        key = json.loads(out.stdout)["key"]

        def post(path: str, key: str) -> tuple[int, dict[str, str]]:
            status, _, headers = http_full(
                "POST", f.shim.ready + path, json.dumps(ENDPOINTS[path]).encode(),
                {"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
            )  # fmt: skip
            return status, {k.lower(): v for k, v in headers.items()}

        assert wait_until(lambda: post("/tokenize", key)[0] == 200, timeout=10)  # key known
        remaining = []
        for path in ENDPOINTS:
            assert post(path, "sk-baton-wrong")[0] == 401, path
            status, headers = post(path, key)
            assert status == 200, path
            remaining.append(int(headers["x-ratelimit-remaining-requests"]))
        assert remaining == list(range(len(ENDPOINTS) - 1, -1, -1)), remaining
        assert post("/v1/embeddings", key)[0] == 429  # every endpoint counted

"""Priority bands and fair share when the fleet is saturated, through real processes: control
with [admission] (a capacity per backend), a shim, sims; tenants made with the real CLI;
clients over HTTP. Every flood is bounded in requests and time."""

from __future__ import annotations

import http.client
import json
import statistics
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.integration.harness import MODEL, Fleet, fleet, http_full, metric, wait_until

pytestmark = pytest.mark.timeout(240)

# Each backend serves 4 requests at once before it is full; a band leaves 25% of that per
# band above it: interactive may use 4, standard 3, batch 2 (of each backend).
ADMISSION = "[admission]\nbackend_capacity = 4\nheadroom = 0.25\nmax_wait = {wait}\n"
STEP = 0.030  # the sims' decode step: a 10-token answer takes about 0.3 s
SIM = ("--decode-ms-per-step", str(int(STEP * 1000)))


@contextmanager
def saturable(tmp_path: Path, wait: float) -> Iterator[Fleet]:
    with fleet(tmp_path, 2, sim_args=SIM, control_extra=ADMISSION.format(wait=wait)) as f:
        yield f


def tenant(f: Fleet, tid: str, *flags: str) -> str:
    out = f.baton("tenants", "add", tid, *flags, "--json")
    assert out.returncode == 0, out.stderr
    key = str(json.loads(out.stdout)["key"])
    # The shim takes the key with control's next snapshot.
    assert wait_until(lambda: ask(f, key, tokens=1)[0] != 401, timeout=10)
    return key


def ask(f: Fleet, key: str, tokens: int = 10) -> tuple[int, dict[str, Any], float]:
    """(status, body, seconds to the answer's first byte) of one streamed completion."""
    body = {"model": MODEL, "prompt": "p", "max_tokens": tokens, "temperature": 0,
            "stream": True}  # fmt: skip
    start = time.monotonic()
    status, raw, headers = http_full(
        "POST", f.shim.ready + "/v1/completions", json.dumps(body).encode(),
        {"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
    )  # fmt: skip
    took = time.monotonic() - start
    if status != 200:
        return status, {**json.loads(raw), "headers": headers}, took
    events = [line[6:] for line in raw.decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-3:]
    return status, {"events": len(events)}, took


def ttft(f: Fleet, key: str) -> float:
    """Seconds to the first token of a streamed completion (the SDK's view)."""
    import openai

    client = openai.OpenAI(base_url=f.base_url, api_key=key, max_retries=0)
    start = time.monotonic()
    stream = client.completions.create(model=MODEL, prompt="q", max_tokens=4, temperature=0,
                                       stream=True)  # fmt: skip
    first = None
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].text:
            first = time.monotonic() - start
    assert first is not None
    return first


# It times a few-millisecond TTFT against its own idle baseline through a flood it makes
# itself: other test files' processes on the same two cores are noise it cannot tell from
# the flood's, so it runs with nothing beside it (`make test` runs `alone` tests last).
@pytest.mark.alone
def test_interactive_is_served_through_a_batch_flood_and_batch_is_shed_with_retry_after(
    tmp_path: Path,
) -> None:
    with saturable(tmp_path, wait=2.0) as f:
        interactive = tenant(f, "app", "--priority", "interactive")
        batch = tenant(f, "jobs", "--priority", "batch")
        idle = statistics.median(ttft(f, interactive) for _ in range(9))
        stop = threading.Event()
        batch_results: Counter[int] = Counter()
        retry_after: list[str] = []

        def flood() -> None:  # 80 at once: ten times the fleet's 8 slots
            for _ in range(4):
                if stop.is_set():
                    return
                status, body, _ = ask(f, batch)
                batch_results[status] += 1
                if status == 429:
                    retry_after.append(body["headers"].get("Retry-After", ""))

        with ThreadPoolExecutor(80) as pool:
            flooding = [pool.submit(flood) for _ in range(80)]
            # Measured once the flood has filled batch's share and its queue.
            assert wait_until(lambda: batch_results[200] >= 4 or batch_results[429] > 0, 30)
            busy = []
            statuses = []
            for _ in range(9):
                start = time.monotonic()
                try:
                    busy.append(ttft(f, interactive))
                    statuses.append(200)
                except Exception as exc:  # noqa: BLE001 - judged below: none may fail
                    statuses.append(getattr(exc, "status_code", -1))
                    time.sleep(max(0.0, 0.05 - (time.monotonic() - start)))
            stop.set()
            for fut in flooding:
                fut.result(timeout=120)
        assert statuses == [200] * 9, statuses  # no 429 for the interactive tenant
        # The flood's own work (80 clients streaming through the same shim and sims, on the
        # same two cores) slows every first token by milliseconds: the host's, not the
        # router's (10 ms against an idle 6 ms, seen in a clean-clone .ci/run here with the
        # engines building beside it).
        # Without the bands the interactive request waits for a slot, a batch answer's whole
        # generation (10 steps, 0.3 s), or gets a 429: the bound allows a tenth of that.
        assert statistics.median(busy) <= 1.5 * idle + STEP, (busy, idle)
        assert batch_results[200] > 0, batch_results  # served with what is left
        assert batch_results[429] > 0, batch_results  # and shed past its wait
        assert set(batch_results) <= {200, 429}, batch_results
        assert retry_after and all(r.isdigit() and int(r) >= 1 for r in retry_after)
        # Control's per-tenant series say the same, with the tenant as the label.
        control = f.control.announced["METRICS"].removesuffix("/metrics")
        assert metric(control, "baton_tenant_requests_total", 'tenant="app"') >= 18
        shed = metric(control, "baton_tenant_refused_total", 'limit="saturated",tenant="jobs"')
        assert shed == batch_results[429], (shed, batch_results)
        assert metric(control, "baton_tenant_queued_seconds_total", 'tenant="jobs"') > 0
        assert metric(control, "baton_tenant_tokens_total", 'kind="completion",tenant="jobs"') > 0
        assert metric(control, "baton_queued_requests", 'priority="batch"') == 0  # all ended
        # Every request ended is counted out (the last ends' reports land within a flush).
        assert wait_until(
            lambda: metric(control, "baton_tenant_in_flight", 'tenant="jobs"') == 0, 10
        )


def test_two_tenants_of_one_class_share_by_weight(tmp_path: Path) -> None:
    with saturable(tmp_path, wait=60.0) as f:
        heavy = tenant(f, "heavy", "--weight", "3")
        light = tenant(f, "light", "--weight", "1")
        served: Counter[str] = Counter()
        lock = threading.Lock()
        done = threading.Event()
        target = 160  # completions counted while both are backlogged

        def client(name: str, key: str) -> None:
            for _ in range(200):
                if done.is_set():
                    return
                status, body, _ = ask(f, key)
                assert status == 200, body
                with lock:
                    if not done.is_set():
                        served[name] += body["events"]
                        if sum(served.values()) >= target * 12:  # tokens, with [DONE] and a role
                            done.set()

        with ThreadPoolExecutor(48) as pool:
            runs = [pool.submit(client, "heavy", heavy) for _ in range(24)]
            runs += [pool.submit(client, "light", light) for _ in range(24)]
            for r in runs:
                r.result(timeout=200)
        ratio = served["heavy"] / served["light"]
        assert 2.7 <= ratio <= 3.3, served


def test_a_client_that_leaves_while_waiting_is_dropped_from_the_queue(tmp_path: Path) -> None:
    """One backend with room for one request: a stream holds it; a second request waits in
    its band, and its client gives up. Control drops it at once (the queue empties and its
    tenant has nothing in flight) while the first still holds the slot."""
    admission = "[admission]\nbackend_capacity = 1\nmax_wait = 30\n"
    with fleet(tmp_path, 1, sim_args=("--decode-ms-per-step", "50"),
               control_extra=admission) as f:  # fmt: skip
        holder_key = tenant(f, "holder")
        leaver_key = tenant(f, "leaver")
        control = f.control.announced["METRICS"].removesuffix("/metrics")
        held = threading.Thread(target=ask, args=(f, holder_key, 200), daemon=True)  # ~10 s
        held.start()
        assert wait_until(
            lambda: metric(control, "baton_tenant_in_flight", 'tenant="holder"') == 1, 10
        )
        body = json.dumps({"model": MODEL, "prompt": "p", "max_tokens": 4}).encode()
        conn = http.client.HTTPConnection(f.shim.ready.removeprefix("http://"), timeout=10)
        conn.request("POST", "/v1/completions", body, {
            "Content-Type": "application/json", "Authorization": f"Bearer {leaver_key}"})
        assert wait_until(
            lambda: metric(control, "baton_queued_requests", 'priority="standard"') == 1, 10
        )
        conn.close()  # the client leaves while its request waits
        assert wait_until(
            lambda: metric(control, "baton_queued_requests", 'priority="standard"') == 0, 10
        )
        assert metric(control, "baton_tenant_in_flight", 'tenant="leaver"') == 0
        assert held.is_alive()  # the slot is still held: the queue was left, not served
        held.join(timeout=60)


@pytest.mark.parametrize("route_port", ["0", "off"], ids=["route-socket", "grpc"])
def test_a_waiting_request_gets_its_answer_when_room_frees(
    tmp_path: Path, route_port: str
) -> None:
    """Control's later answer reaches the shim whichever way its routes ride: the route
    socket, or gRPC's RouteStream when control has no socket."""
    admission = "[admission]\nbackend_capacity = 1\nmax_wait = 30\n"
    with fleet(tmp_path, 1, sim_args=("--decode-ms-per-step", "20"), control_extra=admission,
               control_args=("--route-port", route_port)) as f:  # fmt: skip
        key = tenant(f, "acme")
        control = f.control.announced["METRICS"].removesuffix("/metrics")
        holder: list[int] = []
        held = threading.Thread(target=lambda: holder.append(ask(f, key, 100)[0]), daemon=True)
        held.start()  # about 2 s on the one slot
        assert wait_until(
            lambda: metric(control, "baton_tenant_in_flight", 'tenant="acme"') == 1, 10
        )
        waited: list[tuple[int, dict[str, Any], float]] = []
        second = threading.Thread(target=lambda: waited.append(ask(f, key, 4)), daemon=True)
        second.start()
        assert wait_until(
            lambda: metric(control, "baton_queued_requests", 'priority="standard"') == 1, 10
        )
        held.join(timeout=60)
        second.join(timeout=60)
        assert holder == [200]
        status, body, _ = waited[0]
        assert status == 200, body  # served once the first freed the slot

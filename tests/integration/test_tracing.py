"""Failover traces exported over OTLP to a real OTLP TraceService on 127.0.0.1, from real
control, shim and sim processes; the span tree and its attributes are what Jaeger shows."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2

from tests.integration.harness import MODEL, fleet, wait_until

pytestmark = pytest.mark.timeout(90)
SERVER, CLIENT = trace_pb2.Span.SPAN_KIND_SERVER, trace_pb2.Span.SPAN_KIND_CLIENT


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list[tuple[str, trace_pb2.Span]] = []
        self._lock = threading.Lock()

    def Export(self, request: Any, context: Any) -> Any:
        with self._lock:
            for rs in request.resource_spans:
                service = next(
                    (
                        a.value.string_value
                        for a in rs.resource.attributes
                        if a.key == "service.name"
                    ),
                    "",
                )
                for ss in rs.scope_spans:
                    self.spans += [(service, s) for s in ss.spans]
        return trace_service_pb2.ExportTraceServiceResponse()

    def named(self, name: str) -> list[tuple[str, trace_pb2.Span]]:
        with self._lock:
            return [(svc, s) for svc, s in self.spans if s.name == name]


@pytest.fixture
def receiver() -> Iterator[tuple[Receiver, str]]:
    servicer = Receiver()
    server = grpc.server(ThreadPoolExecutor(4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"http://127.0.0.1:{port}"
    server.stop(0)


def attrs(span: trace_pb2.Span) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for a in span.attributes:
        v = a.value
        out[a.key] = v.string_value or v.int_value or v.double_value or v.bool_value
    return out


def test_a_failover_is_one_trace_across_shim_and_control(
    tmp_path: Path, receiver: tuple[Receiver, str]
) -> None:
    rx, endpoint = receiver
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_BSP_SCHEDULE_DELAY": "50"}
    with fleet(
        tmp_path,
        n=2,
        per_sim=[("--fault", "die-after=5")],
        probe_interval=60,
        control_env=env,
        shim_env=env,
    ) as f:
        c = openai.OpenAI(base_url=f.base_url, api_key="x", max_retries=0)
        text = "".join(
            ch.choices[0].text
            for ch in c.completions.create(
                model=MODEL, prompt="trace me", max_tokens=16, temperature=0, stream=True
            )
        )
        assert text
        assert wait_until(
            lambda: rx.named("baton.failover") and rx.named("baton.control.failover"), 10
        )
        ((svc, root),) = rx.named("POST /v1/completions")
        assert svc == "baton-shim" and root.kind == SERVER and not root.parent_span_id
        trace_id = root.trace_id
        ((_, route),) = rx.named("baton.route")
        assert route.kind == CLIENT and route.parent_span_id == root.span_id
        ((svc, decided),) = rx.named("baton.control.route")
        assert svc == "baton-control" and decided.kind == SERVER
        assert decided.trace_id == trace_id and decided.parent_span_id == route.span_id
        attempts = [s for _, s in rx.named("baton.attempt")]
        assert [attrs(s)["baton.backend"] for s in attempts] == ["s0"]
        assert attempts[0].parent_span_id == root.span_id and attempts[0].kind == CLIENT
        ((_, fo),) = rx.named("baton.failover")
        a = attrs(fo)
        assert fo.trace_id == trace_id
        assert (a["baton.from_backend"], a["baton.to_backend"]) == ("s0", "s1")
        assert a["baton.tokens_sent"] == 5 and a["baton.resume_path"] == "token"
        assert a["baton.seam"] == "verified" and a["baton.gap_ms"] > 0
        ((_, control_fo),) = rx.named("baton.control.failover")
        assert control_fo.trace_id == trace_id
        events = json.loads(f.baton("events", "--kind", "failover", "--json").stdout)
        assert [e["trace_id"] for e in events] == [trace_id.hex()]

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

from tests.integration.harness import MODEL, fleet, once_key_taken, wait_until

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

    def all(self) -> list[trace_pb2.Span]:
        with self._lock:
            return [s for _, s in self.spans]


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
        if v.HasField("array_value"):
            out[a.key] = [x.string_value for x in v.array_value.values]
        else:
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
        attempts = [s for _, s in rx.named(f"text_completion {MODEL}")]
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


def test_upstream_attempts_follow_the_genai_conventions(
    tmp_path: Path, receiver: tuple[Receiver, str]
) -> None:
    rx, endpoint = receiver
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_BSP_SCHEDULE_DELAY": "50"}
    secret = "a prompt nobody may record"
    with fleet(tmp_path, n=1, control_env=env, shim_env=env) as f:
        c = openai.OpenAI(base_url=f.base_url, api_key="x", max_retries=0)
        messages = [{"role": "user", "content": secret}]
        chat = c.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=8, temperature=0, seed=7, top_p=0.5
        )  # type: ignore[arg-type]
        list(c.completions.create(model=MODEL, prompt=secret, max_tokens=6, stream=True,
                                  stream_options={"include_usage": True}))  # fmt: skip
        streamed = list(c.responses.create(model=MODEL, input=secret, max_output_tokens=5,
                                           temperature=0, store=False, stream=True))  # fmt: skip
        emb = c.embeddings.create(model=MODEL, input=secret)
        wanted = {f"chat {MODEL}": 2, f"text_completion {MODEL}": 1, f"embeddings {MODEL}": 1}
        assert wait_until(
            lambda: all(len(rx.named(n)) >= k for n, k in wanted.items()), 10
        )
        by_op: dict[str, list[dict[str, Any]]] = {}
        for name in wanted:
            for svc, span in rx.named(name):
                assert svc == "baton-shim" and span.kind == CLIENT
                by_op.setdefault(name, []).append(attrs(span))
        port = int(f.sims["s0"].ready.rsplit(":", 1)[1])
        for a in [*by_op[f"chat {MODEL}"], *by_op[f"text_completion {MODEL}"],
                  *by_op[f"embeddings {MODEL}"]]:  # fmt: skip
            assert a["gen_ai.provider.name"] == "vllm" and a["gen_ai.request.model"] == MODEL
            assert (a["server.address"], a["server.port"]) == ("127.0.0.1", port)
            assert a["baton.backend"] == "s0"
        whole = next(a for a in by_op[f"chat {MODEL}"] if "gen_ai.request.seed" in a)
        assert whole["gen_ai.operation.name"] == "chat"
        assert whole["gen_ai.request.max_tokens"] == 8 and whole["gen_ai.request.seed"] == 7
        assert whole["gen_ai.request.top_p"] == 0.5
        assert whole["gen_ai.response.id"] == chat.id
        assert whole["gen_ai.response.finish_reasons"] == ["length"]
        assert chat.usage is not None
        assert whole["gen_ai.usage.input_tokens"] == chat.usage.prompt_tokens
        assert whole["gen_ai.usage.output_tokens"] == 8
        (comp,) = by_op[f"text_completion {MODEL}"]
        assert comp["gen_ai.operation.name"] == "text_completion"
        assert comp["gen_ai.usage.output_tokens"] == 6
        resp = next(a for a in by_op[f"chat {MODEL}"] if a is not whole)
        assert resp["gen_ai.request.max_tokens"] == 5 and resp["gen_ai.usage.output_tokens"] == 5
        assert streamed[-1].type == "response.completed"
        (embedded,) = by_op[f"embeddings {MODEL}"]
        assert embedded["gen_ai.operation.name"] == "embeddings"
        assert embedded["gen_ai.usage.input_tokens"] == emb.usage.prompt_tokens > 0
        assert embedded["gen_ai.response.id"] == emb.id
        for _, span in rx.spans:  # prompt and completion text are never recorded
            assert secret not in str(attrs(span))


def test_a_tenants_request_carries_its_tenant_on_both_route_spans_and_never_its_key(
    tmp_path: Path, receiver: tuple[Receiver, str]
) -> None:
    rx, endpoint = receiver
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_BSP_SCHEDULE_DELAY": "50"}
    with fleet(tmp_path, n=1, control_env=env, shim_env=env) as f:
        out = f.baton("tenants", "add", "acme", "--json")
        assert out.returncode == 0, out.stderr
        key = json.loads(out.stdout)["key"]
        c = openai.OpenAI(base_url=f.base_url, api_key=key, max_retries=0)

        assert once_key_taken(lambda: c.completions.create(model=MODEL, prompt="traced",
                                                            max_tokens=4))  # fmt: skip
        assert wait_until(lambda: rx.named("baton.route") and rx.named("baton.control.route"), 10)
        ((_, route),) = rx.named("baton.route")
        ((_, decided),) = rx.named("baton.control.route")
        assert attrs(route)["baton.tenant"] == attrs(decided)["baton.tenant"] == "acme"
        for s in rx.all():
            assert key not in str(attrs(s)), s.name

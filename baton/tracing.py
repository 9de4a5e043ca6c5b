"""OpenTelemetry set-up shared by control and the shim, configured by the standard OTEL_*
environment variables (OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_SERVICE_NAME, ...), exported over
OTLP, which Jaeger ingests directly.

Tracing is on when OTEL_EXPORTER_OTLP_ENDPOINT (or ..._TRACES_ENDPOINT) is set and
OTEL_TRACES_EXPORTER is not "none". When off, `Tracing.enabled` is False and callers skip
span work entirely, so it costs nothing on the hot path.

Baton's own span attributes start with `baton.`; an upstream attempt's span also carries the
OpenTelemetry GenAI conventions' `gen_ai.*` ones (docs/observability.md)."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

PROPAGATOR = TraceContextTextMapPropagator()

__all__ = ["SpanKind", "Tracing", "tracing_from_env"]


class Tracing:
    def __init__(self, tracer: Tracer, enabled: bool) -> None:
        self.tracer = tracer
        self.enabled = enabled

    @staticmethod
    def traceparent(context: Context | None = None) -> str:
        """The W3C `traceparent` of the current (or given) span, for a wire message."""
        carrier: dict[str, str] = {}
        PROPAGATOR.inject(carrier, context=context)
        return carrier.get("traceparent", "")

    @staticmethod
    def context_from(traceparent: str) -> Context:
        return PROPAGATOR.extract({"traceparent": traceparent})

    @staticmethod
    def headers() -> dict[str, str]:
        carrier: dict[str, str] = {}
        PROPAGATOR.inject(carrier)
        return carrier

    @staticmethod
    def trace_id() -> str:
        ctx = trace.get_current_span().get_span_context()
        return format(ctx.trace_id, "032x") if ctx.is_valid else ""

    def span(
        self,
        name: str,
        kind: SpanKind = SpanKind.INTERNAL,
        context: Context | None = None,
        **attributes: str | int | float | bool,
    ) -> AbstractContextManager[Span | None]:
        """A current span named `name` with `baton.`-prefixed attributes; nothing when off."""
        if not self.enabled:
            return nullcontext(None)
        return self.tracer.start_as_current_span(
            name,
            context=context,
            kind=kind,
            attributes={f"baton.{k}": v for k, v in attributes.items()},
        )

    def client_span(
        self, name: Callable[[], str], attributes: Callable[[], Mapping[str, AttributeValue]]
    ) -> AbstractContextManager[Span | None]:
        """A current CLIENT span with the attributes `attributes()` gives (their names are the
        caller's, e.g. the GenAI conventions'); nothing when off. Both are called only when
        tracing is on: with it off, a request pays nothing for them."""
        if not self.enabled:
            return nullcontext(None)
        return self.tracer.start_as_current_span(
            name(), kind=SpanKind.CLIENT, attributes=attributes()
        )

    def annotate(self, attributes: Mapping[str, AttributeValue]) -> None:
        """Adds `attributes` to the current span (when on and there are any)."""
        if self.enabled and attributes:
            trace.get_current_span().set_attributes(attributes)

    def shutdown(self) -> None:
        provider = trace.get_tracer_provider()
        shutdown = getattr(provider, "shutdown", None)
        if callable(shutdown):
            shutdown()


def tracing_from_env(service: str, env: Mapping[str, str] | None = None) -> Tracing:
    env = os.environ if env is None else env
    endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    if not endpoint or env.get("OTEL_TRACES_EXPORTER", "otlp") == "none":
        return Tracing(trace.NoOpTracer(), enabled=False)
    # Imported only when tracing is on: the SDK and exporter are not needed otherwise.
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    name = env.get("OTEL_SERVICE_NAME") or service
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    return Tracing(trace.get_tracer("baton"), enabled=True)


OFF = Tracing(trace.NoOpTracer(), enabled=False)

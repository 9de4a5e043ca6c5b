"""A failover's report, once its seam verdict is known: the shim's failover metric, one span
per failover (from the failure to now), and the audit event in control."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from baton.model import FailoverReport, Seam
from baton.tracing import Tracing
from dataplane.link.needs import FailoverAudit
from dataplane.metrics import ShimMetrics
from dataplane.relay.background import Background
from dataplane.relay.resume.resumed import ChoiceResume


class Reporter:
    def __init__(
        self,
        control: FailoverAudit,
        metrics: ShimMetrics,
        tracing: Tracing,
        background: Background,
        tenant: str = "",
    ) -> None:
        """`tenant`: the request's tenant id, on each report (never its key)."""
        self._tenant = tenant
        self._control = control
        self._metrics = metrics
        self._tracing = tracing
        self._background = background
        self.detected_ns = 0  # wall clock of the current failure, for the failover span

    def report(self, result: ChoiceResume, report: FailoverReport) -> None:
        if result.verdict is None:
            self.send(report)
            return

        async def when_checked(verdict: asyncio.Task[Seam]) -> None:
            seam = await verdict
            self.send(replace(report, seam=seam))

        self._metrics.seam_checks.inc()
        self._background.spawn(when_checked(result.verdict), self._checked)

    def _checked(self, task: asyncio.Future[None]) -> None:
        """Sent, failed or cancelled (shutdown): no longer pending either way."""
        self._metrics.seam_checks.dec()

    def send(self, report: FailoverReport) -> None:
        if self._tenant:
            report = replace(report, tenant=self._tenant)
        self._metrics.count(
            self._metrics.failovers, report.failure, report.seam or "none", report.outcome
        )
        if self._tracing.enabled:
            report = replace(report, trace_id=Tracing.trace_id())
            # One span per failover, from the failure to now (the seam verdict is known).
            span = self._tracing.tracer.start_span(
                "baton.failover",
                start_time=self.detected_ns or None,
                attributes={
                    "baton.request_id": report.request_id,
                    "baton.from_backend": report.from_backend,
                    "baton.to_backend": report.to_backend,
                    "baton.failure": report.failure,
                    "baton.choice": report.choice,
                    "baton.tokens_sent": report.tokens_sent,
                    "baton.resume_path": report.path or "",
                    "baton.seam": report.seam or "",
                    "baton.gap_ms": report.gap_ms,
                    "baton.attempt": report.attempt,
                    "baton.outcome": report.outcome,
                    **({"baton.tenant": report.tenant} if report.tenant else {}),
                },
            )
            span.end()
        self._control.report_failover(report)

"""Predicted time to first token: each candidate's estimate is the prefill work already
ahead of the request there (what Baton sent it and is predicted still to be prefilling, in
ms; plus the requests on it Baton did not send, at a learned cost each), plus the prompt
tokens it has not cached times that backend's prefill rate (both rates learned:
control/routing/prefill.py). The lowest estimate wins; ties go to the spread ring.

What a backend has cached comes from its KV-cache events (its live index: what the engine
really holds, evictions included). A backend without a live index falls back to the pin:
the pinned backend is credited the pinned prefix's share of the prompt. A prefix Baton has
never seen is uncached everywhere, so the work ahead alone decides: a cold burst that shares
a system prompt spreads over every card (each member routed adds its own prefill to that
card's backlog), and piles onto the card that cached it first only while that card's
backlog costs less than prefilling elsewhere.

Reads: the request's shape (prompt size, message count), the routable backends, the
backlog, outside requests, cache and rates per backend (RoutingView.predict). Returns:
reason `predicted`, with the estimate and the runner-up in the detail."""

# baton: pure

from __future__ import annotations

from collections.abc import Sequence

from baton.model import (
    CHARS_PER_TOKEN,
    Backend,
    BackendId,
    Decision,
    Estimate,
    Reason,
    RouteRequest,
)
from baton.spread import first
from control.routing.policy.base import Prediction, RoutingView
from control.routing.prefill import Rates

# A continuation leaves the card that holds most of its prefix only for an estimate this much
# lower. The estimate prices the request's own prefill, not what a move costs the others: its
# prompt's blocks evict other conversations' blocks on the new card (a full cache pays that
# back as their re-prefills), and its own blocks on the old card go unused. Two close
# estimates would otherwise move a conversation on a difference within their own error.
# (Measured on real (b), more agents than the caches hold: no gain beyond run-to-run noise.)
MOVE_MARGIN = 0.3


def prompt_tokens(request: RouteRequest, prediction: Prediction) -> float:
    if prediction.prompt_tokens is not None:
        return float(prediction.prompt_tokens)
    return request.shape.prompt_chars / (prediction.chars_per_token or CHARS_PER_TOKEN)


def estimate(
    request: RouteRequest, view: RoutingView, prediction: Prediction, backend_id: BackendId
) -> tuple[float, float, float, float]:
    """(estimated TTFT ms, uncached tokens, backlog ms, outside requests) of the request on
    `backend_id`."""
    total = prompt_tokens(request, prediction)
    uncached = max(total - _cached(request, view, prediction, backend_id, total), 0.0)
    backlog = prediction.backlog_ms.get(backend_id, 0.0)
    outside = prediction.outside.get(backend_id, 0.0)
    rates = prediction.rates.get(backend_id, Rates())
    return rates.ttft_ms(uncached, backlog, outside), uncached, backlog, outside


def _cached(
    request: RouteRequest, view: RoutingView, prediction: Prediction, backend_id: BackendId,
    total: float,
) -> float:  # fmt: skip
    """Prompt tokens credited as cached on `backend_id`."""
    if not any(request.shape.assistant_turns):
        # A first turn (a fresh conversation, a burst member): only a shared system prompt
        # could be cached, and crediting it piles new conversations onto the card that
        # cached it first, where their later turns queue behind each other (seed 003's
        # lesson). Such requests are credited nothing: the queue decides.
        return 0.0
    if backend_id in prediction.cached_tokens:  # a live index: what the engine holds
        return float(prediction.cached_tokens[backend_id])
    pin = view.pin
    if pin is not None and pin.pin.backend_id == backend_id and request.shape.message_count:
        return total * (pin.index + 1) / request.shape.message_count
    return 0.0


class PredictedTTFT:
    name = "ttft"
    predicts = True  # the router builds RoutingView.predict for it

    def decide(self, request: RouteRequest, view: RoutingView) -> Decision:
        ring = view.ring
        order = {b.id: i for i, b in enumerate(ring)}
        prediction = view.predict or Prediction()
        scored = sorted(
            (estimate(request, view, prediction, b.id)[0], order[b.id], b) for b in ring
        )
        best_ms, _, best = scored[0]
        stay = ""
        home = _home(request, view, prediction, ring)
        if home is not None and home.id != best.id:
            home_ms = next(ms for ms, _, b in scored if b.id == home.id)
            if best_ms > home_ms * (1 - MOVE_MARGIN):
                stay = f"; stays: {best.id} {best_ms:.1f} ms is not {MOVE_MARGIN:.0%} better"
                best_ms, best = home_ms, home
        _, uncached, backlog, outside = estimate(request, view, prediction, best.id)
        expected = Estimate(best.id, best_ms, uncached, backlog, outside)
        detail = (f"est {best_ms:.1f} ms on {best.id} (backlog {backlog:.0f} ms, outside "
                  f"{outside:g}, uncached {uncached:.0f} tok)")  # fmt: skip
        if stay:
            detail += stay
        elif len(scored) > 1:
            detail += f"; next {scored[1][2].id} {scored[1][0]:.1f} ms"
        return Decision(first(best, ring), Reason.PREDICTED, view.snapshot.version, detail,
                        estimate=expected)  # fmt: skip


def _home(
    request: RouteRequest, view: RoutingView, prediction: Prediction, ring: Sequence[Backend]
) -> Backend | None:
    """The card holding the most of a continuation's prefix (none for a first turn, or when
    no card holds any of it)."""
    if not any(request.shape.assistant_turns):
        return None
    total = prompt_tokens(request, prediction)
    held = [(_cached(request, view, prediction, b.id, total), b) for b in ring]
    most, home = max(held, key=lambda h: h[0])
    return home if most > 0 else None

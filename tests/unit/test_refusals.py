"""Control's refusals, as the client is told them: one row per reason (dataplane/refusals.py)."""

from __future__ import annotations

import pytest

from baton.model import Decision, Reason
from baton.tenancy import Limited, Quota
from dataplane.exceptions import ErrorKind
from dataplane.refusals import duration, refusal


@pytest.mark.parametrize(
    ("reason", "kind", "status", "said"),
    [
        (Reason.TENANT_MODEL, ErrorKind.MODEL_NOT_ALLOWED, 403, "`m`"),
        (Reason.TENANT_UNKNOWN, ErrorKind.UNAUTHORIZED, 401, "API key"),
        (Reason.TENANT_LIMITED, ErrorKind.RATE_LIMITED, 429, "why"),
        (Reason.SHED, ErrorKind.FLEET_SATURATED, 429, "why"),
        (Reason.OWNER_GONE, ErrorKind.RESPONSE_OWNER_GONE, 404, "why"),
        (Reason.OWNER_UNKNOWN, ErrorKind.RESPONSE_NOT_FOUND, 404, "why"),
        (Reason.UNKNOWN_MODEL, ErrorKind.MODEL_NOT_FOUND, 404, "`m` does not exist"),
        (Reason.NO_BACKEND, ErrorKind.NO_BACKEND, 503, "why"),
    ],
)
def test_each_reason_has_its_error(reason: Reason, kind: ErrorKind, status: int, said: str) -> None:
    err = refusal(Decision((), reason, 1, "why"), "m")
    assert (err.kind, err.status) == (kind, status) and said in err.message


def test_a_rate_limit_says_which_limit_and_when_to_retry() -> None:
    q = Quota(limit_tokens=100, retry_after_s=1.5, limited_by=Limited.TOKENS)
    err = refusal(Decision((), Reason.TENANT_LIMITED, 1, "tokens", quota=q), "m")
    assert err.body()["error"]["type"] == "tokens"  # type: ignore[index]
    assert err.headers is not None and err.headers["Retry-After"] == "2"
    assert err.headers["retry-after-ms"] == "1500"
    assert "1.5s" in err.message
    shed = refusal(Decision((), Reason.SHED, 1, "full"), "m")
    assert shed.headers == {"Retry-After": "1", "retry-after-ms": "1000"}


@pytest.mark.parametrize(("seconds", "said"), [(0.02, "20ms"), (1, "1s"), (360, "6m0s")])
def test_reset_times_are_written_as_openai_writes_them(seconds: float, said: str) -> None:
    assert duration(seconds) == said

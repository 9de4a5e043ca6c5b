"""The shim's mid-stream failover settings (set from `baton shim` flags)."""

# baton: pure

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ResumeSettings:
    seam_tokens: int = 4  # m: resume this many tokens early and check them; 0 = off
    max_resumes: int = 3  # failovers per request
    max_resume_seconds: float = 30.0  # from the first failure to giving up
    first_token_timeout: float = 120.0  # no token this long after the request: a stall
    inter_token_timeout: float = 30.0  # no chunk this long between tokens: a stall
    # parallel: stream from the exact prefix and verify the overlap in a side request;
    # inline: resume m tokens early and check them before sending (costs m decode steps).
    seam_mode: str = "parallel"
    # Connections kept open to every routable backend for resumes (standby.py); 0 = none.
    standby_connections: int = 4

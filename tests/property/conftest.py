"""Hypothesis settings for the property tests: derandomized and database-free, so CI runs the
same examples every time and writes nothing; bounded so the whole directory stays in seconds."""

from __future__ import annotations

from hypothesis import HealthCheck, settings

settings.register_profile(
    "baton",
    derandomize=True,
    database=None,
    max_examples=150,
    # Shared 2-core CI machines make per-example timing noise, not signal.
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
)
settings.load_profile("baton")

"""Test-wide settings: property tests judge inputs, not the machine's speed.

CI runs on a busy 2-core machine, where Hypothesis's wall-clock checks (a per-example deadline and the
"input generation is slow" health check) fail tests that are correct; this profile turns them off for
every test (a test's own ``@settings`` still sets its example count)."""

from __future__ import annotations

from hypothesis import HealthCheck, settings

settings.register_profile("twisternet", deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile("twisternet")

"""Test-wide settings. Hypothesis: no per-example deadline and no too-slow health check -- CI
hosts are loaded, and a test asserts behaviour, never wall time."""

from hypothesis import HealthCheck, settings

settings.register_profile("poseidon", deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("poseidon")

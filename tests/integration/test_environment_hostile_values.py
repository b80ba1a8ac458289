"""The example settings' environment variables: a hostile value stops the process with an error naming the
variable and quoting the value, never a bare ValueError or OverflowError.
"""

from __future__ import annotations

import pytest

from tests.integration.test_example_environment import load_settings


# The example project's environment: each of these stopped the process with a raw ValueError or OverflowError
# naming neither the variable nor the fix (or, DURABLE_LEASE_SECONDS, loaded a lease no timestamp can hold).
@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("DURABLE_BASE_URL", "http://[::1"),
        ("DURABLE_SWEEP_SECONDS", "1e300"),
        ("DURABLE_LEASE_SECONDS", "1e300"),
        ("DJANGO_DB_POOL", "sixteen"),
        ("DJANGO_DB_POOL", "-4"),
        ("DJANGO_CONN_MAX_AGE", "10m"),
        ("CELERY_DB_REUSE_MAX", "lots"),
    ],
)
def test_environment__a_hostile_value_stops_the_process_naming_the_variable(tmp_path, variable, value):
    loaded = load_settings(tmp_path, **{variable: value})
    assert loaded.returncode != 0, f"the example settings accepted {variable}={value!r}"
    assert f"ImproperlyConfigured: {variable} must be" in loaded.stderr, loaded.stderr[-800:]
    assert repr(value) in loaded.stderr, "the message should quote the bad value"
    assert "ValueError" not in loaded.stderr and "OverflowError" not in loaded.stderr, loaded.stderr[-800:]

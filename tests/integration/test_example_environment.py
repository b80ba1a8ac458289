"""The example project's settings read the app's knobs from the environment, and refuse bad values by name.

Each case loads project/settings.py in a fresh process, as gunicorn and the workers load it, with only the
variables under test set (docs/howto/production.md lists them).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PRINT_APP_SETTINGS = (
    "import json, django; django.setup(); from django.conf import settings; "
    "print(json.dumps({**settings.DURABLE_AGENTS, 'LOGIN_URL': settings.LOGIN_URL, "
    "'CSRF_TRUSTED_ORIGINS': settings.CSRF_TRUSTED_ORIGINS, "
    "'SECURE_PROXY_SSL_HEADER': settings.SECURE_PROXY_SSL_HEADER}))"
)


def load_settings(var_dir: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """A process on project/settings.py with a local key and `env`, and none of the test suite's own variables."""
    clean = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("DJANGO_", "DURABLE_")) and k not in ("DATABASE_URL", "CELERY_BROKER_URL")
    }
    clean.update(
        DJANGO_SETTINGS_MODULE="project.settings", DURABLE_VAR_DIR=str(var_dir), DJANGO_LOCAL_SECRET_KEY="1", **env
    )
    return subprocess.run(
        [sys.executable, "-c", PRINT_APP_SETTINGS], cwd=ROOT, env=clean, capture_output=True, text=True, timeout=60
    )


def app_settings(var_dir: Path, **env: str) -> dict:
    loaded = load_settings(var_dir, **env)
    assert loaded.returncode == 0, f"project/settings.py did not load with {env}: {loaded.stderr[-800:]}"
    return json.loads(loaded.stdout)


def test_environment__sets_base_url_approvers_metrics_token_and_stuck_threshold(tmp_path):
    configured = app_settings(
        tmp_path,
        DURABLE_BASE_URL="https://agents.example.com",
        DURABLE_APPROVERS=" lead@example.com, oncall@example.com,,",
        DURABLE_METRICS_TOKEN="s3cret-token",
        DURABLE_STUCK_AFTER_SECONDS="90.5",
    )
    assert configured["BASE_URL"] == "https://agents.example.com", "approval links must start with DURABLE_BASE_URL"
    assert configured["APPROVERS"] == ["lead@example.com", "oncall@example.com"], (
        "DURABLE_APPROVERS is a comma-separated list: spaces trimmed, empty entries dropped"
    )
    assert configured["METRICS_TOKEN"] == "s3cret-token"
    assert configured["STUCK_AFTER_SECONDS"] == 90.5
    assert configured["LOGIN_URL"] == "admin:login", "anonymous approvers must be sent to the admin's login page"
    assert configured["CSRF_TRUSTED_ORIGINS"] == ["https://agents.example.com"], (
        "forms posted from the address approvers open must pass CSRF behind a proxy that ends HTTPS"
    )
    assert configured["SECURE_PROXY_SSL_HEADER"] is None, "trust X-Forwarded-Proto only when told to"
    behind = app_settings(tmp_path, DJANGO_BEHIND_HTTPS_PROXY="1")
    assert behind["SECURE_PROXY_SSL_HEADER"] == ["HTTP_X_FORWARDED_PROTO", "https"]


def test_environment__unset_variables_leave_the_app_defaults(tmp_path):
    defaults = app_settings(tmp_path)
    assert defaults["BASE_URL"] == "http://127.0.0.1:8000"
    assert defaults["APPROVERS"] == []
    assert defaults["METRICS_TOKEN"] is None, "without a token only staff logins may read /metrics"
    assert defaults["STUCK_AFTER_SECONDS"] == 600.0
    assert app_settings(tmp_path, DURABLE_METRICS_TOKEN="")["METRICS_TOKEN"] is None, "an empty token is no token"


@pytest.mark.parametrize(
    ("variable", "value", "says"),
    [
        ("DURABLE_STUCK_AFTER_SECONDS", "ten minutes", "DURABLE_STUCK_AFTER_SECONDS must be a number of seconds"),
        ("DURABLE_STUCK_AFTER_SECONDS", "0", "DURABLE_STUCK_AFTER_SECONDS must be a number of seconds above 0"),
        ("DURABLE_STUCK_AFTER_SECONDS", "nan", "DURABLE_STUCK_AFTER_SECONDS must be a number of seconds"),
        ("DURABLE_LEASE_SECONDS", "15s", "DURABLE_LEASE_SECONDS must be a number of seconds"),
        ("DURABLE_BASE_URL", "agents.example.com", "DURABLE_BASE_URL must be the address approvers open"),
    ],
)
def test_environment__a_bad_value_stops_the_process_naming_the_variable(tmp_path, variable, value, says):
    loaded = load_settings(tmp_path, **{variable: value})
    assert loaded.returncode != 0, f"the settings accepted {variable}={value!r}"
    assert f"ImproperlyConfigured: {says}" in loaded.stderr, loaded.stderr[-800:]
    assert repr(value) in loaded.stderr, "the message should quote the bad value"
    assert "ValueError" not in loaded.stderr, "a raw ValueError names neither the variable nor the fix"

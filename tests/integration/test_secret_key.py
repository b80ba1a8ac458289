"""The example settings never fall back to a public SECRET_KEY, and no public key validates a decision link.

Issue 13 item 19: with DEBUG off and no DJANGO_SECRET_KEY, `project/settings.py` used a key printed in this
repository, so anyone could sign a decision link for any wait. The settings are loaded in subprocesses, as a
deployment, the demo and the tests load them.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from django.core import signing
from django.core.exceptions import ImproperlyConfigured
from django.test.utils import override_settings

from durable_agents import api
from durable_agents.errors import InvalidInputError
from durable_agents.links import PUBLIC_SECRET_KEYS, SALT, make_token, read_token
from durable_agents.models import Wait, WaitStatus
from durable_agents.testing import drive

ROOT = Path(__file__).resolve().parents[2]
OLD_PUBLIC_KEY = "django-insecure-demo-key-set-DJANGO_SECRET_KEY-in-production"
PRINT_KEY = "from django.conf import settings; print(settings.SECRET_KEY)"


def load_settings(var_dir: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """Start a process on project/settings.py with only `env` configured (no key, no debug, no test flags)."""
    clean = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("DJANGO_", "DURABLE_")) and k not in ("DATABASE_URL", "CELERY_BROKER_URL")
    }
    clean.update(DJANGO_SETTINGS_MODULE="project.settings", DURABLE_VAR_DIR=str(var_dir), **env)
    return subprocess.run(
        [sys.executable, "-c", f"import django; django.setup(); {PRINT_KEY}"],
        cwd=ROOT,
        env=clean,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_settings__refuse_to_start_without_a_secret_key_outside_debug_and_local_runs(tmp_path):
    started = load_settings(tmp_path)
    assert started.returncode != 0, f"the settings started with DEBUG off and no key: {started.stdout!r}"
    assert "ImproperlyConfigured: DJANGO_SECRET_KEY is not set" in started.stderr, started.stderr[-800:]
    assert "token_urlsafe" in started.stderr, "the error should say how to make a key"
    manage = subprocess.run(
        [sys.executable, "manage.py", "check"],
        cwd=ROOT,
        env={**os.environ, "DJANGO_SETTINGS_MODULE": "project.settings", "DURABLE_VAR_DIR": str(tmp_path)}
        | {"DJANGO_LOCAL_SECRET_KEY": "", "DJANGO_SECRET_KEY": "", "DJANGO_DEBUG": "0"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert manage.returncode != 0 and "DJANGO_SECRET_KEY is not set" in manage.stderr, manage.stderr[-800:]
    assert not (tmp_path / "secret_key").exists(), "a production start must not invent a key"


def test_settings__a_configured_key_is_used_as_it_is(tmp_path):
    started = load_settings(tmp_path, DJANGO_SECRET_KEY="k" * 60)
    assert started.returncode == 0 and started.stdout.strip() == "k" * 60, started.stderr[-800:]


@pytest.mark.parametrize("flag", [{"DJANGO_LOCAL_SECRET_KEY": "1"}, {"DJANGO_DEBUG": "1"}], ids=["local", "debug"])
def test_settings__a_local_run_makes_one_random_key_and_keeps_it_in_the_var_dir(tmp_path, flag):
    first, again = load_settings(tmp_path, **flag), load_settings(tmp_path, **flag)
    other_machine = load_settings(tmp_path / "elsewhere", **flag)
    assert first.returncode == 0, first.stderr[-800:]
    key = first.stdout.strip()
    assert len(key) >= 50 and key not in PUBLIC_SECRET_KEYS and key == again.stdout.strip(), (
        "a local run must keep one random key across restarts (workers and web sign and check links with it)"
    )
    assert other_machine.stdout.strip() != key, "the key must be random per var dir, never a constant"
    mode = stat.S_IMODE((tmp_path / "secret_key").stat().st_mode)
    assert mode == 0o600, f"the key file is readable by others: {oct(mode)}"


def test_settings__the_demo_command_starts_with_no_configuration(tmp_path):
    """scripts/demo on a fresh machine: it sets DJANGO_LOCAL_SECRET_KEY itself; `migrate` is its first step."""
    script = (ROOT / "scripts" / "demo").read_text()
    assert 'export DJANGO_LOCAL_SECRET_KEY="${DJANGO_LOCAL_SECRET_KEY:-1}"' in script
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO_", "DURABLE_")) and k != "DATABASE_URL"}
    env.update(DJANGO_SETTINGS_MODULE="project.settings", DURABLE_VAR_DIR=str(tmp_path), DJANGO_LOCAL_SECRET_KEY="1")
    migrated = subprocess.run(
        [sys.executable, "manage.py", "migrate", "--verbosity", "0"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert migrated.returncode == 0, migrated.stderr[-800:]
    assert (tmp_path / "secret_key").exists()


@pytest.mark.django_db(transaction=True)
def test_links__a_link_signed_with_a_public_key_never_validates():
    run = drive(api.start("approve_charge", {"order_id": "K-1"}).id)
    wait = Wait.objects.get(run=run, status=WaitStatus.OPEN)
    claim = {"w": wait.pk, "r": str(wait.run_id), "n": wait.link_nonce}
    forged = signing.dumps(claim, key=OLD_PUBLIC_KEY, salt=SALT, compress=True)
    with pytest.raises(InvalidInputError, match="not valid"):
        read_token(wait.pk, forged)  # our own key is configured: the forged signature fails
    with override_settings(SECRET_KEY_FALLBACKS=[OLD_PUBLIC_KEY]), pytest.raises(InvalidInputError, match="not valid"):
        read_token(wait.pk, forged)  # not even as a fallback key (a rotation left behind)
    with override_settings(SECRET_KEY=OLD_PUBLIC_KEY):
        with pytest.raises(InvalidInputError, match="decision links are disabled"):
            read_token(wait.pk, forged)
        with pytest.raises(ImproperlyConfigured, match="published key"):
            make_token(wait)
    assert read_token(wait.pk, make_token(wait)).wait_id == wait.pk, "a link signed with our own key still works"

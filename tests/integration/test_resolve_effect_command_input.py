"""The durable_effect command's input: hostile arguments are a one-line error, never a traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest
from django.test import override_settings

from durable_agents import api
from durable_agents.models import Effect, EffectStatus
from durable_agents.testing import drive
from durable_agents.testing.receiver import IdempotentReceiver
from tests.conftest import ROOT
from tests.testapp.trust import HOOKS

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("hooks_cleared")]


@pytest.fixture
def carrier():
    with IdempotentReceiver() as receiver:
        yield receiver


# --- Hostile input to durable_effect -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra",
    [
        ["--applied", "--result", "NaN"],
        ["--applied", "--result", '"\\u0000"'],
        ["--applied", "--as", "x" * 300],
    ],
    ids=["nan-result", "nul-in-result", "long-actor"],
)
def test_durable_effect__hostile_input_is_a_one_line_error_not_a_traceback(worker_env, carrier, extra):
    """The command's domain errors are one line and exit 2. Values Postgres refuses (NaN or \\u0000 in jsonb, an
    actor longer than the column) escape as a DataError traceback instead."""

    def broken(ctx):
        raise ConnectionResetError("connection reset")

    HOOKS["before_post"] = broken
    with override_settings(DURABLE_AGENTS={"EFFECT_MAX_INVOCATIONS": 1}):
        run = drive(api.start("ship_then_hold", {"order_id": "HI-1", "url": carrier.url}).id)
    HOOKS.clear()
    effect = Effect.objects.get(run=run)
    done = subprocess.run(
        [sys.executable, "-m", "django", "durable_effect", effect.idempotency_key, *extra],
        cwd=ROOT,
        env={**worker_env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, (
        "guarantee 8 (nothing fails silently; errors with a hint): durable_effect crashed on hostile input "
        f"(exit {done.returncode}): {done.stderr.strip().splitlines()[-1:]}"
    )
    assert Effect.objects.get(pk=effect.pk).status == EffectStatus.PENDING

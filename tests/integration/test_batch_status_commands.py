"""`durable_status` reports the Message Batches in flight, the turns in them and queued, and the oldest batch's age
(text and --json); `durable_show` lists a run's batch turns with their batches (issue 32)."""

from __future__ import annotations

import json
from datetime import timedelta
from io import StringIO

import pytest
from django.core.management import CommandError, call_command

from durable_agents import api, clock
from durable_agents.models import BatchTurn, Step
from tests.integration.test_admin_batches import batched_run

pytestmark = pytest.mark.django_db


def run_command(*args: str) -> str:
    """The command's stdout, whatever its exit code (durable_status exits 1 when the system is unhealthy)."""
    out = StringIO()
    try:
        call_command(*args, stdout=out)
    except CommandError as exc:
        assert exc.returncode == 1, f"{args[0]} failed with {exc}"
    return out.getvalue()


def queue_turn(minutes_ago: int) -> BatchTurn:
    run = api.start("noop", {"steps": 1})
    step = Step.objects.create(run=run, step_id="triage", name="triage", position=5, kind="agent")
    return BatchTurn.objects.create(
        run=run,
        step=step,
        index=0,
        custom_id=f"da-queued-{run.pk.hex}",
        request_digest="q",
        params={},
        status="queued",
        created_at=clock.now() - timedelta(minutes=minutes_ago),
    )


def test_durable_status__reports_batches_in_flight_turns_in_them_and_queued_and_the_oldest():
    batched_run(turns=4)  # one ended batch, one in flight (made 12 min ago) with 3 turns
    queue_turn(minutes_ago=2)

    text = run_command("durable_status")
    report = json.loads(run_command("durable_status", "--json"))

    line = next(line for line in text.splitlines() if line.startswith("message batches"))
    assert line == (
        "message batches in flight: 1 (3 turns in them, 1 queued for the next); oldest made 12 min ago; "
        "oldest queued turn 2 min ago"
    ), line
    batches = report["batches"]
    assert (batches["in_flight"], batches["turns_in_flight"], batches["turns_queued"]) == (1, 4, 1)
    assert 11 * 60 < batches["oldest_batch_seconds"] < 13 * 60, batches
    assert 60 < batches["oldest_queued_seconds"] < 3 * 60, batches


def test_durable_status__says_none_in_flight_without_batches():
    text = run_command("durable_status")
    report = json.loads(run_command("durable_status", "--json"))

    assert "message batches in flight: 0 (0 turns in them, 0 queued for the next)" in text
    assert report["batches"]["in_flight"] == 0 and report["batches"]["oldest_batch_at"] is None


def test_durable_show__lists_the_runs_batch_turns_with_their_batches():
    run, ended, flying = batched_run(turns=2)

    text = run_command("durable_show", str(run.pk))
    shown = json.loads(run_command("durable_show", str(run.pk), "--json"))["batch_turns"]

    lines = text.split("message batch turns:\n", 1)[1].splitlines()[:2]
    assert "turn 0" in lines[0] and "succeeded" in lines[0] and f"batch {ended.provider_id} (ended)" in lines[0]
    assert "turn 1" in lines[1] and "submitted" in lines[1] and f"batch {flying.provider_id} (in_progress)" in lines[1]
    assert [(t["index"], t["status"], t["batch"]) for t in shown] == [
        (0, "succeeded", ended.provider_id),
        (1, "submitted", flying.provider_id),
    ]

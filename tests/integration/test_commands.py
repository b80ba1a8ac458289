"""The durable_* management commands as an operator runs them: output, --json, exit codes, messages."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection
from django.test.utils import CaptureQueriesContext

from durable_agents import api, operations
from durable_agents.errors import RunNotFoundError
from durable_agents.models import Event, Run, RunStatus, Wait, WaitStatus
from durable_agents.testing import drive

pytestmark = pytest.mark.django_db(transaction=True)
ROOT = Path(__file__).resolve().parents[2]


def test_commands__start_show_runs_cancel_resume_round_trip(manage):
    started = manage("durable_start", "record", "--input", '{"steps": 2}', "--key", "k-1", "--json")
    assert started.returncode == 0, started.stderr
    run_id = json.loads(started.stdout)["id"]
    again = manage("durable_start", "record", "--input", '{"steps": 2}', "--key", "k-1")
    assert again.stdout.strip() == run_id, "the same key must print the same run id"

    listed = json.loads(manage("durable_runs", "--status", "pending", "--json").stdout)
    assert [row["id"] for row in listed] == [run_id]

    cancelled = manage("durable_cancel", run_id, "--reason", "test", "--as", "alice")
    assert cancelled.returncode == 0 and "cancelled" in cancelled.stdout
    resumed = manage("durable_resume", run_id, "--json")
    assert json.loads(resumed.stdout) == [{"id": run_id, "status": "pending"}]

    drive(run_id)
    shown = json.loads(manage("durable_show", run_id, "--json").stdout)
    assert shown["status"] == "completed"
    assert [s["status"] for s in shown["step_rows"]] == ["done", "done"]
    kinds = [e["kind"] for e in shown["events"]]
    assert kinds == ["cancelled", "resumed"]
    assert shown["events"][0]["actor"] == "alice"
    text = manage("durable_show", run_id)
    assert "s001" in text.stdout and "done" in text.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["durable_start", "nope"], "unknown workflow 'nope'"),
        (["durable_start", "noop", "--input", "{bad"], "--input is not valid JSON"),
        (["durable_start", "noop", "--input", '{"steps": -1}'], "noop takes"),
        (["durable_start", "noop", "--version", "7"], "has no version 7"),
        (["durable_show", "not-a-run"], "no run has id 'not-a-run'"),
        (["durable_show", "00000000-0000-0000-0000-000000000000"], "no run has id"),
        (["durable_cancel", "not-a-run"], "no run has id"),
        (["durable_resume", "not-a-run"], "no run has id"),
        (["durable_show", "abc12"], "give at least 6 characters of the id"),
        (["durable_cancel", "abc-12"], "give at least 6 characters of the id"),
        (["durable_show", "abcdef99"], "no run has an id starting with 'abcdef99'; list runs with"),
        (["durable_swap", "abcdef99", "anthropic"], "no run has an id starting with 'abcdef99'"),
        (["durable_budget", "abcdef99", "--tokens", "5"], "no run has an id starting with 'abcdef99'"),
        (["durable_runs", "--older-than", "soon"], "invalid duration 'soon'"),
        (["durable_runs", "--status", "lost"], "unknown status 'lost'"),
    ],
)
def test_commands__user_mistakes_exit_2_with_one_line_on_stderr(manage, args, message):
    result = manage(*args)
    assert result.returncode == 2, f"{args}: exit {result.returncode}, stderr {result.stderr}"
    assert message in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_commands__cancelling_a_finished_run_exits_2(manage):
    run = drive(api.start("noop", {"steps": 1}).id)
    result = manage("durable_cancel", str(run.id))
    assert result.returncode == 2 and "already completed; there is nothing to cancel" in result.stderr
    assert Run.objects.get(pk=run.id).status == RunStatus.COMPLETED


def test_commands__runs_filters_stuck_and_age(manage):
    stuck = api.start("noop", {"steps": 1})
    Run.objects.filter(pk=stuck.id).update(
        status=RunStatus.RUNNING, lease_owner="gone:1", lease_expires_at=stuck.created_at
    )
    api.start("noop", {"steps": 1})
    listed = json.loads(manage("durable_runs", "--stuck", "--json").stdout)
    assert [row["id"] for row in listed] == [str(stuck.id)]
    assert json.loads(manage("durable_runs", "--older-than", "1h", "--json").stdout) == []


def test_commands__sweep_reports_what_it_did(manage):
    result = manage("durable_sweep", "--json")
    assert result.returncode == 0
    assert json.loads(result.stdout) == {
        "woken": 0,
        "cancelled": 0,
        "fired": 0,
        "expired": 0,
        "warned": 0,
        "reminded": 0,
        "notifications": 0,
        "scheduled": 0,
        "joined": 0,
        "orphans_cancelled": 0,
        "family_undone": 0,
        "admitted": 0,
    }


def test_commands__cancel_of_several_runs_cancels_each_once(manage):
    first, second = api.start("noop", {"steps": 1}), api.start("noop", {"steps": 1})
    result = manage("durable_cancel", str(first.id), str(second.id), str(first.id), "--json")
    assert result.returncode == 0, result.stderr
    assert sorted(row["id"] for row in json.loads(result.stdout)) == sorted([str(first.id), str(second.id)])
    assert set(Run.objects.values_list("status", flat=True)) == {RunStatus.CANCELLED}
    assert Event.objects.filter(kind="cancelled").count() == 2, "a run named twice must be cancelled once"


def test_commands__a_run_finishing_between_the_check_and_the_cancel_rolls_the_batch_back(monkeypatch):
    """The check passes for both runs, then a worker finishes the second before the cancel reaches it."""
    first, second = api.start("noop", {"steps": 1}), api.start("noop", {"steps": 1})
    checked = operations.get_run

    def check_then_a_worker_finishes_it(run_id):
        run = checked(run_id)
        if run.id == second.id:
            drive(second.id)
        return run

    monkeypatch.setattr(operations, "get_run", check_then_a_worker_finishes_it)
    with pytest.raises(CommandError) as raised:
        call_command("durable_cancel", str(first.id), str(second.id), "--as", "op")
    message = str(raised.value)
    assert raised.value.returncode == 2 and "\n" not in message, message
    assert f"nothing changed: run {second.id} changed between the check and the cancel" in message, message
    assert "is already completed" in message and f"({first.id}) were not changed either" in message, message
    assert Run.objects.get(pk=first.id).status == RunStatus.PENDING, "the batch cancelled a run, then refused"
    assert not Event.objects.filter(run_id=first.id).exists(), "a rolled-back cancel left its event"


def run_with_id(run_id: str) -> Run:
    """A bare pending run whose id the test chooses, so that two ids can share a prefix."""
    return Run.objects.create(id=uuid.UUID(run_id), workflow="noop", workflow_version=1, input={}, input_hash="-")


def test_commands__an_8_character_prefix_names_a_run_for_show_and_cancel(manage):
    run = api.start("noop", {"steps": 1})
    short = str(run.id)[:8]
    shown = manage("durable_show", short, "--json")
    assert shown.returncode == 0, f"durable_show {short} (as the admin prints ids) failed: {shown.stderr}"
    assert json.loads(shown.stdout)["id"] == str(run.id)
    dashed = manage("durable_show", str(run.id)[:13].upper())
    assert dashed.returncode == 0 and str(run.id) in dashed.stdout, f"a dashed upper-case prefix: {dashed.stderr}"
    cancelled = manage("durable_cancel", short, "--json")
    assert cancelled.returncode == 0, cancelled.stderr
    assert json.loads(cancelled.stdout) == [{"id": str(run.id), "status": "cancelled"}]


def test_commands__an_ambiguous_prefix_exits_2_naming_some_matches(manage):
    first = run_with_id("abcdef12-0000-4000-8000-000000000001")
    run_with_id("abcdef13-0000-4000-8000-000000000002")
    for args in (
        ["durable_show", "abcdef1"],
        ["durable_cancel", "ABCDEF"],
        ["durable_budget", "abc-def", "--tokens", "9"],
    ):
        result = manage(*args)
        assert result.returncode == 2, f"{args}: exit {result.returncode}, stderr {result.stderr}"
        assert "matches several runs" in result.stderr and "give more characters" in result.stderr, result.stderr
        assert str(first.id) in result.stderr and "Traceback" not in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert set(Run.objects.values_list("status", flat=True)) == {RunStatus.PENDING}, "a refused prefix changed a run"
    unique = manage("durable_show", "abcdef12", "--json")
    assert json.loads(unique.stdout)["id"] == str(first.id), unique.stderr


def test_commands__a_batch_with_an_ambiguous_prefix_changes_nothing():
    run_with_id("abcdef12-0000-4000-8000-000000000001")
    run_with_id("abcdef13-0000-4000-8000-000000000002")
    other = api.start("noop", {"steps": 1})
    with pytest.raises(CommandError) as raised:
        call_command("durable_cancel", str(other.id)[:8], "abcdef1")
    assert raised.value.returncode == 2 and "nothing changed" in str(raised.value), raised.value
    assert "'abcdef1' matches several runs" in str(raised.value), raised.value
    assert Run.objects.get(pk=other.id).status == RunStatus.PENDING


def test_resolve_run_id__a_prefix_is_a_primary_key_range_not_a_text_match():
    run = run_with_id("abcdef12-3456-4000-8000-000000000001")
    run_with_id("abcdef13-0000-4000-8000-000000000002")
    with CaptureQueriesContext(connection) as queries:
        assert operations.resolve_run_id("ABCDEF12-34") == str(run.id)
    assert len(queries) == 1, [q["sql"] for q in queries]
    sql = queries[0]["sql"]
    assert '"id" >=' in sql and '"id" <' in sql, f"a prefix must become a range on the primary key: {sql}"
    assert "LIKE" not in sql.upper() and "::text" not in sql, f"a text match reads every run: {sql}"


def test_resolve_run_id__edges_of_the_range():
    top = run_with_id("ffffffff-ffff-4fff-bfff-ffffffffffff")
    below = run_with_id("abcdeeff-ffff-4fff-bfff-ffffffffffff")
    assert operations.resolve_run_id("ffffff") == str(top.id), "a prefix of all f's has no upper bound"
    assert operations.resolve_run_id("abcdee") == str(below.id)
    with pytest.raises(RunNotFoundError, match="no run has an id starting with 'abcdef'"):
        operations.resolve_run_id("abcdef")  # the next prefix up must not reach back into abcdee…
    with CaptureQueriesContext(connection) as queries:
        assert operations.resolve_run_id(top.id) == str(top.id)
        assert operations.resolve_run_id(str(top.id).replace("-", "")) == str(top.id)
    assert not queries, "a whole id needs no query to resolve"


def test_commands__steps_are_numbered_from_1_as_in_the_admin(manage):
    run = api.start("noop", {"steps": 2})
    shown = json.loads(manage("durable_show", str(run.id), "--json").stdout)
    assert [(s["position"], s["number"]) for s in shown["step_rows"]] == [(0, 1), (1, 2)]
    assert (shown["cursor"], shown["step_number"]) == (0, 1), "JSON keeps cursor 0-based; step_number is the admin's"
    text = manage("durable_show", str(run.id)).stdout
    assert "step 1/2" in text and "     1  tick-1" in text and "     2  tick-2" in text, text
    assert "step 1/2" in manage("durable_runs").stdout
    drive(run.id)
    listed = json.loads(manage("durable_runs", "--json").stdout)
    assert (listed[0]["cursor"], listed[0]["step_number"]) == (2, None), listed
    assert "2/2 steps done" in manage("durable_runs").stdout


def test_commands__runs_shows_the_open_wait_of_a_waiting_run(manage):
    waiting = drive(api.start("approve_charge", {"order_id": "CLI-1"}).id)
    assert waiting.status == RunStatus.WAITING, waiting.error
    wait = Wait.objects.get(run=waiting, status=WaitStatus.OPEN)
    api.start("noop", {"steps": 1})
    rows = {row["id"]: row for row in json.loads(manage("durable_runs", "--json").stdout)}
    assert rows[str(waiting.id)]["open_wait"] == {"id": wait.pk, "kind": wait.kind, "name": wait.name}
    assert [row["open_wait"] for row in rows.values() if row["id"] != str(waiting.id)] == [None]
    text = manage("durable_runs", "--status", "waiting").stdout
    assert f"wait {wait.pk} ({wait.kind}" in text, f"durable_decide needs the wait id; durable_runs printed {text}"
    decided = manage("durable_decide", str(wait.pk), "--approve")
    assert decided.returncode == 0, decided.stderr


def test_commands__an_empty_list_says_so(manage):
    assert manage("durable_runs").stdout.strip() == "no runs match"
    assert json.loads(manage("durable_runs", "--json").stdout) == []

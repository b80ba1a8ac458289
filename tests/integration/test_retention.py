"""Retention: the policy picks finished runs by workflow, status and age; the prune deletes them in batches, archived
first, and never touches a live run, a run a fork or another run relies on, or a run the engine is working on."""

from __future__ import annotations

import gzip
import json
import logging
import re
import threading
import uuid
from datetime import timedelta
from pathlib import Path

import pytest
from django.conf import settings
from django.core.files.storage import FileSystemStorage
from django.core.management import call_command
from django.db import OperationalError, connection, connections, transaction
from django.test import override_settings

from durable_agents import api, checks, clock, retention
from durable_agents.clock import DbNow
from durable_agents.display import when_text
from durable_agents.engine import job_lease
from durable_agents.engine import prune as engine_prune
from durable_agents.engine.archive import read_archive, record_lines, write_archive
from durable_agents.engine.job_lease import Holder, take_job_lease
from durable_agents.engine.lease import worker_id
from durable_agents.errors import DefinitionError, InvalidInputError
from durable_agents.models import Effect, Event, JobLease, Reliance, Run, RunStatus, Step, StepStatus
from durable_agents.testing import drive, wait_for, wait_for_run
from durable_agents.workflows import call, registry, workflow
from tests.testapp.models import Execution

pytestmark = pytest.mark.django_db(transaction=True)
ROOT = Path(__file__).resolve().parents[2]
POLICY = {
    "default": {"completed": "30d", "failed": "180d", "cancelled": "30d"},
    "charge": {"completed": "7d", "failed": None},
}


def retained(**extra):
    """DURABLE_AGENTS with a retention policy (and no rest between batches: tests need no politeness)."""
    return override_settings(
        DURABLE_AGENTS={**settings.DURABLE_AGENTS, "RETENTION": POLICY, "RETENTION_DUTY_CYCLE": 1, **extra}
    )


def old_runs(n: int, *, workflow: str = "record", status: str = RunStatus.COMPLETED, age_days: float = 400) -> list:
    """`n` finished runs last changed `age_days` ago (on the database's clock), each with two steps and an event."""
    then = clock.now() - timedelta(days=age_days)
    runs = Run.objects.bulk_create(
        Run(
            workflow=workflow,
            workflow_version=1,
            status=status,
            input={"n": i},
            input_hash="x",
            step_count=2,
            cursor=2,
            created_at=then,
            updated_at=then,
            finished_at=then,
        )
        for i in range(n)
    )
    Step.objects.bulk_create(
        Step(run=run, step_id=f"s{p}", name="work", position=p, status=StepStatus.DONE, result={"p": p})
        for run in runs
        for p in (1, 2)
    )
    Event.objects.bulk_create(Event(run=run, kind="completed", detail={"why": "test"}) for run in runs)
    return [run.id for run in runs]


def exists(ids) -> set:
    return set(Run.objects.filter(id__in=list(ids)).values_list("id", flat=True))


def test_policy__a_workflows_entry_overrides_the_default_status_by_status():
    policy = retention.load_policy(POLICY)
    assert policy.age("charge", "completed") == timedelta(days=7)
    assert policy.age("charge", "failed") is None, "None keeps a status for ever, over the default"
    assert policy.age("charge", "cancelled") == timedelta(days=30), "an unnamed status falls back to the default"
    assert policy.age("record", "failed") == timedelta(days=180)
    assert retention.load_policy({}).age("record", "completed") is None


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"default": {"running": "1d"}}, "only finished runs are pruned"),
        ({"default": {"completed": "soon"}}, "invalid duration 'soon'"),
        ({"default": "30d"}, "must map statuses to ages"),
    ],
)
def test_policy__a_bad_entry_says_which_and_how_to_fix_it(config, message):
    with pytest.raises(InvalidInputError, match=message):
        retention.load_policy(config)


def test_prune__selects_by_workflow_status_and_age():
    charge_done_10d = old_runs(3, workflow="charge", age_days=10)  # charge keeps completed 7 d: goes
    charge_failed_old = old_runs(2, workflow="charge", status=RunStatus.FAILED)  # charge keeps failed for ever
    record_done_10d = old_runs(3, age_days=10)  # default keeps completed 30 d: stays
    record_failed_100d = old_runs(2, status=RunStatus.FAILED, age_days=100)  # default 180 d: stays
    record_failed_200d = old_runs(2, status=RunStatus.FAILED, age_days=200)  # goes
    record_cancelled_40d = old_runs(2, status=RunStatus.CANCELLED, age_days=40)  # goes
    with retained():
        planned = retention.prune(dry_run=True)
        assert planned.counts == {"charge/completed": 3, "record/failed": 2, "record/cancelled": 2}
        report = retention.prune(batch_size=2)
    assert report.deleted == 7 and report.batches >= 4, report.as_dict()
    gone = {*charge_done_10d, *record_failed_200d, *record_cancelled_40d}
    kept = {*charge_failed_old, *record_done_10d, *record_failed_100d}
    assert exists(gone | kept) == kept
    assert not Step.objects.filter(run_id__in=gone).exists() and not Event.objects.filter(run_id__in=gone).exists()


def test_prune__dry_run_changes_nothing():
    ids = old_runs(5)
    before = (Run.objects.count(), Step.objects.count(), Event.objects.count())
    with retained():
        report = retention.prune(dry_run=True)
    assert report.selected == 5 and report.deleted == 0
    assert (Run.objects.count(), Step.objects.count(), Event.objects.count()) == before
    assert exists(ids) == set(ids)


def test_prune__never_a_pending_running_or_waiting_run_however_old():
    live = [*old_runs(2, status=RunStatus.PENDING), *old_runs(2, status=RunStatus.RUNNING)]
    live += old_runs(2, status=RunStatus.WAITING)
    with retained():
        report = retention.prune(older_than="0s")
    assert report.deleted == 0 and exists(live) == set(live)


def test_prune__keeps_a_source_while_a_fork_points_at_it_or_relies_on_its_effect():
    source = drive(api.start("charge", {"order_id": "R-1"}).id)
    fork = drive(api.fork(source.id, "after", actor="ops").id)
    assert fork.status == RunStatus.COMPLETED
    effect = Effect.objects.get(run=source, tool="charge")
    assert Reliance.objects.filter(effect=effect, run=fork).exists(), "the fork relies on the source's charge"
    clock.advance(timedelta(days=365))
    try:
        with retained():
            # The fork stands (here: still running), so its source stays, however old.
            Run.objects.filter(pk=fork.id).update(status=RunStatus.RUNNING)
            retention.prune(workflow="charge", older_than="1d", batch_size=1)
            assert exists([source.id, fork.id]) == {source.id, fork.id}, "a fork stands: its source must stay"
            # Without the fork's pointer (forked_from is SET_NULL), its Reliance alone still keeps the source.
            Run.objects.filter(pk=fork.id).update(forked_from=None)
            retention.prune(workflow="charge", older_than="1d")
            assert exists([source.id, fork.id]) == {source.id, fork.id}, "the fork relies on the source's effect"
            # Once the fork is finished and old too, it goes; then nothing relies on the source, which goes in the
            # same pass if it comes after the fork in id order, else in the next one.
            Run.objects.filter(pk=fork.id).update(status=RunStatus.COMPLETED)
            retention.prune(workflow="charge", older_than="1d", batch_size=1)
            assert exists([fork.id]) == set()
            retention.prune(workflow="charge", older_than="1d", batch_size=1)
            assert exists([source.id]) == set(), "once nothing relies on the source, it goes"
        assert not Effect.objects.filter(idempotency_key=effect.idempotency_key).exists()
    finally:
        clock.reset()


def test_prune__a_live_parent_keeps_its_children_and_a_parent_goes_only_after_them():
    parent, *children = old_runs(4)
    Run.objects.filter(pk__in=children).update(parent=parent, parent_step="fan")
    for index, child in enumerate(children):
        Run.objects.filter(pk=child).update(child_index=index)
    with retained():
        # The parent still waits on its join, which reads its children's rows: none may go.
        Run.objects.filter(pk=parent).update(status=RunStatus.WAITING)
        retention.prune(older_than="1d")
        assert exists([parent, *children]) == {parent, *children}, "a live parent's children were pruned"
        # Finished, its children go first; the parent once nothing points at it: in a later batch of this pass if
        # it comes after them in id order, else in the next pass.
        Run.objects.filter(pk=parent).update(status=RunStatus.COMPLETED)
        reports = [retention.prune(older_than="1d", batch_size=1) for _ in range(2)]
        assert exists([parent, *children]) == set()
        assert [r.skipped for r in reports] == [0, 0], "no batch was rolled back on the children's foreign key"


def test_prune__an_effect_waiting_for_an_operator_keeps_its_run():
    (run_id,) = old_runs(1, status=RunStatus.FAILED, age_days=400)
    Effect.objects.create(
        run_id=run_id, idempotency_key=f"{run_id}:x", tool="ship", args_hash="h", needs_attention="outcome unknown"
    )
    with retained():
        retention.prune()
    assert exists([run_id]) == {run_id}


def test_archive__written_again_under_its_name_replaces_it(tmp_path):
    ids = old_runs(2)
    storages = {
        **settings.STORAGES,
        "archive": {"BACKEND": "django.core.files.storage.FileSystemStorage", "OPTIONS": {"location": str(tmp_path)}},
    }
    name = engine_prune.archive_name(sorted(ids))
    with override_settings(STORAGES=storages):
        first = write_archive("archive", name, ids)
        again = write_archive("archive", name, ids)  # a crash after the first write: the next pass writes it again
        rows = read_archive("archive", again)
    assert first == again == name, "the same batch must land under the same name, not a renamed copy"
    assert len(list(tmp_path.rglob("*.jsonl.gz"))) == 1
    assert [row["id"] for row in rows if row["type"] == "run"] == [str(i) for i in ids]


class FailingStorage(FileSystemStorage):
    """A storage whose writes fail: the archive cannot be written."""

    def _save(self, name, content):
        raise OSError("disk full")


def test_archive__written_before_delete_and_reads_back_as_the_export(tmp_path):
    run = drive(api.start("charge", {"order_id": "A-1"}).id)
    ids = [run.id, *old_runs(4)]
    expected = [json.loads(line) for line in record_lines(ids).splitlines()]
    storages = {
        **settings.STORAGES,
        "archive": {"BACKEND": "django.core.files.storage.FileSystemStorage", "OPTIONS": {"location": str(tmp_path)}},
    }
    clock.advance(timedelta(days=365))
    try:
        with override_settings(STORAGES=storages), retained(RETENTION_ARCHIVE="archive"):
            report = retention.prune(batch_size=100)
            rows = read_archive("archive", report.archives[0]) if report.archives else []
    finally:
        clock.reset()
    assert report.deleted == 5 and len(report.archives) == 1, report.as_dict()
    by_run = {row["id"] for row in rows if row["type"] == "run"}
    assert by_run == {str(i) for i in ids}
    assert sorted(rows, key=json.dumps) == sorted(expected, key=json.dumps), "the archive holds every row, unchanged"
    assert {row["type"] for row in rows} >= {"run", "step", "effect", "event"}
    assert gzip.decompress((tmp_path / report.archives[0]).read_bytes()).count(b"\n") == len(rows)


def test_archive__a_failed_write_deletes_nothing(tmp_path):
    ids = old_runs(3)
    storages = {
        **settings.STORAGES,
        "archive": {"BACKEND": f"{__name__}.FailingStorage", "OPTIONS": {"location": str(tmp_path)}},
    }
    with override_settings(STORAGES=storages), retained(RETENTION_ARCHIVE="archive"), pytest.raises(OSError):
        retention.prune()
    assert exists(ids) == set(ids), "a run is deleted only after its archive is written"


def test_prune__skips_a_run_that_changed_after_it_was_archived():
    (run_id,) = old_runs(1)
    eligible = retention.eligible(retention.load_policy(POLICY), clock.now())
    chosen = engine_prune._fingerprints(engine_prune.prunable(eligible))
    Event.objects.create(run_id=run_id, kind="operator_note")  # written between the archive and the delete
    assert engine_prune.delete_batch(chosen, eligible) == []
    assert exists([run_id]) == {run_id}


def test_prune__races_a_worker_running_other_runs(start_worker):
    start_worker(beat=True)
    live = [api.start("record", {"steps": 40}).id for _ in range(6)]
    old = old_runs(3000)
    with retained():
        report = retention.prune(batch_size=100)
    assert report.deleted == 3000 and exists(old) == set(), report.as_dict()
    for run_id in live:
        run = wait_for_run(run_id, "completed", timeout=180)
        assert Step.objects.filter(run=run, status=StepStatus.DONE).count() == 40
        counts = Execution.objects.filter(run_id=run_id).values_list("step_id", flat=True)
        assert len(counts) == 40 and len(set(counts)) == 40, "every step of a live run ran exactly once"
    assert exists(live) == set(live)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["durable_export", "not-a-run"], "no run has id 'not-a-run'"),
        (["durable_export", str(uuid.UUID(int=0))], "no run has id"),
        (["durable_prune", "--batch-size", "0"], "--batch-size"),
        (["durable_prune", "--older-than", "soon"], "invalid duration 'soon'"),
        (["durable_prune", "--pause", "-1"], "--pause is seconds from 0 to 3600"),
        (["durable_prune", "--duty-cycle", "0"], "--duty-cycle is the share of the time the prune may work"),
        (["durable_prune", "--duty-cycle", "1.5"], "from 0.01 to 1 (flat out)"),
        (["durable_prune", "--duty-cycle", "half"], "got 'half'"),
        (["durable_prune", "--stop-after", "later"], "invalid duration 'later'"),
        (["durable_prune", "--workflow", "w" * 500], "--workflow"),
    ],
)
def test_commands__bad_input_is_exit_2_with_one_line(manage, args, message):
    done = manage(*args)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert message in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_commands__export_writes_the_record_and_prune_dry_run_reports(manage, tmp_path):
    run = drive(api.start("record", {"steps": 2}).id)
    out = tmp_path / "run.jsonl"
    assert manage("durable_export", str(run.id)[:8], "--output", str(out)).returncode == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows[0]["type"] == "run" and rows[0]["id"] == str(run.id)
    assert [r["step_id"] for r in rows if r["type"] == "step"] == ["s001", "s002"]
    printed = manage("durable_export", str(run.id))
    assert printed.stdout == out.read_text()
    old_runs(2)
    dry = manage("durable_prune", "--dry-run", "--older-than", "1d", "--json")
    assert json.loads(dry.stdout)["selected"] == 2 and Run.objects.count() == 3


def test_command__prune_in_process_reports_deleted(capsys):
    old_runs(3)
    with retained():
        call_command("durable_prune", "--batch-size", "2")
    assert "deleted 3 runs in 2 batches" in capsys.readouterr().out


def test_pace__a_batch_is_followed_by_a_rest_that_keeps_the_pass_to_its_duty_cycle():
    assert engine_prune.rest_after(0.3, 0.0, 0.1) == pytest.approx(2.7)
    assert engine_prune.rest_after(0.3, 0.0, 1.0) == 0.0, "1: flat out"
    assert engine_prune.rest_after(0.3, 5.0, 0.5) == 5.0, "the pause is the least rest"
    assert engine_prune.rest_after(2.0, 0.0, 0.5) == pytest.approx(2.0), "a slower batch (a busy database) rests more"


@pytest.mark.parametrize(("extra", "rests"), [({"RETENTION_DUTY_CYCLE": 0.25}, [6.0, 6.0]), ({}, [18.0, 18.0])])
def test_prune__rests_by_each_batchs_own_time(monkeypatch, extra, rests):
    """Each batch takes 2 s on a clock the test controls; the pass rests (1 - share) / share of that after it: 6 s
    at a duty cycle of 0.25, 18 s at 0.1 (the default). The report sums the rests."""
    seconds = iter(range(0, 1000, 2))
    monkeypatch.setattr(engine_prune, "time", type("Clock", (), {"monotonic": staticmethod(lambda: next(seconds))}))
    taken: list[float] = []
    monkeypatch.setattr(engine_prune, "_sleep", taken.append)
    old_runs(4)
    with retained(**{"RETENTION_DUTY_CYCLE": 0.1, **extra}):
        report = retention.prune(batch_size=2)
    assert report.deleted == 4 and taken == rests and report.rested == sum(rests)
    assert not report.stopped


@pytest.mark.parametrize("keyword", ["stop_after", "older_than"])
def test_prune__a_duration_that_is_not_one_is_a_clear_error(keyword):
    with retained(), pytest.raises(InvalidInputError, match=f"{keyword} is a duration, e.g. '2h' or a timedelta"):
        retention.prune(**{keyword: 60})


def test_prune__stop_after_starts_no_batch_past_its_time(monkeypatch):
    """A maintenance window: each batch takes 2 s on the test's clock; with --stop-after 5s the pass checks the
    clock before each batch (0 s, 2 s in: go; 8 s in: stop) and says it stopped; the next pass goes on."""
    seconds = iter(range(0, 1000, 2))
    monkeypatch.setattr(engine_prune, "time", type("Clock", (), {"monotonic": staticmethod(lambda: next(seconds))}))
    monkeypatch.setattr(engine_prune, "_sleep", lambda seconds: None)
    # A windowed pass begins at a random id; from the smallest, its first page is full and no clock read is spent
    # going round (test_prune_pace.py tests the random start and the wrap).
    monkeypatch.setattr(engine_prune, "window_start", lambda: uuid.UUID(int=0))
    ids = old_runs(6)
    with retained(RETENTION_DUTY_CYCLE=0.5):
        first = retention.prune(batch_size=2, stop_after="5s")
        assert (first.deleted, first.stopped) == (2, True) and len(exists(ids)) == 4
        rest = retention.prune(batch_size=2)
    assert (rest.deleted, rest.stopped, exists(ids)) == (4, False, set())


def test_checks__a_bad_policy_or_archive_alias_is_an_error_with_a_hint():
    bad = {"RETENTION": {"default": {"completed": "a month"}}, "RETENTION_ARCHIVE": "nowhere"}
    with override_settings(DURABLE_AGENTS={**settings.DURABLE_AGENTS, **bad}):
        found = {message.id: message for message in checks.check_retention()}
    assert set(found) == {"durable_agents.E011", "durable_agents.E012"}
    assert "invalid duration 'a month'" in found["durable_agents.E011"].msg
    with retained():
        assert checks.check_retention() == []


def test_prune__a_batch_of_runs_it_must_keep_does_not_end_the_pass():
    """Candidates are read by age in id order, then checked: a whole batch of old runs that must be kept (here,
    each with an effect waiting for an operator) is passed over, and the prunable runs behind it still go."""
    ids = sorted(old_runs(7))
    kept = ids[:4]
    for run_id in kept:
        Effect.objects.create(
            run_id=run_id, idempotency_key=f"{run_id}:x", tool="ship", args_hash="h", needs_attention="outcome unknown"
        )
    with retained():
        report = retention.prune(batch_size=2)
    assert exists(ids) == set(kept)
    assert (report.deleted, report.selected) == (3, 3), report.as_dict()


def _work(ctx) -> dict:
    return {}


@pytest.mark.parametrize(
    ("declared", "message"),
    [
        ({"done": "30d"}, "retention names status 'done'; only finished runs are pruned: use completed, failed"),
        ({"completed": "a month"}, "retention['completed']: invalid duration 'a month'"),
        ("30d", "retention maps finished statuses to ages"),
        ({"failed": timedelta(days=-1)}, "retention['failed'] is negative"),
    ],
)
def test_workflow_retention__a_bad_declaration_is_refused_when_defined(declared, message):
    with registry.isolated(), pytest.raises(DefinitionError, match=re.escape(message)):
        workflow("brief", steps=[call("work", _work)], retention=declared)


def test_workflow_retention__its_own_ages_apply_and_the_settings_entry_for_it_wins():
    """A workflow declares its own ages: they prune its runs even with no RETENTION in the settings; a status it
    leaves out falls back to the settings' default; the settings' entry for the workflow wins, status by status."""
    with registry.isolated():
        workflow("brief", steps=[call("work", _work)], retention={"completed": "1d", "failed": None})
        young = old_runs(2, workflow="brief", age_days=0.5)
        old = old_runs(2, workflow="brief", age_days=2)
        failed = old_runs(2, workflow="brief", status=RunStatus.FAILED, age_days=400)
        cancelled = old_runs(2, workflow="brief", status=RunStatus.CANCELLED, age_days=40)
        other = old_runs(2, age_days=2)
        policy = retention.load_policy(None)
        assert policy.age("brief", "completed") == timedelta(days=1) and policy.age("brief", "failed") is None
        assert policy.age("record", "completed") is None
        with override_settings(DURABLE_AGENTS={**settings.DURABLE_AGENTS, "RETENTION": None}):
            retention.prune(duty_cycle=1)
        assert exists(young + old + failed + cancelled + other) == set(young + failed + cancelled + other)

        # The settings' default fills the status the workflow left out (cancelled: 30d)...
        with retained():
            retention.prune()
        assert exists(young + failed + cancelled) == set(young + failed)
        # ...and the settings' own entry for the workflow wins over its declaration (failed: 180d).
        with retained(RETENTION={"brief": {"failed": "180d"}}):
            assert retention.load_policy().age("brief", "completed") == timedelta(days=1)
            retention.prune()
        assert exists(young + failed) == set(young)


# -- One pass at a time: a lease row on the database's clock -------------------------------------------------------


class PassAtRest:
    """A prune pass in a thread of this process that rests after its first batch until the test lets it go:
    a pass certainly still running (holding the prune's lease) while the test acts, however busy the machine."""

    def __init__(self, monkeypatch, **kwargs):
        self.resting, self.go = threading.Event(), threading.Event()
        self.kwargs = {"batch_size": 1, "pause_seconds": 1, **kwargs}
        self.report = None
        monkeypatch.setattr(engine_prune, "_sleep", self._rest)
        self.thread = threading.Thread(target=self._run)

    def _rest(self, seconds):
        self.resting.set()
        assert self.go.wait(60), "the test never let the resting pass go"

    def _run(self):
        try:
            with retained():
                self.report = retention.prune(**self.kwargs)
        finally:
            connections.close_all()

    def __enter__(self):
        self.thread.start()
        assert self.resting.wait(60), "the pass never reached its first rest"
        return self

    def __exit__(self, *exc):
        self.go.set()
        self.thread.join(60)


def test_prune__a_second_pass_at_once_says_which_pass_holds_the_lease_and_until_when(monkeypatch, manage, caplog):
    """Beat and cron (or two beats) start passes that overlap: one runs, the other says who holds the prune, until
    when (the lease's expiry on the database's clock), at WARNING and on the command's output, and does nothing."""
    monkeypatch.setattr(engine_prune, "PRUNE_LEASE_SECONDS", 3600.0)  # no renewal moves the expiry as the test reads it
    ids = old_runs(3)
    with PassAtRest(monkeypatch) as first:
        second = manage("durable_prune", "--older-than", "1d")
        with caplog.at_level(logging.WARNING, logger="durable_agents.engine"):
            again = retention.prune(older_than="1d")
        lease = JobLease.objects.get(name=engine_prune.PRUNE_JOB)
    assert first.report.deleted == 3 and exists(ids) == set(), first.report.as_dict()
    holder = worker_id()
    assert second.returncode == 0, second.stderr
    assert f"another prune pass holds the lease: {holder}" in second.stdout, second.stdout
    assert when_text(lease.expires_at) in second.stdout, "the output says until when the lease runs"
    # The tests' logging shows durable_agents at WARNING and above, on stderr.
    assert f"another pass holds the lease: {holder}" in second.stderr, "the busy pass logs it at WARNING"
    assert [r.levelname for r in caplog.records if "another pass holds the lease" in r.getMessage()] == ["WARNING"]
    assert again.busy and again.deleted == 0
    assert again.as_dict()["held_by"] == holder and again.as_dict()["held_until"] == lease.expires_at.isoformat()
    after = retention.prune(older_than="1d")
    assert not after.busy, "the first pass released its lease when it ended: the next pass runs at once"


def test_prune__a_pass_that_died_holding_the_lease_is_taken_over_once_it_lapses(caplog):
    """A pass killed mid-run (SIGKILL, OOM, a lost machine) releases nothing: its lease row stays, and lapses at its
    expiry on the database's clock; the next pass then takes it over."""
    ids = old_runs(2)
    dead = take_job_lease(engine_prune.PRUNE_JOB, seconds=engine_prune.PRUNE_LEASE_SECONDS, holder="gone-host:4242")
    assert not isinstance(dead, Holder)
    with retained(), caplog.at_level(logging.WARNING, logger="durable_agents.engine"):
        blocked = retention.prune()
    assert blocked.busy and blocked.held_by == "gone-host:4242" and exists(ids) == set(ids)
    assert "gone-host:4242" in caplog.text
    clock.advance(timedelta(seconds=engine_prune.PRUNE_LEASE_SECONDS + 1))
    with retained():
        taken_over = retention.prune()
    assert not taken_over.busy and taken_over.deleted == 2 and exists(ids) == set()
    lease = JobLease.objects.get(name=engine_prune.PRUNE_JOB)
    assert lease.holder == worker_id() and lease.expires_at is None, "the pass that took over released it at its end"


def test_prune__the_lease_is_renewed_while_the_pass_rests(monkeypatch):
    """A pass resting between batches (RETENTION_DUTY_CYCLE can ask for minutes) still holds the prune: its lease
    is renewed on the database's clock while it rests, and a pass started meanwhile is refused."""
    monkeypatch.setattr(engine_prune, "PRUNE_LEASE_SECONDS", 0.9)
    old_runs(2)
    with PassAtRest(monkeypatch) as first:
        taken = JobLease.objects.get(name=engine_prune.PRUNE_JOB).expires_at
        wait_for(
            lambda: JobLease.objects.get(name=engine_prune.PRUNE_JOB).expires_at > taken,
            timeout=30,
            what="the resting pass to renew its lease",
        )
    assert first.report.deleted == 2 and not first.report.lost


def test_prune__a_pass_that_lost_its_lease_stops_before_its_next_batch(monkeypatch, caplog):
    """A pass held up past its lease's expiry (a paused VM, a stalled machine) may find another pass took over: it
    starts no batch after that, and says so."""
    ids = old_runs(3)
    with caplog.at_level(logging.WARNING, logger="durable_agents.engine"), PassAtRest(monkeypatch) as first:
        JobLease.objects.filter(name=engine_prune.PRUNE_JOB).update(
            holder="other-host:7", token=uuid.uuid4(), expires_at=DbNow(timedelta(minutes=1))
        )
    assert first.report.lost and first.report.stopped and first.report.deleted == 1, first.report.as_dict()
    assert len(exists(ids)) == 2, "no batch after the lease was lost"
    assert "lost" in caplog.text
    assert JobLease.objects.get(name=engine_prune.PRUNE_JOB).holder == "other-host:7", "the successor keeps it"


def test_job_lease__two_passes_taking_it_at_the_same_instant_one_wins():
    """The second taker's UPDATE waits for the first's row lock, then re-reads the row (Postgres re-checks the WHERE
    of an UPDATE on the row version it waited for, in READ COMMITTED: "Concurrency Control", 13.2.1) and finds it
    held: it says by whom instead of taking it too."""
    took, let_go, out = threading.Event(), threading.Event(), {}

    def first():
        try:
            with transaction.atomic():
                out["first"] = take_job_lease("race", seconds=60, holder="first:1")
                took.set()
                let_go.wait(60)
        finally:
            connections.close_all()

    def second():
        try:
            out["second"] = take_job_lease("race", seconds=60, holder="second:2")
        finally:
            connections.close_all()

    one, two = threading.Thread(target=first), threading.Thread(target=second)
    one.start()
    assert took.wait(60)
    two.start()

    def second_waits_for_the_row() -> bool:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_stat_clear_snapshot()")
            cursor.execute(
                "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
                "WHERE NOT l.granted AND a.datname = current_database() AND a.query LIKE %s",
                ["%durable_agents_joblease%"],
            )
            return cursor.fetchone()[0] > 0

    wait_for(second_waits_for_the_row, what="the second taker to wait for the first's row lock")
    let_go.set()
    one.join(60)
    two.join(60)
    assert not isinstance(out["first"], Holder)
    assert isinstance(out["second"], Holder) and out["second"].holder == "first:1", out


def test_prune__a_lease_it_cannot_release_lapses_and_the_pass_still_reports(monkeypatch, caplog):
    """The database goes away as a pass ends: the pass's work is done and reported; its lease is left to lapse (a
    warning says so), not raised as a traceback over the pass's report."""
    ids = old_runs(2)

    def database_away(name, token):
        raise OperationalError("server closed the connection unexpectedly")

    monkeypatch.setattr(job_lease, "release_job_lease", database_away)
    with retained(), caplog.at_level(logging.WARNING, logger="durable_agents.engine"):
        report = retention.prune()
    assert report.deleted == 2 and exists(ids) == set()
    assert "not released" in caplog.text and "lapses at its expiry" in caplog.text

"""The hot path's statements take a run's row by its primary key, whatever the table's statistics say.

A statement that names its run by id and also tests its status (the claim, the commit's fence) could be planned as a
scan of the status index for every run in that status, when ANALYZE last ran before those runs existed: the planner
then believes there are almost none. A prepared statement keeps such a plan, so every step read an index entry per
run in flight (bench/agent_scale.py: 636 a commit at 1,000 conversations). Here the statistics are made that way on
purpose — analyzed with every run finished, then runs started and claimed — and each statement of a claim, a
commit, a commit-and-claim and a run's last commit is explained: no scan of the run table may use another index.

The engine's other transitions (an approval decided, a signal, a cancel, a resume, an admission) go through the ORM
and name their run or wait by key too: on such statistics none of their statements may scan an index on a status
(`models.Unindexed`, `Wait.objects.open(keyed=True)`) but the one keyed by the run, durable_wait_one_open_per_run,
which answers a run's open wait from one entry whatever its closed waits.
"""

from __future__ import annotations

import json

import pytest
from django.conf import settings
from django.db import connection
from django.test.utils import CaptureQueriesContext, override_settings

from bench.scale_agent import WORKFLOW, answer
from durable_agents import api
from durable_agents.engine.admission import admit
from durable_agents.engine.advance import Outcome, advance, advance_slice
from durable_agents.engine.family import parent_is_cancelled
from durable_agents.models import Run, RunStatus, Wait, WaitKind, WaitStatus
from durable_agents.testing.runs import take_lease

RUN_TABLE = Run._meta.db_table


WAIT_TABLE = Wait._meta.db_table


def _scans(plan: dict, table: str | None = RUN_TABLE) -> list[str]:
    """(scan type, index) of every node of `plan` that reads `table` (None: any table; an UPDATE's own node reads
    nothing)."""
    found = []
    if plan.get("Relation Name") and table in (None, plan["Relation Name"]) and plan["Node Type"] != "ModifyTable":
        found.append(f"{plan['Node Type']} {plan.get('Index Name', '')}".strip())
    for child in plan.get("Plans", []):
        found.extend(_scans(child, table))
    return found


def _explained(sql: str, table: str | None = RUN_TABLE) -> list[str]:
    with connection.cursor() as cursor:
        cursor.execute(f"EXPLAIN (FORMAT JSON) {sql}")
        plan = cursor.fetchone()[0]
    return _scans((json.loads(plan) if isinstance(plan, str) else plan)[0]["Plan"], table)


def _misleading_statistics(*, waiting: int = 0) -> None:
    """Statistics that say no run is pending, running or waiting and no wait is open, taken before 300 runs started
    and were claimed (and `waiting` more parked on an open approval)."""
    finished = api.start_many("noop", [{"steps": 1}] * 400)
    Run.objects.filter(pk__in=[run.id for run in finished]).update(status=RunStatus.COMPLETED)
    with connection.cursor() as cursor:
        cursor.execute(f"ANALYZE {RUN_TABLE}, {WAIT_TABLE}")
    crowd = api.start_many("noop", [{"steps": 3}] * 300)
    Run.objects.filter(pk__in=[run.id for run in crowd]).update(status=RunStatus.RUNNING)
    for run in api.start_many("approve_charge", [{"order_id": "crowd"}] * waiting):
        advance(run.id)  # prepare
        advance(run.id)  # parks on its approval


def _status_indexes() -> set[str]:
    """The indexes of the run and wait tables with a status in their key or their predicate, but the one keyed by
    the run (a run's open wait: one entry)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT indexname FROM pg_indexes WHERE tablename IN (%s, %s) AND indexdef LIKE %s",
            [RUN_TABLE, WAIT_TABLE, "%status%"],
        )
        return {name for (name,) in cursor.fetchall()} - {"durable_wait_one_open_per_run"}


def _assert_no_status_index(statements: list[str]) -> None:
    forbidden = _status_indexes()
    assert "durable_run_status_updated" in forbidden and "durable_wait_deadline_due" in forbidden
    for sql in statements:
        if sql.lstrip().upper().startswith(("SELECT", "UPDATE", "DELETE", "WITH")):
            used = {scan.rsplit(" ", 1)[-1] for scan in _explained(sql, table=None)}
            assert not used & forbidden, (sorted(used & forbidden), sql[-600:])


def _assert_by_key(statements: list[str]) -> None:
    for sql in statements:
        scans = _explained(sql)
        assert all(scan.endswith(f"{RUN_TABLE}_pkey") for scan in scans), (scans, sql[:400])


@pytest.mark.django_db(transaction=True)
def test_claims_and_commits_take_the_run_by_its_key_when_statistics_say_no_run_is_running():
    _misleading_statistics()
    run = api.start("noop", {"steps": 3})

    with CaptureQueriesContext(connection) as one_step:
        advance(run.id)  # a claim, then a commit
    eager = {**settings.DURABLE_AGENTS, "EAGER_SLICE_MS": 600_000.0}
    with override_settings(DURABLE_AGENTS=eager), CaptureQueriesContext(connection) as slice_:
        advance_slice(run.id)  # a claim, a commit-and-claim, the run's last commit
    assert Run.objects.get(pk=run.id).status == RunStatus.COMPLETED

    statements = [query["sql"] for query in [*one_step.captured_queries, *slice_.captured_queries]]
    assert len(statements) == 5, statements
    assert all(_explained(sql) for sql in statements), "each of them reads the run"
    _assert_by_key(statements)


@pytest.mark.django_db(transaction=True)
def test_a_conversation_s_statements_take_the_run_by_its_key_when_statistics_say_no_run_is_running(fake_anthropic):
    fake_anthropic.responder = answer
    _misleading_statistics()
    run = api.start(WORKFLOW, {"order_id": "A-1"})
    with CaptureQueriesContext(connection) as queries:
        assert advance(run.id) is Outcome.COMPLETED  # bench/scale_agent.py's: two turns and an effect
    _assert_by_key([query["sql"] for query in queries.captured_queries])


def _advance_to_its_end(run_id) -> None:
    for _ in range(5):
        if advance(run_id) is Outcome.COMPLETED:
            return
    raise AssertionError(f"run {run_id} did not complete in 5 steps: {Run.objects.get(pk=run_id).status}")


@pytest.mark.django_db(transaction=True)
def test_decisions_signals_cancels_and_resumes_take_their_run_and_wait_by_key_when_statistics_say_none_waits():
    _misleading_statistics(waiting=200)
    approved, signalled = api.start("approve_charge", {"order_id": "A-1"}), api.start("signal_flow", {})
    pending, held, broken = api.start("noop", {"steps": 2}), api.start("noop", {"steps": 2}), api.start("broken", {})
    for run in (approved, approved, signalled, broken, broken):
        advance(run.id)
    assert Run.objects.get(pk=broken.id).status == RunStatus.FAILED
    wait = Wait.objects.get(run_id=approved.id, status=WaitStatus.OPEN)
    assert take_lease(held.id) is not None
    keys = {str(run.id).replace("-", "") for run in (approved, signalled, pending, held, broken)} | {f"= {wait.id}"}

    with CaptureQueriesContext(connection) as queries:
        api.decide(wait.id, True, by="ops@example.com")
        _advance_to_its_end(approved.id)
        api.send_signal(signalled.id, "payment.confirmed", {"paid": True})
        _advance_to_its_end(signalled.id)
        api.cancel(pending.id, "not needed")
        api.cancel(held.id, "not needed")  # asked: settled once the holder lets go
        api.resume(broken.id)

    keyed = [query["sql"] for query in queries.captured_queries if any(key in query["sql"] for key in keys)]
    assert len(keyed) > 20, keyed
    _assert_no_status_index(keyed)


@pytest.mark.django_db(transaction=True)
def test_an_admission_takes_its_queued_run_by_key_when_statistics_say_none_is_pending():
    _misleading_statistics()
    queued = [api.start("noop", {"steps": 1}, concurrency_key="k", concurrency_limit=1) for _ in range(50)]
    Run.objects.filter(pk=queued[0].id).update(status=RunStatus.COMPLETED)  # its slot is free
    with CaptureQueriesContext(connection) as queries:
        assert admit("k") == [queued[1].id]
    key = str(queued[1].id).replace("-", "")
    keyed = [query["sql"] for query in queries.captured_queries if key in query["sql"]]
    assert any(sql.startswith("UPDATE") for sql in keyed), keyed
    _assert_no_status_index(keyed)


@pytest.mark.django_db(transaction=True)
def test_a_finished_run_named_by_key_is_taken_by_key_when_statistics_say_none_is_finished():
    """A child's resume asks whether its parent was cancelled (so do a deadline's failure and an effect resolved)."""
    _misleading_statistics()
    cancelled = api.start_many("noop", [{"steps": 1}] * 300)
    Run.objects.filter(pk__in=[run.id for run in cancelled]).update(status=RunStatus.CANCELLED)
    with CaptureQueriesContext(connection) as queries:
        assert parent_is_cancelled(Run(parent_id=cancelled[7].id))
    _assert_no_status_index([query["sql"] for query in queries.captured_queries])


def _wait_rows_read(sql: str) -> int:
    """Rows of the wait table `sql` reads (returned and filtered out), by EXPLAIN ANALYZE."""
    with connection.cursor() as cursor:
        cursor.execute(f"EXPLAIN (ANALYZE, FORMAT JSON) {sql}")
        plan = cursor.fetchone()[0]

    def read(node: dict) -> int:
        own = 0
        if node.get("Relation Name") == WAIT_TABLE and node["Node Type"] != "ModifyTable":
            own = node["Actual Loops"] * node["Actual Rows"] + node.get("Rows Removed by Filter", 0)
        return own + sum(read(child) for child in node.get("Plans", []))

    return read((json.loads(plan) if isinstance(plan, str) else plan)[0]["Plan"])


@pytest.mark.django_db(transaction=True)
def test_a_run_s_open_wait_is_found_without_reading_its_closed_waits():
    """A run that parks turn after turn (a conversation, batched answers) keeps its closed waits: parking and a signal
    find its open wait from one entry of durable_wait_one_open_per_run, not by reading every wait it ever had."""
    run = api.start("signal_flow", {})
    Wait.objects.bulk_create(
        Wait(run_id=run.id, kind=WaitKind.SIGNAL, name="payment.confirmed", status=WaitStatus.EXPIRED)
        for _ in range(300)
    )
    with connection.cursor() as cursor:
        cursor.execute(f"ANALYZE {WAIT_TABLE}")  # statistics that are right
    with CaptureQueriesContext(connection) as queries:
        advance(run.id)  # parks on its signal (park_txn)
        api.send_signal(run.id, "payment.confirmed", {"paid": True})
    key = str(run.id).replace("-", "")
    reads = [
        query["sql"]
        for query in queries.captured_queries
        if key in query["sql"] and query["sql"].lstrip().startswith("SELECT") and "\"status\" = 'open'" in query["sql"]
    ]
    assert reads, [query["sql"] for query in queries.captured_queries]
    read = [(_wait_rows_read(sql), sql[-400:]) for sql in reads]
    assert all(rows <= 5 for rows, _ in read), read

"""The hot path's statements take a run's row by its primary key, whatever the table's statistics say.

A statement that names its run by id and also tests its status (the claim, the commit's fence) could be planned as a
scan of the status index for every run in that status, when ANALYZE last ran before those runs existed: the planner
then believes there are almost none. A prepared statement keeps such a plan, so every step read an index entry per
run in flight (bench/agent_scale.py: 636 a commit at 1,000 conversations). Here the statistics are made that way on
purpose — analyzed with every run finished, then runs started and claimed — and each statement of a claim, a
commit, a commit-and-claim and a run's last commit is explained: no scan of the run table may use another index.
"""

from __future__ import annotations

import json

import pytest
from django.conf import settings
from django.db import connection
from django.test.utils import CaptureQueriesContext, override_settings

from bench.scale_agent import WORKFLOW, answer
from durable_agents import api
from durable_agents.engine.advance import Outcome, advance, advance_slice
from durable_agents.models import Run, RunStatus

RUN_TABLE = Run._meta.db_table


def _run_scans(plan: dict) -> list[str]:
    """(scan type, index) of every node of `plan` that reads the run table (an UPDATE's own node reads nothing)."""
    found = []
    if plan.get("Relation Name") == RUN_TABLE and plan["Node Type"] != "ModifyTable":
        found.append(f"{plan['Node Type']} {plan.get('Index Name', '')}".strip())
    for child in plan.get("Plans", []):
        found.extend(_run_scans(child))
    return found


def _explained(sql: str) -> list[str]:
    with connection.cursor() as cursor:
        cursor.execute(f"EXPLAIN (FORMAT JSON) {sql}")
        plan = cursor.fetchone()[0]
    return _run_scans((json.loads(plan) if isinstance(plan, str) else plan)[0]["Plan"])


def _misleading_statistics() -> None:
    """Statistics that say no run is pending or running, taken before 300 runs started and were claimed."""
    finished = api.start_many("noop", [{"steps": 1}] * 400)
    Run.objects.filter(pk__in=[run.id for run in finished]).update(status=RunStatus.COMPLETED)
    with connection.cursor() as cursor:
        cursor.execute(f"ANALYZE {RUN_TABLE}")
    crowd = api.start_many("noop", [{"steps": 3}] * 300)
    Run.objects.filter(pk__in=[run.id for run in crowd]).update(status=RunStatus.RUNNING)


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

"""The hot path's prepared statements find a run's step by its position, whatever the run's length.

A prepared statement is planned once for any parameters (a generic plan) after five executions, or at once under
`plan_cache_mode = force_generic_plan`. Postgres uses a partial index only where it can prove the index's predicate
from the query's clauses when it plans (the PostgreSQL docs, 11.8 "Partial Indexes": "Matching takes place at query
planning time, not at run time. As a result, parameterized query clauses do not work with a partial index"): `status
<> $3` proves nothing, `status <> 'superseded'` proves durable_step_run_position_uniq's `NOT status = 'superseded'`.
With the status sent as a parameter the step under the cursor was read through the step table's run_id index, every
step of the run, at every claim and commit: a 300-step run read 300 entries a step, a 5,000-step run took 1.1 ms of
Postgres CPU a step instead of 0.05.

Here auto_explain (a superuser's LOAD; Debian's postgresql package ships it) reports the plan each statement ran
with, generic plans forced: every read of a row is by its table's key, a run's position, a step's turn or an
idempotency key.
"""

from __future__ import annotations

import json

import pytest
from django.conf import settings
from django.db import connection
from django.db.backends.signals import connection_created
from django.test.utils import override_settings

from bench.scale_agent import WORKFLOW, answer
from durable_agents import api
from durable_agents.engine import statements
from durable_agents.engine.advance import Outcome, advance, advance_slice
from durable_agents.models import Effect, Run, RunStatus, Step, Turn

STEP_TABLE = Step._meta.db_table
KEY_INDEX = "durable_run_idempotency_key_uniq"
# The indexes a read of one row may use: a table's key, a run's live step at a position (either index), a step's turn.
BY_KEY = {
    *(f"{model._meta.db_table}_pkey" for model in (Run, Step, Turn, Effect)),
    "durable_step_run_position_uniq",
    "durable_step_run_position",
    "durable_turn_step_index_uniq",
    KEY_INDEX,
}


def _scans(plan: dict) -> list[tuple[str, str, str]]:
    """(table, node type, index) of every node of `plan` that reads a table."""
    found = []
    if plan.get("Relation Name") and plan["Node Type"] != "ModifyTable":
        found.append((plan["Relation Name"], plan["Node Type"], plan.get("Index Name", "")))
    for child in plan.get("Plans", []):
        found.extend(_scans(child))
    return found


class _PlansRun:
    """The plans of the statements this thread's connections run, generic ones forced, as auto_explain logs them (a
    conversation closes its connection before each model call: each new one is set up as well)."""

    def __init__(self) -> None:
        self.plans: list[tuple[str, dict]] = []

    def __enter__(self) -> _PlansRun:
        assert statements.prepares(), "the engine's statements are prepared on this database"
        connection.ensure_connection()
        self._set_up(connection)
        connection_created.connect(self._created)
        return self

    def __exit__(self, *exc: object) -> None:
        connection_created.disconnect(self._created)
        connection.close()  # its settings and handler go with it

    def _created(self, sender, connection, **kwargs) -> None:
        self._set_up(connection)

    def _set_up(self, db) -> None:
        db.connection.add_notice_handler(self._notice)
        with db.cursor() as cursor:
            cursor.execute("LOAD 'auto_explain'")
            for name, value in {
                "auto_explain.log_min_duration": "0",
                "auto_explain.log_format": "json",
                "auto_explain.log_level": "notice",
                "plan_cache_mode": "force_generic_plan",
            }.items():
                cursor.execute(f"SET {name} = '{value}'")

    def _notice(self, diagnostic) -> None:
        message = diagnostic.message_primary or ""
        if message.startswith("duration:") and "plan:" in message:
            explained = json.loads(message.split("plan:", 1)[1])
            self.plans.append((explained["Query Text"], explained["Plan"]))

    def misread(self) -> list[tuple[list, str]]:
        """The scans of a table by anything but a key, with their statement's text."""
        return [
            (bad, text[:300])
            for text, plan in self.plans
            if (bad := [scan for scan in _scans(plan) if scan[2] not in BY_KEY])
        ]


@pytest.mark.django_db(transaction=True)
def test_a_long_run_s_claims_and_commits_read_its_step_by_position_under_generic_plans():
    run = api.start("noop", {"steps": 300})
    eager = {**settings.DURABLE_AGENTS, "EAGER_SLICE_MS": 600_000.0, "EAGER_MAX_STEPS": 1_000}
    with override_settings(DURABLE_AGENTS=eager), _PlansRun() as plans:
        advance(run.id)  # a claim and a commit, each sent once: not prepared yet
        advance(run.id)  # prepared from here on
        advance_slice(run.id)  # a claim, 297 commit-and-claims, the last commit
    assert Run.objects.get(pk=run.id).status == RunStatus.COMPLETED
    read_steps = [text for text, plan in plans.plans if any(scan[0] == STEP_TABLE for scan in _scans(plan))]
    assert len(read_steps) >= 300, len(read_steps)
    assert plans.misread() == []


@pytest.mark.django_db(transaction=True)
def test_a_conversation_s_turns_read_its_step_by_key_under_generic_plans(fake_anthropic):
    fake_anthropic.responder = answer
    runs = [api.start(WORKFLOW, {"order_id": f"A-{i}"}) for i in range(3)]
    with _PlansRun() as plans:
        for run in runs:  # the second and third are sent prepared
            assert advance(run.id) is Outcome.COMPLETED  # bench/scale_agent.py's: two turns and an effect
    assert len(plans.plans) > 10
    assert plans.misread() == []


@pytest.mark.django_db(transaction=True)
def test_starts_with_and_without_keys_read_runs_by_key_under_generic_plans():
    with _PlansRun() as plans:
        for i in range(3):  # the second and third are sent prepared
            api.start("noop", {"steps": 2})
            api.start("noop", {"steps": 2}, idempotency_key=f"order-{i}")
            api.start("noop", {"steps": 2}, idempotency_key=f"order-{i}")  # the run holding the key comes back
            api.start_many("noop", [{"steps": 1}, {"steps": 2}], idempotency_keys=[f"a-{i}", f"b-{i}"])
    assert Run.objects.count() == 12
    keyed = [text for text, plan in plans.plans if any(scan[2] == KEY_INDEX for scan in _scans(plan))]
    assert len(keyed) >= 6, keyed
    assert plans.misread() == []

"""A run's row is written in the indexes of what it is, not of relations it does not have.

No claim or commit of a run is a HOT update (each changes its status, which indexes hold), so each writes a new entry
in every index whose predicate the row meets: at its start, its claim and each commit. A btree index without a
predicate holds a row whose column is NULL too, and a GIN index an empty document, so the indexes of a fork's source,
of a parent and of the search attributes are partial: a plain run writes none of their entries, and the look-ups
they serve (a fork's source, a parent's children, a search; retention's checks, a deletion's SET NULL) still read
an index.
"""

from __future__ import annotations

import pytest
from django.db import connection
from django.db.models import Exists, OuterRef, Q
from django.db.models.functions import Now

from durable_agents import api
from durable_agents.engine.prune import prunable
from durable_agents.models import Run, RunStatus
from durable_agents.testing import drive

pytestmark = pytest.mark.django_db

RUNS = Run._meta.db_table
# The indexes every run is in: its key, the console's and the sweep's orders.
EVERY_RUN = {f"{RUNS}_pkey", "durable_run_status_updated", "durable_run_workflow_status", "durable_run_created"}
# ... and while it is pending or running, the sweep's look-out for stranded runs.
RUNNABLE = {"durable_run_runnable_updated"}


def indexes_holding(run_id) -> set[str]:
    """The run table's indexes that hold the row of `run_id`: those without a predicate, and those whose predicate
    the row meets."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT c.relname, pg_get_expr(i.indpred, i.indrelid) FROM pg_index i"
            " JOIN pg_class c ON c.oid = i.indexrelid WHERE i.indrelid = %s::regclass",
            [RUNS],
        )
        indexes = cursor.fetchall()
        holding = set()
        for name, predicate in indexes:
            if predicate is None:
                holding.add(name)
                continue
            cursor.execute(f"SELECT EXISTS (SELECT FROM {RUNS} WHERE id = %s AND ({predicate}))", [run_id])
            if cursor.fetchone()[0]:
                holding.add(name)
    return holding


def plan(queryset) -> str:
    with connection.cursor() as cursor:
        # With a handful of rows a scan is cheapest: turn it off to see whether an index can serve the query.
        cursor.execute("SET LOCAL enable_seqscan = off")
    return queryset.explain()


def test_a_plain_run_is_in_the_indexes_every_run_needs_and_no_other():
    run = api.start("noop", {"steps": 1})
    assert indexes_holding(run.id) == EVERY_RUN | RUNNABLE
    drive(run.id)
    assert Run.objects.get(pk=run.id).status == RunStatus.COMPLETED
    assert indexes_holding(run.id) == EVERY_RUN


def test_a_run_with_search_attributes_is_in_the_search_index():
    run = api.start("searchable", {"order_id": "A-1001"})
    assert indexes_holding(run.id) == EVERY_RUN | RUNNABLE | {"durable_run_searched"}


def test_a_fork_is_in_the_index_of_its_source():
    source = api.start("noop", {"steps": 2})
    drive(source.id)
    step_id = source.steps.order_by("position").values_list("step_id", flat=True)[1]
    fork = api.fork(source.id, step_id)
    assert "durable_run_forks" in indexes_holding(fork.id)
    assert "durable_run_forks" not in indexes_holding(source.id)


def test_the_forks_of_a_run_are_found_by_an_index():
    explained = plan(Run.objects.filter(forked_from="00000000-0000-0000-0000-000000000001"))
    assert "durable_run_forks" in explained, explained


def test_the_children_of_a_run_are_found_by_an_index():
    explained = plan(Run.objects.filter(parent="00000000-0000-0000-0000-000000000001"))
    assert "durable_run_child_uniq" in explained or "durable_run_live_children" in explained, explained


def test_retention_probes_forks_and_children_by_index():
    # prune.prunable asks, run by run of a page, whether any run was forked from it or is its child.
    page = ["00000000-0000-0000-0000-000000000001", "00000000-0000-0000-0000-000000000002"]
    forked = Run.objects.filter(pk__in=page).exclude(Exists(Run.objects.filter(forked_from=OuterRef("pk"))))
    assert "durable_run_forks" in plan(forked)
    parented = Run.objects.filter(pk__in=page).exclude(Exists(Run.objects.filter(parent=OuterRef("pk"))))
    explained = plan(parented)
    assert "durable_run_child_uniq" in explained or "durable_run_live_children" in explained, explained
    # The whole check, as a pass asks it of a page: every read of the run table can be served by an index (scans
    # turned off: with real statistics the planner may still hash the parents of a large page).
    whole = plan(prunable(Q(finished_at__lt=Now())).filter(id__in=page))
    assert f"Seq Scan on {RUNS}" not in whole, whole

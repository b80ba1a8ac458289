"""Retention of families: children are pruned only with their parent, a parent rerun from its fan-out after its
children were pruned fails rather than charging anybody twice, and the children-started count it relies on is
written in the children's own transaction.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from django.conf import settings
from django.db import connection, transaction
from django.test import override_settings

from durable_agents import api, clock, retention
from durable_agents.models import Run, RunStatus
from durable_agents.testing import drive
from tests.testapp.models import LedgerEntry

pytestmark = pytest.mark.django_db(transaction=True)
POLICY = {"default": {"completed": "30d", "failed": "30d", "cancelled": "30d"}}


class Holder:
    """Another connection holding row locks on some runs (an operator or engine mid-transaction)."""

    def __init__(self, ids):
        self.ids, self.locked, self.release = list(ids), threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._hold)

    def _hold(self):
        try:
            with transaction.atomic():
                list(Run.objects.select_for_update().filter(id__in=self.ids).values_list("id", flat=True))
                self.locked.set()
                self.release.wait(30)
        finally:
            connection.close()

    def __enter__(self):
        self.thread.start()
        assert self.locked.wait(30)
        return self

    def __exit__(self, *exc):
        self.release.set()
        self.thread.join(30)


def finished_fan_out() -> Run:
    run = api.start("fan_collect", {"items": [{"item": i, "order_id": f"kid-{i}"} for i in range(2)]})
    drive(run.id)
    for child in Run.objects.filter(parent_id=run.id):
        drive(child.id)
    assert drive(run.id).status == RunStatus.COMPLETED
    assert LedgerEntry.objects.filter(kind="charge").count() == 2
    return run


def test_prune__children_stay_while_their_parent_is_kept():
    """A family goes together: children are pruned only once their parent is due too (its policy, its age), so a
    parent kept longer can still be rerun from its fan-out step and find its children by their key."""
    run = finished_fan_out()
    clock.advance(timedelta(days=400))
    try:
        policy = {**POLICY, "fan_collect": {"completed": None}}  # the parents' workflow is kept for ever
        with override_settings(DURABLE_AGENTS={**settings.DURABLE_AGENTS, "RETENTION": policy}):
            assert retention.prune().deleted == 0
            assert retention.prune(dry_run=True).selected == 0, "the dry run counts what a pass deletes"
        assert Run.objects.count() == 3
        api.resume(run.id, from_step="fan")
        rerun = drive(run.id)
    finally:
        clock.reset()
    assert rerun.status == RunStatus.COMPLETED, rerun.error
    assert LedgerEntry.objects.filter(kind="charge").count() == 2, "the rerun found its children: none ran again"


def test_prune__a_parent_rerun_from_its_fan_out_after_its_children_were_pruned_charges_nobody_twice():
    """The window a family still has: the prune deletes the children, and an operator holds the parent (resuming
    it) so the prune passes it by. Rerun from its fan-out step, the parent finds no child by its key (parent,
    step, index): it must fail, not start them again under new ids."""
    run = finished_fan_out()
    clock.advance(timedelta(days=400))
    try:
        with override_settings(DURABLE_AGENTS={**settings.DURABLE_AGENTS, "RETENTION": POLICY}):
            with Holder([run.id]):
                report = retention.prune()
            assert report.deleted == 2, report.as_dict()
        assert list(Run.objects.values_list("id", flat=True)) == [run.id]
        api.resume(run.id, from_step="fan")
        rerun = drive(run.id)
        for child in Run.objects.filter(parent_id=run.id):
            drive(child.id)
    finally:
        clock.reset()
    assert LedgerEntry.objects.filter(kind="charge").count() == 2, "a pruned child was started again: charged twice"
    assert rerun.status == RunStatus.FAILED and "were pruned" in rerun.error["message"], rerun.error


def test_spawn__the_children_started_count_is_written_with_the_children_never_without(monkeypatch):
    """The count a rerun checks after a prune is in the children's transaction: a crash between the two (here,
    the event's insert failing) leaves neither, and the step starts them on its next execution."""
    from durable_agents.engine import family

    def crash(*args, **kwargs):
        raise RuntimeError("killed between the children and their count")

    monkeypatch.setattr(family, "record_event", crash)
    run = api.start("fan_collect", {"items": [{"item": i, "order_id": f"kid-{i}"} for i in range(2)]})
    drive(run.id)
    assert not Run.objects.filter(parent_id=run.id).exists(), "children committed without their count"
    monkeypatch.undo()
    api.resume(run.id)  # the failed fan-out step, executed again
    drive(run.id)
    for child in Run.objects.filter(parent_id=run.id):
        drive(child.id)
    assert drive(run.id).status == RunStatus.COMPLETED
    assert LedgerEntry.objects.filter(kind="charge").count() == 2

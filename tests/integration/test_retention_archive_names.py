"""Retention's archives: a later batch with the same ends does not overwrite the archive of runs already
deleted.
"""

from __future__ import annotations

import threading
import uuid
from datetime import timedelta

import pytest
from django.conf import settings
from django.db import connection, transaction
from django.test import override_settings

from durable_agents import clock, retention
from durable_agents.engine.archive import read_archive
from durable_agents.models import Run, RunStatus

pytestmark = pytest.mark.django_db(transaction=True)
POLICY = {"default": {"completed": "30d", "failed": "30d", "cancelled": "30d"}}


def archived(tmp_path):
    storages = {
        **settings.STORAGES,
        "archive": {"BACKEND": "django.core.files.storage.FileSystemStorage", "OPTIONS": {"location": str(tmp_path)}},
    }
    durable = {**settings.DURABLE_AGENTS, "RETENTION": POLICY, "RETENTION_DUTY_CYCLE": 1}
    return override_settings(STORAGES=storages, DURABLE_AGENTS={**durable, "RETENTION_ARCHIVE": "archive"})


def old_run(run_id: uuid.UUID, *, age_days: float = 400) -> uuid.UUID:
    then = clock.now() - timedelta(days=age_days)
    Run.objects.create(
        id=run_id,
        workflow="record",
        workflow_version=1,
        status=RunStatus.COMPLETED,
        input={"id": str(run_id)},
        input_hash="x",
        created_at=then,
        updated_at=then,
        finished_at=then,
    )
    return run_id


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


def archived_run_ids(tmp_path) -> set[str]:
    found = set()
    for path in tmp_path.rglob("*.jsonl.gz"):
        rows = read_archive("archive", str(path.relative_to(tmp_path)))
        found |= {row["id"] for row in rows if row["type"] == "run"}
    return found


def test_archive__a_later_batch_with_the_same_ends_does_not_overwrite_a_deleted_runs_archive(tmp_path):
    a, b, c = (old_run(uuid.UUID(f"{n}0000000-0000-4000-8000-000000000000")) for n in (1, 2, 3))
    with archived(tmp_path):
        with Holder([a, c]):  # a and c busy: only b goes in the first pass
            first = retention.prune(batch_size=10)
        assert first.deleted == 1 and first.skipped == 2, first.as_dict()
        old_run(uuid.UUID("15000000-0000-4000-8000-000000000000"))  # a new run between a and c becomes due
        second = retention.prune(batch_size=10)
        assert second.deleted == 3, second.as_dict()
        kept = archived_run_ids(tmp_path)
    assert str(b) in kept, "b was deleted in the first pass: its archive must not be replaced by a later batch"
    assert Run.objects.count() == 0

"""The console's approvals queue reads one page of waits, however many approvals are open.

The wait changelist's default view ("Open approvals": status = 'open' AND kind = 'approval') is ordered by
`deadline ASC NULLS LAST, created_at, -id` and shows 100 rows: durable_wait_open_approvals returns open approvals in
that order (a btree's ascending order puts NULLs last), so the page reads about one page of index entries rather than
every open approval, sorted (at 100,000 open waits: a parallel scan of the wait table and a sort on disk).
"""

from __future__ import annotations

import json
import uuid
from datetime import timedelta

import pytest
from django.contrib.auth.models import User
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

from durable_agents.models import Run, RunStatus, Wait, WaitKind, WaitStatus

pytestmark = pytest.mark.django_db(transaction=True)
WAIT_TABLE = Wait._meta.db_table
OPEN_APPROVALS = 3000


def _wait_reads(plan: dict) -> list[tuple[str, str, int]]:
    """(node type, index, actual rows) of every plan node that reads the wait table."""
    found = []
    if plan.get("Relation Name") == WAIT_TABLE:
        found.append((plan["Node Type"], plan.get("Index Name", ""), plan["Actual Rows"] * plan["Actual Loops"]))
    for child in plan.get("Plans", []):
        found.extend(_wait_reads(child))
    return found


def test_the_open_approvals_page_reads_one_page_of_waits_not_every_open_approval():
    now = timezone.now()
    runs = Run.objects.bulk_create(
        Run(id=uuid.uuid4(), workflow="approve_charge", workflow_version=1, status=RunStatus.WAITING, input={})
        for _ in range(OPEN_APPROVALS)
    )
    Wait.objects.bulk_create(
        Wait(
            run=run,
            kind=WaitKind.APPROVAL,
            status=WaitStatus.OPEN,
            name="approve",
            deadline=now + timedelta(minutes=i) if i % 2 else None,
        )
        for i, run in enumerate(runs)
    )
    with connection.cursor() as cursor:
        cursor.execute(f"ANALYZE {WAIT_TABLE}, {Run._meta.db_table}")

    admin = Client()
    admin.force_login(User.objects.create_superuser("root", password="secret"))
    with CaptureQueriesContext(connection) as queries:
        page = admin.get(reverse("admin:durable_agents_wait_changelist"))
    assert page.status_code == 200
    listed = [
        q["sql"]
        for q in queries.captured_queries
        if f'FROM "{WAIT_TABLE}"' in q["sql"] and "ORDER BY" in q["sql"] and "LIMIT" in q["sql"]
    ]
    assert listed, [q["sql"][:200] for q in queries.captured_queries]

    with connection.cursor() as cursor:
        cursor.execute(f"EXPLAIN (ANALYZE, FORMAT JSON) {listed[0]}")
        plan = cursor.fetchone()[0]
    reads = _wait_reads((json.loads(plan) if isinstance(plan, str) else plan)[0]["Plan"])
    # One page (100 rows + the next, to know there is more) and the ties of its last deadline, not all 3,000.
    assert sum(rows for _, _, rows in reads) <= 300, reads

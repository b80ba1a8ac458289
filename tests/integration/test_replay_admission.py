"""A replay at scale: its runs under the replay's own concurrency key, `concurrency` of them admitted once the replay
commits (one hand-off for all its runs), the rest queued in order; its report read in a few queries, however many
runs it has."""

from __future__ import annotations

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from durable_agents import api
from durable_agents.engine.admission import admit
from durable_agents.models import ReplayRun, Run
from tests.integration.refund_recordings import recorded, shop  # noqa: F401 - shop: a fixture

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("shop")]


def test_replay__admits_its_concurrency_once_it_commits_and_queues_the_rest_in_order():
    runs = [recorded("A-1001"), recorded("A-1001"), recorded("A-1001")]

    replay = api.replay(runs=[r.id for r in runs], candidate={"model": "claude-haiku-5-5"}, concurrency=2)

    links = ReplayRun.objects.filter(replay=replay).order_by("recording__position", "lane")
    replay_runs = [Run.objects.get(pk=link.run_id) for link in links]
    assert len(replay_runs) == 6
    assert {r.concurrency_key for r in replay_runs} == {f"durable-replay:{replay.id}"}
    admitted = sorted((r for r in replay_runs if r.admitted_at), key=lambda r: (r.created_at, r.id))
    queued = sorted((r for r in replay_runs if not r.admitted_at), key=lambda r: (r.created_at, r.id))
    assert len(admitted) == 2, "the replay's concurrency is admitted when it commits, no more"
    assert max(r.created_at for r in admitted) <= min(r.created_at for r in queued), "admitted oldest first"
    assert admit(f"durable-replay:{replay.id}") == [], "a full key admits nobody more"


def test_replay_report__reads_a_cohort_of_three_in_as_many_queries_as_a_cohort_of_one():
    one = api.replay_here(api.replay(runs=[recorded("A-1001").id], candidate={"model": "claude-haiku-5-5"}).id)
    three = api.replay_here(
        api.replay(runs=[recorded("A-1001").id for _ in range(3)], candidate={"model": "claude-haiku-5-5"}).id
    )
    assert one.finished and three.finished

    counts = []
    for report in (one, three):
        with CaptureQueriesContext(connection) as queries:
            api.replay_report(report.replay_id)
        counts.append(len(queries))

    assert counts[0] == counts[1], f"the report reads each replay run on its own: {counts}"

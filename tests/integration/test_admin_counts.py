"""The console's counts: exact where cheap, "≈" for an estimate, "more than N" where even the estimate is known to
be low — and every inexact count offers the exact one on demand.

The planner's estimates come from the statistics of the last ANALYZE: rows written since (a burst of starts
before autovacuum's next pass) are missing from them. A count that stopped at the cap has proven more rows
than that; an estimate below it is stale, and showing it ("≈ 1,001 completed" beside 1,750) misleads.
"""

from __future__ import annotations

import re

import pytest
from django.conf import settings
from django.db import connection
from django.test.utils import override_settings

from durable_agents import api
from durable_agents.admin.counting import counts_by_value, estimated_count
from durable_agents.models import Run
from tests.integration.test_admin import LIST, login

pytestmark = pytest.mark.django_db

LIMITED = {**settings.DURABLE_AGENTS, "ADMIN_EXACT_COUNT_LIMIT": 3}


def _stale_statistics(starts: int) -> None:
    """ANALYZE an empty run table, then start runs: the statistics know none of them."""
    with connection.cursor() as cursor:
        cursor.execute(f"ANALYZE {Run._meta.db_table}")
    for _ in range(starts):
        api.start("noop", {"steps": 1})


@override_settings(DURABLE_AGENTS=LIMITED)
def test_count__an_estimate_below_what_was_counted_reads_as_a_lower_bound():
    _stale_statistics(6)

    filtered = estimated_count(Run.objects.filter(workflow="noop"))
    by_status = counts_by_value(Run, "status", ["pending"])["pending"]

    for count in (filtered, by_status):
        assert not count.exact and count.at_least, count
        assert str(count) == "more than 3", f"{count}: the count stopped at the cap, the stale estimate is lower"


@override_settings(DURABLE_AGENTS=LIMITED)
def test_run_list__an_inexact_count_links_to_the_exact_one():
    _stale_statistics(6)
    operator = login("operator")

    estimated = operator.get(LIST).content.decode()
    assert "count=exact" in estimated, "an inexact count offers the exact one"

    exact = operator.get(f"{LIST}?count=exact")
    assert exact.status_code == 200, "count=exact is not a filter the list refuses"
    assert exact.context["cl"].paginator.row_count.exact and exact.context["cl"].paginator.row_count.value == 6
    assert re.search(r"\b6\s+runs\b", exact.content.decode()), "the page says the exact count"
    assert "count=exact" not in exact.content.decode(), "an exact count offers nothing more"


@override_settings(DURABLE_AGENTS=LIMITED)
def test_run_list__the_exact_count_keeps_the_filters():
    _stale_statistics(6)
    operator = login("operator")
    api.start("record", {"steps": 1})

    exact = operator.get(f"{LIST}?workflow=noop&count=exact")
    assert exact.status_code == 200
    assert exact.context["cl"].paginator.row_count.value == 6, "filtered by workflow, counted exactly"

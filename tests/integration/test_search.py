"""Search attributes: a run is found by what the business knows (an order number), in the admin, the shell and
the API, through the GIN index at any size."""

from __future__ import annotations

import json
import re

import pytest
from django.db import connection
from psycopg.types.json import Jsonb

from durable_agents import api
from durable_agents import search as search_attributes
from durable_agents.errors import InvalidInputError
from durable_agents.models import Run, RunStatus
from durable_agents.testing import drive
from tests.integration.test_admin import LIST, ids, listed, login, page_url
from tests.integration.test_run_list import row_of

pytestmark = pytest.mark.django_db


@pytest.fixture
def orders():
    """Three runs of `searchable`: A-1001 (customer c-1), A-1002 (customer A-1001, to tell the fields apart) and
    one with no order id."""
    return (
        api.start("searchable", {"order_id": "A-1001", "customer": "c-1"}),
        api.start("searchable", {"order_id": "A-1002", "customer": "A-1001"}),
        api.start("searchable", {"customer": "c-3"}),
    )


def test_start__stores_the_declared_fields_of_the_input():
    run = api.start("searchable", {"order_id": "A-1001", "customer": 42, "order": {"id": "X-9"}, "other": "no"})
    run.refresh_from_db()
    assert run.search == {"order_id": "A-1001", "customer": "42", "order.id": "X-9"}


def test_start__a_workflow_without_search_stores_nothing():
    run = api.start("noop", {"steps": 1, "order_id": "A-1001"})
    run.refresh_from_db()
    assert run.search == {}


def test_fork__with_new_input_searches_by_that_input(orders):
    first, _, _ = orders
    fork = api.fork(first.id, "work", input={"order_id": "A-2001"})
    same = api.fork(first.id, "work")
    assert Run.objects.get(pk=fork.pk).search == {"order_id": "A-2001"}
    assert Run.objects.get(pk=same.pk).search == {"order_id": "A-1001", "customer": "c-1"}


def test_children__are_found_by_their_own_input():
    parent = api.start("fan_searchable", {"orders": ["C-1", "C-2"]})
    drive(parent.id)
    children = Run.objects.filter(parent=parent).order_by("child_index")
    assert [child.search for child in children] == [{"order_id": "C-1"}, {"order_id": "C-2"}]
    assert list(api.runs(search={"order_id": "C-2"})) == [children[1]]


def test_runs__finds_by_every_given_field(orders):
    first, second, _ = orders
    assert list(api.runs(search={"order_id": "A-1001"})) == [first]
    assert list(api.runs(search={"customer": "A-1001"})) == [second]
    assert list(api.runs(search={"order_id": "A-1001", "customer": "c-1"})) == [first]
    assert list(api.runs(search={"order_id": "A-1001", "customer": "c-9"})) == []
    assert list(api.runs(workflow="noop", search={"order_id": "A-1001"})) == []


@pytest.mark.parametrize(
    ("search", "message"),
    [
        ({"order id": "A-1"}, "'order id' is not a search field name"),
        ({"order_id": 7}, "search value of 'order_id' must be a string"),
        ({"order_id": ""}, "search value of 'order_id' must not be empty"),
        ("order_id=A-1", "search is a mapping of field names to values"),
        ({"order_id": "A\x00"}, r"search value of 'order_id' contains \\u0000"),
        ({"order_id": "A" * 201}, "at most 200 fit"),
        ({"order_id" * 20: "A"}, "is not a search field name"),
    ],
)
def test_runs__bad_search_says_what_to_give(search, message):
    with pytest.raises(InvalidInputError, match=message):
        api.runs(search=search)


def test_admin_search__a_bare_value_finds_it_in_any_field(orders):
    first, second, _ = orders
    assert ids(listed(login("operator-search"), "q=A-1001")) == {first.pk, second.pk}


def test_admin_search__field_colon_value_matches_that_field_only(orders):
    first, second, _ = orders
    client = login("operator-search-field")
    assert ids(listed(client, "q=order_id:A-1001")) == {first.pk}
    assert ids(listed(client, "q=customer:A-1001")) == {second.pk}
    assert ids(listed(client, "q=order_id:A-404")) == set()


def test_admin_search__ids_and_keys_are_still_found(orders):
    first, _, _ = orders
    keyed = api.start("noop", {"steps": 1}, idempotency_key="order-77")
    # A key with colons reads like field:value: it is still found by the key.
    slot = api.start("noop", {"steps": 1}, idempotency_key="schedule:nightly:2026-12-03T02:00")
    client = login("operator-search-ids")
    assert ids(listed(client, f"q={str(first.pk)[:8]}")) == {first.pk}
    assert ids(listed(client, "q=order-77")) == {keyed.pk}
    assert ids(listed(client, "q=schedule:nightly:2026-12-03T02:00")) == {slot.pk}


def test_admin_list__shows_the_search_attributes_under_the_workflow(orders):
    first, _, unnumbered = orders
    page = login("operator-search-column").get(LIST).content.decode()
    assert "order_id: A-1001" in row_of(page, first)
    assert "customer: c-1" in row_of(page, first)
    assert "order_id:" not in row_of(page, unnumbered)


def test_run_page__shows_the_search_attributes(orders):
    first, _, _ = orders
    page = login("operator-search-page", codenames=()).get(page_url(first)).content.decode()
    assert 'id="search-attributes"' in page
    assert "order_id: A-1001" in page


def plan(queryset) -> str:
    with connection.cursor() as cursor:
        # With a handful of rows a scan is cheapest: turn it off to see whether the index can serve the query.
        cursor.execute("SET LOCAL enable_seqscan = off")
    return queryset.explain()


def test_index__a_field_value_search_uses_the_gin_index(orders):
    explained = plan(Run.objects.matching_search({"order_id": "A-1001"}))
    assert "durable_run_searched" in explained, f"the search does not use the GIN index:\n{explained}"


def test_index__a_bare_value_search_uses_the_gin_index(orders):
    explained = plan(Run.objects.holding_search_value("A-1001", ["customer", "order_id"]))
    assert "durable_run_searched" in explained, f"the search does not use the GIN index:\n{explained}"


def generic_plan(queryset) -> str:
    """The plan of `queryset` prepared for any parameters, as under server-side binding once Postgres settles on a
    generic plan (forced here: plan_cache_mode)."""
    sql, params = queryset.query.sql_with_params()
    numbers = iter(range(1, len(params) + 1))
    prepared = re.sub(r"%s", lambda _: f"${next(numbers)}", sql)
    with connection.cursor() as cursor:
        cursor.execute("SET LOCAL plan_cache_mode = force_generic_plan")
        cursor.execute(f"PREPARE searched AS {prepared}")
        values = [json.dumps(p.obj) if isinstance(p, Jsonb) else p for p in params]
        cursor.execute(f"EXPLAIN EXECUTE searched({', '.join('%s' for _ in params)})", values)
        explained = "\n".join(row[0] for row in cursor.fetchall())
        cursor.execute("DEALLOCATE searched")
    return explained


def test_index__a_search_planned_for_any_parameters_uses_the_gin_index():
    # The index holds runs with search attributes only: its predicate must be provable with the values unknown,
    # or a generic plan reads the whole table (found by an attack: `search <> $2` proves nothing).
    def finished(**search: str) -> Run:
        return Run(workflow="noop", workflow_version=1, status=RunStatus.COMPLETED, input_hash="x", search=search)

    Run.objects.bulk_create(finished() for _ in range(3000))
    Run.objects.bulk_create(finished(order_id=f"A-{i}", customer="c") for i in range(3000))
    with connection.cursor() as cursor:
        cursor.execute(f"ANALYZE {Run._meta.db_table}")
    explained = generic_plan(Run.objects.matching_search({"order_id": "A-17"}).order_by())
    assert "durable_run_searched" in explained, explained
    explained = generic_plan(Run.objects.holding_search_value("A-17", ["customer", "order_id"]).order_by())
    assert "durable_run_searched" in explained, explained


@pytest.mark.django_db(transaction=True)
def test_durable_runs__search_lists_the_matching_runs(manage, orders):
    first, _, _ = orders
    result = manage("durable_runs", "--search", "order_id=A-1001", "--json")
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert [row["id"] for row in rows] == [str(first.id)]
    assert rows[0]["search"] == {"order_id": "A-1001", "customer": "c-1"}
    both = manage("durable_runs", "--search", "order_id=A-1001", "--search", "customer=c-9", "--json")
    assert json.loads(both.stdout) == []
    text = manage("durable_runs", "--search", "order_id=A-1001").stdout
    assert "order_id: A-1001" in text


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("A-1001", "--search takes field=value, e.g. --search order_id=A-1001"),
        ("order id=A-1001", "'order id' is not a search field name"),
        ("order_id=", "search value of 'order_id' must not be empty"),
    ],
)
def test_durable_runs__bad_search_exits_2_with_one_line(manage, value, message):
    result = manage("durable_runs", "--search", value)
    assert result.returncode == 2, f"exit {result.returncode}, stderr {result.stderr}"
    assert message in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_matching__no_attributes_asked_matches_every_run(orders):
    # Found by an attack: an empty search became Q(), which `exclude` and `|` read as "no condition".
    vendor = connection.vendor
    assert Run.objects.filter(search_attributes.matching({}, vendor)).count() == len(orders)
    assert not Run.objects.exclude(search_attributes.matching({}, vendor)).exists()

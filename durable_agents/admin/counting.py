"""Counting rows without COUNT(*) over a million: exact up to a cap, then a Postgres estimate.

An operator needs "about 950,000 completed" and "exactly 3 stuck", never a full-table scan per page view.
Small answers are counted exactly (the count stops at the cap); large ones come from the table's
`reltuples` (unfiltered) or the planner's row estimate (filtered).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property

from django.core.paginator import EmptyPage, Paginator
from django.db import connections
from django.db.models import Count, Model, QuerySet
from django.db.models.expressions import RawSQL

from durable_agents.conf import settings


@dataclass(frozen=True)
class RowCount:
    """A number of rows: exact, an estimate, or (`at_least`) a lower bound — the count stopped at its cap and the
    planner's estimate, from statistics older than the rows, was lower still."""

    value: int
    exact: bool
    at_least: bool = False

    def __str__(self) -> str:
        if self.exact:
            return f"{self.value:,}"
        return f"more than {self.value - 1:,}" if self.at_least else f"≈ {self.value:,}"


def _beyond(counted: int, estimate: int | None) -> RowCount:
    """What is known of a count that stopped at its cap (`counted` rows): the estimate, unless it is lower than
    what was counted (statistics from before those rows) — then only that there are more than the cap."""
    if estimate is None or estimate < counted:
        return RowCount(counted, exact=False, at_least=True)
    return RowCount(estimate, exact=False)


def exact_count_limit() -> int:
    return int(settings.ADMIN_EXACT_COUNT_LIMIT)


def is_postgres(queryset: QuerySet) -> bool:
    return connections[queryset.db].vendor == "postgresql"


def table_estimate(model: type[Model], using: str = "default") -> int | None:
    """The table's row count as of its last ANALYZE (None if it was never analyzed)."""
    with connections[using].cursor() as cursor:
        cursor.execute("SELECT reltuples FROM pg_class WHERE oid = %s::regclass", [model._meta.db_table])
        row = cursor.fetchone()
    # reltuples is -1 on Postgres 14+ until the first ANALYZE or VACUUM.
    return int(row[0]) if row and row[0] >= 0 else None


def planner_estimate(queryset: QuerySet) -> int | None:
    """The rows the planner expects `queryset` to return: one EXPLAIN, no execution."""
    sql, params = queryset.order_by().values("pk").query.sql_with_params()
    with connections[queryset.db].cursor() as cursor:
        cursor.execute(f"EXPLAIN (FORMAT JSON) {sql}", params)
        plan = cursor.fetchone()[0]
    plan = json.loads(plan) if isinstance(plan, str) else plan
    return int(plan[0]["Plan"]["Plan Rows"])


def capped_count(queryset: QuerySet, cap: int, *, selective: bool = False) -> int:
    """min(count, cap): the database stops reading after `cap` rows.

    `selective`: the filter usually matches few rows but Postgres may think it matches many (stuck runs:
    old `updated_at` and runnable are correlated, so it guesses thousands where there are ten). With a
    LIMIT it then prefers a seq scan that "meets `cap` rows early" — and reads the whole table. Sorting the
    matches by something no index serves takes that bet away: the plan must read every match before the
    LIMIT, so the filter's own indexes win. One statement, no planner setting to change and restore.
    """
    capped = queryset.order_by().values("pk")
    if selective and is_postgres(queryset):
        capped = capped.order_by(RawSQL("random()", []).asc())
    return capped[:cap].count()


def estimated_count(queryset: QuerySet, *, limit: int | None = None, selective: bool = False) -> RowCount:
    """Exact up to `limit` (DURABLE_AGENTS['ADMIN_EXACT_COUNT_LIMIT']), an estimate beyond it.

    Example::

        estimated_count(Run.objects.filter(status="completed"))   # RowCount(value=951234, exact=False)
    """
    limit = exact_count_limit() if limit is None else limit
    postgres = is_postgres(queryset)
    if postgres and not queryset.query.where:
        estimate = table_estimate(queryset.model, queryset.db)
        if estimate is not None and estimate > limit:
            return RowCount(estimate, exact=False)
    counted = capped_count(queryset, limit + 1, selective=selective)
    if counted <= limit:
        return RowCount(counted, exact=True)
    if not postgres:
        # The embedded SQLite default holds small tables: an exact count is affordable there.
        return RowCount(queryset.order_by().count(), exact=True)
    return _beyond(counted, planner_estimate(queryset))


def counts_by_value(
    model: type[Model], field: str, values: list[str], *, limit: int | None = None
) -> dict[str, RowCount]:
    """RowCount of rows per value of an indexed `field`, in one query whatever the number of values.

    Each value is counted up to `limit` + 1 (an index range that stops at the cap); past the limit its count
    is estimated from the column's statistics (its most common values' frequencies times the table's row
    count, as of the last ANALYZE), read in the same statement. On SQLite, exact counts.

    Example::

        counts_by_value(Run, "status", RunStatus.values)   # {"completed": RowCount(951234, exact=False), ...}
    """
    limit = exact_count_limit() if limit is None else limit
    connection = connections["default"]
    if connection.vendor != "postgresql":
        counted = dict(model.objects.values_list(field).annotate(n=Count("*")).order_by())
        return {value: RowCount(counted.get(value, 0), exact=True) for value in values}
    table, column = model._meta.db_table, model._meta.get_field(field).column
    quoted_table, quoted_column = connection.ops.quote_name(table), connection.ops.quote_name(column)
    with connection.cursor() as cursor:
        cursor.execute(
            "WITH stats AS (SELECT c.reltuples AS total, s.most_common_vals::text::text[] AS common, "
            "s.most_common_freqs AS freqs FROM pg_class c LEFT JOIN pg_stats s ON s.schemaname = current_schema() "
            "AND s.tablename = %s AND s.attname = %s WHERE c.oid = %s::regclass) "
            f"SELECT v.value, (SELECT count(*) FROM (SELECT 1 FROM {quoted_table} WHERE {quoted_column} = v.value "
            "LIMIT %s) capped), (SELECT total * freqs[array_position(common, v.value::text)] FROM stats) "
            "FROM unnest(%s::text[]) AS v(value)",
            [table, column, table, limit + 1, list(values)],
        )
        rows = cursor.fetchall()
    return {
        value: RowCount(counted, exact=True)
        if counted <= limit
        else _beyond(counted, None if estimate is None else int(estimate))
        for value, counted, estimate in rows
    }


class EstimatedCountPaginator(Paginator):
    """A paginator for the admin that never counts a big result exactly.

    A page past the (estimated) end is empty rather than an error, since the estimate may be high.
    `selective` is set by the admin when a filter that usually matches few rows is on (see capped_count).
    """

    selective = False
    # The operator asked for the exact count (the run list's "count exactly" link): one COUNT(*), however big.
    exact = False

    @cached_property
    def row_count(self) -> RowCount:
        if self.exact:
            return RowCount(self.object_list.order_by().count(), exact=True)
        return estimated_count(self.object_list, selective=self.selective)

    @cached_property
    def count(self) -> int:
        return self.row_count.value

    def validate_number(self, number: object) -> int:
        try:
            return super().validate_number(number)
        except EmptyPage:
            if int(number) >= 1:  # past an over-estimated end, not before the first page
                return int(number)
            raise

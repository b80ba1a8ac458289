"""Search attributes: the input fields a workflow declares searchable, their values on a run, and finding runs by them.

A workflow names fields of its input (`workflow(..., search=("order_id", "customer"))`); a dotted path
(`"order.id"`) reads into nested objects. At start each field's value is stored on the run as a string
(`Run.search`, e.g. `{"order_id": "A-1001"}`): strings as they are, numbers and booleans as JSON spells them
(`42`, `true`). A field the input lacks, a null, an object, a list, an empty string or a value longer than
MAX_VALUE_CHARS is left out: the search finds runs by an exact value, never by part of one.

On Postgres `search__contains` (`@>`) is served by a GIN index (jsonb_path_ops, `durable_run_searched`), so a
search reads a handful of index pages at a million runs. That index holds only runs with search attributes (a run
without writes no entry at each claim and commit), so a search says so too (`search <> {}`), which lets the planner
use it. SQLite has no `@>`: the same filters are written there as exact matches on each key, read by a scan.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from typing import Any

from django.db.models import F, Lookup, Q
from django.db.models.fields.json import KeyTextTransform
from django.db.models.lookups import Exact

from durable_agents.errors import DefinitionError, InvalidInputError
from durable_agents.storable import check_text, shown

# A key of the input, or a dotted path of keys into nested objects; never "__" (the ORM's separator), ":" or "="
# (the admin's and the shell's separators).
FIELD_RE = re.compile(r"(?!.*__)[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*")
MAX_FIELDS = 20
MAX_FIELD_CHARS = 100
MAX_VALUE_CHARS = 200
EXAMPLE = "e.g. search=('order_id',)"


def check_declaration(workflow: str, search: Any) -> tuple[str, ...]:
    """The declared fields as a tuple; DefinitionError saying what to write for anything else."""
    if isinstance(search, str | bytes) or not isinstance(search, Iterable):
        raise DefinitionError(f"workflow {workflow!r}: search is a tuple of input field names, {EXAMPLE}")
    fields = tuple(search)
    for field in fields:
        if not is_field_name(field):
            raise DefinitionError(
                f"workflow {workflow!r}: search field {field!r} must be a top-level input key or a dotted path "
                f"into nested objects (letters, digits and single underscores: 'order_id', 'order.id'), "
                f"at most {MAX_FIELD_CHARS} characters"
            )
    for field in fields:
        if fields.count(field) > 1:
            raise DefinitionError(f"workflow {workflow!r}: search names {field!r} twice")
    if len(fields) > MAX_FIELDS:
        raise DefinitionError(f"workflow {workflow!r}: search names at most {MAX_FIELDS} fields, got {len(fields)}")
    return fields


def is_field_name(field: Any) -> bool:
    return isinstance(field, str) and len(field) <= MAX_FIELD_CHARS and FIELD_RE.fullmatch(field) is not None


def attributes_of(fields: Iterable[str], run_input: Any) -> dict[str, str]:
    """The values of `fields` in `run_input`, as strings; what is not a short scalar is left out."""
    found: dict[str, str] = {}
    for field in fields:
        value: Any = run_input
        for key in field.split("."):
            value = value.get(key) if isinstance(value, dict) else None
        if isinstance(value, bool | int | float):
            value = json.dumps(value)
        if isinstance(value, str) and value and len(value) <= MAX_VALUE_CHARS:
            found[field] = value
    return found


def check_filters(search: Any) -> dict[str, str]:
    """The filters `{field: value}` a caller asks for; InvalidInputError saying what to give otherwise."""
    if not isinstance(search, Mapping):
        raise InvalidInputError("search is a mapping of field names to values, e.g. search={'order_id': 'A-1001'}")
    for field, value in search.items():
        if not is_field_name(field):
            raise InvalidInputError(
                f"{shown(field)} is not a search field name: a workflow's search names input keys such as "
                "'order_id' or 'order.id'"
            )
        if not isinstance(value, str):
            raise InvalidInputError(f"the search value of {field!r} must be a string (values are stored as text)")
        if not value:
            raise InvalidInputError(f"the search value of {field!r} must not be empty")
        # No run holds a longer value (attributes_of leaves those out), nor one Postgres cannot store.
        check_text(value, f"the search value of {field!r}", max_chars=MAX_VALUE_CHARS)
    return dict(search)


def parse_filter(text: str, *, separator: str = "=") -> tuple[str, str] | None:
    """`field=value` (the shell) or `field:value` (the admin) as (field, value); None when `text` is not one."""
    field, found, value = text.partition(separator)
    if not found:
        return None
    return field.strip(), value.strip()


def as_text(attributes: Mapping[str, str]) -> str:
    """`order_id: A-1001, customer: c-1`: how the admin and durable_runs show a run's search attributes."""
    return ", ".join(f"{field}: {value}" for field, value in attributes.items())


def matching(search: Mapping[str, str], vendor: str) -> Q:
    """Runs whose search attributes hold every `field: value` of `search`."""
    if vendor == "postgresql":
        if not search:
            return Q(search__contains={})  # every run
        # With the index's own predicate (Run.Meta.indexes, durable_run_searched): Postgres cannot infer it from `@>`.
        return Q(search__contains=dict(search)) & ~Q(_EmptyDocument(F("search"), True))
    return Q(*(Exact(KeyTextTransform(field, "search"), value) for field, value in search.items()))


class _EmptyDocument(Lookup):
    """`search = '{}'` with the `{}` written in the statement, as the index's predicate is: Postgres proves a partial
    index's predicate when it plans (the PostgreSQL docs, 11.8 "Partial Indexes"), and from `search <> $2`, a
    parameter, it proves nothing: planned for any parameters (a generic plan, under server-side binding), a search
    would read the whole table."""

    lookup_name = "empty_document"

    def as_sql(self, compiler: Any, connection: Any) -> tuple[str, list[Any]]:
        column, params = self.process_lhs(compiler, connection)
        return f"{column} = '{{}}'::jsonb", list(params)


def holding(value: str, fields: Iterable[str], vendor: str) -> Q:
    """Runs with `value` in any of `fields` (on Postgres one index scan each, OR-ed as bitmaps)."""
    parts = [matching({field: value}, vendor) for field in fields]
    if not parts:
        return Q(pk__in=[])
    match = parts[0]
    for part in parts[1:]:
        match |= part
    return match

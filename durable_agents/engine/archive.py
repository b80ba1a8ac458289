"""A run's full record as JSON lines: the run, its steps, turns, effects, reliances, waits, events and payloads.

One line per row, `{"type": "run" | "step" | ..., <every column by its attribute name>}`, the run's line first:
the format `durable_export` prints and the retention archive stores gzipped (`write_archive`). UUIDs, times,
decimals and durations are written as Django's JSON encoder writes them, except times, which keep their
microseconds (Django's encoder cuts them to milliseconds); a payload's bytes as base64.

Example::

    lines = record_lines([run.id])                       # bytes, one JSON object per line
    rows = [json.loads(line) for line in lines.splitlines()]
    rows[0]["type"], rows[0]["id"]                      # "run", the run's id
"""

from __future__ import annotations

import base64
import gzip
import json
import uuid
from collections import defaultdict
from collections.abc import Iterable
from datetime import datetime
from typing import Any

from django.core.files.base import ContentFile
from django.core.files.storage import storages
from django.core.serializers.json import DjangoJSONEncoder
from django.db.models import Model

from durable_agents.models import Effect, Event, Payload, Reliance, Run, Step, Turn, Wait

# The tables of a run's record, in the order a reader meets them; each has a `run` foreign key.
CHILD_MODELS: tuple[tuple[str, type[Model]], ...] = (
    ("step", Step),
    ("turn", Turn),
    ("effect", Effect),
    ("reliance", Reliance),
    ("wait", Wait),
    ("event", Event),
    ("payload", Payload),
)


class ArchiveEncoder(DjangoJSONEncoder):
    """Django's JSON encoder, with times written whole: an archive must not round what it keeps."""

    def default(self, o: Any) -> Any:
        if isinstance(o, datetime):
            return o.isoformat()
        return super().default(o)


def row(kind: str, instance: Model) -> dict[str, Any]:
    """One row as a line's object: its type, then every concrete column by attribute name (`run_id`, not `run`)."""
    fields: dict[str, Any] = {"type": kind}
    for field in instance._meta.concrete_fields:
        value = getattr(instance, field.attname)
        if isinstance(value, bytes | memoryview):
            value = base64.b64encode(bytes(value)).decode("ascii")
        fields[field.attname] = value
    return fields


def record_rows(run_ids: Iterable[uuid.UUID | str]) -> list[dict[str, Any]]:
    """The full records of these runs, run by run (in the order given; unknown ids are left out).

    One query per table for the whole batch, not per run: a prune batch of 500 runs reads eight tables once.
    """
    ids = [uuid.UUID(str(run_id)) for run_id in run_ids]
    runs = {run.id: run for run in Run.objects.filter(id__in=ids)}
    children: dict[uuid.UUID, list[dict[str, Any]]] = defaultdict(list)
    for kind, model in CHILD_MODELS:
        for instance in model._default_manager.filter(run_id__in=list(runs)).order_by("run_id", "pk"):
            children[instance.run_id].append(row(kind, instance))
    rows: list[dict[str, Any]] = []
    for run_id in ids:
        if run_id in runs:
            rows.append(row("run", runs.pop(run_id)))
            rows.extend(children[run_id])
    return rows


def record_lines(run_ids: Iterable[uuid.UUID | str]) -> bytes:
    """The JSON lines of these runs' full records (UTF-8, one object per line, each line ending in a newline)."""
    return b"".join(
        json.dumps(line, cls=ArchiveEncoder, ensure_ascii=False).encode() + b"\n" for line in record_rows(run_ids)
    )


def write_archive(alias: str, name: str, run_ids: Iterable[uuid.UUID | str]) -> str:
    """Write these runs' records, gzipped, to `name` in storage `alias`; returns the name written.

    Idempotent by name: an archive of the same name is replaced (Django's `save` would otherwise pick a new name
    and leave two copies). The write is complete when this returns, before any of the runs is deleted.
    """
    storage = storages[alias]
    data = gzip.compress(record_lines(run_ids), mtime=0)
    if storage.exists(name):
        storage.delete(name)
    return storage.save(name, ContentFile(data))


def read_archive(alias: str, name: str) -> list[dict[str, Any]]:
    """The rows of an archive written by `write_archive` (for a restore, an audit or a test)."""
    with storages[alias].open(name, "rb") as handle:
        text = gzip.decompress(handle.read()).decode()
    return [json.loads(line) for line in text.splitlines() if line]

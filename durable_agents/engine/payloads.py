"""Payloads: inputs are checked (JSON Postgres can store, within the size limit); large step results live out of row.

A result over RESULT_INLINE_MAX_BYTES is stored once, content-addressed by its sha256, in the Payload table
beside its run (Postgres is the only state: a next step on another machine, or after a redeploy, reads it
there) or, when DURABLE_AGENTS["RESULT_STORAGE"] names one, in that shared Django storage (S3, say). The step
row keeps a reference and the hash, and every read verifies the hash.

References in Step.result_ref:

* ``payload:<sha256>``                     a Payload row of the step's run
* ``storage:<alias>:<name>``               a file in the Django storage STORAGES[alias]
* ``durable_agents/results/...``           older rows: a file in default_storage (still read)
"""

from __future__ import annotations

import hashlib
import json
import uuid
from dataclasses import dataclass
from typing import Any

from django.core.files.base import ContentFile
from django.core.files.storage import default_storage, storages
from django.core.files.storage.handler import InvalidStorageError
from django.core.serializers.json import DjangoJSONEncoder

from durable_agents.conf import settings
from durable_agents.errors import InputTooLargeError, InvalidInputError, PermanentError, RunNotFoundError
from durable_agents.models import Payload
from durable_agents.storable import check_json

PAYLOAD_REF = "payload:"
STORAGE_REF = "storage:"


def canonical_json(value: Any) -> bytes:
    """Stable bytes for hashing and size checks: sorted keys, no whitespace."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), cls=DjangoJSONEncoder).encode()


def digest(value: Any) -> str:
    return hashlib.sha256(canonical_json(value)).hexdigest()


def check_input(run_input: Any, what: str = "input") -> str:
    """Return the input's hash, or InvalidInputError if it is not JSON Postgres can store, or too large.

    `what` names the value in messages (``input["items"][2] is NaN, ...``): "input", "payload".
    """
    return checked_input(run_input, what)[0]


def checked_input(run_input: Any, what: str = "input") -> tuple[str, str]:
    """As check_input, the input's hash and the JSON text it hashes (sorted keys, no whitespace: as jsonb stores it,
    the key order aside), for a writer that sends the input as text."""
    try:
        raw = json.dumps(run_input, sort_keys=True, separators=(",", ":")).encode()
    except (TypeError, ValueError, RecursionError) as exc:
        raise InvalidInputError(f"{what} must be JSON-serialisable: {exc}") from exc
    check_json(run_input, what, InvalidInputError, raw=raw)
    limit = int(settings.INPUT_MAX_BYTES)
    if len(raw) > limit:
        raise InputTooLargeError(
            f"{what} is {len(raw)} bytes, over the {limit}-byte limit "
            "(DURABLE_AGENTS['INPUT_MAX_BYTES']); pass a reference to the data instead"
        )
    return hashlib.sha256(raw).hexdigest(), raw.decode()


@dataclass(frozen=True)
class StoredResult:
    """A step result ready to commit: inline JSON, or a reference to where it is stored, with its hash."""

    inline: Any
    ref: str = ""
    sha256: str = ""

    @property
    def public_value(self) -> Any:
        """What a run's output shows: the value itself, or where it lives."""
        return {"result_ref": self.ref, "result_hash": self.sha256} if self.ref else self.inline


def store_result(run_id: uuid.UUID | str, step_id: str, value: Any) -> StoredResult:
    """Serialise a step result, refusing what Postgres cannot store (PermanentError naming the spot);
    above RESULT_INLINE_MAX_BYTES store it out of row (outside any transaction: the row is idempotent)."""
    try:
        raw = json.dumps(value, separators=(",", ":"), cls=DjangoJSONEncoder).encode()
    except (TypeError, ValueError, RecursionError) as exc:
        raise PermanentError(f"step {step_id!r} returned a value that is not JSON-serialisable: {exc}") from exc
    # What the JSON column would hold; checked before the commit, where a DataError would leave the
    # lease held and the step re-running on every expiry.
    stored = value if _is_plain(value) else json.loads(raw)
    check_json(stored, "result", PermanentError, raw=raw)
    if len(raw) <= int(settings.RESULT_INLINE_MAX_BYTES):
        return StoredResult(inline=stored)
    sha = hashlib.sha256(raw).hexdigest()
    alias = settings.RESULT_STORAGE
    ref = _save_in_storage(alias, run_id, sha, raw) if alias else _save_payload(run_id, sha, raw)
    return StoredResult(inline=None, ref=ref, sha256=sha)


def _save_payload(run_id: uuid.UUID | str, sha: str, raw: bytes) -> str:
    # Insert-or-ignore on (run, sha256): a re-executed step writing the same bytes reuses the row, and a
    # crash after this insert leaves a row its run's cascade removes.
    Payload.objects.bulk_create([Payload(run_id=run_id, sha256=sha, data=raw, size=len(raw))], ignore_conflicts=True)
    return f"{PAYLOAD_REF}{sha}"


def _save_in_storage(alias: str, run_id: uuid.UUID | str, sha: str, raw: bytes) -> str:
    storage = _storage(alias)
    # Content-addressed name: a re-executed step writing the same bytes finds the same file.
    name = f"durable_agents/results/{run_id}/{sha}.json"
    if not storage.exists(name):
        name = storage.save(name, ContentFile(raw))
    return f"{STORAGE_REF}{alias}:{name}"


def _storage(alias: str) -> Any:
    try:
        return storages[alias]
    except InvalidStorageError as exc:
        raise PermanentError(
            f"DURABLE_AGENTS['RESULT_STORAGE'] is {alias!r}, which is not a key of settings.STORAGES; "
            "add that storage or set RESULT_STORAGE to None (results then live in Postgres)"
        ) from exc


def load_result(ref: str, sha256: str, *, run_id: uuid.UUID | str | None = None) -> Any:
    """Read an out-of-row result back (from Postgres, or the storage its reference names) and verify its hash."""
    if ref.startswith(PAYLOAD_REF):
        raw = _read_payload(run_id, sha256, ref)
    elif ref.startswith(STORAGE_REF):
        alias, _, name = ref.removeprefix(STORAGE_REF).partition(":")
        raw = _read_file(_storage(alias), name, ref)
    else:
        raw = _read_file(default_storage, ref, ref)  # written before results moved to Postgres
    if hashlib.sha256(raw).hexdigest() != sha256:
        raise PermanentError(f"stored result {ref} does not match its hash; it was changed after it was written")
    return json.loads(raw)


def _read_payload(run_id: uuid.UUID | str | None, sha256: str, ref: str) -> bytes:
    rows = Payload.objects.filter(sha256=ref.removeprefix(PAYLOAD_REF))
    if run_id is not None:
        rows = rows.filter(run_id=run_id)
    data = rows.values_list("data", flat=True).first()
    if data is None:
        raise PermanentError(f"stored result {ref} of run {run_id} is missing from the Payload table")
    return bytes(data)


def _read_file(storage: Any, name: str, ref: str) -> bytes:
    try:
        with storage.open(name, "rb") as handle:
            return handle.read()
    except FileNotFoundError as exc:
        raise PermanentError(
            f"stored result {ref} is not in storage: it was written to one machine's disk; "
            "results now live in Postgres (or DURABLE_AGENTS['RESULT_STORAGE']), rerun the step that made it"
        ) from exc


def copy_payloads(source_id: uuid.UUID | str, target_id: uuid.UUID | str, refs: list[str]) -> None:
    """Give `target_id` its own copy of the source's Payload rows named by `refs` (a fork's copied
    checkpoints), so each run's rows live and cascade with that run alone. One payload in memory at a time, read by
    its key: `.iterator()` would read them all at once where server-side cursors are off (behind a transaction
    pooler: DISABLE_SERVER_SIDE_CURSORS)."""
    shas = [ref.removeprefix(PAYLOAD_REF) for ref in refs if ref.startswith(PAYLOAD_REF)]
    for pk in list(Payload.objects.filter(run_id=source_id, sha256__in=shas).values_list("pk", flat=True)):
        payload = Payload.objects.filter(pk=pk).first()
        if payload is None:  # the source run was deleted meanwhile (retention, an operator)
            raise RunNotFoundError(f"run {source_id} was deleted while it was being forked: nothing was forked")
        Payload.objects.bulk_create(
            [Payload(run_id=target_id, sha256=payload.sha256, data=payload.data, size=payload.size)],
            ignore_conflicts=True,
        )


def _is_plain(value: Any) -> bool:
    """True for values the JSON column stores as they are (no datetimes, decimals or tuples to coerce)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, list):
        return all(_is_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_plain(v) for k, v in value.items())
    return False

"""Payload sizes: inputs over the hard limit are refused; large step results live out of row in storage."""

from __future__ import annotations

import hashlib
import json
import uuid
from dataclasses import dataclass
from typing import Any

from django.core.files.base import ContentFile
from django.core.files.storage import default_storage
from django.core.serializers.json import DjangoJSONEncoder

from durable_agents.conf import settings
from durable_agents.errors import InputTooLargeError, InvalidInputError, PermanentError


def canonical_json(value: Any) -> bytes:
    """Stable bytes for hashing and size checks: sorted keys, no whitespace."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), cls=DjangoJSONEncoder).encode()


def digest(value: Any) -> str:
    return hashlib.sha256(canonical_json(value)).hexdigest()


def check_input(run_input: Any) -> str:
    """Return the input's hash, or raise if it is not JSON or too large."""
    try:
        raw = json.dumps(run_input, sort_keys=True, separators=(",", ":")).encode()
    except (TypeError, ValueError) as exc:
        raise InvalidInputError(f"run input must be JSON-serialisable: {exc}") from exc
    limit = int(settings.INPUT_MAX_BYTES)
    if len(raw) > limit:
        raise InputTooLargeError(
            f"run input is {len(raw)} bytes, over the {limit}-byte limit "
            "(DURABLE_AGENTS['INPUT_MAX_BYTES']); pass a reference to the data instead"
        )
    return hashlib.sha256(raw).hexdigest()


@dataclass(frozen=True)
class StoredResult:
    """A step result ready to commit: inline JSON, or a storage reference with its hash."""

    inline: Any
    ref: str = ""
    sha256: str = ""

    @property
    def public_value(self) -> Any:
        """What a run's output shows: the value itself, or where it lives."""
        return {"result_ref": self.ref, "result_hash": self.sha256} if self.ref else self.inline


def store_result(run_id: uuid.UUID | str, step_id: str, value: Any) -> StoredResult:
    """Serialise a step result; above RESULT_INLINE_MAX_BYTES write it to storage (outside any transaction)."""
    try:
        raw = json.dumps(value, separators=(",", ":"), cls=DjangoJSONEncoder).encode()
    except (TypeError, ValueError) as exc:
        raise PermanentError(f"step {step_id!r} returned a value that is not JSON-serialisable: {exc}") from exc
    if len(raw) <= int(settings.RESULT_INLINE_MAX_BYTES):
        return StoredResult(inline=json.loads(raw) if not _is_plain(value) else value)
    sha = hashlib.sha256(raw).hexdigest()
    # Content-addressed name: a re-executed step writing the same bytes reuses the same file.
    name = f"durable_agents/results/{run_id}/{step_id}-{sha[:16]}.json"
    if not default_storage.exists(name):
        name = default_storage.save(name, ContentFile(raw))
    return StoredResult(inline=None, ref=name, sha256=sha)


def load_result(ref: str, sha256: str) -> Any:
    """Read an out-of-row result back and verify its hash."""
    with default_storage.open(ref, "rb") as handle:
        raw = handle.read()
    if hashlib.sha256(raw).hexdigest() != sha256:
        raise PermanentError(f"stored result {ref} does not match its hash; the file was changed")
    return json.loads(raw)


def _is_plain(value: Any) -> bool:
    """True for values the JSON column stores as they are (no datetimes, decimals or tuples to coerce)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, list):
        return all(_is_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_plain(v) for k, v in value.items())
    return False

"""The fake Anthropic API's Message Batches endpoints: create, retrieve, list, cancel, delete and results.

Written from the documentation, cited at each rule:

* guide: https://platform.claude.com/docs/en/build-with-claude/batch-processing
* create: https://platform.claude.com/docs/en/api/creating-message-batches
* retrieve: https://platform.claude.com/docs/en/api/retrieving-message-batches
* list: https://platform.claude.com/docs/en/api/listing-message-batches
* cancel: https://platform.claude.com/docs/en/api/canceling-message-batches
* delete: https://platform.claude.com/docs/en/api/deleting-message-batches
* results: https://platform.claude.com/docs/en/api/retrieving-message-batch-results

A batch is evaluated lazily: when it is retrieved, listed or its results asked for, it ends if its processing time
passed (or it expired, or was cancelled), and only then are its requests answered, in order, each exactly as a
live `POST /v1/messages` would answer it (the fake's `answer` callable). Until the batch ends every request counts
as `processing` ("Requests start as processing and move to one of the other statuses only once processing of the
entire batch ends", retrieve docs), so a poller never sees half a batch.
"""

from __future__ import annotations

import json
import re
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import parse_qs

from durable_agents.testing.fake_log import RequestLog
from durable_agents.testing.fake_replies import Fault, error_body

if TYPE_CHECKING:
    from durable_agents.testing.fake_http import Handler

__all__ = ["BATCHES_PATH", "Batch", "BatchCall", "BatchDesk", "BatchRequest", "fault_result"]

BATCHES_PATH = "/v1/messages/batches"
# guide, "Batch limitations": 100,000 Message requests or 256 MB in size, whichever is reached first.
MAX_REQUESTS = 100_000
MAX_BATCH_BODY_BYTES = 256 * 1024 * 1024
# create docs: custom_id "Must be unique for each request within the Message Batch", 1 to 64 of these characters.
CUSTOM_ID = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
# retrieve docs: expires_at is "24 hours after creation".
EXPIRES_AFTER = timedelta(hours=24)
# list docs: limit "Defaults to 20. Ranges from 1 to 1000."
LIST_LIMIT_DEFAULT, LIST_LIMIT_MAX = 20, 1000

BatchCall = Literal["create", "retrieve", "list", "cancel", "delete", "results"]
BATCH_CALLS: frozenset[str] = frozenset({"create", "retrieve", "list", "cancel", "delete", "results"})
Answer = Callable[[Any, Mapping[str, str], str], dict[str, Any]]
"""How the fake answers one batched request: (params, the create call's headers, batch id) → its `result` object."""


@dataclass
class BatchRequest:
    """One request of a batch; `result` is its `result` object once the batch ended, else None."""

    custom_id: str
    params: Any
    result: dict[str, Any] | None = None


@dataclass
class Batch:
    """A batch as the fake holds it: `fake.batches` lists these (deleted ones too, with `deleted` set)."""

    id: str
    requests: list[BatchRequest]
    headers: dict[str, str]
    started: float  # on the monotonic clock: processing time and expiry count from here
    created_at: datetime
    cancel_initiated_at: datetime | None = None
    ended_at: datetime | None = None
    deleted: bool = False
    settling: bool = False  # a thread is answering its requests right now

    @property
    def custom_ids(self) -> list[str]:
        return [r.custom_id for r in self.requests]

    @property
    def request_count(self) -> int:
        return len(self.requests)

    @property
    def processing_status(self) -> str:
        if self.ended_at is not None:
            return "ended"
        return "canceling" if self.cancel_initiated_at is not None else "in_progress"

    def results(self) -> dict[str, dict[str, Any]]:
        """custom_id → result object, for the requests answered so far (all of them once ended)."""
        return {r.custom_id: r.result for r in self.requests if r.result is not None}

    def to_json(self, base_url: str) -> dict[str, Any]:
        counts = dict.fromkeys(("processing", "succeeded", "errored", "canceled", "expired"), 0)
        for request in self.requests:
            result = request.result if self.ended_at is not None else None
            counts[result["type"] if result is not None else "processing"] += 1
        return {
            "id": self.id,
            "type": "message_batch",
            "processing_status": self.processing_status,
            "request_counts": counts,
            "created_at": _rfc3339(self.created_at),
            "expires_at": _rfc3339(self.created_at + EXPIRES_AFTER),
            "ended_at": _rfc3339(self.ended_at),
            "cancel_initiated_at": _rfc3339(self.cancel_initiated_at),
            "archived_at": None,
            # retrieve docs: results_url is set once processing ended; the SDK fetches exactly this URL.
            "results_url": f"{base_url}{BATCHES_PATH}/{self.id}/results" if self.ended_at else None,
        }


def fault_result(fault: Fault, body: Any) -> dict[str, Any]:
    """The `result` object a batched request gets when the script serves it `fault` instead of a reply.

    results docs: `errored` carries an error response; `canceled` and `expired` carry nothing else. A dropped
    connection or a delay has no meaning inside a batch, so it is an `api_error`, as a server-side failure would be.
    """
    if fault.kind in ("expired", "canceled"):
        return {"type": fault.kind}
    if fault.kind in ("status", "stream_error") and fault.body:
        error = dict(fault.body)
        if fault.model_in_message:
            model = body.get("model") if isinstance(body, dict) else None
            error["error"] = {**error["error"], "message": f"model: {model}"}
        return {"type": "errored", "error": error}
    return {"type": "errored", "error": error_body("api_error", "Internal server error")}


class BatchDesk:
    """The batches a fake holds and the endpoints that serve them; `FakeAnthropic` owns one and delegates to it."""

    def __init__(
        self,
        *,
        answer: Answer,
        log: RequestLog,
        lock: threading.RLock,
        stopping: threading.Event,
        processing_seconds: float = 0.0,
        expire_after_seconds: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.processing_seconds = processing_seconds
        self.expire_after_seconds = expire_after_seconds
        self.creates = 0  # creates that took effect
        self.answered = 0  # batched requests answered (the script or responder consulted)
        self._answer = answer
        self._log = log
        self._lock = lock
        self._stopping = stopping
        self._clock = clock
        self._batches: list[Batch] = []
        self._held = False
        self._faults: dict[str, deque[tuple[Fault, bool]]] = {}

    # -- knobs -----------------------------------------------------------------------------------------------

    @property
    def batches(self) -> list[Batch]:
        with self._lock:
            return list(self._batches)

    def hold(self) -> None:
        with self._lock:
            self._held = True

    def release(self) -> None:
        with self._lock:
            self._held = False

    def end_all(self) -> None:
        """End every batch still processing now, answering its requests (a cancelled one: `canceled`)."""
        with self._lock:
            pending = [b for b in self._batches if b.ended_at is None and not b.settling and not b.deleted]
        for batch in pending:
            self._settle(batch, "cancel" if batch.cancel_initiated_at else "answer")

    def fail_call(self, op: BatchCall, fault: Fault, *, after: bool = False) -> None:
        if op not in BATCH_CALLS:
            raise ValueError(f"op must be one of {sorted(BATCH_CALLS)}, not {op!r}")
        with self._lock:
            self._faults.setdefault(op, deque()).append((fault, after))

    def clear(self) -> None:
        with self._lock:
            self._batches.clear()
            self._faults.clear()
            self.creates = self.answered = 0

    # -- serving ---------------------------------------------------------------------------------------------

    def serve(self, handler: Handler, method: str, path: str, headers: dict[str, str], base_url: str) -> None:
        """Answer one call under `/v1/messages/batches` (the API key is already checked)."""
        query = {k: v[-1] for k, v in parse_qs(handler.path.partition("?")[2]).items()}
        parts = path[len(BATCHES_PATH) :].strip("/").split("/") if path != BATCHES_PATH else []
        length = handler.content_length()
        if length > MAX_BATCH_BODY_BYTES:
            handler.discard_body(length)
            message = "Request exceeds the maximum allowed number of bytes."
            self._log.record(method, path, headers, None, refused=message)
            handler.send_json(413, error_body("request_too_large", message))
            return
        raw = handler.rfile.read(length)
        try:
            body = json.loads(raw) if raw else None
        except (ValueError, RecursionError):
            body = raw.decode("utf-8", "replace")
        op = _operation(method, parts)
        self._log.record(method, path, headers, body)
        if op is None:
            handler.send_json(404, error_body("not_found_error", f"{method} {path} not found"))
            return
        fault, after = self._take_fault(op)
        if fault is not None and not after and self._serve_fault(handler, fault):
            return
        status, answer, content = self._call(op, parts, body, query, headers, base_url)
        if fault is not None and after and self._serve_fault(handler, fault):
            return  # the call took effect, and the client never hears of it
        if content is not None:
            handler.send_bytes(200, content, "application/x-jsonl")
        else:
            handler.send_json(status, answer)

    def _call(
        self,
        op: str,
        parts: list[str],
        body: Any,
        query: dict[str, str],
        headers: dict[str, str],
        base_url: str,
    ) -> tuple[int, dict[str, Any], bytes | None]:
        if op == "create":
            return (*self._create(body, headers, base_url), None)
        if op == "list":
            return (*self._list(query, base_url), None)
        batch = self._find(parts[0])
        if batch is None:
            return 404, error_body("not_found_error", f"Message Batch {parts[0]} not found"), None
        self._evaluate(batch)
        if op == "retrieve":
            return 200, batch.to_json(base_url), None
        if op == "cancel":
            return (*self._cancel(batch, base_url), None)
        if op == "delete":
            return (*self._delete(batch), None)
        return self._results(batch)

    def _create(self, body: Any, headers: dict[str, str], base_url: str) -> tuple[int, dict[str, Any]]:
        if problem := _check_create(body):
            return 400, error_body("invalid_request_error", problem)
        # create docs: "Once a Message Batch is created, it begins processing immediately." The params are
        # validated while processing (guide): a refused one ends `errored`, the batch itself is accepted.
        batch = Batch(
            id=f"msgbatch_01{secrets.token_hex(11)}",
            requests=[BatchRequest(r["custom_id"], r["params"]) for r in body["requests"]],
            headers={k: v for k, v in headers.items() if k.startswith("anthropic-") or k.startswith("x-durable")},
            started=self._clock(),
            created_at=datetime.now(UTC),
        )
        with self._lock:
            self._batches.append(batch)
            self.creates += 1
        return 200, batch.to_json(base_url)

    def _list(self, query: dict[str, str], base_url: str) -> tuple[int, dict[str, Any]]:
        # list docs: "Most recently created batches are returned first"; after_id pages on (older), before_id back.
        try:
            limit = int(query.get("limit", LIST_LIMIT_DEFAULT))
        except ValueError:
            return 400, error_body("invalid_request_error", "limit: Input should be a valid integer")
        if not 1 <= limit <= LIST_LIMIT_MAX:
            return 400, error_body("invalid_request_error", f"limit: must be between 1 and {LIST_LIMIT_MAX}")
        if "before_id" in query and "after_id" in query:
            return 400, error_body("invalid_request_error", "before_id and after_id cannot both be given")
        with self._lock:
            newest_first = [b for b in reversed(self._batches) if not b.deleted]
        ids = [b.id for b in newest_first]
        cursor = query.get("after_id") or query.get("before_id")
        if cursor is not None and cursor not in ids:
            name = "after_id" if "after_id" in query else "before_id"
            return 400, error_body("invalid_request_error", f"{name}: unknown Message Batch {cursor}")
        if "before_id" in query:
            end = ids.index(query["before_id"])
            page, has_more = newest_first[max(0, end - limit) : end], end - limit > 0
        else:
            start = ids.index(query["after_id"]) + 1 if "after_id" in query else 0
            page, has_more = newest_first[start : start + limit], start + limit < len(ids)
        for batch in page:
            self._evaluate(batch)
        return 200, {
            "data": [b.to_json(base_url) for b in page],
            "has_more": has_more,
            "first_id": page[0].id if page else None,
            "last_id": page[-1].id if page else None,
        }

    def _cancel(self, batch: Batch, base_url: str) -> tuple[int, dict[str, Any]]:
        # cancel docs: "Batches may be canceled any time before processing ends. Once cancellation is initiated,
        # the batch enters a canceling state"; requests not yet processed end `canceled`.
        with self._lock:
            if batch.ended_at is None and batch.cancel_initiated_at is None:
                batch.cancel_initiated_at = datetime.now(UTC)
            elif batch.ended_at is not None:
                return 400, error_body(
                    "invalid_request_error", f"Message Batch {batch.id} has already ended and cannot be canceled"
                )
        return 200, batch.to_json(base_url)

    def _delete(self, batch: Batch) -> tuple[int, dict[str, Any]]:
        # delete docs: "Message Batches can only be deleted once they've finished processing. If you'd like to
        # delete an in-progress batch, you must first cancel it."
        with self._lock:
            if batch.ended_at is None:
                return 400, error_body(
                    "invalid_request_error",
                    f"Message Batch {batch.id} is still processing; it can only be deleted once it has "
                    "finished processing (cancel it first)",
                )
            batch.deleted = True
        return 200, {"id": batch.id, "type": "message_batch_deleted"}

    def _results(self, batch: Batch) -> tuple[int, dict[str, Any], bytes | None]:
        # guide: results are available once processing of the whole batch ended (results_url is null before);
        # the fake answers an early fetch of the URL 400, saying so.
        if batch.ended_at is None:
            message = f"Message Batch {batch.id} has not finished processing; results are not yet available"
            return 400, error_body("invalid_request_error", message), None
        lines = [json.dumps({"custom_id": r.custom_id, "result": r.result}) for r in batch.requests]
        return 200, {}, ("\n".join(lines) + "\n").encode()

    # -- processing ------------------------------------------------------------------------------------------

    def _evaluate(self, batch: Batch) -> None:
        """End `batch` if its time came: processing done, expired, or cancelled (unless batches are held)."""
        now = self._clock()
        with self._lock:
            if batch.ended_at is not None or batch.settling:
                return
            expire = self.expire_after_seconds
            expired = expire is not None and now - batch.started >= expire
            done = not self._held and now - batch.started >= self.processing_seconds
            if done and expire is not None and self.processing_seconds >= expire:
                done = False  # it would have expired before its processing time came
            if batch.cancel_initiated_at is not None and not self._held:
                how = "cancel"
            elif done:
                how = "answer"
            elif expired:
                how = "expire"
            else:
                return
        self._settle(batch, how)

    def _settle(self, batch: Batch, how: Literal["answer", "cancel", "expire"]) -> None:
        with self._lock:
            if batch.ended_at is not None or batch.settling:
                return
            batch.settling = True  # answered outside the lock: the responder may be slow or read the log
        try:
            results: list[dict[str, Any]] = []
            for request in batch.requests:
                if how == "answer":
                    result = self._answer(request.params, batch.headers, batch.id)
                    with self._lock:
                        self.answered += 1
                else:
                    result = {"type": "canceled" if how == "cancel" else "expired"}
                results.append(result)
            with self._lock:
                for request, result in zip(batch.requests, results, strict=True):
                    request.result = result
                batch.ended_at = datetime.now(UTC)
        finally:
            with self._lock:
                batch.settling = False

    # -- helpers ---------------------------------------------------------------------------------------------

    def _find(self, batch_id: str) -> Batch | None:
        with self._lock:
            return next((b for b in self._batches if b.id == batch_id and not b.deleted), None)

    def _take_fault(self, op: str) -> tuple[Fault | None, bool]:
        with self._lock:
            queue = self._faults.get(op)
            return queue.popleft() if queue else (None, False)

    def _serve_fault(self, handler: Handler, fault: Fault) -> bool:
        """Serve `fault` for a batch endpoint; False when it was only a delay and the call goes on."""
        if fault.kind == "reset":
            handler.drop_connection()
            return True
        if fault.kind == "delay":
            if self._stopping.wait(fault.seconds):
                handler.drop_connection()
                return True
            return False
        body = dict(fault.body or error_body("api_error", "Internal server error"))
        handler.send_json(fault.status_code or 500, body, fault.headers)
        return True


def _operation(method: str, parts: list[str]) -> str | None:
    if not parts:
        return {"POST": "create", "GET": "list"}.get(method)
    if len(parts) == 1:
        return {"GET": "retrieve", "DELETE": "delete"}.get(method)
    if len(parts) == 2 and (method, parts[1]) in (("POST", "cancel"), ("GET", "results")):
        return parts[1]
    return None


def _check_create(body: Any) -> str | None:
    """What the create endpoint refuses outright (400), naming the field; None when the batch is accepted."""
    if not isinstance(body, dict):
        return "request body: Input should be a valid dictionary"
    if extra := sorted(set(body) - {"requests"}):
        return f"{extra[0]}: Extra inputs are not permitted"
    requests = body.get("requests")
    if not isinstance(requests, list):
        return "requests: Field required" if requests is None else "requests: Input should be a valid list"
    # create docs: requests holds 1 to 100,000 items (guide: "100,000 Message requests or 256 MB").
    if not requests:
        return "requests: List should have at least 1 item after validation, not 0"
    if len(requests) > MAX_REQUESTS:
        return f"requests: List should have at most {MAX_REQUESTS} items after validation, not {len(requests)}"
    seen: set[str] = set()
    for i, request in enumerate(requests):
        if not isinstance(request, dict):
            return f"requests.{i}: Input should be a valid dictionary"
        if extra := sorted(set(request) - {"custom_id", "params"}):
            return f"requests.{i}.{extra[0]}: Extra inputs are not permitted"
        custom_id = request.get("custom_id")
        if custom_id is None:
            return f"requests.{i}.custom_id: Field required"
        if not isinstance(custom_id, str) or not CUSTOM_ID.match(custom_id):
            return f"requests.{i}.custom_id: String should match pattern '{CUSTOM_ID.pattern}'"
        if custom_id in seen:
            return f"requests.{i}.custom_id: Duplicate custom_id {custom_id!r}: each must be unique within the batch"
        seen.add(custom_id)
        if not isinstance(request.get("params"), dict):
            return f"requests.{i}.params: Input should be a valid dictionary"
    return None


def _rfc3339(moment: datetime | None) -> str | None:
    return moment.isoformat().replace("+00:00", "Z") if moment is not None else None

"""The batcher: sends queued batch turns as Message Batches, polls them, and brings their answers home.

One pass (`run_pass`, the `durable_agents.batches` task the sweep sends while there is batch work; one pass at a
time across machines, under a job lease) does, in order:

1. **abandon** the turns of runs that finished by another road (an answer no step will use — its run ended just
   after it came, its step finished another way — is counted on its run), and **cancel** at the API each batch of
   which no turn is wanted any more (every run in it was cancelled);
2. **send**: the queued turns go out once BATCH_MAX_REQUESTS wait or the oldest has waited BATCH_WINDOW_SECONDS.
   Exactly once, like an effect's outbox row: the MessageBatch row, with its turns chosen, is committed before
   the create request goes; the API's answer records its id. If no answer came (a timeout, a cut connection, the
   batcher killed), the row stays `submitting`: after BATCH_SUBMIT_GRACE_SECONDS the API's batches created since
   are listed, and one nobody here knows that holds as many requests is adopted; if there is none, the create
   never landed and the turns are sent again. An adopted batch whose results hold none of its custom ids was
   someone else's: its turns are sent again. Lost creates are looked for first, and while one is unresolved no
   other batch goes: told apart by their size alone, two lost creates of one size could each adopt the other's
   batch and send their own turns again. A refusal for what the batch holds (a 4xx) ends its turns errored with
   the API's words; any other failure before an answer puts them back in the queue;
3. **poll** each batch in flight whose time has come (first after BATCH_POLL_SECONDS, then doubling up to
   BATCH_POLL_MAX_SECONDS, on the database's clock); once it ended, stream its results (JSON lines, in the API's
   key order) and record each: its turn ends, its wait closes, its run wakes. Recording is idempotent, so a pass
   killed halfway through the results reads them again and records the rest; the batch is marked ended last.

What is not guaranteed: a create request whose answer was lost, made while another installation sharing the API
key created a batch of the same size in the same minutes, may adopt that batch first; its results then hold none
of our custom ids, and the turns are sent again (paid twice, answered once). And a pass checks its lease right
before each create request: one frozen between that check and the request, past its lease, still sends it (the
check-then-act no lease closes); the pass that took over sends the same turns, and both batches are paid.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

import anthropic
import httpx2 as httpx

from durable_agents.agents.batching import response_of
from durable_agents.agents.claude import new_client
from durable_agents.agents.pricing import cost_usd
from durable_agents.conf import settings
from durable_agents.engine import batches
from durable_agents.engine.job_lease import JobLeaseHeld
from durable_agents.models import BatchTurn, MessageBatch
from durable_agents.redaction import redact

logger = logging.getLogger("durable_agents.batches")
# The API's clock and ours may disagree: a lost create is looked for among batches created this long before it.
CLOCK_SKEW = timedelta(minutes=5)
POLLS_PER_PASS = 100
# Renewed every third of it while a pass runs; a pass killed outright holds the batcher up this long at most.
LEASE_SECONDS = 30.0


@dataclass
class PassReport:
    """What one pass did, for the task's result and the logs."""

    sent: int = 0
    turns_sent: int = 0
    requeued: int = 0
    adopted: int = 0
    polled: int = 0
    ended: int = 0
    answered: int = 0
    late: int = 0
    cancelled: int = 0
    abandoned: int = 0
    errors: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v}


def run(client: anthropic.Anthropic | None = None) -> dict[str, Any]:
    """One pass, if no other machine is making one (a job lease on the database's clock); what it did."""
    with JobLeaseHeld("batches", seconds=LEASE_SECONDS) as lease:
        if lease.holder is not None:
            return {"busy": f"{lease.holder.holder} holds the batcher until {lease.holder.until}"}
        return run_pass(client, lease=lease).as_dict()


def run_pass(client: anthropic.Anthropic | None = None, *, lease: JobLeaseHeld | None = None) -> PassReport:
    """One pass of the batcher (module docstring). Errors talking to the API are logged and left for the next pass.

    With `lease` (the job lease `run` holds) no create request goes once the lease is lost: a pass frozen past its
    lease (SIGSTOP, a swap storm) would otherwise send turns that the pass which took over sends too.
    """
    if client is None:
        # A client of its own for the pass, closed at its end (its connections are not kept between passes).
        with new_client() as own:
            return run_pass(own, lease=lease)
    report = PassReport()
    report.abandoned = batches.abandon_turns_of_finished_runs()
    report.late += batches.set_aside_unused_answers()
    _cancel_unwanted(client, report)
    _recover_lost_creates(client, report)
    _send_due(client, report, lease)
    _poll_due(client, report)
    return report


def _send_due(client: anthropic.Anthropic, report: PassReport, lease: JobLeaseHeld | None) -> None:
    if batches.has_unanswered_create():
        # A lost create is told from the API's list by its size alone: with a second one of the same size out,
        # each could adopt the other's batch and send its own turns again. Nothing goes until it is resolved.
        return
    window = timedelta(seconds=float(settings.BATCH_WINDOW_SECONDS))
    while turns := batches.due_turns(window, int(settings.BATCH_MAX_REQUESTS), int(settings.BATCH_MAX_BYTES)):
        batch = batches.open_batch(turns)
        if batch is None:
            continue
        if not _send(client, batch, report, lease):
            return  # the API is not taking batches now: the next pass tries again


def _send(client: anthropic.Anthropic, batch: MessageBatch, report: PassReport, lease: JobLeaseHeld | None) -> bool:
    requests = batches.requests_of(batch)
    if not requests:
        # Every turn it was to carry was abandoned since (their runs cancelled): there is nothing to send.
        batches.not_created(batch, "every turn it was to carry was abandoned before it went")
        return True
    if len(requests) != batch.request_count:
        # A turn was abandoned since the row was committed: a lost create is recognised by what it really holds.
        batches.recount(batch, len(requests))
    if lease is not None and not lease.renew():
        # Another pass holds the batcher now: the row, left `submitting`, is its to look for after the grace period.
        report.errors.append(f"batch {batch.pk}: not sent, the batcher's lease was lost")
        return False
    try:
        created = client.messages.batches.create(requests=requests)  # type: ignore[arg-type]
    except anthropic.APIStatusError as exc:
        if 400 <= exc.status_code < 500 and exc.status_code not in (408, 409, 429):
            error = _error_body(exc)
            logger.error("the API refused Message Batch %s: %s", batch.pk, error.get("message"))
            batches.refused(batch, error)
            report.errors.append(f"batch {batch.pk} refused: {error.get('message')}")
            return True
        # The API answered, so nothing was created: its turns go back to the queue.
        report.requeued += batches.not_created(batch, f"create answered {exc.status_code}: {redact(str(exc))}")
        report.errors.append(f"batch {batch.pk}: create answered {exc.status_code}")
        return False
    except anthropic.APIConnectionError as exc:
        if isinstance(exc.__cause__, httpx.ConnectError):
            report.requeued += batches.not_created(batch, f"could not connect: {redact(str(exc))}")
            return False
        # Sent, and no answer came: it may exist. Left `submitting`; looked for after the grace period.
        logger.warning("Message Batch %s: the create request went without an answer (%s)", batch.pk, redact(str(exc)))
        report.errors.append(f"batch {batch.pk}: create went without an answer")
        return False
    batches.submitted(batch, created.id, _counts(created), _first_poll())
    report.sent += 1
    report.turns_sent += len(requests)
    logger.info("sent Message Batch %s as %s with %d turns", batch.pk, created.id, len(requests))
    return True


def _recover_lost_creates(client: anthropic.Anthropic, report: PassReport) -> None:
    grace = timedelta(seconds=float(settings.BATCH_SUBMIT_GRACE_SECONDS))
    lost = batches.submitting_since(grace)
    if not lost:
        return
    earliest = min(b.created_at for b in lost) - CLOCK_SKEW
    try:
        listed = _listed_since(client, earliest)
    except (anthropic.APIError, httpx.HTTPError) as exc:
        report.errors.append(f"could not list batches: {type(exc).__name__}")
        return
    taken = batches.known_provider_ids([b.id for b in listed])
    for batch in sorted(lost, key=lambda b: b.created_at):
        candidates = [
            b
            for b in listed
            if b.id not in taken
            and _total(_counts(b)) == batch.request_count
            and _created(b) >= batch.created_at - CLOCK_SKEW
        ]
        if candidates:
            found = min(candidates, key=_created)
            taken.add(found.id)
            if batches.submitted(batch, found.id, _counts(found), _first_poll()):
                report.adopted += 1
                logger.warning("Message Batch %s: its lost create had landed as %s; adopted", batch.pk, found.id)
        else:
            report.requeued += batches.not_created(batch, "the create request went without an answer and never landed")
            logger.warning("Message Batch %s: its create never landed; its turns are sent again", batch.pk)


def _listed_since(client: anthropic.Anthropic, since: datetime) -> list[Any]:
    """The API's batches created since `since`, newest first (the list endpoint's order)."""
    found = []
    for listed in client.messages.batches.list(limit=100):
        if _created(listed) < since:
            break
        found.append(listed)
    return found


def _poll_due(client: anthropic.Anthropic, report: PassReport) -> None:
    for batch in batches.due_polls(POLLS_PER_PASS):
        try:
            current = client.messages.batches.retrieve(batch.provider_id)
        except anthropic.NotFoundError:
            # Deleted at the API (or the key changed): nothing will come; its turns are sent again.
            report.requeued += batches.not_created(batch, "the API no longer knows this batch")
            continue
        except (anthropic.APIError, httpx.HTTPError) as exc:
            report.errors.append(f"poll of {batch.provider_id}: {type(exc).__name__}")
            batches.polled(batch, batch.counts, _next_poll(batch))
            continue
        report.polled += 1
        counts = _counts(current)
        if current.processing_status != "ended":
            batches.polled(batch, counts, _next_poll(batch))
            continue
        try:
            _collect(client, batch, report)
        except (anthropic.APIError, httpx.HTTPError) as exc:
            report.errors.append(f"results of {batch.provider_id}: {type(exc).__name__}")
            continue
        missing = batches.end_batch(batch, counts)
        if missing:
            logger.error("Message Batch %s ended without a result for %d turns; they are sent again", batch.pk, missing)
            report.requeued += missing
        report.ended += 1


def _collect(client: anthropic.Anthropic, batch: MessageBatch, report: PassReport) -> None:
    """Record every result of an ended batch, read as JSON lines in the API's own key order."""
    matched = 0
    decoder = client.messages.batches.results(batch.provider_id)
    try:
        for line in decoder.http_response.iter_lines():
            if not line.strip():
                continue
            entry = json.loads(line)
            custom_id, result = entry.get("custom_id"), entry.get("result") or {}
            cost, counters = _billed(custom_id, result)
            outcome = batches.record_result(batch, str(custom_id), result, cost=cost, counters=counters)
            if outcome != "unknown":
                matched += 1
            if outcome == "answered":
                report.answered += 1
            elif outcome == "late":
                report.late += 1
    finally:
        decoder.close()
    if not matched and batch.request_count:
        report.requeued += batches.not_ours(batch)


def _billed(custom_id: Any, result: dict[str, Any]) -> tuple[Decimal, dict[str, Any]]:
    """A succeeded result's cost at batch prices and its tokens by counter; nothing for any other result."""
    if result.get("type") != "succeeded":
        return Decimal(0), {}
    turn = BatchTurn.objects.filter(custom_id=str(custom_id)).only("custom_id", "model", "result", "index").first()
    if turn is None:
        return Decimal(0), {}
    turn.result = result
    response = response_of(turn)
    return cost_usd(response.model, response.usage, batch=True), batches.billed_counters(result)


def _cancel_unwanted(client: anthropic.Anthropic, report: PassReport) -> None:
    for batch in batches.to_cancel():
        try:
            client.messages.batches.cancel(batch.provider_id)
        except anthropic.APIStatusError as exc:
            if exc.status_code not in (400, 409):
                report.errors.append(f"cancel of {batch.provider_id}: {exc.status_code}")
                continue  # asked again next pass
            # Ended meanwhile (nothing to cancel): its results are collected as any batch's.
            logger.info("cancel of %s answered %s", batch.provider_id, exc.status_code)
        except (anthropic.APIError, httpx.HTTPError) as exc:
            report.errors.append(f"cancel of {batch.provider_id}: {type(exc).__name__}")
            continue
        if batches.cancelling(batch):
            report.cancelled += 1


def _error_body(exc: anthropic.APIStatusError) -> dict[str, Any]:
    body = exc.body if isinstance(exc.body, dict) else {}
    error = body.get("error") if isinstance(body.get("error"), dict) else {}
    return {"type": error.get("type") or "invalid_request_error", "message": redact(str(error.get("message") or exc))}


def _counts(batch: Any) -> dict[str, int]:
    counts = getattr(batch, "request_counts", None)
    names = ("processing", "succeeded", "errored", "canceled", "expired")
    return {name: int(getattr(counts, name, 0) or 0) for name in names}


def _total(counts: dict[str, int]) -> int:
    return sum(counts.values())


def _created(batch: Any) -> datetime:
    return batch.created_at


def _first_poll() -> timedelta:
    return timedelta(seconds=float(settings.BATCH_POLL_SECONDS))


def _next_poll(batch: MessageBatch) -> timedelta:
    """Doubling from BATCH_POLL_SECONDS with each poll, up to BATCH_POLL_MAX_SECONDS."""
    first = float(settings.BATCH_POLL_SECONDS)
    return timedelta(seconds=min(first * 2 ** min(batch.polls + 1, 30), float(settings.BATCH_POLL_MAX_SECONDS)))

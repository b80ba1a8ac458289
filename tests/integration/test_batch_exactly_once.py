"""Batch delivery's exactly-once rules, driven in-process against the fake's batches endpoints through the real SDK
(the crash points under real SIGKILL are tests/chaos/test_batch_crashes.py):

* a create request that went without an answer: it landed (adopted, never created again), it never landed (its
  turns sent once more), or what was adopted was someone else's batch (its turns sent again, answered once);
  two lost creates of the same size at once (one never sent, one landed) each end with their own turns, none
  sent twice;
* results read twice: a pass killed after recording half of them; the next records the rest, nothing twice;
* the park/answer race: the answer recorded while the step is between journaling its turn and parking still
  wakes the run.
"""

from __future__ import annotations

import uuid
from collections import Counter
from datetime import timedelta

import pytest
from django.db import connection

from durable_agents import api
from durable_agents.agents import batcher
from durable_agents.agents.loop import agent
from durable_agents.engine import batches
from durable_agents.engine.advance import advance
from durable_agents.models import BatchTurn, JobLease, MessageBatch, Run, Turn, Wait
from durable_agents.testing.fake_anthropic import Fault, Reply
from tests.integration.batch_helpers import MODEL, client_of, settle
from tests.testapp.models import LedgerEntry
from tests.testapp.workflows import charge

pytestmark = pytest.mark.django_db(transaction=True)


class Killed(BaseException):
    """The batcher's process dying here: nothing after this line of the pass runs."""


@pytest.fixture
def grace(settings):
    """Set BATCH_SUBMIT_GRACE_SECONDS (a lost create is looked for once its row is this old)."""

    def set_grace(seconds: float) -> None:
        settings.DURABLE_AGENTS = {**settings.DURABLE_AGENTS, "BATCH_SUBMIT_GRACE_SECONDS": seconds}

    set_grace(3600)
    return set_grace


@pytest.fixture
def charging(batched_workflows):
    batched_workflows(
        "batched_charge_once",
        [
            agent(
                "assistant",
                instructions="Charge the order.",
                tools=[charge],
                prompt=lambda ctx: ctx.input["message"],
                model=MODEL,
                max_tokens=256,
                delivery="batch",
            )
        ],
    )
    return "batched_charge_once"


@pytest.fixture
def answering(batched_workflows):
    batched_workflows(
        "batched_answer_once",
        [
            agent(
                "a",
                instructions="Answer.",
                prompt=lambda ctx: ctx.input["q"],
                model=MODEL,
                max_tokens=64,
                delivery="batch",
            )
        ],
    )
    return "batched_answer_once"


def parked(workflow: str, run_input: dict) -> Run:
    run = api.start(workflow, run_input)
    advance(run.id)
    run.refresh_from_db()
    assert run.status == "waiting", run.error
    return run


def sent_once(batch_fake, run_ids) -> Counter:
    """Each of the runs' turns was in exactly one batch at the API and asked once; the per-custom-id counts."""
    sent = Counter(c for b in batch_fake.batches for c in b.custom_ids)
    for turn in BatchTurn.objects.filter(run_id__in=list(run_ids)).select_related("step"):
        assert sent[turn.custom_id] == 1, f"turn {turn.index} of {turn.run_id} was in {sent[turn.custom_id]} batches"
        assert batch_fake.count(f"{turn.run_id}:{turn.step.step_id}", turn.index) == 1
    return sent


def test_lost_create__a_create_that_landed_without_an_answer_is_adopted_and_never_created_again(
    batch_fake,
    charging,
    grace,
):
    batch_fake.enqueue(Reply.tool_use("charge", {"order_id": "L-1", "amount": "12.00"}), Reply.text("Charged."))
    run = parked(charging, {"message": "Charge L-1"})
    batch_fake.fail_batch_call("create", Fault.reset(), after=True)
    batcher.run_pass(client_of(batch_fake))
    lost = MessageBatch.objects.get()
    assert lost.status == "submitting" and lost.provider_id == "", "no answer: its id is unknown"
    assert batch_fake.batch_creates == 1, "but the batch exists at the API"

    grace(0)
    run = settle(batch_fake, run.id)

    assert run.status == "completed", run.error
    lost.refresh_from_db()
    assert lost.provider_id == batch_fake.batches[0].id and lost.status == "ended", "the landed batch was adopted"
    assert batch_fake.batch_creates == 2, "one batch per turn: the lost one was not created again"
    sent_once(batch_fake, [run.id])
    assert Turn.objects.filter(run_id=run.id).count() == 2
    assert LedgerEntry.objects.filter(order_id="L-1", kind="charge").count() == 1


def test_lost_create__a_create_that_never_landed_is_sent_once_more(batch_fake, answering, grace):
    run = parked(answering, {"q": "Hello?"})
    batch_fake.fail_batch_call("create", Fault.reset())
    batcher.run_pass(client_of(batch_fake))
    assert batch_fake.batch_creates == 0
    assert BatchTurn.objects.get(run_id=run.id).status in ("submitted", "queued")

    grace(0)
    run = settle(batch_fake, run.id)

    assert run.status == "completed", run.error
    assert batch_fake.batch_creates == 1, "sent again once it was clear the first create never landed"
    sent_once(batch_fake, [run.id])
    assert Turn.objects.filter(run_id=run.id).count() == 1


def test_lost_create__an_adopted_batch_that_was_not_ours_sends_its_turns_again(batch_fake, answering, grace):
    run = parked(answering, {"q": "Hello?"})
    batch_fake.fail_batch_call("create", Fault.reset())
    batcher.run_pass(client_of(batch_fake))
    # Another installation on the same API key creates a batch of the same size meanwhile.
    foreign = client_of(batch_fake).messages.batches.create(
        requests=[
            {
                "custom_id": "someone-else-1",
                "params": {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]},
            }
        ]
    )

    grace(0)
    run = settle(batch_fake, run.id)

    assert run.status == "completed", run.error
    adopted = MessageBatch.objects.get(provider_id=foreign.id)
    assert adopted.status == "failed" and "not ours" in adopted.error
    sent = sent_once(batch_fake, [run.id])
    assert sent["someone-else-1"] == 1
    assert Turn.objects.filter(run_id=run.id).count() == 1


def test_lost_create__no_batch_goes_while_a_create_is_unanswered_so_none_adopts_anothers(batch_fake, answering, grace):
    # The batcher killed after committing a batch row, before its create went (nothing at the API) ...
    first = parked(answering, {"q": "First?"})
    assert batches.open_batch(batches.due_turns(timedelta(0), 10, 10**6)) is not None
    # ... and a later pass has the next turn to send, whose create would land with its answer lost. Sent now, the
    # two lost creates (one row never sent, one landed, both of one request) could be told apart by size alone:
    # the older row would adopt the landed batch, and the younger row's turn be sent a second time.
    second = parked(answering, {"q": "Second?"})
    batch_fake.fail_batch_call("create", Fault.reset(), after=True)
    batcher.run_pass(client_of(batch_fake))
    assert batch_fake.batch_creates == 0, "nothing is sent while a create is unanswered"
    assert BatchTurn.objects.get(run_id=second.id).status == "queued"

    grace(0)
    for run in (first, second):
        run = settle(batch_fake, run.id)
        assert run.status == "completed", run.error

    sent_once(batch_fake, [first.id, second.id])
    assert batch_fake.batch_creates == 1, (
        "the never-sent row requeued, both turns sent in one batch, its lost create adopted"
    )
    assert list(MessageBatch.objects.order_by("id").values_list("status", flat=True)) == ["failed", "ended"]


def test_lost_create__a_turn_abandoned_before_the_create_went_does_not_hide_the_batch_that_landed(
    batch_fake,
    answering,
    grace,
    monkeypatch,
):
    cancelled, kept = parked(answering, {"q": "Cancelled?"}), parked(answering, {"q": "Kept?"})
    requests_of = batches.requests_of

    def cancelled_meanwhile(batch):
        # The run is cancelled between the batch row's commit (two turns) and the create (one turn still wanted).
        api.cancel(cancelled.id, reason="not needed")
        return requests_of(batch)

    monkeypatch.setattr(batches, "requests_of", cancelled_meanwhile)
    batch_fake.fail_batch_call("create", Fault.reset(), after=True)
    batcher.run_pass(client_of(batch_fake))
    monkeypatch.setattr(batches, "requests_of", requests_of)
    assert batch_fake.batch_creates == 1 and batch_fake.batches[0].request_count == 1

    grace(0)
    run = settle(batch_fake, kept.id)

    assert run.status == "completed", run.error
    assert batch_fake.batch_creates == 1, "the landed batch (one request, not the row's first two) was adopted"
    sent_once(batch_fake, [kept.id])


def test_zombie_batcher__a_pass_that_lost_its_lease_sends_no_create(batch_fake, answering, grace, monkeypatch):
    run = parked(answering, {"q": "Frozen?"})
    open_batch = batches.open_batch

    def frozen_past_its_lease(turns):
        batch = open_batch(turns)
        # Frozen here (SIGSTOP, a swap storm) past its lease: another pass took the batcher over. That pass finds
        # this row unanswered after the grace period and sends its turns itself; the thawed one must not too.
        JobLease.objects.filter(name="batches").update(token=uuid.uuid4(), holder="another:1")
        return batch

    monkeypatch.setattr(batches, "open_batch", frozen_past_its_lease)
    batcher.run(client_of(batch_fake))
    monkeypatch.setattr(batches, "open_batch", open_batch)
    assert batch_fake.batch_creates == 0, "the pass that lost its lease sent nothing"

    grace(0)
    run = settle(batch_fake, run.id)

    assert run.status == "completed", run.error
    assert batch_fake.batch_creates == 1
    sent_once(batch_fake, [run.id])


def test_results_read_twice__a_pass_killed_after_half_the_results_records_the_rest_once(
    batch_fake,
    answering,
    monkeypatch,
):
    batch_fake.hold_batches()
    runs = [parked(answering, {"q": f"Question {n}?"}) for n in range(4)]
    batcher.run_pass(client_of(batch_fake))
    assert batch_fake.batch_creates == 1 and batch_fake.batches[0].request_count == 4, (
        "the four turns went in one batch"
    )
    batch_fake.release_batches()

    record, recorded = batches.record_result, []

    def dying_after_two(*args, **kwargs):
        if len(recorded) == 2:
            raise Killed
        recorded.append(record(*args, **kwargs))
        return recorded[-1]

    monkeypatch.setattr(batches, "record_result", dying_after_two)
    with pytest.raises(Killed):
        batcher.run_pass(client_of(batch_fake))
    assert recorded == ["answered", "answered"]
    assert Counter(BatchTurn.objects.values_list("status", flat=True)) == {"succeeded": 2, "submitted": 2}
    assert MessageBatch.objects.get().status == "in_progress", "the batch is marked ended last"

    monkeypatch.setattr(batches, "record_result", record)
    report = batcher.run_pass(client_of(batch_fake))

    assert (report.answered, report.ended) == (2, 1), "the second pass recorded the other two, the first two known"
    assert set(BatchTurn.objects.values_list("status", flat=True)) == {"succeeded"}
    for run in runs:
        run = settle(batch_fake, run.id)
        assert run.status == "completed", run.error
        assert Turn.objects.filter(run_id=run.id).count() == 1
    assert batch_fake.batch_creates == 1
    sent_once(batch_fake, [r.id for r in runs])


def test_park_race__an_answer_recorded_while_the_step_parks_still_wakes_the_run(
    batch_fake,
    answering,
    monkeypatch,
):
    queue, seen = batches.queue_turn, []

    def queued_then_answered(ctx, **kwargs):
        turn = queue(ctx, **kwargs)
        assert not connection.in_atomic_block, "the turn is committed before the step parks"
        # The batcher sends, polls and records the answer now: after the turn is journaled, before the Park.
        for _ in range(50):
            batcher.run_pass(client_of(batch_fake))
            turn.refresh_from_db()
            if turn.status == "succeeded":
                break
        seen.append(turn.status)
        return turn

    monkeypatch.setattr(batches, "queue_turn", queued_then_answered)
    run = api.start(answering, {"q": "Quick?"})
    advance(run.id)
    monkeypatch.setattr(batches, "queue_turn", queue)

    assert seen == ["succeeded"], "the answer was recorded before the run parked"
    run.refresh_from_db()
    assert not Wait.objects.filter(run_id=run.id, status="open").exists(), "no wait left open for an answer that came"
    assert run.status != "waiting", "the parking step saw the answer and the run goes on: nothing else would wake it"
    run = settle(batch_fake, run.id)
    assert run.status == "completed", run.error
    assert Turn.objects.filter(run_id=run.id).count() == 1
    sent_once(batch_fake, [run.id])

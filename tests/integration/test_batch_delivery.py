"""Model turns through the Message Batches API (`delivery="batch"`), driven in-process against the fake's batches
endpoints through the real SDK: the run parks holding nothing, the batcher sends and collects, every turn is
journaled once at half price, and failed results follow the documented policies.

Docs: https://platform.claude.com/docs/en/build-with-claude/batch-processing (50 % of standard prices; results
succeeded / errored / canceled / expired, matched by custom_id).
"""

from __future__ import annotations

import json
from decimal import Decimal
from io import StringIO

import pytest
from django.conf import settings
from django.core.management import call_command
from django.test import override_settings

from durable_agents import api
from durable_agents.agents import batcher
from durable_agents.agents.loop import agent
from durable_agents.agents.messages import Usage
from durable_agents.agents.pricing import cost_usd
from durable_agents.engine.advance import advance
from durable_agents.engine.sweep import sweep
from durable_agents.errors import InvalidInputError
from durable_agents.judge import judge
from durable_agents.metrics import DatabaseCollector
from durable_agents.models import BatchTurn, Effect, Event, MessageBatch, Replay, ReplayRun, Turn, Wait
from durable_agents.testing import drive
from durable_agents.testing.fake_anthropic import Fault, Reply
from durable_agents.workflows import Batch
from tests.integration.batch_helpers import MODEL, client_of, settle
from tests.integration.test_replay_runs import billing_script
from tests.testapp.models import LedgerEntry
from tests.testapp.workflows import charge, lookup_order

pytestmark = pytest.mark.django_db(transaction=True)


def test_batch_delivery__each_turn_goes_in_a_batch_and_is_journaled_once_at_half_price(batch_fake, batched_workflows):
    batched_workflows(
        "batched_charge",
        [
            agent(
                "assistant",
                instructions="Look the order up, then charge it.",
                tools=[lookup_order, charge],
                prompt=lambda ctx: ctx.input["message"],
                model=MODEL,
                max_tokens=512,
                delivery="batch",
            )
        ],
    )
    batch_fake.enqueue(
        Reply.tool_use("lookup_order", {"order_id": "A-1"}),
        Reply.tool_use("charge", {"order_id": "A-1", "amount": "30.00"}),
        Reply.text("Charged."),
    )
    run = api.start("batched_charge", {"message": "Charge A-1"})
    advance(run.id)
    run.refresh_from_db()
    assert run.status == "waiting" and run.lease_owner == "", "a batched turn parks its run, holding no lease"
    assert Wait.objects.get(run_id=run.id, status="open").kind == "batch"
    assert BatchTurn.objects.get(run_id=run.id).status == "queued"

    run = settle(batch_fake, run.id)

    assert run.status == "completed", run.error
    assert batch_fake.batch_creates == 3, "one batch per turn: each turn waits for the one before"
    asked = [r for r in batch_fake.requests if r.path == "/v1/messages"]
    assert len(asked) == 3 and all(r.batch_id for r in asked), "every turn was batched, none asked live"
    turns = list(Turn.objects.filter(run_id=run.id).order_by("index"))
    assert [t.index for t in turns] == [0, 1, 2]
    for turn in turns:
        usage = Usage(turn.input_tokens, turn.output_tokens, turn.cache_write_tokens, turn.cache_read_tokens)
        live = cost_usd(turn.model, usage)
        assert live > 0 and turn.cost_usd == (live / 2).quantize(Decimal("0.000001")), "batch turns cost half"
    assert run.cost_usd == sum(t.cost_usd for t in turns)
    assert LedgerEntry.objects.filter(order_id="A-1", kind="charge").count() == 1
    assert set(BatchTurn.objects.filter(run_id=run.id).values_list("status", flat=True)) == {"succeeded"}
    assert set(BatchTurn.objects.filter(run_id=run.id).values_list("used", flat=True)) == {True}, (
        "a journaled answer is marked used: the batcher's look for unused answers skips it (an index)"
    )
    assert set(MessageBatch.objects.values_list("status", flat=True)) == {"ended"}


def test_batch_delivery__a_workflow_default_applies_to_its_judge_and_a_step_may_stay_live(
    batch_fake, batched_workflows
):
    batched_workflows(
        "batched_review",
        [
            agent("draft", instructions="Draft a reply.", model=MODEL, max_tokens=256, delivery="live"),
            judge("review", rubric="Is it polite?", subject=lambda ctx: ctx.result("draft")["text"], model=MODEL),
        ],
        delivery="batch",
    )
    batch_fake.enqueue(
        Reply.text("Dear customer, done."),
        Reply.tool_use("submit_verdict", {"passed": True, "score": 0.9, "reasons": "polite"}),
    )
    run = settle(batch_fake, api.start("batched_review", {}).id)
    assert run.status == "completed", run.error
    asked = [r for r in batch_fake.requests if r.path == "/v1/messages"]
    assert [bool(r.batch_id) for r in asked] == [False, True], "the draft live, the judge's call in a batch"


def test_batch_delivery__an_errored_result_retries_and_an_expired_one_is_sent_again(batch_fake, batched_workflows):
    batched_workflows(
        "batched_retry",
        [agent("a", instructions="Answer.", model=MODEL, max_tokens=256, delivery="batch")],
    )
    batch_fake.enqueue(Fault.status(529), Fault.expired(), Reply.text("Finally."))
    run = settle(batch_fake, api.start("batched_retry", {}).id)
    assert run.status == "completed", run.error
    assert batch_fake.batch_creates == 3
    statuses = list(BatchTurn.objects.filter(run_id=run.id).order_by("id").values_list("status", flat=True))
    assert statuses == ["errored", "expired", "succeeded"]
    assert Turn.objects.filter(run_id=run.id).count() == 1


def test_batch_delivery__a_deadline_falls_back_to_a_live_call_and_the_late_answer_is_only_counted(
    batch_fake, batched_workflows
):
    batched_workflows(
        "batched_deadline",
        [agent("a", instructions="Answer.", model=MODEL, max_tokens=256, delivery=Batch(deadline="1s"))],
    )
    batch_fake.hold_batches()
    run = api.start("batched_deadline", {})
    advance(run.id)
    batcher.run_pass(client_of(batch_fake))
    assert MessageBatch.objects.get().status == "in_progress"
    # The deadline passes (on the database's clock): the sweep's wait pass closes the wait and wakes the run.
    BatchTurn.objects.filter(run_id=run.id).update(deadline="2000-01-01T00:00:00Z")
    Wait.objects.filter(run_id=run.id, status="open").update(deadline="2000-01-01T00:00:00Z")
    sweep()
    batch_fake.enqueue(Reply.text("Live answer."))
    run = settle(batch_fake, run.id)
    assert run.status == "completed"
    assert [b["text"] for b in Turn.objects.get(run_id=run.id).content if b["type"] == "text"] == ["Live answer."]
    assert Event.objects.filter(run_id=run.id, kind="batch_fallback").exists()
    cost_before = run.cost_usd
    batch_fake.release_batches()
    batch_fake.enqueue(Reply.text("Late batch answer."))
    batcher.run_pass(client_of(batch_fake))
    batcher.run_pass(client_of(batch_fake))
    run.refresh_from_db()
    assert BatchTurn.objects.get(run_id=run.id).status == "abandoned"
    assert run.cost_usd > cost_before, "the late answer was billed: it counts against the run"
    assert Turn.objects.filter(run_id=run.id).count() == 1, "and is never used"


def test_batch_delivery__cancelling_the_run_abandons_its_turn_and_cancels_the_batch(batch_fake, batched_workflows):
    batched_workflows(
        "batched_cancel", [agent("a", instructions="Answer.", model=MODEL, max_tokens=256, delivery="batch")]
    )
    batch_fake.hold_batches()
    run = api.start("batched_cancel", {})
    advance(run.id)
    batcher.run_pass(client_of(batch_fake))
    api.cancel(run.id, reason="not needed")
    assert BatchTurn.objects.get(run_id=run.id).status == "abandoned"
    batcher.run_pass(client_of(batch_fake))
    assert MessageBatch.objects.get().status in ("canceling", "ended")
    assert batch_fake.batches[0].processing_status in ("canceling", "ended")


def test_replay_in_batch__every_model_call_of_both_lanes_goes_in_a_batch_and_nothing_is_applied(
    batch_fake, monkeypatch
):
    monkeypatch.setenv("ANTHROPIC_BASE_URL", batch_fake.url)  # the batcher's own client, as a worker's would be made
    batch_fake.responder = billing_script
    source = drive(api.start("agent_charge", {"message": "Please charge order A-1."}).id)
    assert source.status == "completed"
    live_asks = len(batch_fake.requests)
    assert live_asks == 3
    effects, ledger = Effect.objects.count(), LedgerEntry.objects.count()

    replay = api.replay(runs=[source.id], candidate={"model": "claude-haiku-4-5"}, delivery="batch", concurrency=10)
    report = api.replay_here(replay.id)

    replayed = [r for r in batch_fake.requests[live_asks:] if r.path == "/v1/messages"]
    assert replayed and all(r.batch_id for r in replayed), "a replay with delivery='batch' asks nothing live"
    assert report.lanes["baseline"].agree == report.lanes["candidate"].agree == 1
    assert (Effect.objects.count(), LedgerEntry.objects.count()) == (effects, ledger), "a replay applies nothing"
    replay_ids = ReplayRun.objects.filter(replay=replay).values("run_id")
    assert set(Wait.objects.filter(run_id__in=replay_ids).values_list("kind", flat=True)) == {"batch"}
    assert BatchTurn.objects.filter(run_id__in=replay_ids, status="succeeded").count() == len(replayed)


def test_replay_in_batch__a_delivery_that_is_not_one_is_refused():
    with pytest.raises(InvalidInputError, match='"live" or "batch"'):
        api.replay(runs=[], delivery="overnight")


def test_durable_replay_batch__the_command_replays_through_batches(batch_fake, monkeypatch):
    monkeypatch.setenv("ANTHROPIC_BASE_URL", batch_fake.url)
    batch_fake.responder = billing_script
    source = drive(api.start("agent_charge", {"message": "Please charge order A-1."}).id)
    out = StringIO()

    call_command(
        "durable_replay", "--runs", str(source.id), "--lanes", "baseline", "--batch", "--here", "--json", stdout=out
    )

    report = json.loads(out.getvalue())
    assert report["lanes"]["baseline"]["agree"] == 1
    assert Replay.objects.get(pk=report["replay"]).delivery == "batch"
    assert batch_fake.batch_creates >= 1


def test_batch_metrics__turns_and_batches_in_flight_are_exported(batch_fake, batched_workflows):
    batched_workflows(
        "batched_metrics", [agent("a", instructions="Answer.", model=MODEL, max_tokens=256, delivery="batch")]
    )
    batch_fake.hold_batches()
    queued_run, sent_run = api.start("batched_metrics", {}), api.start("batched_metrics", {"n": 2})
    advance(sent_run.id)
    batcher.run_pass(client_of(batch_fake))
    advance(queued_run.id)
    with override_settings(DURABLE_AGENTS={**settings.DURABLE_AGENTS, "BATCH_WINDOW_SECONDS": 3600}):
        batcher.run_pass(client_of(batch_fake))  # the second turn's window has not passed: it stays queued

    figures = {family.name: family.samples for family in DatabaseCollector().collect()}

    turns = {sample.labels["status"]: sample.value for sample in figures["durable_batch_turns"]}
    assert turns == {"queued": 1, "submitted": 1}
    assert [s.value for s in figures["durable_batches_in_flight"]] == [1]
    assert figures["durable_batch_oldest_age_seconds"][0].value >= 0

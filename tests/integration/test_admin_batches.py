"""The console's view of batch delivery (issue 32): the run page's Message Batches section and batch-priced turns,
the read-only Message Batches admin, the overview's batches-in-flight card — each within the list pages' query budget
and with every COUNT capped.

Rows are written directly (what the batcher and the step would have written): these tests defend what the console
shows of them; tests/integration/test_batch_delivery.py drives the same rows through the real SDK.
"""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

import pytest
from django.conf import settings
from django.contrib.auth.models import User
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext, override_settings
from django.urls import reverse

from durable_agents import api, clock
from durable_agents.models import BatchTurn, MessageBatch, Run, Step, Turn
from tests.integration.test_admin import LIST, login, page_url
from tests.integration.test_run_list import QUERY_BUDGET

pytestmark = pytest.mark.django_db

BATCHES = reverse("admin:durable_agents_messagebatch_changelist")


def batch_page(batch: MessageBatch) -> str:
    return reverse("admin:durable_agents_messagebatch_change", args=[batch.pk])


def batched_run(*, turns: int = 2, provider: str = "msgbatch_01inflight") -> tuple[Run, MessageBatch, MessageBatch]:
    """A run whose review step sent its turns in Message Batches: turn 0 answered in an ended batch (and journaled
    at batch price), the later ones still in a batch in flight; beside it a live turn of another step."""
    now = clock.now()
    run = api.start("noop", {"steps": 1})
    step = Step.objects.create(run=run, step_id="review", name="review", position=5, kind="agent")
    live_step = Step.objects.create(run=run, step_id="draft", name="draft", position=6, kind="agent")
    ended = MessageBatch.objects.create(
        provider_id=f"{provider}-ended",
        status="ended",
        request_count=1,
        counts={"processing": 0, "succeeded": 1},
        created_at=now - timedelta(minutes=40),
        submitted_at=now - timedelta(minutes=40),
        ended_at=now - timedelta(minutes=5),
        polls=6,
    )
    flying = MessageBatch.objects.create(
        provider_id=provider,
        status="in_progress",
        request_count=turns - 1,
        counts={"processing": turns - 1},
        created_at=now - timedelta(minutes=12),
        submitted_at=now - timedelta(minutes=12),
        next_poll_at=now + timedelta(seconds=30),
        polls=3,
    )
    answered = BatchTurn.objects.create(
        run=run,
        step=step,
        index=0,
        purpose="turn",
        custom_id=f"da-answered-{run.pk.hex}",
        model="claude-sonnet-5-5",
        request_digest="d0",
        params={"messages": []},
        status="succeeded",
        batch=ended,
        result={"type": "succeeded", "message": {}},
        cost_usd=Decimal("0.000600"),
        created_at=now - timedelta(minutes=41),
        ended_at=now - timedelta(minutes=5),
    )
    Turn.objects.create(
        run=run,
        step=step,
        index=0,
        request_digest="d0",
        content=[{"type": "text", "text": "batched answer"}],
        stop_reason="end_turn",
        model="claude-sonnet-5-5",
        request_id=answered.custom_id,
        input_tokens=100,
        output_tokens=20,
        cost_usd=Decimal("0.000600"),
    )
    Turn.objects.create(
        run=run,
        step=live_step,
        index=0,
        request_digest="l0",
        content=[{"type": "text", "text": "live answer"}],
        stop_reason="end_turn",
        model="claude-sonnet-5-5",
        request_id="req_live",
        input_tokens=100,
        output_tokens=20,
        cost_usd=Decimal("0.001200"),
    )
    for index in range(1, turns):
        BatchTurn.objects.create(
            run=run,
            step=step,
            index=index,
            purpose="turn",
            custom_id=f"da-flying-{index}-{run.pk.hex}",
            model="claude-sonnet-5-5",
            request_digest=f"d{index}",
            params={"messages": []},
            status="submitted",
            batch=flying,
            created_at=now - timedelta(minutes=12),
            submitted_at=now - timedelta(minutes=12),
        )
    return run, ended, flying


@pytest.fixture
def viewer():
    """Staff who may view runs (and so their batches), nothing more."""
    return login("batch-viewer")


def test_run_page__lists_each_batch_turn_with_its_batch_status_and_age(viewer):
    run, ended, flying = batched_run(turns=2)

    html = viewer.get(page_url(run)).content.decode()

    section = html.split('id="batches"', 1)[1].split('<div class="module"', 1)[0]
    assert "Message Batches" in html and flying.provider_id in section and ended.provider_id in section
    answered, waiting = BatchTurn.objects.filter(run=run).order_by("index")
    answered_row = section.split(f'id="batch-turn-{answered.pk}"', 1)[1].split("</tr>", 1)[0]
    waiting_row = section.split(f'id="batch-turn-{waiting.pk}"', 1)[1].split("</tr>", 1)[0]
    assert "succeeded" in answered_row and "ended" in answered_row and "ended after 36 min" in answered_row, (
        f"an answered turn shows its batch ended and how long the answer took: {answered_row}"
    )
    assert "submitted" in waiting_row and "in_progress" in waiting_row and "waiting 12 min" in waiting_row, (
        f"a turn in flight shows its batch in progress and how long it has waited: {waiting_row}"
    )
    assert batch_page(flying) in waiting_row, "a turn links to its batch's page"


def test_run_page__a_turn_answered_in_a_batch_is_marked_batch_priced_a_live_one_is_not(viewer):
    run, _, _ = batched_run(turns=2)
    batched = Turn.objects.get(run=run, step__step_id="review")
    live = Turn.objects.get(run=run, step__step_id="draft")

    html = viewer.get(page_url(run)).content.decode()

    batched_row = html.split(f'id="turn-{batched.pk}"', 1)[1].split("</tr>", 1)[0]
    live_row = html.split(f'id="turn-{live.pk}"', 1)[1].split("</tr>", 1)[0]
    assert "$0.000600" in batched_row and "durable-batch-mark" in batched_row, (
        "the turn answered in a batch shows its cost marked as batch-priced"
    )
    assert "$0.001200" in live_row and "durable-batch-mark" not in live_row, "a live turn carries no batch mark"


def test_run_page__a_run_without_batch_turns_shows_no_batches_section(viewer):
    run = api.start("noop", {"steps": 1})

    html = viewer.get(page_url(run)).content.decode()

    assert 'id="batches"' not in html and 'class="durable-batch-mark"' not in html


def test_run_page__query_count_does_not_grow_with_batch_turns(viewer):
    def count_queries(run: Run) -> int:
        with CaptureQueriesContext(connection) as queries:
            assert viewer.get(page_url(run)).status_code == 200
        return len(queries)

    few, _, _ = batched_run(turns=2, provider="msgbatch_few")
    many, _, _ = batched_run(turns=60, provider="msgbatch_many")
    plain = api.start("noop", {"steps": 1})

    counts = {"few": count_queries(few), "many": count_queries(many), "plain": count_queries(plain)}
    assert len(set(counts.values())) == 1, f"the run page reads a fixed number of queries: {counts}"


def test_batch_list__shows_provider_id_status_requests_counts_age_and_polls_filtered_by_status(viewer):
    _, ended, flying = batched_run(turns=4)

    html = viewer.get(BATCHES).content.decode()
    assert flying.provider_id in html and ended.provider_id in html
    assert "processing 3" in html and "succeeded 1" in html, "the API's request counts as last polled"
    assert "ended after 35 min" in html and ">12 min<" in html, "each batch's age: in flight, or until it ended"

    in_progress = viewer.get(f"{BATCHES}?status__exact=in_progress")
    assert [b.pk for b in in_progress.context["cl"].result_list] == [flying.pk], "the status filter narrows the list"


def test_batch_page__lists_its_turns_each_linking_to_its_run(viewer):
    run, _, flying = batched_run(turns=3)

    response = viewer.get(batch_page(flying))

    assert response.status_code == 200
    html = response.content.decode()
    turns = html.split('id="batch-turns"', 1)[1].split("</table>", 1)[0]
    assert turns.count("<tr>") == 1 + 2, "a header and the batch's two turns"
    assert page_url(run) in turns and "submitted" in turns


def test_batches__read_only_for_everyone_and_hidden_from_who_may_not_view_runs(viewer):
    _, _, flying = batched_run()
    superuser = Client()
    superuser.force_login(User.objects.create_superuser("batch-admin", password="secret"))

    for client in (viewer, superuser):
        page = client.get(BATCHES).content.decode()
        assert reverse("admin:durable_agents_messagebatch_add") not in page, "no batch is added by hand"
        assert client.get(reverse("admin:durable_agents_messagebatch_add")).status_code == 403
        assert client.get(reverse("admin:durable_agents_messagebatch_delete", args=[flying.pk])).status_code == 403
        form = client.get(batch_page(flying)).content.decode()
        assert 'name="_save"' not in form, "a batch's page saves nothing"
        client.post(batch_page(flying), {"status": "ended", "provider_id": "changed"})
        flying.refresh_from_db()
        assert (flying.status, flying.provider_id) == ("in_progress", "msgbatch_01inflight"), "a post changes nothing"

    stranger = Client()
    stranger.force_login(User.objects.create_user("batch-stranger", password="secret", is_staff=True))
    assert stranger.get(BATCHES).status_code == 403, "staff who may not view runs may not view their batches"
    assert stranger.get(batch_page(flying)).status_code == 403


def test_overview__shows_batches_in_flight_and_the_oldest_ones_age(viewer):
    _, _, flying = batched_run(turns=3)
    other = api.start("noop", {"steps": 1})
    BatchTurn.objects.create(
        run=other,
        step=Step.objects.create(run=other, step_id="triage", name="triage", position=5, kind="agent"),
        index=0,
        custom_id="da-queued-overview",
        request_digest="q",
        params={},
        status="queued",
        created_at=clock.now() - timedelta(minutes=3),
    )

    html = viewer.get(LIST).content.decode()

    card = html.split('id="durable-batches"', 1)[1].split("</div>\n    </div>", 1)[0]
    assert "1 batch</a>" in card and "2 turns processing" in card and "1 queued" in card, card
    assert "oldest made 12 min ago" in card and flying.provider_id in card and "oldest queued turn 3 min ago" in card
    assert BATCHES in card, "the card links to the Message Batches list"


def test_overview__no_batches_card_when_nothing_is_in_flight(viewer):
    batched_run()
    MessageBatch.objects.update(status="ended", ended_at=clock.now())

    assert 'id="durable-batches"' not in viewer.get(LIST).content.decode()


def test_list_pages__stay_within_the_query_budget_with_every_count_capped(viewer):
    for i in range(3):
        batched_run(turns=3, provider=f"msgbatch_budget_{i}")
    limited = {**settings.DURABLE_AGENTS, "ADMIN_EXACT_COUNT_LIMIT": 2}

    for url in (LIST, BATCHES, f"{BATCHES}?status__exact=in_progress"):
        with CaptureQueriesContext(connection) as queries:
            assert viewer.get(url).status_code == 200
        assert len(queries) <= QUERY_BUDGET, f"{url} takes {len(queries)} queries (budget {QUERY_BUDGET})"
        with override_settings(DURABLE_AGENTS=limited), CaptureQueriesContext(connection) as queries:
            assert viewer.get(url).status_code == 200
        counts = [q["sql"] for q in queries if "COUNT(" in q["sql"].upper()]
        assert all("LIMIT" in sql.upper() for sql in counts), f"every COUNT on {url} is capped by a LIMIT: {counts}"
    with override_settings(DURABLE_AGENTS=limited):
        card = viewer.get(LIST).content.decode().split('id="durable-batches"', 1)[1]
    assert "more than 2 batches" in card, "past the console's count limit the card says so instead of counting on"

"""The refund example (project/refunds) on Postgres, Redis and real workers, Claude played through the real SDK.

The fake Messages API answers with the same policy as the demo's scripted participant (`script.next_move`),
so the worker's "anthropic" participant — chosen because ANTHROPIC_API_KEY is set in its environment — runs
the whole SDK path against the strict stand-in of the default model: requests, thinking blocks, tool_use ids
minted by the server, the judge's verdict without forced tool choice, usage.
"""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

import pytest

from durable_agents import api, clock
from durable_agents.models import Effect, Event, Run, RunStatus, Step, StepStatus, Turn, Wait, WaitStatus
from durable_agents.testing import drive, wait_for, wait_for_run
from durable_agents.testing.fake_anthropic import FakeAnthropic, Fault, RecordedRequest, Reply, tool_use_block
from project.refunds import script
from project.refunds.models import Order, OutboundEmail, Refund
from project.refunds.script import stand_in_reply
from project.refunds.seed import CASES, SEEDED, seed_shop

pytestmark = pytest.mark.django_db(transaction=True)

CASE = {case.number: case for case in CASES}


@pytest.fixture
def fake(worker_env):
    """The strict stand-in plays Claude's default model: thinking blocks, no prefill, no forced tool choice."""
    with FakeAnthropic(responder=stand_in_reply) as server:
        worker_env.update(server.environ())
        yield server
        refused = [r.refused for r in server.requests if r.refused]
        assert not refused, f"the stand-in refused what the workers sent (the real API would too): {refused}"


@pytest.fixture(autouse=True)
def shop(transactional_db):
    seed_shop()
    yield
    clock.reset()


def start(number: str) -> Run:
    return api.start("refund_agent", CASE[number].run_input)


def test_refund_agent__is_found_by_its_order_number():
    number = next(iter(CASE))
    run = start(number)
    start(next(n for n in CASE if n != number))
    assert Run.objects.get(pk=run.pk).search == {"order_id": number}, "refund_agent declares search=('order_id',)"
    assert list(api.runs(search={"order_id": number})) == [run]


def refunds_of(number: str) -> list[Decimal]:
    refunds = Refund.objects.filter(order__number=number).exclude(idempotency_key__startswith=SEEDED).order_by("id")
    return [refund.amount for refund in refunds]


def emails_to(number: str) -> list[OutboundEmail]:
    return list(OutboundEmail.objects.filter(order__number=number).order_by("id"))


def asked(fake: FakeAnthropic, run: Run, step: str = "resolve") -> list[int]:
    """How many times each turn of a step's conversation was sent to the API."""
    conversation = f"{run.id}:{step}"
    turns = max((r.turn for r in fake.requests_for(conversation)), default=-1) + 1
    return [fake.count(conversation, turn) for turn in range(turns)]


def test_refund_agent__each_case_ends_as_the_demo_expects(start_worker, fake):
    start_worker()
    start_worker()
    numbers = [case.number for case in CASES if not case.needs_approval]
    runs = {number: start(number) for number in numbers}

    for number, run in runs.items():
        run = wait_for_run(run.id, "completed", timeout=120)
        case = CASE[number]
        assert refunds_of(number) == ([case.refund] if case.refund else []), f"{number}: {case.expectation}"
        assert len(emails_to(number)) == 1, f"{number}: one email to the customer"
        assert run.output["passed"] is True and run.output["reasons"], run.output
        assert set(Turn.objects.filter(run=run).values_list("participant", flat=True)) == {"anthropic"}
        assert all(n == 1 for n in asked(fake, run)), f"{number}: a turn was asked twice: {asked(fake, run)}"

    assert "already been refunded in full" in emails_to("A-1003")[0].body
    assert "on its way" in emails_to("A-1005")[0].body
    refund = Refund.objects.get(order__number="A-1001")
    effect = Effect.objects.get(tool="issue_refund", run=runs["A-1001"])
    assert refund.idempotency_key == effect.idempotency_key and effect.status == "applied"
    assert refund.idempotency_key.startswith(f"{runs['A-1001'].id}:resolve:toolu_"), "keyed by run, step, tool_use_id"


def test_refund_agent__judge_asks_for_one_verdict_on_the_email_sent_without_forcing_the_tool(start_worker, fake):
    start_worker()
    run = wait_for_run(start("A-1001").id, "completed", timeout=90)

    (review,) = fake.requests_for(f"{run.id}:review_email")
    assert [tool["name"] for tool in review.body["tools"]] == ["submit_verdict"]
    # The default model refuses forced tool choice (https://platform.claude.com/docs/en/models/sonnet-5-5/migration-guide).
    assert review.body["model"] == "claude-sonnet-5-5"
    assert review.body["tool_choice"] == {"type": "auto", "disable_parallel_tool_use": True}
    email = emails_to("A-1001")[0]
    assert email.subject in review.last_user_text and "We have refunded €34.90" in review.last_user_text
    assert Step.objects.get(run=run, step_id="review_email").result == run.output


def test_refund_agent__refund_above_50_waits_for_approval_then_is_made_once(start_worker, fake):
    start_worker(beat=True)
    run = start("A-1002")
    wait_for(lambda: Run.objects.get(pk=run.id).status == RunStatus.WAITING, timeout=60, what="the run to park")

    wait = Wait.objects.get(run=run, status=WaitStatus.OPEN)
    assert wait.name == "issue_refund" and '"amount": "129.00"' in wait.question
    assert refunds_of("A-1002") == [] and emails_to("A-1002") == [], "nothing happens before the manager decides"
    api.decide(wait.pk, True, by="manager@example.com", comment="defective within warranty")
    run = wait_for_run(run.id, "completed", timeout=90)

    assert refunds_of("A-1002") == [Decimal("129.00")]
    assert "We have refunded €129.00" in emails_to("A-1002")[0].body
    assert asked(fake, run) == [1, 1, 1, 1], "the parked turn is replayed from the journal, not asked again"
    assert Event.objects.get(run=run, kind="wait_decided").actor == "manager@example.com"
    assert run.output["passed"] is True


def test_refund_agent__rejected_refund_is_explained_and_never_made(start_worker, fake):
    start_worker(beat=True)
    run = start("A-1002")
    wait_for(lambda: Wait.objects.filter(run=run, status=WaitStatus.OPEN).exists(), timeout=60, what="an approval")
    api.decide(Wait.objects.get(run=run).pk, False, by="manager@example.com", comment="outside the warranty")
    run = wait_for_run(run.id, "completed", timeout=90)

    assert refunds_of("A-1002") == []
    assert not Effect.objects.filter(run=run, tool="issue_refund", status="applied").exists()
    (email,) = emails_to("A-1002")
    assert "could not approve a refund" in email.body and "outside the warranty" not in email.body


def test_refund_agent__sigkill_after_the_refund_never_refunds_twice(start_worker, fake):
    def hang_once_after_the_refund(request: RecordedRequest) -> Reply | Fault:
        # The turn that follows the refund hangs on its first attempt: the worker dies waiting for it.
        if request.conversation.endswith(":resolve") and request.turn == 2 and request.attempt == 1:
            return Fault.delay(60)
        return stand_in_reply(request)

    fake.responder = hang_once_after_the_refund
    worker = start_worker()
    run = start("A-1001")
    wait_for(
        lambda: fake.count(f"{run.id}:resolve", 2) == 1 and refunds_of("A-1001"),
        timeout=60,
        what="the refund to be made and the next turn to be asked",
    )
    worker.kill()
    start_worker(beat=True)
    run = wait_for_run(run.id, "completed", timeout=120)

    assert refunds_of("A-1001") == [Decimal("34.90")], "a refund made twice: the resumed run repeated an effect"
    assert len(emails_to("A-1001")) == 1
    assert asked(fake, run) == [1, 1, 2, 1], "only the turn that never got an answer is asked again"
    assert Effect.objects.get(run=run, tool="issue_refund").attempts == 1
    assert Event.objects.filter(run=run, kind="lease_takeover").exists()


def test_refund_agent__failed_review_redoes_the_agent_with_the_reasons_without_a_second_refund(start_worker, fake):
    reasons = "The email does not say when the money arrives."

    def strict_first_review(request: RecordedRequest) -> Reply:
        if request.conversation.endswith(":review_email") and request.attempt == 1:
            verdict = {"passed": False, "score": 0.3, "reasons": reasons}
            return Reply(content=[tool_use_block("submit_verdict", verdict)], stop_reason="tool_use")
        return stand_in_reply(request)

    fake.responder = strict_first_review
    start_worker()
    run = wait_for_run(start("A-1001").id, "completed", timeout=120)

    assert refunds_of("A-1001") == [Decimal("34.90")], "the redo must not refund again"
    first, corrected = emails_to("A-1001")
    assert "We have refunded €34.90" in corrected.body, "the corrected email restates the refund already made"
    redo = fake.requests_for(f"{run.id}:resolve")
    redone_prompts = [r.messages[0] for r in redo if r.turn == 0]
    assert len(redone_prompts) == 2 and reasons in str(redone_prompts[1]), "ctx.feedback() reaches the agent's prompt"
    assert Event.objects.filter(run=run, kind="redo_from_step", detail__target="resolve").exists()
    review = Step.objects.live().get(run=run, step_id="review_email")
    assert review.status == StepStatus.DONE and review.result["passed"] is True
    assert Order.objects.get(number="A-1001").refundable_amount() == Decimal("0.00")


def test_refund_agent__approval_given_after_the_order_went_stale_is_asked_again_on_fresh_data(monkeypatch):
    monkeypatch.setattr(script, "THINK_SECONDS", 0)
    run = drive(start("A-1002").id)
    assert run.status == RunStatus.WAITING, run.error
    first = Wait.objects.get(run=run, status=WaitStatus.OPEN)

    clock.advance(timedelta(minutes=30))  # the manager answers long after the order was loaded (10 min budget)
    api.decide(first.pk, True, by="manager@example.com")
    run = drive(run.id)

    assert Event.objects.filter(run=run, kind="replanned").exists(), "resumed past the order's freshness budget"
    assert run.status == RunStatus.WAITING and refunds_of("A-1002") == [], "no refund on a stale decision"
    second = Wait.objects.get(run=run, status=WaitStatus.OPEN)
    api.decide(second.pk, True, by="manager@example.com")
    run = drive(run.id)

    assert run.status == RunStatus.COMPLETED and refunds_of("A-1002") == [Decimal("129.00")]
    assert len(emails_to("A-1002")) == 1


def test_admin_index__opens_on_the_overview_then_the_apps_and_recent_actions(client, django_user_model):
    admin = django_user_model.objects.create_superuser("oncall", password="correct horse battery")
    client.force_login(admin)
    html = client.get("/admin/").content.decode()
    assert 'id="durable-overview"' in html and 'id="durable-health"' in html, "the console's landing page"
    assert "Recent actions" in html and "/admin/durable_agents/run/?status__exact=" in html

"""Humans in the loop: durable approvals across crashes, deadlines and reminders, signals, timers, links."""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta

import pytest
import redis
from django.contrib.auth.models import Permission, User
from django.core import mail
from django.db import connections
from django.test.utils import override_settings

from durable_agents import api, clock
from durable_agents.engine.sweep import sweep
from durable_agents.links import decision_path
from durable_agents.models import Effect, Event, Run, RunStatus, Wait, WaitStatus
from durable_agents.testing import deliver_notifications, drive, wait_for, wait_for_run
from tests.celery import app as celery_app
from tests.testapp.models import Execution, LedgerEntry

pytestmark = pytest.mark.django_db(transaction=True)
RUN_TASKS = {"durable_agents.advance", "durable_agents.advance_many"}  # the tasks that execute a run's steps


@pytest.fixture(autouse=True)
def _reset_clock():
    yield
    clock.reset()


def park(workflow: str, run_input: dict | None = None) -> tuple[Run, Wait]:
    """Start a run and drive it in-process until it waits."""
    run = drive(api.start(workflow, run_input or {"order_id": "W-1"}).id)
    assert run.status == RunStatus.WAITING, f"{workflow} should wait, it is {run.status} ({run.error})"
    return run, Wait.objects.get(run=run, status=WaitStatus.OPEN)


def test_approval__wait_survives_a_worker_sigkill_and_resumes_on_approve(start_worker):
    worker = start_worker()
    run = api.start("approve_charge", {"order_id": "W-1"})
    wait_for(lambda: Run.objects.get(pk=run.id).status == RunStatus.WAITING, timeout=30, what="the run to wait")
    worker.kill()
    start_worker(beat=True)
    time.sleep(1.5)  # sweeps pass: a waiting run must stay parked, its effect not applied
    assert Run.objects.get(pk=run.id).status == RunStatus.WAITING and not LedgerEntry.objects.exists()

    wait = Wait.objects.get(run=run)
    assert "Charge the customer 40.00?" in wait.brief and "If you approve: the card is charged 40.00" in wait.brief
    # The request reaches the approver even if the killed worker held it: the sweep re-sends it. (Checked before
    # the decision: a request for a wait decided meanwhile is rightly never sent.) If the killed worker had
    # claimed it mid-send, it is due again only after the claim's hold (NOTIFY_SEND_TIMEOUT_SECONDS plus the
    # first backoff: tens of seconds with the defaults): wait past it.
    sent = wait_for(
        lambda: Effect.objects.filter(tool="notify.requested", run=run, status="applied").first(),
        timeout=120,
        what="the approval request to be delivered (even if its worker died)",
    )
    assert "/durable/waits/" in sent.args["link"]
    api.decide(wait.pk, True, by="alice", comment="looks right")
    run = wait_for_run(run.id, "completed", timeout=60)

    assert run.output == {"charged": True} and LedgerEntry.objects.count() == 1
    assert Execution.objects.filter(run_id=run.id, step_id="charge").count() == 1
    decided = Event.objects.get(run=run, kind="wait_decided")
    assert decided.actor == "alice" and decided.detail["comment"] == "looks right"
    assert Effect.objects.filter(tool="notify.requested").count() == 1


def test_approval__reject_takes_the_reject_path_and_applies_nothing():
    run, wait = park("approve_charge")
    api.decide(wait.pk, False, by="bob", comment="fraud")
    run = drive(run.id)
    assert run.status == RunStatus.COMPLETED and run.output == {"charged": False}
    assert not LedgerEntry.objects.exists() and not Effect.objects.filter(kind="effect").exists()


def test_approval__deciding_a_closed_wait_is_a_clear_error():
    run, wait = park("approve_charge")
    api.decide(wait.pk, True, by="alice")
    with pytest.raises(api.WaitClosedError, match="already approved by alice"):
        api.decide(wait.pk, False, by="bob")
    with pytest.raises(api.WaitNotFoundError):
        api.decide(999999, True, by="bob")


def test_approval__racing_approvers_exactly_one_wins():
    run, wait = park("approve_charge")
    outcomes: list[str] = []
    barrier = threading.Barrier(2)

    def decide(user: str, approve: bool) -> None:
        barrier.wait()
        try:
            api.decide(wait.pk, approve, by=user)
            outcomes.append(f"won:{user}")
        except api.WaitClosedError:
            outcomes.append(f"lost:{user}")
        finally:
            connections.close_all()

    threads = [threading.Thread(target=decide, args=(u, a)) for u, a in (("alice", True), ("bob", False))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(o.split(":")[0] for o in outcomes) == ["lost", "won"], outcomes
    assert Event.objects.filter(run=run, kind="wait_decided").count() == 1


def test_deadline__reject_policy_with_warning_and_reminders():
    run, wait = park("deadline_reject")
    deliver_notifications()  # the approval request: the sweep only enqueues, so deliver in-process
    mail.outbox.clear()
    for minutes, reminders, warned in [(21, 1, False), (41, 2, False), (52, 2, True)]:
        clock.reset()
        clock.advance(timedelta(minutes=minutes))
        sweep()
        deliver_notifications()
        wait.refresh_from_db()
        assert (wait.reminders_sent, bool(wait.warned_at)) == (reminders, warned), f"at +{minutes} min"
    clock.reset()
    clock.advance(timedelta(minutes=61))
    assert sweep().expired == 1
    deliver_notifications()
    wait.refresh_from_db()
    assert wait.status == WaitStatus.REJECTED and wait.decided_by == "deadline"
    run = drive(run.id)
    assert (
        run.status == RunStatus.COMPLETED
        and Run.objects.get(pk=run.id).steps.get(step_id="approve").result["approved"] is False
    )
    subjects = [m.subject for m in mail.outbox]
    assert [s.split(":")[0] for s in subjects] == ["Reminder 1", "Reminder 2", "Deadline soon", "Deadline passed"]
    assert "Since then" in mail.outbox[0].body or "nothing else has changed" in mail.outbox[0].body


def test_deadline__fail_policy_fails_the_run_while_no_worker_runs():
    run, wait = park("deadline_fail")
    clock.advance(timedelta(hours=2))
    sweep()
    run.refresh_from_db()
    assert run.status == RunStatus.FAILED and run.error["type"] == "WaitExpiredError"
    assert Wait.objects.get(pk=wait.pk).status == WaitStatus.EXPIRED


def test_deadline__escalate_notifies_and_extends_once_then_rejects():
    run, wait = park("deadline_escalate")
    mail.outbox.clear()
    clock.advance(timedelta(minutes=61))
    sweep()
    deliver_notifications()
    wait.refresh_from_db()
    assert wait.status == WaitStatus.OPEN and wait.escalated_at and wait.deadline > clock.now()
    escalation = [m for m in mail.outbox if m.subject.startswith("Escalated")]
    assert escalation and "boss@example.com" in escalation[0].to
    clock.advance(timedelta(hours=2))
    sweep()
    wait.refresh_from_db()
    assert wait.status == WaitStatus.REJECTED


def test_deadline__expiry_while_no_worker_runs_then_a_worker_finishes(start_worker):
    run, wait = park("deadline_reject")
    clock.advance(timedelta(hours=2))
    sweep()  # no worker is running: the sweep alone decides the deadline
    start_worker()
    run = wait_for_run(run.id, "completed", timeout=60)
    assert Execution.objects.filter(run_id=run.id, step_id="after").count() == 1


def test_signal__arriving_after_or_before_the_wait_wakes_the_run():
    run, wait = park("signal_flow")
    api.send_signal(run.id, "payment.confirmed", {"paid": 40}, by="bank")
    assert drive(run.id).output == {"got": {"paid": 40}}

    early = api.start("signal_flow", {})
    api.send_signal(early.id, "payment.confirmed", {"paid": 7})
    assert drive(early.id).output == {"got": {"paid": 7}}, "a signal sent before the wait opened is kept"


def test_timer__durable_sleep_is_woken_by_the_sweep():
    run, wait = park("timer_flow")
    assert sweep().fired == 0
    clock.advance(timedelta(hours=1, seconds=1))
    assert sweep().fired == 1
    assert drive(run.id).status == RunStatus.COMPLETED


def test_tool_approval__refund_above_threshold_waits_then_applies_once():
    small = drive(api.start("refund_tool", {"amount": "20.00"}).id)
    assert small.status == RunStatus.COMPLETED, "20.00 is under the threshold: no approval"

    run, wait = park("refund_tool", {"amount": "80.00"})
    assert wait.effect_key.endswith(":refund:big_refund:1") and "80.00" in wait.question
    assert not LedgerEntry.objects.filter(order_id="R-1", amount=-80).exists()
    api.decide(wait.pk, True, by="alice")
    assert drive(run.id).status == RunStatus.COMPLETED
    assert LedgerEntry.objects.filter(amount=-80).count() == 1


def test_tool_approval__rejected_tool_never_runs():
    run, wait = park("refund_tool", {"amount": "80.00"})
    api.decide(wait.pk, False, by="alice", comment="too much")
    run = drive(run.id)
    assert run.status == RunStatus.FAILED and run.error["type"] == "ApprovalRejectedError"
    assert "too much" in run.error["message"] and not LedgerEntry.objects.filter(amount=-80).exists()


def test_cancel__a_waiting_run_cancels_its_wait():
    run, wait = park("approve_charge")
    api.cancel(run.id, "no longer needed")
    assert Run.objects.get(pk=run.id).status == RunStatus.CANCELLED
    assert Wait.objects.get(pk=wait.pk).status == WaitStatus.CANCELLED


# --- Signed links -------------------------------------------------------------------------------------------


@pytest.fixture
def approver(client):
    user = User.objects.create_user("carol", password="pw", is_staff=True)
    user.user_permissions.add(Permission.objects.get(codename="decide_wait"))
    client.force_login(user)
    return client


def test_link__approver_confirms_then_the_link_is_spent(approver):
    run, wait = park("approve_charge")
    path = decision_path(wait)
    page = approver.get(path)
    assert page.status_code == 200 and b"Charge the customer 40.00?" in page.content
    done = approver.post(path, {"decision": "approve", "comment": "ok"})
    assert done.status_code == 200 and b"Recorded" in done.content
    wait.refresh_from_db()
    assert (wait.status, wait.decided_by, wait.decision["via"]) == ("approved", "carol", "link")
    replay = approver.post(path, {"decision": "reject"})
    assert replay.status_code == 409 and b"already approved" in replay.content


def test_link__tampered_expired_and_other_wait_links_are_refused(approver):
    run, wait = park("approve_charge")
    other_run, other = park("approve_charge", {"order_id": "W-2"})
    path = decision_path(wait)
    tampered = path.replace(path.rstrip("/").rsplit("/", 1)[1], path.rstrip("/").rsplit("/", 1)[1][:-3] + "xyz")
    assert approver.get(tampered).status_code == 400
    foreign = decision_path(other).replace(f"/waits/{other.pk}/", f"/waits/{wait.pk}/")
    response = approver.get(foreign)
    assert response.status_code == 400 and b"belongs to another request" in response.content
    with override_settings(DURABLE_AGENTS={"LINK_MAX_AGE_SECONDS": 0}):
        time.sleep(1.1)
        expired = approver.get(path)
    assert expired.status_code == 400 and b"expired" in expired.content
    assert Wait.objects.get(pk=wait.pk).is_open, "no refused link may decide anything"


def test_link__users_without_permission_or_login_cannot_decide(client):
    run, wait = park("approve_charge")
    path = decision_path(wait)
    anonymous = client.get(path)
    assert anonymous.status_code == 302 and "/admin/login/" in anonymous["Location"]
    client.force_login(User.objects.create_user("dave", password="pw", is_staff=True))
    refused = client.post(path, {"decision": "approve"})
    assert refused.status_code == 403 and Wait.objects.get(pk=wait.pk).is_open


# --- Waiting costs nothing ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_waiting__a_thousand_waiting_runs_hold_no_worker_slot(start_worker, broker_url):
    from django.db import transaction

    from durable_agents.engine.advance import advance

    with transaction.atomic():  # no wake-up messages: the runs are parked in-process below
        ids = [api.start("approve_charge", {"order_id": f"K-{i}"}).id for i in range(1000)]
    for run_id in ids:
        advance(run_id)
        advance(run_id)
    assert Run.objects.filter(status=RunStatus.WAITING).count() == 1000
    deliver_notifications()  # their approval requests: sent once, not a cost of waiting
    redis.Redis.from_url(broker_url).flushdb()  # the wake-ups (and deliveries) sent while parking in-process
    worker = start_worker(beat=True)
    wait_for(lambda: celery_app.control.inspect(timeout=1).ping(), timeout=30, what="the worker to answer")
    time.sleep(2)  # several sweeps pass over the waiting runs

    # Beat's own tasks (a sweep may be executing or queued at any instant) are not a run's: only a run's are counted.
    inspect = celery_app.control.inspect(timeout=2)
    active = [task for tasks in (inspect.active() or {}).values() for task in tasks if task["name"] in RUN_TASKS]
    reserved = [task for tasks in (inspect.reserved() or {}).values() for task in tasks if task["name"] in RUN_TASKS]
    assert active == [] and reserved == [], f"waiting runs hold worker slots: {active + reserved}"
    queued = [
        json.loads(message)["headers"]["task"] for message in redis.Redis.from_url(broker_url).lrange("celery", 0, -1)
    ]
    assert not RUN_TASKS.intersection(queued), f"waiting runs left messages in the queue: {queued}"
    assert worker.process.poll() is None


def test_commands__decide_and_signal(capsys):
    from django.core.management import call_command
    from django.core.management.base import CommandError

    run, wait = park("approve_charge")
    call_command("durable_decide", str(wait.pk), "--approve", "--as", "erin", "--comment", "fine")
    assert Wait.objects.get(pk=wait.pk).decided_by == "erin"
    with pytest.raises(CommandError, match="already approved by erin") as closed:
        call_command("durable_decide", str(wait.pk), "--reject")
    assert closed.value.returncode == 2
    with pytest.raises(CommandError, match="no wait has id") as unknown:
        call_command("durable_decide", "424242", "--approve")
    assert unknown.value.returncode == 2

    signal_run, _ = park("signal_flow")
    call_command("durable_signal", str(signal_run.id), "payment.confirmed", "--payload", '{"paid": 1}')
    assert drive(signal_run.id).output == {"got": {"paid": 1}}
    with pytest.raises(CommandError, match="not valid JSON") as bad:
        call_command("durable_signal", str(signal_run.id), "x", "--payload", "{nope")
    assert bad.value.returncode == 2


def test_brief__written_by_the_participant_and_journaled():
    run = api.start("approve_briefed", {})
    api.swap_participant(run.id, "brief-writer")
    run = drive(run.id)
    wait = Wait.objects.get(run=run)
    assert wait.brief.startswith("Charging 40.00 settles the customer's open invoice.")
    assert "Decision needed: Charge 40.00?" in wait.brief, "the record it was written from stays below it"
    assert run.turns.get(purpose="brief").participant == "brief-writer"


def test_brief__falls_back_to_the_template_when_the_participant_fails(monkeypatch):
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    run = drive(api.start("approve_briefed", {}).id)  # the default participant, Claude, has no API key here
    wait = Wait.objects.get(run=run)
    assert wait.brief.startswith("Decision needed: Charge 40.00?")
    assert Event.objects.filter(run=run, kind="brief_fallback").exists()

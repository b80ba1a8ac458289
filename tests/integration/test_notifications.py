"""Notifications through their own outbox: the sweep only enqueues, a task claims then sends, failures back off.

Most tests drive the engine in-process with a test enqueuer (`deliver_now`: deliver at once, as a worker
would; `record_only`: as if every message were lost) and a counting notifier; the last one runs real
workers against a webhook that never answers.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socketserver
import threading
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.contrib.auth.models import User
from django.core import mail
from django.core.management import call_command
from django.db import connections
from django.db.models.functions import Now
from django.test import Client
from django.test.utils import override_settings
from django.urls import reverse

from durable_agents import api, clock, operations
from durable_agents.engine.sweep import sweep
from durable_agents.links import PUBLIC_SECRET_KEYS
from durable_agents.models import Effect, EffectStatus, Event, Run, RunStatus, Wait, WaitStatus
from durable_agents.testing import drive, wait_for, wait_for_run
from tests.integration.conftest import broker_down
from tests.testapp import notifiers
from tests.testapp.models import Execution

pytestmark = pytest.mark.django_db(transaction=True)

COUNTING = "tests.testapp.notifiers.CountingNotifier"
DELIVER_NOW = "tests.testapp.notifiers.deliver_now"
RECORD_ONLY = "tests.testapp.notifiers.record_only"


@pytest.fixture(autouse=True)
def _reset() -> Iterator[None]:
    notifiers.CountingNotifier.reset()
    notifiers.enqueued.clear()
    yield
    clock.reset()


@contextlib.contextmanager
def durable(**overrides: Any) -> Iterator[None]:
    """DURABLE_AGENTS with `overrides` on top of the test settings."""
    with override_settings(DURABLE_AGENTS={**settings.DURABLE_AGENTS, **overrides}):
        yield


def park(workflow: str = "approve_charge", run_input: dict | None = None) -> tuple[Run, Wait, Effect]:
    """A run parked on an approval, and its "requested" notification, left pending (its message lost)."""
    with durable(NOTIFIER=COUNTING, NOTIFICATION_ENQUEUER=RECORD_ONLY):
        notifiers.CountingNotifier.fail_all = True  # the code before the outbox sent on commit: keep it pending
        run = drive(api.start(workflow, run_input or {"order_id": "N-1"}).id)
        notifiers.CountingNotifier.fail_all = False
    assert run.status == RunStatus.WAITING, f"{workflow} should wait, it is {run.status} ({run.error})"
    wait = Wait.objects.get(run=run, status=WaitStatus.OPEN)
    return run, wait, Effect.objects.get(idempotency_key=f"wait:{wait.pk}:requested:1")


def age(*effects: Effect) -> None:
    """Make rows look written (and last enqueued) a minute ago: past NOTIFY_RETRY_SECONDS, on the DB clock."""
    Effect.objects.filter(pk__in=[e.pk for e in effects]).update(
        created_at=Now() - timedelta(minutes=1), updated_at=Now() - timedelta(minutes=1)
    )


def make_due(*effects: Effect) -> None:
    """Let a backoff pass without sleeping through it (the database's clock cannot be moved)."""
    age(*effects)
    Effect.objects.filter(pk__in=[e.pk for e in effects]).update(next_attempt_at=Now() - timedelta(seconds=1))


def test_sweep__never_calls_the_notifier_it_only_enqueues():
    run, wait, effect = park()
    age(effect)
    notifiers.enqueued.clear()
    with durable(NOTIFIER=COUNTING, NOTIFICATION_ENQUEUER=RECORD_ONLY):
        report = sweep()
    assert notifiers.CountingNotifier.sent == [], "the sweep sent a notification itself: it must only enqueue"
    assert notifiers.enqueued == [effect.pk] and report.notifications == 1, (
        f"the sweep should hand the due notification to its task once, it enqueued {notifiers.enqueued}"
    )
    assert Effect.objects.get(pk=effect.pk).status == EffectStatus.PENDING


def test_sweep__finds_a_notification_whose_task_message_was_lost_once_it_is_due():
    run, wait, effect = park()
    assert notifiers.enqueued == [effect.pk], "the notification is enqueued when its row commits"
    with durable(NOTIFICATION_ENQUEUER=RECORD_ONLY, NOTIFY_RETRY_SECONDS=30):
        assert sweep().notifications == 0, "a just-enqueued notification is not presumed lost yet"
        age(effect)
        assert sweep().notifications == 1, "a notification nobody picked up for NOTIFY_RETRY_SECONDS is enqueued"
        assert sweep().notifications == 0, "an overlapping sweep must not enqueue it again right away"
    assert notifiers.enqueued == [effect.pk, effect.pk]


def test_sweep__two_concurrent_sweeps_deliver_each_notification_once():
    effects = [park(run_input={"order_id": f"N-{i}"})[2] for i in range(4)]
    age(*effects)
    notifiers.CountingNotifier.delay = 0.3  # a slow receiver: two senders would overlap
    barrier = threading.Barrier(2)
    errors: list[BaseException] = []

    def sweep_in_thread() -> None:
        try:
            barrier.wait()
            sweep()
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)
        finally:
            connections.close_all()

    with durable(NOTIFIER=COUNTING, NOTIFICATION_ENQUEUER=DELIVER_NOW):
        threads = [threading.Thread(target=sweep_in_thread) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert not errors, errors
    sent = sorted(notifiers.CountingNotifier.sent)
    assert sent == sorted(e.idempotency_key for e in effects), f"each notification must go out once: {sent}"
    assert set(Effect.objects.filter(pk__in=[e.pk for e in effects]).values_list("status", flat=True)) == {"applied"}


def test_deliver__a_duplicate_task_sends_once():
    from durable_agents.engine.outbox import Delivery, deliver

    run, wait, effect = park()
    notifiers.CountingNotifier.delay = 0.3
    barrier = threading.Barrier(2)
    outcomes: list[Delivery] = []

    def deliver_in_thread() -> None:
        try:
            barrier.wait()
            outcomes.append(deliver(effect.pk))
        finally:
            connections.close_all()

    with durable(NOTIFIER=COUNTING):
        threads = [threading.Thread(target=deliver_in_thread) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert sorted(o.value for o in outcomes) == ["not_due", "sent"], f"the claim should let one in: {outcomes}"
    assert notifiers.CountingNotifier.sent == [effect.idempotency_key]
    assert Effect.objects.get(pk=effect.pk).attempts == 1


def test_sweep__failed_sends_count_attempts_and_back_off_longer_each_time():
    run, wait, effect = park()
    notifiers.CountingNotifier.fail_all = True
    backoffs: list[float] = []
    with durable(
        NOTIFIER=COUNTING,
        NOTIFICATION_ENQUEUER=DELIVER_NOW,
        NOTIFY_MAX_ATTEMPTS=10,
        NOTIFY_BACKOFF_SECONDS=1.0,
        NOTIFY_BACKOFF_MAX_SECONDS=100.0,
        NOTIFY_SEND_TIMEOUT_SECONDS=0.5,
    ):
        for attempt in range(1, 5):
            make_due(effect)
            sweep()
            row = Effect.objects.get(pk=effect.pk)
            assert row.status == EffectStatus.PENDING and row.attempts == attempt, (
                f"attempt {attempt} should be counted on the row, it says {row.attempts} ({row.status})"
            )
            assert row.error["type"] == "ConnectionError" and row.error["attempt"] == attempt, row.error
            ceiling = 2.0 ** (attempt - 1)
            backoff = row.error["backoff_seconds"]
            assert ceiling / 2 <= backoff <= ceiling, f"attempt {attempt}: backoff {backoff}s outside the jitter range"
            due_in = (row.next_attempt_at - row.updated_at).total_seconds()
            assert due_in == pytest.approx(backoff, abs=0.01), "the next attempt is due after the backoff (DB clock)"
            backoffs.append(backoff)
            assert sweep().notifications == 0, "a notification backing off is not enqueued again"
    assert backoffs == sorted(backoffs), f"the backoff must grow: {backoffs}"
    retries = Event.objects.filter(run=run, kind="notification_retry").order_by("id")
    assert [e.detail["attempt"] for e in retries] == [1, 2, 3, 4], "every failed attempt is in the run's history"


def test_sweep__gives_up_visibly_after_max_attempts(caplog):
    run, wait, effect = park()
    notifiers.CountingNotifier.fail_all = True
    with (
        durable(NOTIFIER=COUNTING, NOTIFICATION_ENQUEUER=DELIVER_NOW, NOTIFY_MAX_ATTEMPTS=3),
        caplog.at_level(logging.WARNING, logger="durable_agents"),
    ):
        for _ in range(5):
            make_due(effect)
            sweep()
    row = Effect.objects.get(pk=effect.pk)
    assert row.status == EffectStatus.FAILED and row.attempts == 3, (
        f"after 3 failed attempts the notification must be given up, it is {row.status} after {row.attempts}"
    )
    assert "after 3 attempts" in row.needs_attention and "ConnectionError" in row.needs_attention
    assert "decide the wait" in row.needs_attention, "needs_attention must say what to do"
    failed = Event.objects.get(run=run, kind="notification_failed")
    assert failed.detail["key"] == effect.idempotency_key and failed.detail["attempt"] == 3
    assert any("gave up" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)
    shown = next(e for e in operations.describe_run(run.id)["effects"] if e["key"] == effect.idempotency_key)
    assert shown["status"] == "failed" and shown["needs_attention"] == row.needs_attention


# No link without the app's URLs (system check E015 says so at start), nor signed with a published SECRET_KEY.
@pytest.mark.parametrize(
    ("site", "said"),
    [
        ({"ROOT_URLCONF": "django.contrib.auth.urls"}, "durable_agents.urls"),
        ({"SECRET_KEY": sorted(PUBLIC_SECRET_KEYS)[0]}, "SECRET_KEY"),
    ],
    ids=["urls-not-included", "published-secret-key"],
)
def test_notify__a_request_whose_link_cannot_be_made_fails_alone_and_the_wait_stays_decidable(caplog, site, said):
    """The run waits all the same, the request is failed visibly with what to do, and the command decides."""
    with (
        override_settings(**site),
        durable(NOTIFIER=COUNTING, NOTIFICATION_ENQUEUER=DELIVER_NOW),
        caplog.at_level(logging.WARNING, logger="durable_agents"),
    ):
        run = drive(api.start("approve_charge", {"order_id": "N-9"}).id)
        assert run.status == RunStatus.WAITING, f"a decision link that cannot be made failed the run: {run.error}"
        wait = Wait.objects.get(run=run)
        assert wait.status == WaitStatus.OPEN
        request = Effect.objects.get(idempotency_key=f"wait:{wait.pk}:requested:1")
        assert request.status == EffectStatus.FAILED and notifiers.CountingNotifier.sent == [], request.status
        assert said in request.needs_attention and "durable_decide" in request.needs_attention, (
            f"needs_attention must say what is missing and how to decide meanwhile: {request.needs_attention!r}"
        )
        failed = Event.objects.get(run=run, kind="notification_failed")
        assert failed.detail["key"] == request.idempotency_key, failed.detail
        said = [r for r in caplog.records if request.idempotency_key in r.getMessage()]
        assert len(said) == 1 and said[0].levelno == logging.WARNING and not said[0].exc_info, (
            f"one warning line, no traceback: {[r.getMessage() for r in said]}"
        )
        call_command("durable_decide", str(wait.pk), "--approve", "--as", "alice")
        run = drive(run.id)
    assert run.status == RunStatus.COMPLETED and run.output == {"charged": True}, (run.status, run.output)


def test_sweep__a_reminder_whose_link_cannot_be_made_fails_alone_and_the_sweep_goes_on():
    with durable(NOTIFICATION_ENQUEUER=RECORD_ONLY):
        run = drive(api.start("deadline_reject", {"order_id": "N-4"}).id)
        clock.advance(timedelta(minutes=25))  # past the first reminder (every 20 min), before the warning (50 min)
        with override_settings(ROOT_URLCONF="django.contrib.auth.urls"):  # the URLs left out by a later deploy
            sweep()
    wait = Wait.objects.get(run=run)
    reminder = Effect.objects.get(idempotency_key=f"wait:{wait.pk}:reminder:1")
    assert reminder.status == EffectStatus.FAILED and "durable_agents.urls" in reminder.needs_attention
    assert wait.status == WaitStatus.OPEN and Run.objects.get(pk=run.pk).status == RunStatus.WAITING


def test_enqueue__a_broker_outage_is_one_line_and_the_sweep_enqueues_the_request_later(caplog):
    # The default enqueuer publishes through Celery, which raises kombu's OperationalError once its publish retries
    # are spent (kombu/connection.py, Connection._reraise_as_library_errors).
    with broker_down(), caplog.at_level(logging.WARNING, logger="durable_agents"):
        run = drive(api.start("approve_charge", {"order_id": "N-5"}).id)
    request = Effect.objects.get(run=run, kind="notification")
    said = [r for r in caplog.records if f"notification {request.pk}" in r.getMessage()]
    assert len(said) == 1 and not said[0].exc_info, f"one line, no traceback: {[r.getMessage() for r in said]}"
    assert "Connection refused" in said[0].getMessage() and "\n" not in said[0].getMessage(), said[0].getMessage()
    assert request.status == EffectStatus.PENDING, "the request is kept for the sweep"
    age(request)
    with durable(NOTIFIER=COUNTING, NOTIFICATION_ENQUEUER=DELIVER_NOW):
        sweep()
    assert notifiers.CountingNotifier.sent == [request.idempotency_key], "the sweep enqueues it once it can"


def test_sweep__a_decided_waits_pending_request_is_skipped_not_sent():
    run, wait, effect = park()
    api.decide(wait.pk, True, by="alice")
    age(effect)
    with durable(NOTIFIER=COUNTING, NOTIFICATION_ENQUEUER=DELIVER_NOW):
        sweep()
    row = Effect.objects.get(pk=effect.pk)
    assert notifiers.CountingNotifier.sent == [], "'Approval needed' went out for a wait already decided"
    assert row.status == EffectStatus.SKIPPED, f"the request should be skipped, it is {row.status}"
    assert row.result == {"skipped": f"wait {wait.pk} is already approved by alice"}, row.result


def test_deliver__an_expired_notice_is_sent_though_its_wait_is_closed():
    from durable_agents.testing import deliver_notifications

    with durable(NOTIFIER=COUNTING, NOTIFICATION_ENQUEUER=RECORD_ONLY):
        run = drive(api.start("deadline_reject", {"order_id": "N-2"}).id)
        clock.advance(timedelta(hours=2))
        assert sweep().expired == 1
        deliver_notifications()
    wait = Wait.objects.get(run=run)
    assert wait.status == WaitStatus.REJECTED
    expired = Effect.objects.get(idempotency_key=f"wait:{wait.pk}:expired:1")
    assert expired.status == EffectStatus.APPLIED and expired.idempotency_key in notifiers.CountingNotifier.sent


def test_deliver__no_recipients_is_skipped_and_shown_as_such(capsys):
    mail.outbox.clear()
    with durable(NOTIFICATION_ENQUEUER=DELIVER_NOW):  # the default notifier: email, to nobody
        run = drive(api.start("refund_tool", {"amount": "80.00"}).id)
    effect = Effect.objects.get(run=run, kind="notification")
    assert effect.status == EffectStatus.SKIPPED, f"a notification to nobody must not be {effect.status}"
    assert effect.result == {"skipped": "no recipients"} and mail.outbox == []
    assert Event.objects.filter(run=run, kind="notification_skipped").exists(), "a request nobody gets is history"

    shown = next(e for e in operations.describe_run(run.id)["effects"] if e["kind"] == "notification")
    assert shown["status"] == "skipped" and shown["skipped"] == "no recipients"
    call_command("durable_show", str(run.id))
    assert "(skipped: no recipients)" in capsys.readouterr().out
    client = Client()
    client.force_login(User.objects.create_superuser("root", password="pw"))
    page = client.get(reverse("admin:durable_agents_run_change", args=[run.pk])).content.decode()
    assert "no recipients" in page, "the admin run page must say why the notification was skipped"


def test_sweep__undeliverable_notifications_do_not_starve_a_new_one():
    stuck = [park(run_input={"order_id": f"S-{i}"}) for i in range(6)]
    notifiers.CountingNotifier.failing = {wait.pk for _, wait, _ in stuck}
    effects = [effect for _, _, effect in stuck]
    with durable(NOTIFIER=COUNTING, NOTIFICATION_ENQUEUER=DELIVER_NOW, SWEEP_BATCH=3):
        for _ in range(3):  # they fail again and again, and are due again every time
            make_due(*effects)
            sweep()
        run, wait, fresh = park(run_input={"order_id": "S-new"})
        make_due(*effects)
        age(fresh)
        sweep()
    assert fresh.idempotency_key in notifiers.CountingNotifier.sent, (
        "a new notification starved behind undeliverable ones in one bounded sweep batch"
    )


# --- Real workers: a hanging webhook does not hold a step -----------------------------------------------


class HangingWebhook(socketserver.ThreadingTCPServer):
    """Accepts each request and never answers it (until closed): a receiver that hangs."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self) -> None:
        self.released = threading.Event()
        self.requests = 0
        super().__init__(("127.0.0.1", 0), self._Handler)

    class _Handler(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            self.request.recv(65536)
            self.server.requests += 1  # type: ignore[attr-defined]
            self.server.released.wait(60)  # type: ignore[attr-defined]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/hook"

    def __enter__(self) -> HangingWebhook:
        threading.Thread(target=self.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.released.set()
        self.shutdown()
        self.server_close()


def sends(log: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def test_hanging_webhook__steps_never_wait_behind_a_notification_send(start_worker, worker_env, tmp_path):
    log = tmp_path / "sends.jsonl"
    with HangingWebhook() as webhook:
        worker_env.update(
            DURABLE_TEST_SEND_LOG=str(log),
            DURABLE_NOTIFY_QUEUE="durable_notifications",
            DURABLE_TEST_SETTINGS=json.dumps(
                {
                    "NOTIFIER": "tests.testapp.notifiers.RecordingWebhookNotifier",
                    "WEBHOOK_URL": webhook.url,
                    "NOTIFY_SEND_TIMEOUT_SECONDS": 2.0,
                    "NOTIFY_BACKOFF_SECONDS": 0.2,
                    "NOTIFY_BACKOFF_MAX_SECONDS": 1.0,
                }
            ),
        )
        steps_worker = start_worker(beat=True)  # the default queue, and the sweep every 0.5 s
        notify_worker = start_worker(extra_args=["--queues", "durable_notifications"])
        parked = [api.start("approve_charge", {"order_id": f"H-{i}"}) for i in range(3)]
        for run in parked:
            wait_for_run(run.id, "waiting", timeout=60)
        wait_for(lambda: sends(log), timeout=60, what="a first notification send to time out")

        steps_pids = steps_worker.pids()

        def finished_without_a_send_in_the_steps_worker() -> Any:
            in_steps_worker = [s for s in sends(log) if s["pid"] in steps_pids]
            assert not in_steps_worker, f"the worker that runs steps sent notifications itself: {in_steps_worker}"
            return Run.objects.filter(pk=run.id, status=RunStatus.COMPLETED).first()

        run = api.start("record", {"steps": 10})
        wait_for(finished_without_a_send_in_the_steps_worker, timeout=90, what="the 10-step run to complete")
        executions = Execution.objects.filter(run_id=run.id)
        began = min(e.at for e in executions).timestamp()
        ended = max(e.at for e in executions).timestamp()
        # The notify worker sends back to back (each send hangs until the timeout): one overlapped the run.
        wait_for(
            lambda: [s for s in sends(log) if s["start"] < ended and s["end"] > began],
            timeout=15,
            what="a notification send in flight while the run's steps ran (the scenario under test)",
        )

    step_pids = set(executions.values_list("pid", flat=True))
    send_pids = {s["pid"] for s in sends(log)}
    assert executions.count() == 10 and step_pids <= steps_pids, "every step ran in the steps worker"
    assert send_pids <= notify_worker.pids(), f"sends came from {send_pids}, not only the notification worker"
    assert not step_pids & send_pids, "a worker both sent notifications and ran steps: steps waited behind sends"
    undelivered = Effect.objects.filter(kind="notification", status__in=["pending", "failed"]).count()
    assert undelivered == 3, "the three requests stay undelivered (and are retried), never marked applied"

"""Notifiers and enqueuers for the notification tests: they count, fail, hang or record on demand."""

from __future__ import annotations

import json
import os
import threading
import time

from durable_agents.notify import Notification, WebhookNotifier


class CountingNotifier:
    """Records every send; fails for the wait ids in `failing` (or all while `fail_all`); sleeps `delay`.

    State is class-level because the engine caches one notifier instance per dotted path.
    """

    needs_recipients = True
    sent: list[str] = []
    failing: set[int] = set()
    fail_all = False
    delay = 0.0
    _lock = threading.Lock()

    @classmethod
    def reset(cls) -> None:
        cls.sent, cls.failing, cls.fail_all, cls.delay = [], set(), False, 0.0

    def send(self, notification: Notification, *, idempotency_key: str) -> None:
        time.sleep(self.delay)
        if self.fail_all or notification.wait_id in self.failing:
            raise ConnectionError(f"receiver down for wait {notification.wait_id}")
        with self._lock:
            self.sent.append(idempotency_key)


class RecordingWebhookNotifier(WebhookNotifier):
    """The webhook notifier, appending (pid, key, start, end) of every send to $DURABLE_TEST_SEND_LOG."""

    def send(self, notification: Notification, *, idempotency_key: str) -> None:
        start = time.time()
        try:
            super().send(notification, idempotency_key=idempotency_key)
        finally:
            line = {"pid": os.getpid(), "key": idempotency_key, "start": start, "end": time.time()}
            with open(os.environ["DURABLE_TEST_SEND_LOG"], "a") as log:
                log.write(json.dumps(line) + "\n")


enqueued: list[int] = []


def record_only(effect_id: int) -> None:
    """A NOTIFICATION_ENQUEUER that only records: as if every message were lost."""
    enqueued.append(effect_id)


def deliver_now(effect_id: int) -> None:
    """A NOTIFICATION_ENQUEUER that delivers in this process at once, as a worker would."""
    from durable_agents.engine.outbox import deliver

    enqueued.append(effect_id)
    deliver(effect_id)

"""Notifications for humans in the loop: who is asked, reminded, warned and escalated to, and how.

The notifier is pluggable (DURABLE_AGENTS['NOTIFIER'], a dotted path): the default sends Django email;
WebhookNotifier posts JSON with an Idempotency-Key. Every send goes through the outbox (an Effect row
keyed per wait, kind and number), sent by its own task with bounded, backed-off retries
(engine/outbox.py); a notifier only sends, within NOTIFY_SEND_TIMEOUT_SECONDS, or raises.

Example::

    DURABLE_AGENTS = {"NOTIFIER": "durable_agents.notify.WebhookNotifier", "WEBHOOK_URL": "https://..."}
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from functools import cache
from typing import Protocol

from django.core.mail import get_connection, send_mail
from django.utils.module_loading import import_string

from durable_agents.conf import settings
from durable_agents.errors import NotificationFailedError


@dataclass(frozen=True)
class Notification:
    """One message about a wait: requested, reminder, warning, escalation or expired."""

    kind: str
    wait_id: int
    run_id: str
    recipients: tuple[str, ...]
    subject: str
    body: str
    link: str = ""


class Notifier(Protocol):
    """Sends one notification or raises; any exception is a failed attempt, retried with backoff.

    `send` must give up within DURABLE_AGENTS['NOTIFY_SEND_TIMEOUT_SECONDS']. A notifier that addresses
    people sets `needs_recipients = True` (the default when absent): a notification with no recipients is
    then not sent but marked `skipped`.
    """

    needs_recipients: bool

    def send(self, notification: Notification, *, idempotency_key: str) -> None: ...


class EmailNotifier:
    """Django's email backend; recipients are the wait's `notify_to` (or DURABLE_AGENTS['APPROVERS'])."""

    needs_recipients = True

    def send(self, notification: Notification, *, idempotency_key: str) -> None:
        if not notification.recipients:
            raise NotificationFailedError(f"no recipients for {notification.kind} of wait {notification.wait_id}")
        body = f"{notification.body}\n\n{notification.link}".strip()
        connection = get_connection(timeout=float(settings.NOTIFY_SEND_TIMEOUT_SECONDS))
        send_mail(notification.subject, body, None, list(notification.recipients), connection=connection)


class WebhookNotifier:
    """POSTs the notification as JSON to DURABLE_AGENTS['WEBHOOK_URL'], passing the outbox key on."""

    # The endpoint decides who hears of it (a channel, a pager): an empty recipient list is fine.
    needs_recipients = False

    def send(self, notification: Notification, *, idempotency_key: str) -> None:
        request = urllib.request.Request(
            settings.WEBHOOK_URL,
            data=json.dumps(asdict(notification)).encode(),
            method="POST",
            headers={"Content-Type": "application/json", "Idempotency-Key": idempotency_key},
        )
        try:
            with urllib.request.urlopen(request, timeout=float(settings.NOTIFY_SEND_TIMEOUT_SECONDS)):
                pass
        except (urllib.error.URLError, TimeoutError) as exc:
            raise NotificationFailedError(f"webhook notification failed: {exc}") from exc


@cache
def _notifier(path: str) -> Notifier:
    return import_string(path)()


def get_notifier() -> Notifier:
    return _notifier(settings.NOTIFIER)

"""Notifications for humans in the loop: who is asked, reminded, warned and escalated to, and how.

The notifier is pluggable (DURABLE_AGENTS['NOTIFIER'], a dotted path): the default sends Django email;
WebhookNotifier posts JSON with an Idempotency-Key. Every send goes through the outbox (an Effect row
keyed per wait, kind and number) so a crash between sending and recording never notifies twice.

Example::

    DURABLE_AGENTS = {"NOTIFIER": "durable_agents.notify.WebhookNotifier", "WEBHOOK_URL": "https://..."}
"""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from functools import cache
from typing import Protocol

from django.core.mail import send_mail
from django.utils.module_loading import import_string

from durable_agents.conf import settings
from durable_agents.errors import RetryableError

logger = logging.getLogger("durable_agents.notify")


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
    def send(self, notification: Notification, *, idempotency_key: str) -> None: ...


class EmailNotifier:
    """Django's email backend; recipients are the wait's `notify_to` (or DURABLE_AGENTS['APPROVERS'])."""

    def send(self, notification: Notification, *, idempotency_key: str) -> None:
        if not notification.recipients:
            logger.warning("no recipients for %s of wait %s", notification.kind, notification.wait_id)
            return
        body = f"{notification.body}\n\n{notification.link}".strip()
        send_mail(notification.subject, body, None, list(notification.recipients))


class WebhookNotifier:
    """POSTs the notification as JSON to DURABLE_AGENTS['WEBHOOK_URL'], passing the outbox key on."""

    def send(self, notification: Notification, *, idempotency_key: str) -> None:
        request = urllib.request.Request(
            settings.WEBHOOK_URL,
            data=json.dumps(asdict(notification)).encode(),
            method="POST",
            headers={"Content-Type": "application/json", "Idempotency-Key": idempotency_key},
        )
        try:
            with urllib.request.urlopen(request, timeout=10):
                pass
        except (urllib.error.URLError, TimeoutError) as exc:
            raise RetryableError(f"webhook notification failed: {exc}") from exc


@cache
def _notifier(path: str) -> Notifier:
    return import_string(path)()


def get_notifier() -> Notifier:
    return _notifier(settings.NOTIFIER)

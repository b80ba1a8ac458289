"""Before a worker or beat serves: Django's system checks, as `manage.py` runs them, and a refusal to start on an error.

A `celery worker` never runs `manage.py`, so nothing else stops one whose settings fail a check: it would take
messages and break the runs they carry (LEASE_SECONDS=-5 kills the lease renewer, and steps run unrenewed; a missing
durable_agents.urls leaves every approval without its notification). tasks.py calls `check_before_serving` from
Celery's worker_init and beat_init signals, before the worker takes a message or beat sends one.

Each message is one log line: its id, what is wrong, and the hint. On an Error (or Critical), the process exits with
78 (EX_CONFIG of sysexits.h: a supervisor can tell a configuration error from a crash), unless
DURABLE_AGENTS["WORKER_CHECKS"] is "warn": then it starts, and says so at ERROR. Silenced checks
(SILENCED_SYSTEM_CHECKS) are left out, as `manage.py` leaves them out; `celery --skip-checks` skips them all, as it
skips Django's, and says so. The checks are Django's and every app's (not the database ones, which would connect),
plus durable_agents' deployment checks (W003, W006): a worker is production.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from django.conf import settings as django_settings
from django.core import checks
from django.core.checks import CheckMessage

EX_CONFIG = 78
WARN = "warn"
TAG = "durable_agents"
OVERRIDE = "DURABLE_AGENTS['WORKER_CHECKS']"
SKIP_CHECKS = "CELERY_SKIP_CHECKS"

logger = logging.getLogger("durable_agents.checks")


def check_before_serving(process: str) -> None:
    """Run the system checks for `process` ("celery worker", "celery beat") as it starts: log each message in one
    line; on an error, raise SystemExit(78), unless WORKER_CHECKS is "warn".

    Example (tasks.py)::

        @worker_init.connect
        def _check(**_):
            check_before_serving("celery worker")
    """
    if os.environ.get(SKIP_CHECKS):
        # `celery --skip-checks` sets it, and Celery's Django fixup then skips the checks: asked for, as manage.py's.
        logger.warning(
            "%s skips the system checks (celery --skip-checks, %s): errors will not stop it.", process, SKIP_CHECKS
        )
        return
    messages = _messages()
    for message in messages:
        logger.log(logging.ERROR if message.is_serious() else logging.WARNING, "%s", as_line(message))
    errors = sum(message.is_serious() for message in messages)
    counted = f"{errors} system check error{'s' if errors != 1 else ''}"
    if _override_asked():
        if errors:
            logger.error(
                "%s starts despite %s (%s is %r): runs it serves may fail or stop; fix them and remove the override.",
                process,
                counted,
                OVERRIDE,
                WARN,
            )
        else:
            logger.warning("%s is %r: a system check error would not stop this %s.", OVERRIDE, WARN, process)
        return
    if errors:
        fix = f"Fix {'them' if errors > 1 else 'it'}, or set {OVERRIDE} = {WARN!r} to start anyway."
        logger.error("%s refuses to start: %s (above). %s", process, counted, fix)
        raise SystemExit(EX_CONFIG)


def as_line(message: CheckMessage) -> str:
    """A check message as one log line: `durable_agents.E003: <what is wrong> HINT: <the fix>`."""
    where = "" if message.obj is None else f"{_label(message.obj)}: "
    text = f"{message.id or logging.getLevelName(message.level)}: {where}{message.msg}"
    if message.hint:
        text += f" HINT: {message.hint}"
    return " ".join(text.split())


def _messages() -> list[CheckMessage]:
    try:
        messages = checks.run_checks()
        # A worker is production: durable_agents' deployment checks too (Django's own are about serving HTTP).
        deploy = checks.run_checks(tags=[TAG], include_deployment_checks=True)
    except Exception as exc:  # noqa: BLE001 - a check that raises: manage.py would stop on it, and so does a worker
        return [checks.Error(f"the system checks could not run: {type(exc).__name__}: {exc}")]
    messages += [message for message in deploy if message not in messages]
    return [message for message in messages if not message.is_silenced()]


def _override_asked() -> bool:
    """WORKER_CHECKS, read as it is configured: any value but "warn" (a typo included, which E003 reports) refuses."""
    configured = getattr(django_settings, "DURABLE_AGENTS", None)
    return isinstance(configured, dict) and configured.get("WORKER_CHECKS") == WARN


def _label(obj: Any) -> str:
    meta = getattr(obj, "_meta", None)
    return str(getattr(meta, "label", None) or obj)

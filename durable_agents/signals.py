"""Django signals for the lifecycle of runs, steps and waits, so projects can hook alerts and metrics.

Each is sent after the transaction that made the change commits (never for a rolled-back change). A receiver
that raises is logged and changes nothing: the change is committed, and the run goes on. Replay runs (replays.py)
send none: they replay recorded work, and a pager or a downstream hook must not take them for the system's.

Example::

    from django.dispatch import receiver
    from durable_agents.signals import run_finished

    @receiver(run_finished)
    def page_on_failure(sender, run_id, status, error, **kwargs):
        if status == "failed":
            pager.alert(f"run {run_id} failed: {error}")
"""

from __future__ import annotations

from typing import Any

from django.db import transaction
from django.dispatch import Signal

#: kwargs: run_id, step_id, attempt
step_committed = Signal()
#: kwargs: run_id, step_id, attempt, error, delay_seconds
step_retried = Signal()
#: kwargs: run_id, step_id, attempt, error
step_failed = Signal()
#: kwargs: run_id, status ("completed", "failed", "cancelled"), error, parent_id (the run that started it as a
#: child run; None for other runs)
run_finished = Signal()
#: kwargs: run_id, wait_id, kind, name
wait_opened = Signal()
#: kwargs: run_id, wait_id, status, decided_by
wait_closed = Signal()


def send_on_commit(signal: Signal, *, replay: bool = False, **kwargs: Any) -> None:
    """Send `signal` once the current transaction commits; free when nobody listens (the step loop). Nothing for a
    replay run (`replay`)."""
    if signal.has_listeners() and not replay:
        transaction.on_commit(lambda: _send(signal, kwargs))


def _send(signal: Signal, kwargs: dict[str, Any]) -> None:
    """Send to every receiver, whatever one raises (Django logs it on `django.dispatch`): a pager that is down
    must not fail the run whose step just committed (the engine would take the error for its own, after the
    commit), nor keep its wake-up unsent."""
    signal.send_robust(sender=None, **kwargs)

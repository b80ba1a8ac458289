"""The words the console shows for a wait's status: one helper the run page, the waits list and the wait's
page share, so no two rows of the console name one state differently.

The engine closes every wait it is done with as `approved` (a decision, a signal, a timer, a met join); to a
reader only an approval is approved: a join is `joined`, a signal `received`, a timer `fired`.
"""

from __future__ import annotations

from typing import Any

from durable_agents.models import Run, Wait, WaitKind, WaitStatus

CLOSED_WORDS = {WaitKind.CHILDREN: "joined", WaitKind.SIGNAL: "received", WaitKind.TIMER: "fired"}
# Badge colours, by the word shown: the same classes as run statuses.
BADGES = {"open": "waiting", "rejected": "failed", "expired": "failed", "cancelled": "cancelled"}


def wait_status_text(wait: Wait, run: Run | None = None) -> str:
    """The wait's status as the console says it: `joined` for a met join, `cancelled with its run` for a
    wait left open by a finished run (pass the run when it is at hand; `wait.run` is read otherwise)."""
    run = run if run is not None else wait.run
    if wait.status == WaitStatus.OPEN and run.is_finished:
        return f"{run.status} with its run"
    if wait.status == WaitStatus.APPROVED:
        return CLOSED_WORDS.get(wait.kind, WaitStatus.APPROVED.value)
    return str(wait.status)


def wait_badge(text: str, wait: Wait | None = None) -> str:
    """The badge class for a status as `wait_status_text` says it; a join some child failed in is no green one."""
    decision: Any = wait.decision if wait is not None else None
    if wait is not None and wait.kind == WaitKind.CHILDREN and isinstance(decision, dict) and decision.get("failed"):
        return "failed"
    return BADGES.get(text, "done" if text in ("approved", *CLOSED_WORDS.values()) else "cancelled")


def join_outcome(wait: Wait) -> str:
    """What a closed join's children came to, e.g. `children finished: 3 completed, 1 failed` ("" otherwise)."""
    decision: Any = wait.decision
    if wait.kind != WaitKind.CHILDREN or wait.is_open or not isinstance(decision, dict):
        return ""
    counts = [f"{decision[k]} {k}" for k in ("completed", "failed", "active") if decision.get(k)]
    return f"children finished: {', '.join(counts) or 'none'}"

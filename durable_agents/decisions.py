"""What a decider is told when the request they saw is no longer open (who closed it, when, and what now), and
when a request is asked again because its run re-planned after it was approved.

Every decision surface (the run page's form, the waits queue, a signed link) decides exactly the wait it
showed. When that wait closed in the meantime nothing is decided, and the decider reads why — and, if
the run has since opened another request, which one, so a "yes" given to one question is never taken
as the answer to the next. Reads only; deciding goes through `durable_agents.api`.

Example::

    try:
        api.decide(wait.pk, True, by=user, via="admin")
    except api.WaitClosedError:
        messages.error(request, describe_closed(wait))
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.utils.text import Truncator

from durable_agents import clock
from durable_agents.display import human_duration, when_text
from durable_agents.engine.plans import StaleObservation, find_stale
from durable_agents.models import Event, Step, StepStatus, Wait, WaitKind, WaitStatus

QUESTION_CHARS = 120


def wait_label(wait: Wait) -> str:
    """`wait 12 ("Refund 5000.00 to A-1002?")`: the id and what it asks, short enough for a message."""
    asks = Truncator(wait.question or wait.name or wait.kind).chars(QUESTION_CHARS)
    return f'wait {wait.pk} ("{asks}")'


def describe_closed(wait: Wait) -> str:
    """Why `wait` cannot be decided now, naming the request its run waits on instead, if any."""
    wait.refresh_from_db(fields=["status", "decided_by", "decided_at"])
    sentence = f"This request, {wait_label(wait)}, is already {wait.status}"
    if wait.decided_by:
        sentence += f" by {wait.decided_by}"
    if wait.decided_at:
        sentence += f" at {when_text(wait.decided_at)}"
    sentence += "; nothing was decided."
    current = (
        Wait.objects.open()
        .filter(run_id=wait.run_id)
        .exclude(pk=wait.pk)
        .only("id", "run_id", "kind", "name", "question")
        .first()
    )
    if current is not None:
        sentence += (
            f" Run {str(wait.run_id)[:8]} now waits on another request, {wait_label(current)}; "
            "read its brief and decide it on its own."
        )
    return sentence


@dataclass(frozen=True)
class AskedAgain:
    """An approval given, then asked again: before the approved step ran, an observation it depends on went
    stale, and the run went back, re-read it and asked the same question (`engine/plans.replan_txn`)."""

    earlier: Wait
    later: Wait
    observation: str
    fresh_for: timedelta | None
    step: str  # the approved step, which had not run

    @property
    def stale(self) -> str:
        budget = f" (fresh for {_duration(self.fresh_for)})" if self.fresh_for else ""
        return f"{self.observation}{budget} went stale before {self.step} ran"

    @property
    def why(self) -> str:
        """Said of the later request: `Asked again: approved by alice at …, but fetch_order (fresh for 5 min)
        went stale before issue_refund ran; the run re-read it and asks again.`"""
        asks = "asks again" if self.later.is_open else "asked again"
        return (
            f"Asked again: approved by {self.earlier.decided_by or 'someone'} at {when_text(self.earlier.decided_at)},"
            f" but {self.stale}; the run re-read it and {asks}."
        )

    @property
    def replaced(self) -> str:
        """Said of the earlier request, whose approval the re-plan set aside."""
        return f"Approved, but {self.stale}: the run re-read it and asked again as wait {self.later.pk}."


def asked_again(waits: Iterable[Wait], *, runs: Iterable[Any] = ()) -> dict[int, AskedAgain]:
    """By wait id, each approval of `waits` (or of `runs`) asked again after a re-plan set its run's earlier
    approval aside, and each earlier approval so set aside. Derived from the history (the `replanned` event,
    the superseded step the earlier wait was bound to): three queries however many waits, none without any."""
    run_ids = {*runs, *(w.run_id for w in waits if w.kind == WaitKind.APPROVAL)}
    if not run_ids:
        return {}
    approvals = list(
        Wait.objects.filter(run_id__in=run_ids, kind=WaitKind.APPROVAL)
        .select_related("step")
        .only("id", "run_id", "kind", "name", "status", "decided_by", "decided_at", "step__step_id", "step__status")
        .order_by("id")
    )
    history = list(Event.objects.filter(run_id__in=run_ids, kind__in=("wait_decided", "replanned")).order_by("id"))
    observations = Step.objects.filter(run_id__in=run_ids, fresh_for__isnull=False)
    budgets = {
        (run_id, step_id): fresh_for
        for run_id, step_id, fresh_for in observations.values_list("run_id", "step_id", "fresh_for")
    }
    # By run: each approval is compared with its own run's history only (a long history stays linear).
    approvals_of: dict[Any, list[Wait]] = defaultdict(list)
    for wait in approvals:
        approvals_of[wait.run_id].append(wait)
    history_of: dict[Any, list[Event]] = defaultdict(list)
    for event in history:
        history_of[event.run_id].append(event)
    found: dict[int, AskedAgain] = {}
    for earlier in approvals:
        if earlier.status != WaitStatus.APPROVED or earlier.step is None:
            continue
        if earlier.step.status != StepStatus.SUPERSEDED:
            continue
        replan = _replan_after(earlier, history_of[earlier.run_id])
        later = next(
            (
                w
                for w in approvals_of[earlier.run_id]
                if w.pk > earlier.pk
                and w.name == earlier.name
                and w.step is not None
                and w.step.step_id == earlier.step.step_id
            ),
            None,
        )
        if replan is None or later is None:
            continue
        named = _detail(replan).get("observation")
        observation = named if isinstance(named, str) and named else "an observation"
        budget = budgets.get((earlier.run_id, observation))
        again = AskedAgain(earlier, later, observation, budget, earlier.step.step_id)
        found[earlier.pk] = found[later.pk] = again
    return found


def stale_before_approved(wait: Wait) -> StaleObservation | None:
    """The observation an open approval's step depends on that has already gone stale: approved now, the step
    would not run; the run re-reads it and asks again."""
    step = wait.step
    if wait.kind != WaitKind.APPROVAL or step is None or not step.depends_on:
        return None
    return find_stale(wait.run_id, list(step.depends_on), clock.now())


def stale_text(stale: StaleObservation) -> str:
    """`observe (fresh for 10 min) has gone stale`."""
    return f"{stale.step_id} (fresh for {_duration(timedelta(seconds=stale.budget_seconds))}) has gone stale"


def _replan_after(earlier: Wait, history: list[Event]) -> Event | None:
    """The first re-plan after `earlier` was decided that superseded its step."""
    decided = next((e.pk for e in history if e.kind == "wait_decided" and _detail(e).get("wait") == earlier.pk), None)
    step_id = earlier.step.step_id if earlier.step is not None else ""
    return next(
        (
            e
            for e in history
            if e.kind == "replanned"
            and e.run_id == earlier.run_id
            and (decided is None or e.pk > decided)
            and (e.step_id == step_id or step_id in _step_ids(_detail(e).get("superseded")))
        ),
        None,
    )


def _step_ids(value: Any) -> list[str]:
    """The step ids a re-plan event lists, [] for any other shape (events outlive the code that wrote them)."""
    return [item for item in value if isinstance(item, str)] if isinstance(value, list) else []


def _detail(event: Event) -> dict[str, Any]:
    return event.detail if isinstance(event.detail, dict) else {}


def _duration(value: timedelta) -> str:
    """`10 min`, `90 s`, `2h`: a freshness budget as an approver reads it."""
    seconds = value.total_seconds()
    if seconds >= 60 and seconds % 60 == 0 and seconds < 3600:
        return f"{int(seconds // 60)} min"
    return human_duration(seconds)

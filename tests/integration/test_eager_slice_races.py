"""Eager continuation (a worker running a run's steps in one slice): a raising signal receiver neither fails
the run nor loses a wake-up, the slice's bounds run every step once, a duplicate delivery, cancel or rerun arriving
right after a commit is handled, and a worker frozen mid-slice commits nothing once it was taken over.

In-process tests use a recording WAKER and transactional databases (signals are sent on commit); worker tests run
real `celery worker` processes (tests/integration/test_eager.py's helpers).
"""

from __future__ import annotations

import signal
from collections import Counter

import pytest
from django.conf import settings
from django.test.utils import override_settings

from durable_agents import api
from durable_agents.engine.advance import Outcome, advance, advance_slice
from durable_agents.models import Event, Run, RunStatus, Step, StepStatus
from durable_agents.signals import run_finished, step_committed
from durable_agents.testing import wait_for, wait_for_run
from tests.integration.test_eager import _assert_once_each_under_increasing_tokens, _worker
from tests.testapp.models import Execution

ON = {"EAGER_SLICE_MS": 600_000.0, "EAGER_MAX_STEPS": 50}
OFF = {"EAGER_SLICE_MS": 0.0}
MODES = pytest.mark.parametrize("mode", [ON, OFF], ids=["slice_on", "slice_off"])
woken: list[str] = []


def record_wake(run_id: str, countdown: float | None = None, **routed: str) -> None:
    """A WAKER that only records what the engine asked for."""
    woken.append(str(run_id))


def _in_process(**changes: object):
    woken.clear()
    return override_settings(DURABLE_AGENTS={**settings.DURABLE_AGENTS, "WAKER": f"{__name__}.record_wake", **changes})


# --- signals: a receiver that raises ----------------------------------------------------------------------------


class PagerDown(Exception):
    pass


@pytest.fixture
def receivers():
    """A step_committed and a run_finished receiver that raise, then one of each that counts."""
    sent: Counter[tuple[str, str]] = Counter()

    def fail(**_: object) -> None:
        raise PagerDown("the pager is down")

    def count_step(step_id: str, **_: object) -> None:
        sent["step_committed", step_id] += 1

    def count_run(status: str, **_: object) -> None:
        sent["run_finished", status] += 1

    connected = [(step_committed, fail), (run_finished, fail), (step_committed, count_step), (run_finished, count_run)]
    for n, (sent_by, receiver) in enumerate(connected):
        sent_by.connect(receiver, weak=False, dispatch_uid=f"eager-slice-{n}")
    yield sent
    for n, (sent_by, _) in enumerate(connected):
        sent_by.disconnect(dispatch_uid=f"eager-slice-{n}")


@pytest.mark.django_db(transaction=True)
@MODES
def test_signals__a_receiver_that_raises_neither_fails_the_run_nor_loses_a_wake_up(receivers, mode):
    run = api.start("noop", {"steps": 3})
    with _in_process(**mode):
        outcomes = [advance_slice(run.id)]
        while outcomes[-1] == Outcome.COMMITTED:
            assert woken.pop() == str(run.id), "a committed step's run was left without a wake-up"
            outcomes.append(advance_slice(run.id))
    run = Run.objects.get(pk=run.id)
    assert run.status == RunStatus.COMPLETED, f"{outcomes}: a receiver's error became the run's"
    assert set(Step.objects.filter(run_id=run.id).values_list("status", flat=True)) == {StepStatus.DONE}
    kinds = set(Event.objects.filter(run_id=run.id).values_list("kind", flat=True))
    assert not kinds & {"failed", "zombie_commit_rejected"}, f"the operator is told a lie: {kinds}"
    assert receivers == {**{("step_committed", f"tick-{i}"): 1 for i in (1, 2, 3)}, ("run_finished", "completed"): 1}
    assert len(outcomes) == (1 if mode is ON else 3)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("bounds", "steps_in_task", "wakes"),
    [
        ({"EAGER_SLICE_MS": 1e9, "EAGER_MAX_STEPS": 10**9}, 5, 0),  # the largest the settings accept
        ({"EAGER_SLICE_MS": 1e-9, "EAGER_MAX_STEPS": 10**9}, 1, 1),  # a slice over before its first commit
        ({"EAGER_SLICE_MS": 1e9, "EAGER_MAX_STEPS": 1}, 2, 1),
    ],
    ids=["largest", "tiniest_slice", "one_more_step"],
)
def test_bounds__the_slice_settings_at_their_limits_run_every_step_once_and_wake_what_they_leave(
    receivers, bounds, steps_in_task, wakes
):
    run = api.start("noop", {"steps": 5})
    with _in_process(**bounds):
        advance_slice(run.id)
        assert Run.objects.get(pk=run.id).cursor == steps_in_task
        assert len(woken) == wakes
        while Run.objects.get(pk=run.id).status == RunStatus.RUNNING:
            advance_slice(run.id)
    assert Run.objects.get(pk=run.id).status == RunStatus.COMPLETED
    assert sum(n for (signal_name, _), n in receivers.items() if signal_name == "step_committed") == 5
    assert receivers["run_finished", "completed"] == 1


# --- the gap between a slice's commit and its next claim ---------------------------------------------------------
# A step_committed receiver runs exactly there (after the commit, before hand_on and the next claim): whatever an
# operator, a duplicate delivery or the sweep can do in that gap, it does here, deterministically.


def _in_the_gap(after_step: str, act):
    done: list[bool] = []

    def receiver(step_id: str, run_id, **_: object) -> None:
        if step_id == after_step and not done:
            done.append(True)
            act(run_id)

    step_committed.connect(receiver, weak=False, dispatch_uid="eager-slice-gap")
    return receiver


def _live(run_id) -> list[tuple[str, str]]:
    return list(Step.objects.live().filter(run_id=run_id).order_by("position").values_list("step_id", "status"))


@pytest.mark.django_db(transaction=True)
def test_gap__a_duplicate_delivery_right_after_a_commit_steps_aside_for_the_slice():
    run = api.start("noop", {"steps": 4})
    outcomes = []
    _in_the_gap("tick-1", lambda run_id: outcomes.append(advance(run_id)))
    try:
        with _in_process(**ON):
            outcomes.append(advance_slice(run.id))
    finally:
        step_committed.disconnect(dispatch_uid="eager-slice-gap")
    # Commit and next claim are one statement: when tick-1's signal fires the slice already holds tick-2, so the
    # duplicate steps aside and the slice runs the rest.
    assert outcomes == [Outcome.SKIPPED, Outcome.COMPLETED], "the slice held tick-2; the duplicate stepped aside"
    assert Run.objects.get(pk=run.id).status == RunStatus.COMPLETED
    assert _live(run.id) == [(f"tick-{i}", StepStatus.DONE) for i in range(1, 5)]
    assert Step.objects.filter(run_id=run.id).count() == 4, "no step was run twice"


@pytest.mark.django_db(transaction=True)
def test_gap__a_cancel_right_after_a_commit_lets_the_claimed_step_finish_then_stops_the_slice():
    run = api.start("noop", {"steps": 4})
    _in_the_gap("tick-2", lambda run_id: api.cancel(run_id, "enough", actor="op"))
    try:
        with _in_process(**ON):
            advance_slice(run.id)
    finally:
        step_committed.disconnect(dispatch_uid="eager-slice-gap")
    assert Run.objects.get(pk=run.id).status == RunStatus.CANCELLED
    # tick-3 was claimed with tick-2's commit: the cancel is requested of a held run, tick-3 finishes and is
    # checkpointed (no claim follows a requested cancel), then the run stops.
    assert [status for _, status in _live(run.id)] == ["done", "done", "done", "pending"]
    assert woken == [], "nothing is left to wake"


@pytest.mark.django_db(transaction=True)
def test_gap__a_rerun_right_after_a_commit_is_refused_while_the_slice_holds_the_run():
    run = api.start("noop", {"steps": 3})
    refused: list[Exception] = []

    def rerun(run_id) -> None:
        try:
            api.resume(run_id, from_step="tick-1", actor="op")
        except api.DurableAgentsError as exc:
            refused.append(exc)

    _in_the_gap("tick-2", rerun)
    try:
        with _in_process(**ON):
            assert advance_slice(run.id) == Outcome.COMPLETED
    finally:
        step_committed.disconnect(dispatch_uid="eager-slice-gap")
    # tick-3 was claimed with tick-2's commit: an operator's rerun of a held run is refused, not half-applied.
    assert len(refused) == 1, "the rerun is refused while a worker holds the run"
    assert _live(run.id) == [(f"tick-{i}", StepStatus.DONE) for i in range(1, 4)]
    assert not Step.objects.filter(run_id=run.id, status=StepStatus.SUPERSEDED).exists(), "nothing was re-planned"


# --- a worker frozen mid-slice ----------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_sigstop__a_worker_frozen_mid_slice_and_thawed_after_a_takeover_commits_nothing_it_ran_before(start_worker):
    """What the thawed worker may still do: finish the step body it was in (a plain step is at-least-once), then
    fail to commit it (its token is stale), and end its slice; or, frozen between a commit and its next claim,
    make that claim, which finds the run held (and ends the slice) or free (and is a fresh claim like any
    delivery's). It never commits a step it ran before another worker took the run."""
    steps = 30
    frozen = _worker(start_worker, {**ON, "EAGER_MAX_STEPS": 1000})
    run = api.start("eager", {"steps": steps, "sleep_ms": [150, 250]})
    wait_for(lambda: Execution.objects.filter(run_id=run.id).count() >= 4, timeout=60, what="four steps")
    frozen.signal(signal.SIGSTOP)
    try:
        done_at_freeze = Step.objects.filter(run_id=run.id, status=StepStatus.DONE).count()
        successor = _worker(start_worker, {**ON, "EAGER_MAX_STEPS": 1000}, beat=True)
        wait_for(
            lambda: Step.objects.filter(run_id=run.id, status=StepStatus.DONE).count() >= done_at_freeze + 3,
            timeout=60,
            what="the successor to take over and commit three steps",
        )
    finally:
        frozen.signal(signal.SIGCONT)
    wait_for_run(run.id, "completed", timeout=120)
    results = _assert_once_each_under_increasing_tokens(run.id, steps)
    frozen_pids = frozen.pids()
    twice = {step_id: pids for step_id, pids in _executions_by_step(run.id).items() if len(pids) > 1}
    assert len(twice) <= 1, f"only the step the worker was frozen in may run again: {twice}"
    for step_id, pids in twice.items():
        committed = Step.objects.get(run_id=run.id, step_id=step_id).result
        assert pids[0] in frozen_pids and committed["pid"] not in frozen_pids, f"{step_id}: a stale attempt committed"
    assert len(results) == steps
    for rejected in Event.objects.filter(run_id=run.id, kind="zombie_commit_rejected"):
        assert frozen.owns(rejected.detail["owner"]) and rejected.detail["current_token"] > rejected.detail["token"]
    assert any(r["pid"] in successor.pids() for r in results), "the successor took the run over"


def _executions_by_step(run_id) -> dict[str, list[int]]:
    by_step: dict[str, list[int]] = {}
    for step_id, pid in Execution.objects.filter(run_id=run_id).order_by("id").values_list("step_id", "pid"):
        by_step.setdefault(step_id, []).append(pid)
    return by_step

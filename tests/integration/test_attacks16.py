"""Attacks on what iteration 16 landed: eager continuation, the run page's truth, the run list.

In-process tests use a recording WAKER and transactional databases (signals are sent on commit); worker tests run
real `celery worker` processes (tests/integration/test_eager.py's helpers).
"""

from __future__ import annotations

from collections import Counter

import pytest
from django.conf import settings
from django.test.utils import override_settings

from durable_agents import api
from durable_agents.engine.advance import Outcome, advance_slice
from durable_agents.models import Event, Run, RunStatus, Step, StepStatus
from durable_agents.signals import run_finished, step_committed

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
    for n, (signal, receiver) in enumerate(connected):
        signal.connect(receiver, dispatch_uid=f"attacks16-{n}")
    yield sent
    for n, (signal, _) in enumerate(connected):
        signal.disconnect(dispatch_uid=f"attacks16-{n}")


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

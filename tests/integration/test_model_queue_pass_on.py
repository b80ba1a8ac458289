"""Routing between QUEUE and MODEL_QUEUE: a configuration the checks pass never leaves runs unable to progress.
A step message is passed on to the model queue only when another worker serves it, a worker serving both queues
finishes the run, and the sweep re-wakes a lost model step on MODEL_QUEUE and a plain one on QUEUE.
"""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.conf import settings
from django.test import override_settings

from durable_agents import api, clock, tasks
from durable_agents.engine.sweep import sweep
from durable_agents.models import StepStatus
from durable_agents.testing import wait_for_run

SAME = "durable-same"
woken: list[tuple[str, dict]] = []


def record_wake(run_id: str, countdown: float | None = None, **routed: str) -> None:
    """A WAKER that only records: what the engine asked for, without a broker."""
    woken.append((run_id, routed))


def _durable(**changes: object) -> dict:
    return {**settings.DURABLE_AGENTS, **changes}


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("queue", "model_queue", "delivered_on"),
    [
        (SAME, SAME, SAME),  # one queue for every durable message, "the model steps too"
        ("", "celery", "celery"),  # the model queue named after Celery's default queue
    ],
)
def test_pass_on__a_model_queue_that_is_also_the_default_queue_runs_the_step_instead_of_passing_it_on(
    queue, model_queue, delivered_on
):
    """A plain step's message on MODEL_QUEUE is passed on to QUEUE (or Celery's default queue); when those are the
    same queue, passing it on puts it back where it came from, for ever: the step never runs."""
    woken.clear()
    durable = _durable(QUEUE=queue, MODEL_QUEUE=model_queue, WAKER=f"{__name__}.record_wake")
    with override_settings(DURABLE_AGENTS=durable):
        run = api.start("noop", {"steps": 1})
        woken.clear()
        done = tasks._advance_or_pass_on(str(run.id), delivered_on)
    assert done != "passed on", (
        f"with QUEUE={queue!r} and MODEL_QUEUE={model_queue!r} the plain step's message was passed on to the queue "
        f"it came from ({woken}): it circles between the worker and the broker and the step never runs"
    )
    assert api.get(run.id).steps.filter(status=StepStatus.DONE).count() == 1


@pytest.mark.django_db(transaction=True)
def test_pass_on__a_worker_serving_one_queue_that_is_queue_and_model_queue_finishes_the_run(start_worker):
    """The same hole on a real worker: QUEUE and MODEL_QUEUE both name the one queue the worker serves."""
    same = {"QUEUE": SAME, "MODEL_QUEUE": SAME}
    with override_settings(DURABLE_AGENTS=_durable(**same)):
        start_worker(env={"DURABLE_TEST_SETTINGS": json.dumps(same)}, extra_args=["--queues", SAME])
        run = api.start("noop", {"steps": 3})
        wait_for_run(run.id, "completed", timeout=30)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("queue", ["", "durable-own"])
def test_pass_on__a_plain_steps_message_on_a_model_queue_of_its_own_is_still_passed_on(queue):
    """What held: with MODEL_QUEUE a queue of its own, a plain step's stale message there goes to the default queue
    (the wake-up carries no queue: the waker sends it to QUEUE, else Celery's default)."""
    woken.clear()
    durable = _durable(QUEUE=queue, MODEL_QUEUE="durable-model", WAKER=f"{__name__}.record_wake")
    with override_settings(DURABLE_AGENTS=durable):
        run = api.start("noop", {"steps": 1})
        woken.clear()
        done = tasks._advance_or_pass_on(str(run.id), "durable-model")
    assert done == "passed on", "a plain step must not run on the model worker's gevent pool"
    assert woken == [(str(run.id), {})], f"the message should go to the default queue, not {woken}"


@pytest.mark.django_db(transaction=True)
def test_sweep__re_wakes_a_lost_model_step_on_the_model_queue_and_a_plain_one_on_queue():
    """What held: the sweep asks the waker for MODEL_QUEUE when the lost run's next step waits on the model, and for
    no queue otherwise (tasks.wake then sends it to QUEUE)."""
    durable = _durable(QUEUE="durable", MODEL_QUEUE="durable-model", WAKER=f"{__name__}.record_wake")
    with override_settings(DURABLE_AGENTS=durable):
        model = api.start("agent_charge", {"message": "charge order 7"})
        plain = api.start("noop", {"steps": 1})
        woken.clear()
        clock.advance(timedelta(minutes=5))  # both messages lost: no progress for longer than IDLE_RESWEEP_SECONDS
        try:
            sweep()
        finally:
            clock.reset()
    assert sorted(woken) == sorted([(str(model.id), {"queue": "durable-model"}), (str(plain.id), {})]), woken

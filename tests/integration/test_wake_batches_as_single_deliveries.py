"""Batched wake-ups (engine/wake.py wake_on_commit, _WakeBatch; tasks.advance_many) behave as deliveries of
single runs.

A batch is only a delivery of several runs. Whatever Django does with a run's own on-commit hook — the order among
the transaction's other hooks, a savepoint's rollback, TestCase.captureOnCommitCallbacks — it does to the run's place
in a batch; whatever a message does to a lone run, a batch does to each of its runs.
"""

from __future__ import annotations

import pytest
from django.conf import settings
from django.db import transaction
from django.test.utils import override_settings

from durable_agents import api, tasks
from durable_agents.models import Run, RunStatus
from tests.integration.conftest import MODEL_QUEUE

order: list[object] = []


def record_wake(run_id: str, countdown: float | None = None, **routed: str) -> None:
    order.append(str(run_id))


def record_batch(run_ids: list[str], **routed: str) -> None:
    order.append(list(run_ids))


RECORDING = {"WAKER": f"{__name__}.record_wake", "BATCH_WAKER": f"{__name__}.record_batch", "WAKE_BATCH_SIZE": 25}


def _in_process(**changes: object):
    order.clear()
    return override_settings(DURABLE_AGENTS={**settings.DURABLE_AGENTS, **RECORDING, **changes})


def _start() -> str:
    return str(api.start("noop", {"steps": 1}).id)


def _ids(item: object) -> list[str]:
    """The runs of one wake-up recorded in `order` (a batch's list, a lone run's id; none for a product's hook)."""
    if isinstance(item, list):
        return item
    return [item] if isinstance(item, str) and len(item) == 36 else []


def _sent() -> list[str]:
    return [run_id for item in order for run_id in _ids(item)]


# --- the order of on-commit hooks ----------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_a_hook_registered_between_two_wakes_runs_between_them():
    """Django runs on-commit hooks in the order they were registered: a run woken after another hook is woken after
    it, as its own hook would be (a product's hook may publish what the run's first step reads)."""
    with _in_process(), transaction.atomic():
        first = _start()
        transaction.on_commit(lambda: order.append("product hook"))
        second = _start()
    flat = [entry for item in order for entry in (item if isinstance(item, list) else [item])]
    assert flat.index(first) < flat.index("product hook") < flat.index(second), order


# --- TestCase.captureOnCommitCallbacks -----------------------------------------------------------------------------


@pytest.mark.django_db
def test_a_run_woken_inside_a_capture_block_is_captured_after_one_woken_before_it(django_capture_on_commit_callbacks):
    with _in_process():
        _start()  # its wake-up waits for a commit that never comes
        with django_capture_on_commit_callbacks(execute=True) as callbacks:
            inside = _start()
        assert callbacks, "the wake-up registered inside the block was not captured"
        assert _sent() == [inside], "the block's run is sent; the one before it waits for a commit that never comes"


@pytest.mark.django_db
def test_a_second_capture_block_captures_its_own_runs(django_capture_on_commit_callbacks):
    with _in_process():
        with django_capture_on_commit_callbacks(execute=True):
            first = [_start(), _start()]
        with django_capture_on_commit_callbacks(execute=True) as callbacks:
            second = [_start(), _start()]
        assert callbacks, "the second block's wake-ups were added to the first block's, already executed, batch"
    assert sorted(_sent()) == sorted(first + second), order


@pytest.mark.django_db(transaction=True)
def test_a_run_started_by_an_on_commit_hook_inside_an_atomic_block_is_woken():
    """Re-entrancy: a hook (run after the batch's own) opens a transaction and starts runs; they are woken."""
    started: list[str] = []

    def start_more() -> None:
        with transaction.atomic():
            started.extend([_start(), _start()])

    with _in_process(), transaction.atomic():
        first = [_start(), _start()]
        transaction.on_commit(start_more)
    assert sorted(_sent()) == sorted(first + started), order


# --- advance_many ---------------------------------------------------------------------------------------------------


def refuse_wake(run_id: str, countdown: float | None = None, **routed: str) -> None:
    raise ConnectionError("the broker is down")


def refuse_batch(run_ids: list[str], **routed: str) -> None:
    raise ConnectionError("the broker is down")


@pytest.mark.django_db(transaction=True)
def test_a_spent_slice_the_broker_refuses_to_pass_on_advances_the_rest_itself(caplog):
    """A delivered message advances its run: a batch whose slice is spent and whose pass-on the broker refuses
    advances the rest itself (one step each), rather than acknowledge runs nobody woke (left for the sweep)."""
    with _in_process(), transaction.atomic():
        ids = [str(api.start("eager", {"steps": 1, "sleep_ms": [20, 20]}).id) for _ in range(3)]
    refused = {"WAKER": f"{__name__}.refuse_wake", "BATCH_WAKER": f"{__name__}.refuse_batch", "EAGER_SLICE_MS": 1.0}
    with _in_process(**refused):
        tasks.advance_many.run(ids)
    assert caplog.text.count("could not wake run") == 2, "the slice was not spent: lengthen the steps"
    statuses = dict(Run.objects.filter(pk__in=ids).values_list("id", "status"))
    assert sorted(statuses.values()) == [RunStatus.COMPLETED] * 3, statuses


@pytest.mark.django_db(transaction=True)
def test_a_run_whose_advance_raises_mid_batch_fails_the_task_once_the_runs_after_it_have_their_message(monkeypatch):
    """A run whose advance raises in a batch does what it does alone (the task fails); the runs before it were
    advanced and those after it are passed on, never dropped with it."""
    with _in_process(), transaction.atomic():
        ids = [_start() for _ in range(4)]
    advance_slice = tasks.engine_advance.advance_slice

    def raising_for_the_second(run_id, **kwargs):
        if str(run_id) == ids[1]:
            raise RuntimeError("the database said no")
        return advance_slice(run_id, **kwargs)

    monkeypatch.setattr(tasks.engine_advance, "advance_slice", raising_for_the_second)
    with _in_process(), pytest.raises(RuntimeError):
        tasks.advance_many.run(ids)
    assert Run.objects.get(pk=ids[0]).status == RunStatus.COMPLETED
    assert order == [[ids[2], ids[3]]], "the runs after the raising one were not passed on"


# --- a batch never makes its runs wait on each other's slow steps ----------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_model_bound_runs_woken_together_each_get_a_message_of_their_own():
    """A model-bound step spends any slice waiting on the model: in one message, a batch's runs would wait on the
    model one after another (run n after n - 1 calls), where the model queue's pool waits on them all at once."""
    with _in_process(MODEL_QUEUE=MODEL_QUEUE), transaction.atomic():
        plain = [str(api.start("eager", {"steps": 1}).id) for _ in range(2)]
        model_bound = [str(api.start("approve_briefed", {}).id) for _ in range(2)]
    assert [item for item in order if isinstance(item, list)] == [plain], "plain runs still go out together"
    assert [item for item in order if isinstance(item, str)] == model_bound

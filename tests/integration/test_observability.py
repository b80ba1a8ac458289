"""Lifecycle signals fire after commit, and engine log lines carry run id, step id and attempt."""

from __future__ import annotations

import json
import logging

import pytest

from durable_agents import api
from durable_agents.logs import JsonFormatter
from durable_agents.signals import run_finished, step_committed, step_failed, wait_closed, wait_opened
from durable_agents.testing import drive

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def received():
    seen: list[tuple[str, dict]] = []
    handlers = {}
    for name, signal in {
        "run_finished": run_finished,
        "step_committed": step_committed,
        "step_failed": step_failed,
        "wait_opened": wait_opened,
        "wait_closed": wait_closed,
    }.items():

        def handler(sender, signal_name=name, **kwargs):
            seen.append((signal_name, {k: v for k, v in kwargs.items() if k != "signal"}))

        handlers[name] = handler
        signal.connect(handler, weak=False)
    yield seen
    for name, signal in {
        "run_finished": run_finished,
        "step_committed": step_committed,
        "step_failed": step_failed,
        "wait_opened": wait_opened,
        "wait_closed": wait_closed,
    }.items():
        signal.disconnect(handlers[name])


def test_signals__run_and_step_lifecycle(received):
    run = drive(api.start("noop", {"steps": 2}).id)
    assert [name for name, _ in received] == ["step_committed", "step_committed", "run_finished"]
    assert received[-1][1] == {"run_id": run.id, "status": "completed", "error": None, "parent_id": None}


def test_signals__failure_and_waits(received):
    failed = drive(api.start("broken").id)
    finished = {"run_id": failed.id, "status": "failed", "error": failed.error, "parent_id": None}
    assert ("run_finished", finished) in received
    assert any(name == "step_failed" and kw["step_id"] == "broken" for name, kw in received)

    waiting = drive(api.start("approve_charge", {"order_id": "O-1"}).id)
    wait = waiting.waits.get()
    api.decide(wait.pk, True, by="amy")
    names = [name for name, _ in received]
    assert names.count("wait_opened") == 1 and names.count("wait_closed") == 1


def test_logs__engine_lines_carry_run_step_and_attempt(caplog):
    caplog.set_level(logging.INFO, logger="durable_agents")
    run = drive(api.start("broken").id)
    errors = [r for r in caplog.records if r.name == "durable_agents.engine" and "step error" in r.getMessage()]
    assert errors, "a failing step logs a warning"
    record = errors[0]
    assert (record.run_id, record.step_id, record.attempt) == (str(run.id), "broken", 1)
    assert record.getMessage().startswith(f"run_id={run.id} step_id=broken attempt=1 ")
    rendered = json.loads(JsonFormatter().format(record))
    assert rendered["run_id"] == str(run.id) and rendered["step_id"] == "broken" and rendered["level"] == "WARNING"
    events = [r for r in caplog.records if r.name == "durable_agents.events" and getattr(r, "event", "") == "failed"]
    assert events and events[0].run_id == str(run.id)

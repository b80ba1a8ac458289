"""The run page tells the truth about a stuck run (issue 16): the step a worker executes shows as running with
its worker and lease, the timeline draws every attempt (the killed ones too) and the stuck stretch, and a
retried step keeps its failures.

A worker SIGKILLed mid-step is simulated as the engine sees it: a claim through the engine (`take_lease`, the
claim statement a worker runs) whose lease then runs out on the engine's clock (`clock.advance`).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from durable_agents import api, clock
from durable_agents.engine.advance import Outcome, advance
from durable_agents.engine.heartbeats import record_beat
from durable_agents.engine.lease import name_this_worker
from durable_agents.engine.sweep import sweep
from durable_agents.models import (
    Effect,
    EffectStatus,
    Event,
    ProcessHeartbeat,
    Run,
    RunStatus,
    Step,
    StepStatus,
    Wait,
    WaitStatus,
)
from durable_agents.testing import drive
from durable_agents.testing.runs import take_lease
from tests.integration.test_admin import login

pytestmark = pytest.mark.django_db

DEAD_FOR = timedelta(minutes=9)


@pytest.fixture(autouse=True)
def _engine_clock():
    clock.reset()
    yield
    clock.reset()


@pytest.fixture
def operator() -> Client:
    return login("operator")


def page(client: Client, run: Run) -> str:
    response = client.get(reverse("admin:durable_agents_run_change", args=[run.pk]))
    assert response.status_code == 200
    return response.content.decode()


def section(html: str, element_id: str) -> str:
    found = re.search(rf'<(\w+)[^>]* id="{element_id}"[^>]*>(.*?)</\1>', html, re.S)
    assert found, f"the run page has no #{element_id}"
    return re.sub(r"\s+", " ", found.group(2))


def svg_of(html: str) -> str:
    return re.search(r'<svg[^>]*class="durable-timeline".*?</svg>', html, re.S).group(0)


@contextmanager
def override_lease_node(node: str) -> Iterator[None]:
    """Leases taken meanwhile name the Celery worker `node`, as a worker's do once it starts."""
    name_this_worker(node)
    try:
        yield
    finally:
        name_this_worker("")


def killed_mid_step(workflow: str = "record", inp: dict | None = None) -> tuple[Run, str]:
    """A run whose first step committed and whose worker then died holding the second: lease expired long ago."""
    run = api.start(workflow, inp or {"steps": 3})
    assert advance(run.id) is Outcome.COMMITTED
    claim = take_lease(run.id)
    assert claim is not None and claim.cursor == 1
    clock.advance(DEAD_FOR)
    run.refresh_from_db()
    return run, claim.owner


def test_stuck_run__the_executing_step_shows_running_with_its_worker_attempt_and_expired_lease(operator):
    run, worker = killed_mid_step()
    step = Step.objects.get(run=run, position=1)
    assert step.status == StepStatus.PENDING and step.attempts == 0, "the engine writes no step row on claim"
    assert run.claimed_at is not None, "the claim statement records when the attempt began"

    html = page(operator, run)

    running = section(html, "running-step")
    assert step.step_id in running and "running" in running and "attempt 1" in running
    assert worker in running, "the worker holding the lease is named"
    assert re.search(r"lease expired 9 min ago", running), "expired: the 2 s lease ran out 9 minutes ago"
    assert 'id="running-step" class="durable-lease-expired"' in html, "the expired lease is flagged"
    row = section(html, "step-2")
    assert re.search(r'class="durable-badge durable-running"[^>]*>running<', row) and ">pending<" not in row
    assert "<td>1</td>" in row, "the executing step's attempt is counted"
    assert svg_of(html).count("not started (pending)") == 1, "only the third step has not started"
    assert step.step_id in section(html, "next-step"), "the next step is named, not only numbered"


def test_stuck_run__the_timeline_draws_the_lapsed_attempt_and_the_stuck_stretch(operator):
    run, worker = killed_mid_step()
    svg = svg_of(page(operator, run))

    lapsed = re.findall(r'<rect class="attempt attempt-lease-expired"[^>]*><title>([^<]*)</title>', svg)
    assert len(lapsed) == 1 and "attempt 1 lease expired" in lapsed[0] and worker in lapsed[0]
    stuck = re.findall(r'<rect class="stuck"[^>]*><title>([^<]*)</title>', svg)
    assert len(stuck) == 1 and "stuck 9 min" in stuck[0] and "no worker has taken the run over" in stuck[0]
    assert re.search(r'class="stuck-label"[^>]*>stuck 9 min', svg), "the stretch is labelled on the drawing"


def test_takeover__the_killed_attempt_is_a_bar_of_its_own_and_the_stretch_until_the_takeover_is_stuck(operator):
    run, worker = killed_mid_step()
    step_id = Step.objects.get(run=run, position=1).step_id
    assert advance(run.id) is Outcome.COMMITTED, "another worker takes the run over and finishes the step"
    takeover = Event.objects.get(run=run, kind="lease_takeover")
    assert takeover.step_id == step_id and takeover.detail["attempt"] == 1
    assert takeover.detail["previous_claimed_at"] and takeover.detail["previous_expires_at"]

    svg = svg_of(page(operator, Run.objects.get(pk=run.pk)))

    bars = re.findall(rf'<rect class="attempt attempt-(\w+)"[^>]*><title>{step_id}: ([^<]*)</title>', svg)
    assert [kind for kind, _ in bars] == ["done", "killed"], f"one bar per attempt: {bars}"
    assert worker in bars[1][1] and "attempt 1 killed" in bars[1][1]
    stuck = re.findall(r'<rect class="stuck"[^>]*><title>([^<]*)</title>', svg)
    assert len(stuck) == 1 and "taken over at" in stuck[0]


def test_retried_step__keeps_its_failures_in_the_steps_view_and_the_timeline(operator):
    run = drive(api.start("flaky", {"failures": 2}).id)
    assert run.status == RunStatus.COMPLETED

    html = page(operator, run)

    row = section(html, "step-1")
    assert "attempt 1 failed" in row and "attempt 2 failed" in row and "flaky failure 1" in row
    assert "<td>3</td>" in row, "three attempts"
    svg = svg_of(html)
    failed = re.findall(r'<rect class="attempt attempt-failed"[^>]*><title>flaky: attempt (\d)', svg)
    assert failed == ["1", "2"], "each failed attempt is a bar of its own"


def test_operator_retried_step__keeps_its_failure_and_retry_history_says_so(operator):
    run = drive(api.start("broken", {}).id)
    assert run.status == RunStatus.FAILED
    api.resume(run.id, actor="operator")
    run.refresh_from_db()
    assert Step.objects.get(run=run, step_id="broken").error is None, "the retry cleared the step's error"

    html = page(operator, run)

    assert "the order data is malformed" in section(html, "step-2"), "the earlier failure stays in the steps view"
    history = section(html, "retry-history")
    assert "no " not in history and "1 failed attempt" in history and "the order data is malformed" in history


def test_cancelled_run__its_wait_step_and_its_wait_show_cancelled(operator):
    run = drive(api.start("approve_charge", {"order_id": "C-1"}).id)
    assert run.status == RunStatus.WAITING
    api.cancel(run.id, "no longer needed", actor="operator")
    run.refresh_from_db()
    waiting = Step.objects.get(run=run, status=StepStatus.WAITING)
    assert Wait.objects.get(run=run).status == WaitStatus.CANCELLED

    html = page(operator, run)

    row = section(html, f"step-{waiting.position + 1}")
    assert ">cancelled<" in row and ">waiting<" not in row
    assert ">cancelled<" in section(html, "waits") and ">open<" not in section(html, "waits")
    assert "nothing" in section(html, "open-wait")


def test_compensated_step__reads_compensated_with_what_was_undone(operator):
    run, _ = killed_mid_step("two_charges", {"order_id": "K-1"})
    # The killed attempt had applied its charge: the effect is on the step the saga will skip.
    step = Step.objects.get(run=run, position=1)
    Effect.objects.create(
        run=run,
        step=step,
        idempotency_key="k1-charge-b",
        tool="charge",
        args={"order_id": "K-1", "amount": "20.00"},
        args_hash="x",
        status=EffectStatus.APPLIED,
        result={"charged": "20.00"},
    )
    api.cancel(run.id, "customer withdrew", compensate=True, actor="operator")
    run = drive(run.id)
    assert run.status == RunStatus.CANCELLED
    assert Step.objects.get(pk=step.pk).status == StepStatus.SKIPPED

    row = section(page(operator, run), "step-2")

    assert ">compensated<" in row and ">skipped<" not in row
    assert "k1-charge-b" in row and "compensated by k1-charge-b:compensate" in row, row


def test_timeline__scales_with_the_page_and_draws_effects_inside_their_attempt(operator):
    run = api.start("two_charges", {"order_id": "E-1"})
    advance(run.id)
    svg = svg_of(page(operator, Run.objects.get(pk=run.pk)))

    tag = re.match(r"<svg[^>]*>", svg).group(0)
    assert 'viewBox="0 0 ' in tag and 'width="100%"' in tag and 'width="980"' not in tag, tag
    assert not re.search(r'height="\d', tag), "the height follows the width (no fixed pixel size)"
    assert "t = 0 at" in svg and re.search(r"t = 0 at \d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} \w+", svg)
    bar = re.search(r'<rect class="attempt attempt-done" x="([\d.]+)" y="[\d.]+" width="([\d.]+)"', svg)
    effect = re.search(r'<path class="effect" d="M([\d.]+) ', svg)
    assert bar and effect, svg
    left, width = float(bar.group(1)), float(bar.group(2))
    assert left - 1 <= float(effect.group(1)) <= left + width + 1, "the effect is drawn inside its attempt"


def test_run_page__a_stuck_run_reads_as_many_queries_as_a_finished_one(operator):
    def count(run: Run) -> int:
        with CaptureQueriesContext(connection) as queries:
            page(operator, run)
        return len(queries)

    stuck, _ = killed_mid_step()
    finished = drive(api.start("flaky", {"failures": 2}).id)
    # Two more for a stuck run: the heartbeat of the worker its lease names, and the heartbeat table once for the
    # system's likely cause (whatever the number of runs or workers).
    assert count(stuck) == count(finished) + 2


@pytest.mark.parametrize(
    ("heard", "says"),
    [
        # it beat since the lease ran out: a pool process died ("just now", or seconds ago on a busy machine)
        (timedelta(0), "is alive (heartbeat "),
        (DEAD_FOR, "went silent too (last heartbeat 9 min ago"),  # heard from last as it claimed: it died with it
        (None, "no heartbeat from worker"),
    ],
)
def test_stuck_run__the_page_says_whether_the_worker_the_lease_names_is_alive(operator, heard, says):
    with override_lease_node("celery@web-7"):
        run, worker = killed_mid_step()
    assert worker.startswith("celery@web-7:"), "a lease names the Celery worker, as its heartbeat does"
    if heard is not None:
        clock.advance(-heard)
        record_beat("worker:celery@web-7:1", ProcessHeartbeat.Kind.WORKER, hostname="celery@web-7", pid=1)
        clock.advance(heard)

    running = section(page(operator, run), "running-step")

    assert says in running and "celery@web-7" in running, running


def test_stuck_run__names_the_systems_likely_cause_and_what_resume_does(operator):
    # Beat is down: the sweep last ran before the run started, and no worker took the run's wake-up. The run page
    # must say why (as the overview does), not only that the run is stuck.
    sweep(queued={"celery": 0})
    record_beat("worker:w@h:1", ProcessHeartbeat.Kind.WORKER, hostname="w@h", pid=1, queues=["celery"])
    run = api.start("noop", {"steps": 1})
    clock.advance(timedelta(minutes=11))
    record_beat("worker:w@h:1", ProcessHeartbeat.Kind.WORKER, hostname="w@h", pid=1, queues=["celery"])

    stuck = section(page(operator, run), "stuck-reason")

    assert "runnable but not picked up for 11 min" in stuck, stuck
    assert "likely cause: the sweep has not run for 11 min — is celery beat up?" in stuck, stuck
    assert "Resume sends its wake-up again" in stuck, stuck


def test_stuck_run__with_nothing_queued_on_the_broker_says_its_wake_ups_are_not_acted_on(operator):
    run = api.start("noop", {"steps": 1})
    clock.advance(timedelta(minutes=11))
    sweep(queued={"celery": 0})  # the sweep is on time; a live worker; only this run's message is gone
    record_beat("worker:w@h:1", ProcessHeartbeat.Kind.WORKER, hostname="w@h", pid=1, queues=["celery"])

    stuck = section(page(operator, run), "stuck-reason")

    assert (
        "likely cause: runs are not picked up: a runnable run has waited 11 min, and no wake-up waits on the broker"
        in stuck
    ), stuck
    assert "Resume sends its wake-up again" in stuck, stuck


@pytest.mark.django_db(transaction=True)  # a child's end reaches its parent on commit
def test_fan_out__a_failed_child_is_named_linked_and_its_join_is_no_green_badge(operator):
    items = [{"item": 0, "hold": True}, {"item": 1, "fail": True}, {"item": 2, "hold": True}]
    parent = drive(api.start("fan_all", {"items": items}).id)
    for child in Run.objects.filter(parent_id=parent.id).order_by("child_index"):
        drive(child.id)
    parent = drive(parent.id)
    failed = Run.objects.get(parent_id=parent.id, status=RunStatus.FAILED)
    assert parent.status == RunStatus.FAILED

    html = page(operator, parent)

    assert f"child 1 (run {failed.pk}) failed: " in parent.error["message"], parent.error
    error = section(html, "run-error")
    link = reverse("admin:durable_agents_run_change", args=[failed.pk])
    assert f'href="{link}"' in error and "failed child" in error, f"the error links the child that failed: {error}"
    waits = section(html, "waits")
    assert re.search(r'durable-badge durable-failed"[^>]*>joined', waits), f"a join with a failed child: {waits}"


@pytest.mark.django_db(transaction=True)
def test_compensating_run__offers_no_second_cancel(operator):
    # A run compensating on its way to cancelled ignores another cancel (the saga goes on): offering "Cancel…"
    # there promises what it will not do.
    from tests.integration.test_sagas import _charged_twice

    saga = _charged_twice("CO-1")
    api.cancel(saga.id, "customer cancelled", compensate=True, actor="ops-1")

    html = page(operator, Run.objects.get(pk=saga.id))

    assert "compensating, will end cancelled" in html
    actions = section(html, "run-actions")
    assert "Cancel" not in actions, f"a second cancel is offered while compensating: {actions}"

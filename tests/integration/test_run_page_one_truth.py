"""One truth per row (issue 30): no row of the console contradicts another. An attempt says what it did, a
closed wait's bar ends when it closed, a join reads joined, a key-queued run names the run it waits behind, and
each effect's compensation reads the same in the saga banner, both tables and durable_show.
"""

from __future__ import annotations

import re
from datetime import timedelta
from io import StringIO

import pytest
from django.core.management import call_command
from django.test import Client
from django.urls import reverse

from durable_agents import api, clock
from durable_agents.engine.advance import advance
from durable_agents.models import Effect, EffectStatus, Run, RunStatus, Step, StepStatus, Wait, WaitKind, WaitStatus
from durable_agents.testing import drive
from durable_agents.testing.runs import take_lease
from tests.integration.test_admin import login
from tests.integration.test_run_page import DEAD_FOR, killed_mid_step, page, section, svg_of

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _engine_clock():
    clock.reset()
    yield
    clock.reset()


@pytest.fixture
def operator() -> Client:
    return login("operator")


def test_superseded_step__its_killed_attempt_says_it_applied_a_refund_and_is_counted(operator):
    run = api.start("fresh_refund")
    advance(run.id)  # observe
    claim = take_lease(run.id)
    assert claim is not None and claim.cursor == 1
    refund = Step.objects.get(run=run, step_id="refund")
    Effect.objects.create(
        run=run,
        step=refund,
        idempotency_key="f1-refund",
        tool="issue_refund",
        args={"order_id": "F-1", "amount": "25.00"},
        args_hash="x",
        status=EffectStatus.APPLIED,
        result={"refunded": "25.00"},
        applied_at=clock.now(),
    )
    clock.advance(DEAD_FOR + timedelta(minutes=2))  # the worker died; the observation went stale meanwhile
    assert advance(run.id) == "replanned"
    refund.refresh_from_db()
    assert refund.status == StepStatus.SUPERSEDED

    html = page(operator, Run.objects.get(pk=run.pk))

    svg = svg_of(html)
    assert svg.count("not started (superseded)") == 1, "only notify never started; the refund's attempt was killed"
    assert re.search(r'class="attempt-summary"[^>]*>attempt 1 killed after applying issue_refund; superseded<', svg)
    row = section(html, f"step-{refund.position + 1}")  # the superseded row comes first at its position
    assert "killed after applying issue_refund" in row, row
    assert "<td>1</td>" in row, f"the killed attempt is counted: {row}"


def test_cancelled_wait__its_bar_and_its_steps_bar_end_when_it_closed(operator):
    run = drive(api.start("approve_charge", {"order_id": "C-3"}).id)
    assert run.status == RunStatus.WAITING
    api.cancel(run.id, "no longer needed", actor="operator")
    waiting = Step.objects.get(run=run, status=StepStatus.WAITING)
    clock.advance(timedelta(hours=5))  # the page is read long after the cancel

    svg = svg_of(page(operator, Run.objects.get(pk=run.pk)))

    titles = re.findall(rf"<title>([^<]*{waiting.step_id}[^<]*)</title>", svg) + re.findall(
        r'<rect class="wait"[^>]*><title>([^<]*)</title>', svg
    )
    assert titles and not [t for t in titles if re.search(r"\b[45]h", t)], f"a closed wait grew to now: {titles}"
    assert not re.search(r"span [45]h", svg), "the drawing ends when the run ended, not now"


@pytest.mark.django_db(transaction=True)  # a child's end reaches its parent on commit
def test_children_join__reads_joined_with_what_the_children_came_to_on_the_wait_page():
    operator = login("approver", codenames=("decide_wait",))
    run = api.start("fan_collect", {"items": [{"item": 1}, {"item": 2}, {"item": 3, "fail": True}]})
    drive(run.id)
    for child in Run.objects.filter(parent_id=run.id).order_by("child_index"):
        drive(child.id)
    wait = Wait.objects.get(run=run, kind=WaitKind.CHILDREN)
    assert wait.status == WaitStatus.APPROVED, "the engine closes a met join as approved"
    counts = f"{wait.decision['completed']} completed, {wait.decision['failed']} failed"

    html = operator.get(reverse("admin:durable_agents_wait_change", args=[wait.pk])).content.decode()
    facts = section(html, "wait-facts")
    assert ">joined<" in facts and "approved" not in facts.lower(), facts
    assert f"children finished: {counts}" in facts, facts
    listed = operator.get(reverse("admin:durable_agents_wait_changelist") + "?state=all&kind=children").content.decode()
    text = re.sub(r"<[^>]+>", " ", listed)
    assert "joined" in text and "Approved" not in text, "the list of waits calls a join approved"


@pytest.mark.django_db(transaction=True)  # admission hands the key on at commit
def test_key_queued_run__names_and_links_the_run_holding_its_key_and_the_holder_shows_its_queue(operator):
    holder, first, second = (api.start("keyed", {"customer": "c-7"}) for _ in range(3))
    assert Run.objects.get(pk=holder.id).admitted_at is not None and Run.objects.get(pk=first.id).is_queued

    queued = page(operator, Run.objects.get(pk=second.pk))
    waiting_for = section(queued, "open-wait")
    assert "nothing" not in waiting_for, waiting_for
    holder_url = reverse("admin:durable_agents_run_change", args=[holder.pk])
    assert "concurrency key" in waiting_for and "c-7" in waiting_for and f'href="{holder_url}"' in waiting_for

    held = section(page(operator, Run.objects.get(pk=holder.pk)), "concurrency-key")
    first_url = reverse("admin:durable_agents_run_change", args=[first.pk])
    assert "2 runs queued behind it" in held and f'href="{first_url}"' in held, held


def test_durable_show__prints_the_executing_step_as_running_as_the_run_page_does(operator):
    run, _ = killed_mid_step()
    out = StringIO()
    call_command("durable_show", str(run.id), stdout=out)

    line = next(line for line in out.getvalue().splitlines() if re.match(r"\s+2\s", line))
    assert " running " in line and "pending" not in line and "attempts 1" in line, line
    assert re.search(r'class="durable-badge durable-running"[^>]*>running<', section(page(operator, run), "step-2"))


def _mid_compensation() -> tuple[Run, dict[str, str]]:
    """A three_charges run cancelled with compensation: the newest charge undone, the next one's compensation
    claimed by a worker (in flight), the oldest one's still queued. Its effects' keys by the state they are in."""
    run = api.start("three_charges", {"order_id": "T-1"})
    for _ in range(3):
        advance(run.id)
    keys = dict(Effect.objects.filter(run=run).order_by("id").values_list("step__step_id", "idempotency_key"))
    api.cancel(run.id, "customer cancelled", compensate=True, actor="ops")
    advance(run.id)  # compensate-1 undoes charge-c, the newest
    claim = take_lease(run.id)  # a worker executes compensate-2 (charge-b) now
    assert claim is not None
    run = Run.objects.get(pk=run.pk)
    assert Effect.objects.get(idempotency_key=keys["charge-c"]).status == EffectStatus.COMPENSATED
    return run, {"compensated": keys["charge-c"], "in flight": keys["charge-b"], "pending": keys["charge-a"]}


def _text(html: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html))


def test_mid_compensation__banner_steps_effects_and_durable_show_say_the_same_of_each_effect(operator):
    run, by_state = _mid_compensation()
    html = page(operator, run)

    banner = _text(section(html, "saga-progress"))
    assert "compensating, will end cancelled: 1 of 3 effects undone" in banner, banner
    assert f"charge key {by_state['in flight']} in flight" in banner, banner
    in_flight = _text(section(html, "in-flight"))
    assert by_state["in flight"] in in_flight and "attempt 1" in in_flight, in_flight
    assert "none pending" not in in_flight, "a compensation a worker executes now is in flight"

    effects = _text(section(html, "effects"))
    rows = {key: re.search(rf"{re.escape(key)} .*?(?=charge |$)", effects).group(0) for key in by_state.values()}
    shown = StringIO()
    call_command("durable_show", str(run.id), stdout=shown)
    lines = shown.getvalue().splitlines()
    for state, key in by_state.items():
        step = Effect.objects.get(idempotency_key=key).step
        undone = _text(section(html, f"step-{step.position + 1}"))
        line = next(line for line in lines if f"key {key} " in line and re.match(r"\s+charge\s", line))
        for where, text in (("effects table", rows[key]), ("steps table", undone), ("durable_show", line)):
            assert f"compensation {state}" in text or (state == "compensated" and "compensated by" in text), (
                f"the {where} does not say the compensation of {key} is {state}: {text}"
            )
            others = [s for s in by_state if s != state and s != "compensated"]
            assert not [s for s in others if f"compensation {s}" in text], f"the {where} contradicts itself: {text}"
    assert any("compensating, will end cancelled: 1 of 3 effects undone" in line for line in lines), lines


def test_stopped_saga__the_failed_compensation_and_what_is_left_read_the_same_in_both_tables_and_durable_show(
    operator,
):
    run = api.start("three_charges", {"order_id": "T-2"})
    advance(run.id)  # charge-a applied
    charged = Effect.objects.get(run=run)
    # Applied by a tool since retired: its compensation cannot run, and the saga stops on it, visibly.
    retired = Effect.objects.create(
        run=run,
        step=charged.step,
        idempotency_key="t2-retired",
        tool="retired_tool",
        args={},
        args_hash="x",
        status=EffectStatus.APPLIED,
        applied_at=clock.now(),
    )
    api.cancel(run.id, "customer cancelled", compensate=True, actor="ops")
    run = drive(run.id)
    assert run.status == RunStatus.FAILED, "the saga stops on the compensation it cannot run"

    html = page(operator, run)
    effects, steps = _text(section(html, "effects")), _text(section(html, f"step-{charged.step.position + 1}"))
    shown = StringIO()
    call_command("durable_show", str(run.id), stdout=shown)
    lines = shown.getvalue().splitlines()
    for key, state in ((retired.idempotency_key, "compensation failed"), (charged.idempotency_key, "pending")):
        line = next(line for line in lines if f"key {key} " in line)
        row = re.search(rf"{re.escape(key)} .*?(?= charge | retired_tool |$)", effects).group(0)
        told = re.search(rf"{re.escape(key)} ?: [^;]*", steps).group(0)
        for where, text in (("effects table", row), ("steps table", told), ("durable_show", line)):
            assert state in text, f"the {where} does not say {key} is {state}: {text}"

"""Concurrency keys on real workers: runs sharing a key never overlap, go in order, and hand their slot on
through crashes, cancels and races (engine/admission.py)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection, transaction
from django.db.models import Max, Min
from django.urls import reverse

from durable_agents import api, clock, operations
from durable_agents.engine.admission import admit, holders, queue_position
from durable_agents.engine.advance import Outcome, advance
from durable_agents.engine.sweep import sweep
from durable_agents.errors import DefinitionError, InvalidInputError
from durable_agents.models import Event, Run, RunStatus, Wait
from durable_agents.testing import wait_for, wait_for_run
from durable_agents.workflows import call, workflow
from tests.integration.test_admin import login
from tests.testapp.models import Execution

pytestmark = pytest.mark.django_db(transaction=True)


def _in_flight(run_ids: list[Any]) -> list[tuple[Any, int, int]]:
    """(run, first execution id, last execution id), by first execution: Execution ids order every step of every
    run on every worker, so each run's span contains all it executed."""
    rows = Execution.objects.filter(run_id__in=run_ids).values("run_id").annotate(first=Min("id"), last=Max("id"))
    return sorted(((r["run_id"], r["first"], r["last"]) for r in rows), key=lambda r: r[1])


def _max_overlap(run_ids: list[Any]) -> int:
    spans = _in_flight(run_ids)
    edges = [(first, 1) for _, first, _ in spans] + [(last, -1) for *_, last in spans]
    deepest = current = 0
    for _, step in sorted(edges):
        current += step
        deepest = max(deepest, current)
    return deepest


def _assert_serial_in_order(runs: list[Run]) -> None:
    spans = _in_flight([r.id for r in runs])
    assert [s[0] for s in spans] == [r.id for r in runs], (
        "runs of one key did not start in the order they were started (created_at, id): the queue is not FIFO"
    )
    for (earlier, _, last), (later, first, _) in zip(spans, spans[1:], strict=False):
        assert first > last, (
            f"run {later} executed a step before run {earlier} of the same key had finished: the key was held twice"
        )
    finished = {r.id: r for r in Run.objects.filter(pk__in=[r.id for r in runs])}
    for earlier, later in zip(runs, runs[1:], strict=False):
        assert finished[later.id].admitted_at >= finished[earlier.id].finished_at, (
            "a run was admitted before the previous holder of its key finished (database clock)"
        )


def _completed(run: Run, timeout: float = 120) -> Run:
    try:
        return wait_for_run(run.id, "completed", timeout=timeout)
    except TimeoutError as exc:
        state = {
            str(r.id)[:8]: (r.status, r.concurrency_key, r.admitted_at, r.lease_owner)
            for r in Run.objects.filter(concurrency_key=run.concurrency_key).order_by("created_at")
        }
        events = list(Event.objects.filter(run_id=run.id).values_list("kind", flat=True).order_by("id"))
        raise AssertionError(f"run {run.id} did not complete: its key's runs {state}; its events {events}") from exc


def _concurrently(fn: Callable[[], Any], n: int) -> list[Any]:
    """Run `fn` in `n` threads released together (each with its own database connection)."""
    barrier = threading.Barrier(n)
    results: list[Any] = [None] * n

    def worker(i: int) -> None:
        try:
            barrier.wait()
            results[i] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            results[i] = exc
        finally:
            connection.close()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


# --- On real workers ----------------------------------------------------------------------------------------


def test_concurrency_key__runs_of_one_key_never_overlap_and_go_in_order(start_worker):
    for beat in (True, False, False):
        start_worker(beat=beat)
    with transaction.atomic():  # all started at once: admitted when the start commits
        runs = [api.start("keyed", {"customer": "c1", "sleep_ms": [20, 80]}) for _ in range(8)]
        others = [api.start("keyed", {"customer": "c2", "sleep_ms": [20, 80]}) for _ in range(3)]
    for run in runs + others:
        _completed(run)
    _assert_serial_in_order(runs)
    _assert_serial_in_order(others)
    admitted = list(Event.objects.filter(kind="admitted", run_id__in=[r.id for r in runs]).order_by("id"))
    assert [e.run_id for e in admitted] == [r.id for r in runs], "each run is admitted once, in order"


def test_concurrency_limit__three_of_one_key_at_a_time(start_worker):
    for beat in (True, False, False, False):
        start_worker(beat=beat)
    with transaction.atomic():
        runs = [api.start("keyed", {"customer": "c3", "sleep_ms": [50, 150]}, concurrency_limit=3) for _ in range(9)]
    for run in runs:
        _completed(run)
    assert _max_overlap([r.id for r in runs]) <= 3, "more than 3 runs of a key with limit 3 were in flight"
    admitted = Event.objects.filter(kind="admitted", run_id__in=[r.id for r in runs]).order_by("id")
    assert max(e.detail["holders"] for e in admitted) == 3, "the limit of 3 was never used in full"
    assert [e.run_id for e in admitted] == [r.id for r in runs], "runs are admitted in the order they started"


def test_sigkill__a_killed_holder_is_taken_over_and_the_queue_moves_on(start_worker):
    workers = [start_worker(beat=True), start_worker()]
    with transaction.atomic():
        runs = [api.start("keyed_slow", {"customer": "k", "seconds": 2}) for _ in range(3)]
    wait_for(lambda: Execution.objects.filter(run_id=runs[0].id, step_id="slow").exists(), timeout=60, what="slow step")
    holder = Run.objects.get(pk=runs[0].id)
    victim = next(w for w in workers if w.owns(holder.lease_owner))
    victim.kill()
    start_worker(beat=victim is workers[0])  # the successor; a beat runs the sweep that takes the holder over
    for run in runs:
        _completed(run)
    assert Event.objects.filter(run_id=runs[0].id, kind="lease_takeover").exists(), "the holder was taken over"
    _assert_serial_in_order(runs)


def test_cancel__a_queued_run_leaves_the_queue_and_a_cancelled_holder_hands_its_slot_on(start_worker):
    start_worker(beat=True)
    with transaction.atomic():
        a, b, c, d = (api.start("keyed_approval", {"customer": "q"}) for _ in range(4))
    wait_for_run(a.id, "waiting", timeout=60)  # waiting for a human, it still holds the key
    assert [queue_position(Run.objects.get(pk=r.id)) for r in (b, c, d)] == [1, 2, 3]
    api.cancel(c.id, reason="customer withdrew")
    assert Run.objects.get(pk=c.id).status == RunStatus.CANCELLED
    assert queue_position(Run.objects.get(pk=d.id)) == 2, "a cancelled run leaves the queue"
    assert Run.objects.get(pk=b.id).admitted_at is None, "cancelling a queued run frees no slot"

    api.cancel(a.id, reason="stop")  # the holder, waiting: cancelled now, its slot goes to b
    wait_for_run(b.id, "waiting", timeout=60)
    api.decide(Wait.objects.get(run_id=b.id, status="open").pk, True, by="ops")
    wait_for_run(b.id, "completed", timeout=60)
    wait_for_run(d.id, "waiting", timeout=60)
    api.decide(Wait.objects.get(run_id=d.id, status="open").pk, True, by="ops")
    wait_for_run(d.id, "completed", timeout=60)
    assert not Execution.objects.filter(run_id=c.id).exists(), "a run cancelled in the queue never executed"
    _assert_serial_in_order([a, b, d])


def test_cancel__a_running_holder_stops_after_its_step_and_hands_on(start_worker, tmp_path):
    start_worker(beat=True)
    gate = tmp_path / "go-on"  # the slow step runs until the cancel is in
    with transaction.atomic():
        a, b = (api.start("keyed_slow", {"customer": "r", "until": str(gate)}) for _ in range(2))
    wait_for(lambda: Execution.objects.filter(run_id=a.id, step_id="slow").exists(), timeout=60, what="slow step")
    api.cancel(a.id, reason="stop after the step")
    gate.touch()
    wait_for_run(a.id, "cancelled", timeout=60)
    wait_for_run(b.id, "completed", timeout=60)
    _assert_serial_in_order([a, b])


# --- In this process: hand-offs, races, duplicates -----------------------------------------------------------


def test_sweep__admits_a_run_whose_hand_off_was_lost(monkeypatch):
    a, b = (api.start("keyed", {"customer": "lost"}) for _ in range(2))
    assert holders("lost") == [a.id]
    # A crash between the holder's end and its hand-off: the cancel commits, the admission never runs.
    monkeypatch.setattr("durable_agents.engine.runs.admit_on_commit", lambda key: None)
    api.cancel(a.id)
    assert Run.objects.get(pk=b.id).admitted_at is None
    assert sweep().admitted == 1
    assert holders("lost") == [b.id]
    assert sweep().admitted == 0, "a second pass admits nothing more"


def test_admit__duplicate_hand_offs_admit_once():
    runs = [api.start("keyed", {"customer": "dup"}) for _ in range(3)]
    assert holders("dup") == [runs[0].id]
    results = _concurrently(lambda: admit("dup"), 8)
    assert sum(len(r) for r in results) == 0, "a full key admits nothing, however often it is asked"
    # The holder ends (written directly: no hand-off runs, as after a crash between its end and the hand-off).
    Run.objects.filter(pk=runs[0].id).update(status=RunStatus.COMPLETED)
    results = _concurrently(lambda: admit("dup"), 8)
    assert sum(len(r) for r in results) == 1, f"eight hand-offs of one freed slot admitted {results}"
    assert holders("dup") == [runs[1].id]


def test_start__concurrent_starts_of_one_key_admit_one():
    runs = _concurrently(lambda: api.start("keyed", {"customer": "burst"}), 10)
    assert len(holders("burst")) == 1, "ten concurrent starts of one key admitted more than one"
    # Starts that race are admitted in the order they commit (a start older by its clock may commit later, and
    # the first admission sees only what has committed); once all are queued, the order is (created_at, id).
    (holder,) = holders("burst")
    api.cancel(holder, "next")
    waiting = sorted((r for r in runs if r.id != holder), key=lambda r: (Run.objects.get(pk=r.id).created_at, r.id))
    assert holders("burst") == [waiting[0].id], "the oldest queued run is admitted next"


def test_cancel__two_holders_ending_at_once_admit_two():
    runs = [api.start("keyed", {"customer": "pair"}, concurrency_limit=2) for _ in range(6)]
    assert holders("pair") == [runs[0].id, runs[1].id]
    pending = iter([runs[0].id, runs[1].id])
    lock = threading.Lock()

    def cancel_one() -> Any:
        with lock:
            run_id = next(pending)
        return api.cancel(run_id)

    _concurrently(cancel_one, 2)
    assert sorted(holders("pair")) == sorted([runs[2].id, runs[3].id])
    assert Run.objects.queued().filter(concurrency_key="pair").count() == 2


def test_claim__a_queued_run_is_not_claimed_by_a_duplicate_wake():
    a, b = (api.start("keyed", {"customer": "wake"}) for _ in range(2))
    assert advance(b.id) is Outcome.SKIPPED, "a queued run was claimed: it would run beside its key's holder"
    assert Run.objects.get(pk=b.id).status == RunStatus.PENDING
    assert advance(a.id) is Outcome.COMMITTED


def test_resume__a_cancelled_run_queues_for_its_key_again():
    a, b = (api.start("keyed", {"customer": "again"}) for _ in range(2))
    api.cancel(a.id)
    assert holders("again") == [b.id]
    api.resume(a.id)
    resumed = Run.objects.get(pk=a.id)
    assert resumed.status == RunStatus.PENDING and resumed.admitted_at is None, "a resumed run bypassed its key"
    assert queue_position(resumed) == 1
    api.cancel(b.id)
    assert holders("again") == [a.id]


def test_start__bad_concurrency_settings_are_clear_errors():
    with pytest.raises(InvalidInputError, match="concurrency_key could not be computed"):
        api.start("keyed", {"no_customer": 1})
    with pytest.raises(InvalidInputError, match="concurrency limit"):
        api.start("keyed", {"customer": "x"}, concurrency_limit=0)
    with pytest.raises(InvalidInputError, match="concurrency key"):
        api.start("keyed", {"customer": " "})
    with pytest.raises(DefinitionError, match="concurrency_limit"):
        workflow("bad_limit", steps=[call("s", lambda ctx: None)], concurrency_limit=0)
    assert not Run.objects.exists(), "a refused start wrote nothing"


def test_start__an_explicit_key_overrides_the_workflows():
    run = api.start("record", {"steps": 1}, concurrency_key="explicit")
    assert (run.concurrency_key, run.concurrency_limit) == ("explicit", 1)
    assert holders("explicit") == [run.id]
    plain = api.start("record", {"steps": 1})
    assert plain.concurrency_key is None and plain.admitted_at is None


# --- The console ----------------------------------------------------------------------------------------------


def test_console__a_queued_run_says_what_it_waits_for():
    holder, queued = (api.start("keyed", {"customer": "console-7"}) for _ in range(2))
    client = login("ops")
    listed = client.get(reverse("admin:durable_agents_run_changelist")).content.decode()
    assert "waiting for concurrency key &#x27;console-7&#x27; (position 1)" in listed, "the run list says why"
    assert "it starts when the run holding the key ends" in listed
    assert "key console-7" in listed
    only_queued = client.get(reverse("admin:durable_agents_run_changelist") + "?concurrency=queued").content.decode()
    assert str(queued.id)[:8] in only_queued and str(holder.id)[:8] not in only_queued
    searched = client.get(reverse("admin:durable_agents_run_changelist") + "?q=console-7").content.decode()
    assert str(queued.id)[:8] in searched and str(holder.id)[:8] in searched
    page = client.get(reverse("admin:durable_agents_run_change", args=[queued.pk])).content.decode()
    assert 'id="concurrency-key"' in page and "(position 1)" in page, "the run page says why it has not started"
    held = client.get(reverse("admin:durable_agents_run_change", args=[holder.pk])).content.decode()
    assert "holds concurrency key &#x27;console-7&#x27;" in held

    out = StringIO()
    call_command("durable_show", str(queued.id), stdout=out)
    assert "waiting for concurrency key 'console-7' (position 1)" in out.getvalue()
    data = operations.describe_run(queued.id)["concurrency"]
    assert (data["key"], data["limit"], data["queue_position"], data["admitted_at"]) == ("console-7", 1, 1, None)
    Run.objects.filter(pk=queued.pk).update(updated_at=clock.now() - timedelta(days=1))
    assert not Run.objects.stuck(now=clock.now(), stuck_after=timedelta(minutes=1)).filter(pk=queued.pk).exists(), (
        "a run waiting its turn on its key is not stuck"
    )


def test_advance__a_holder_completing_or_failing_hands_its_slot_on(drive):
    failing = api.start("broken", {}, concurrency_key="ends")
    completing, last = (api.start("record", {"steps": 2}, concurrency_key="ends") for _ in range(2))
    assert holders("ends") == [failing.id]
    assert drive(failing.id).status == RunStatus.FAILED
    assert holders("ends") == [completing.id], "a failed holder handed its slot on"
    assert drive(completing.id).status == RunStatus.COMPLETED
    assert holders("ends") == [last.id], "a completed holder handed its slot on"


def test_fork__a_fork_of_a_keyed_run_queues_on_its_key(drive):
    source = api.start("record", {"steps": 2}, concurrency_key="forked")
    assert drive(source.id).status == RunStatus.COMPLETED
    other = api.start("record", {"steps": 2}, concurrency_key="forked")
    fork = api.fork(source.id, "s002")
    assert (fork.concurrency_key, Run.objects.get(pk=fork.id).is_queued) == ("forked", True)
    assert drive(other.id).status == RunStatus.COMPLETED
    assert holders("forked") == [fork.id]


def test_fork__with_new_input_queues_on_the_key_of_its_new_input(drive):
    source = api.start("keyed", {"customer": "c-old"})
    assert drive(source.id).status == RunStatus.COMPLETED
    holder = api.start("keyed", {"customer": "c-new"})
    fork = api.fork(source.id, "leave", input={"customer": "c-new"})
    assert fork.concurrency_key == "c-new", "another customer's work queues on that customer's key"
    assert Run.objects.get(pk=fork.id).is_queued, "c-new's key is held: the fork waits its turn"
    assert drive(holder.id).status == RunStatus.COMPLETED
    assert holders("c-new") == [fork.id]


# --- Families: children hold keys too -------------------------------------------------------------------


def _child_of(parent: Run) -> Run:
    return Run.objects.get(parent_id=parent.id)


def test_children__a_keyed_child_waits_while_another_run_holds_its_key(drive):
    holder = api.start("keyed", {"customer": "fam-1"})
    parent = api.start("fan_keyed_children", {"items": [{"item": 0, "customer": "fam-1"}]})
    assert drive(parent.id).status == RunStatus.WAITING
    child = _child_of(parent)
    assert (child.concurrency_key, child.is_queued) == ("fam-1", True), "the child ran beside the key's holder"
    assert advance(child.id) is Outcome.SKIPPED
    assert drive(holder.id).status == RunStatus.COMPLETED
    assert holders("fam-1") == [child.id], "the holder's end hands its slot to the child"


def test_children__children_of_a_holder_run_in_its_slot_and_the_family_holds_one(drive):
    parent = api.start("fan_keyed", {"customer": "fam-2", "items": [{"item": i, "customer": "fam-2"} for i in (0, 1)]})
    later = api.start("keyed", {"customer": "fam-2"})
    assert drive(parent.id).status == RunStatus.WAITING, "children queued behind their own parent: a deadlock"
    kids = list(Run.objects.filter(parent_id=parent.id).order_by("child_index"))
    assert all(kid.admitted_at is not None for kid in kids), "children of the holder run in its slot"
    assert Run.objects.get(pk=later.id).is_queued, "a family holds one slot: the next run of the key waits"
    assert admit("fam-2") == [], "a hand-off while the family lives admits nothing"
    for kid in kids:
        assert drive(kid.id).status == RunStatus.COMPLETED
    assert Run.objects.get(pk=later.id).is_queued
    assert drive(parent.id).status == RunStatus.COMPLETED
    assert holders("fam-2") == [later.id], "the family's end hands its one slot on"


def test_children__unkeyed_children_of_a_keyed_run_hold_its_key_until_they_end(drive):
    # The parent is cancelled and its operator's process dies before it reaches the child: the child lives on, so
    # the key stays held (by the child, in what was its parent's slot) until the sweep has cancelled it.
    from durable_agents.engine import family
    from durable_agents.engine.runs import cancel_run
    from durable_agents.signals import run_finished

    parent = api.start("fan_keyed_plain_children", {"customer": "fam-3", "items": [{"item": 0, "hold": True}]})
    later = api.start("keyed", {"customer": "fam-3"})
    assert drive(parent.id).status == RunStatus.WAITING
    child = _child_of(parent)
    assert (child.concurrency_key, child.admitted_at is not None) == ("fam-3", True)
    run_finished.disconnect(dispatch_uid="durable_agents.engine.family")
    try:
        cancel_run(parent.id, reason="stop")
    finally:
        run_finished.connect(family._on_run_finished, dispatch_uid="durable_agents.engine.family")
    assert holders("fam-3") == [child.id]
    assert admit("fam-3") == [], "the parent's live child still holds the key"
    report = sweep()
    assert report.orphans_cancelled == 1 and Run.objects.get(pk=child.id).status == RunStatus.CANCELLED
    assert holders("fam-3") == [later.id]


def test_children__a_child_in_its_parents_slot_whose_admission_was_lost_is_admitted_by_the_sweep(monkeypatch, drive):
    monkeypatch.setattr("durable_agents.engine.family.admit_on_commit", lambda key: None)
    parent = api.start("fan_keyed", {"customer": "fam-4", "items": [{"item": 0, "customer": "fam-4"}]})
    assert drive(parent.id).status == RunStatus.WAITING
    assert _child_of(parent).is_queued
    assert sweep().admitted == 1
    assert drive(_child_of(parent).id).status == RunStatus.COMPLETED
    assert drive(parent.id).status == RunStatus.COMPLETED


def test_children__a_grandchild_keyed_like_its_grandparent_runs_in_the_grandparents_slot(drive):
    # outer holds "gen-a" and waits on mid (key "gen-b"), which waits on inner (key "gen-a" again): queued behind its
    # own grandparent, inner would wait for ever.
    outer = api.start("keyed_outer", {"key": "gen-a", "mid_key": "gen-b"})
    later = api.start("keyed", {"customer": "gen-a"})
    assert drive(outer.id).status == RunStatus.WAITING
    mid = _child_of(outer)
    assert drive(mid.id).status == RunStatus.WAITING
    inner = _child_of(mid)
    assert (inner.concurrency_key, inner.slot_of_id, inner.admitted_at is not None) == ("gen-a", outer.id, True)
    assert drive(inner.id).status == RunStatus.COMPLETED
    assert drive(mid.id).status == RunStatus.COMPLETED
    assert Run.objects.get(pk=later.id).is_queued, "the family held its one slot to the end"
    assert drive(outer.id).status == RunStatus.COMPLETED
    assert holders("gen-a") == [later.id]


def test_children__a_resumed_family_admitted_behind_another_holder_takes_its_children_into_its_slot(drive):
    items = [{"item": i, "customer": "rk-2", "hold": True} for i in (0, 1)]
    parent = api.start("fan_keyed", {"customer": "rk-2", "items": items})
    assert drive(parent.id).status == RunStatus.WAITING
    api.cancel(parent.id, "oops")
    other = api.start("keyed", {"customer": "rk-2"})
    api.resume(parent.id)  # the family queues behind the key's new holder
    assert holders("rk-2") == [other.id]
    assert drive(other.id).status == RunStatus.COMPLETED  # its one hand-off admits the parent and its children
    assert sorted(holders("rk-2")) == sorted([parent.id, *(k.id for k in Run.objects.filter(parent_id=parent.id))])


def test_commands__durable_start_takes_a_concurrency_key():
    out = StringIO()
    call_command("durable_start", "record", "--concurrency-key", "cli-7", "--concurrency-limit", "2", stdout=out)
    run = Run.objects.get(pk=out.getvalue().strip())
    assert (run.concurrency_key, run.concurrency_limit, holders("cli-7")) == ("cli-7", 2, [run.id])
    with pytest.raises(CommandError, match="concurrency limit"):
        call_command("durable_start", "record", "--concurrency-key", "cli-7", "--concurrency-limit", "0")

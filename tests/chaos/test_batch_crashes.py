"""Batch delivery under SIGKILL (issue 32): refund_agent runs whose every model call goes through the Message
Batches API, on real workers, the process at each point between "turn submitted" and "result journaled" SIGKILLed.

Each case starts four runs (their turns go out together: a batch leaves once four wait) on two prefork workers, one
with beat (the sweep sends the batcher, task `durable_agents.batches`). The first process to reach the case's point
(tests/chaos/batch_points.py) stops there; the test SIGKILLs its whole worker — parent, pool children, broker
connection — and starts a fresh one. Killed for real at:

    queued      the step, after its turn was journaled as submitted, before its run parked
    opened      the batcher, after the MessageBatch row (the outbox row) was committed, before the create request
    created     the batcher, after the create landed at the API and was answered, before its id was recorded: the
                lost create is found by listing the API's batches and adopted (BATCH_SUBMIT_GRACE_SECONDS = 1)
    collecting  the batcher, after the first answer of a batch of several was recorded, before the others
    recorded    the step, woken by its recorded answer, before it journaled it as a Turn

What must hold after each: every run completes, with every chaos invariant (workload.check: effects once, no step
committed twice, no journaled turn asked again); and for batches: every turn was sent in exactly one batch at the
API (no custom id in two), every batch the API created is one a MessageBatch row carries, each journal turn has one
BatchTurn (none sent again) and one Turn, and the model was asked once per turn.
"""

from __future__ import annotations

import random
import uuid
from collections import Counter
from pathlib import Path

import pytest

from durable_agents.models import BatchTurn, Event, MessageBatch, Turn
from durable_agents.testing import wait_for
from durable_agents.testing.fake_anthropic import FakeAnthropic
from tests.chaos.batch_points import POINTS
from tests.chaos.fleet import Fleet, prefork
from tests.chaos.workload import Case, Model, check, describe, make_cases, seed, start, timeout, wait_until_finished

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, timeout()]

RUNS = 4


@pytest.mark.parametrize("point", POINTS)
def test_batch_crash__a_worker_killed_at_each_point_loses_and_duplicates_nothing(
    point, chaos_env, chaos_logs, fake, model, tmp_path
):
    mark = tmp_path / "stopped-at"
    env = {
        **chaos_env,
        "DURABLE_CHAOS_BATCH": "1",
        "DURABLE_CHAOS_BATCH_SIZE": str(RUNS),
        "DURABLE_CHAOS_BATCH_POINT": point,
        "DURABLE_CHAOS_BATCH_MARK": str(mark),
    }
    cases = make_cases(RUNS, random.Random(f"batch-{point}"), prefix="B")
    seed(cases)
    with Fleet(env, chaos_logs, [prefork(2, beat=True), prefork(2)]) as fleet:
        runs = {start(case): case for case in cases}
        pid = int(wait_for(lambda: mark.exists() and mark.read_text(), timeout=180, what=f"a process to reach {point}"))
        owners = fleet.pids()
        assert pid in owners, f"process {pid} stopped at {point} but is no worker's"
        fleet.kill_worker(owners[pid])
        left = wait_until_finished(runs, timeout=240)
        assert not left, f"{len(left)} runs did not finish after the kill at {point}:\n  {describe(left)}"

    report = check(runs, fake)
    report.assert_ok()
    assert_batched_once(runs, fake, model)
    assert_the_point_was_recovered(point, runs, pid, chaos_logs)
    print(f"\nbatch kill at {point} (pid {pid}): {report.summary()}; {fake.batch_creates} batches created")


def assert_batched_once(runs: dict[uuid.UUID, Case], fake: FakeAnthropic, model: Model) -> None:
    """Every turn sent in exactly one batch at the API, every API batch carried by a row, asked once, journaled once."""
    turns = BatchTurn.objects.filter(run_id__in=list(runs))
    ours = set(turns.values_list("custom_id", flat=True))
    sent = Counter(custom_id for batch in fake.batches for custom_id in batch.custom_ids)
    assert {c: n for c, n in sent.items() if n > 1} == {}, "a turn was sent in two batches"
    assert set(sent) == ours, "every turn went to the API, and nothing else did"
    per_turn = Counter(turns.values_list("step_id", "index"))
    assert {k: n for k, n in per_turn.items() if n > 1} == {}, "a journal turn was submitted twice"
    assert set(turns.values_list("status", flat=True)) == {"succeeded"}
    carried = set(MessageBatch.objects.exclude(provider_id="").values_list("provider_id", flat=True))
    assert {b.id for b in fake.batches} == carried and fake.batch_creates == len(carried), (
        "every batch the API created is one a MessageBatch row carries: none created twice, none lost"
    )
    journaled = Counter()
    for turn in Turn.objects.filter(run_id__in=list(runs)).select_related("step"):
        conversation = f"{turn.run_id}:{turn.step.step_id}"
        index = turn.index if turn.purpose == "turn" else 0
        journaled[(conversation, index)] += 1
        assert fake.count(conversation, index) == 1, (
            f"{conversation} turn {index} asked {fake.count(conversation, index)}x"
        )
    assert journaled and max(journaled.values()) == 1
    assert len(journaled) == turns.count(), "each batched turn journaled as one Turn"
    assert set(model.answered.values()) == {1}, "the model answered each turn once"


def assert_the_point_was_recovered(point: str, runs: dict[uuid.UUID, Case], pid: int, logs: Path) -> None:
    """The kill did what the case is about: the road it leaves for recovery was taken."""
    if point in ("queued", "recorded"):
        # The step's worker died holding the run: another worker took the run over.
        taken = Event.objects.filter(
            run_id__in=list(runs), kind="lease_takeover", detail__previous_owner__endswith=f":{pid}"
        )
        assert taken.exists(), f"no run was taken over from the killed step's process {pid}"
    elif point == "opened":
        lost = MessageBatch.objects.filter(status="failed", provider_id="")
        assert [b.error for b in lost] == ["the create request went without an answer and never landed"]
    elif point == "created":
        text = "".join(path.read_text(errors="replace") for path in logs.glob("worker-*.log"))
        assert "its lost create had landed as" in text, "the lost create was adopted (batcher's warning)"
        assert not MessageBatch.objects.filter(status="failed").exists()
    else:
        assert MessageBatch.objects.filter(request_count__gte=2, status="ended").exists()
        assert not MessageBatch.objects.filter(status="failed").exists()

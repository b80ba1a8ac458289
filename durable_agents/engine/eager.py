"""Eager continuation: the task that committed a step claims the run's next step itself, without a broker hop.

A task sent for a run advances it one step as always; if that step was a plain checkpoint (not the run's last)
and the slice allows — the task has run for less than EAGER_SLICE_MS, it has run fewer than EAGER_MAX_STEPS
steps after its first, and the next step belongs to a queue this worker serves (with a MODEL_QUEUE, a
model-bound step goes to the model queue's workers, a plain one to the default queue's) — it sends no wake-up
and claims the run again: a new claim with a new fencing token, by the rules of a fresh delivery's. On Postgres
the commit's own statement makes that claim (hotpath.commit_and_claim: the checkpoint of step N, then the claim
and load of step N+1 on the row as the checkpoint left it — one statement per step), so whether the slice would
go on is decided before the commit; elsewhere the claim is a second statement. Anything else ends the slice and
the run is handed on exactly as before: a wait, a retry (with its delay), a failure, a re-plan or version
check, a completion, a cancel request, an exception. Either setting at 0 keeps strictly one step per task.

What holds (the guarantees of DESIGN.md §2 are those of one step per task, step by step):

* Each step is still one claim and one fenced checkpoint. A duplicate delivery, the sweep or a thawed zombie
  meets the same lease: while a slice holds the run nobody else runs its step, and a slice's claim that finds
  the run held, finished, parked or not found simply ends the slice (the holder owns the run's next wake-up).
  A claim refused because a cancel is requested settles the cancellation, as a fresh delivery would.
* A wake-up is never lost. The wake-up for the next step is left unsent only when this task goes on to claim
  it; if that claim raises (the database unreachable; on Postgres, the statement that commits and claims), the
  wake-up is sent before the error propagates. If
  the worker dies between the commit and the next claim, the run is running with its lease released and no
  message sent for it, and two things wake it: the task's own message, acknowledged only when the whole slice
  returns (acks_late, requeued when a pool process is lost), is delivered again and its claim takes the
  step under the cursor (a message carries a run, never a step, so a redelivery after a commit advances);
  and the sweep re-wakes a runnable run with a free lease and no progress for IDLE_RESWEEP_SECONDS. A death
  after the next claim is a death mid-step: the lease expires and the sweep re-wakes the run. A claim made by a
  commit is as old as that commit: a task paused after it (a slow signal receiver, SIGSTOP) proves the lease again
  before the step body runs, as it would for a claim of its own (Claim.taken).
* A step body runs at least once, and again only after a death or a lost lease, as with one step per task;
  effects through the effect API apply once (their keys do not depend on which task ran the step).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from durable_agents.conf import settings
from durable_agents.engine.lease import Claim
from durable_agents.engine.wake import next_kind, queue_for, wake
from durable_agents.models import Step

# The default queue's steps (None: not the model queue), which a worker of a plain delivery runs.
DEFAULT_QUEUE = frozenset({None})


@dataclass(frozen=True)
class Kept:
    """A run this task goes on with: the next step's claim made by the commit itself (`made`; `claimed` None if
    that claim was refused, as a claim of its own would have been), or (not `made`) a claim still to make."""

    made: bool
    claimed: tuple[Claim, Step | None] | None = None


@dataclass
class Batch:
    """The runs of one message (a batched wake-up, engine/wake.py), advanced one after another in one slice.

    The commit of a run's last step may claim the batch's next run in the same statement (hotpath.
    commit_and_claim_next) while the slice lasts: that claim is the one the next run's own statement would have
    made, and the task must then advance that run whatever the time (it holds its lease)."""

    ends_by: float
    following: uuid.UUID | None = None
    _claimed_for: uuid.UUID | None = None
    _claimed: tuple[Claim, Step | None] | None = None

    @classmethod
    def start(cls) -> Batch:
        """A batch whose slice starts now."""
        return cls(ends_by=time.monotonic() + float(settings.EAGER_SLICE_MS) / 1000)

    def is_open(self) -> bool:
        return time.monotonic() < self.ends_by

    def next_to_claim(self) -> uuid.UUID | None:
        """The run a last step's commit may claim now: the next of the batch, while the slice lasts."""
        return self.following if self.following is not None and self.is_open() else None

    def claimed(self, run_id: uuid.UUID, claimed: tuple[Claim, Step | None]) -> None:
        """A commit claimed `run_id` (the next run) for this task."""
        self._claimed_for, self._claimed = run_id, claimed

    def holds(self, run_id: uuid.UUID) -> bool:
        """True if this task already holds `run_id`'s claim, made by the commit of the run before it."""
        return self._claimed_for == run_id

    def take(self, run_id: uuid.UUID) -> tuple[Claim, Step | None] | None:
        """The claim a commit made for `run_id`, once (None: none was made; the run claims for itself)."""
        if self._claimed_for != run_id:
            return None
        claimed, self._claimed_for, self._claimed = self._claimed, None, None
        return claimed


@dataclass
class Slice:
    """One task's budget of eager steps, and whether its last commit kept the run for this task."""

    serves: frozenset[str | None]
    deadline: float
    steps_left: int
    kept: Kept | None = None
    batch: Batch | None = None

    @classmethod
    def start(cls, serves: frozenset[str | None] = DEFAULT_QUEUE, batch: Batch | None = None) -> Slice:
        """A slice starting now, for a worker that runs the steps woken on `serves` (None: the default queue);
        in `batch`, it ends with the batch's slice at the latest."""
        slice_seconds = float(settings.EAGER_SLICE_MS) / 1000
        steps = int(settings.EAGER_MAX_STEPS) if slice_seconds > 0 else 0
        deadline = time.monotonic() + slice_seconds
        if batch is not None:
            deadline = min(deadline, batch.ends_by)
        return cls(serves=serves, deadline=deadline, steps_left=steps, batch=batch)

    def is_open(self) -> bool:
        """True if the slice may run another step: decided before a commit, which may then claim it too."""
        return self.steps_left > 0 and time.monotonic() < self.deadline

    def runs(self) -> tuple[bool, bool]:
        """Whether this task runs (a model-bound step, any other step) itself: with a MODEL_QUEUE, a step goes to
        its own queue's workers."""
        model_queue = settings.MODEL_QUEUE
        if not model_queue or (settings.REPLAY_QUEUE and settings.REPLAY_QUEUE in self.serves):
            return True, True
        return model_queue in self.serves, None in self.serves

    def hand_on(self, run_id: uuid.UUID) -> None:
        """After a plain checkpoint of a step that is not the run's last: keep the run for this task's next claim
        if the slice allows, else wake it through the broker as one step per task does."""
        if not self.is_open():
            wake(run_id)
            return
        kind = None
        if settings.MODEL_QUEUE or settings.REPLAY_QUEUE:
            try:
                kind = next_kind(run_id)
            except Exception:  # noqa: BLE001 - the safe way on is the broker; wake() says if it cannot either
                wake(run_id)
                return
            if queue_for(run_id, kind or "") not in self.serves:
                wake(run_id, kind=kind)
                return
        self._keep(Kept(made=False))

    def carry_on(self, run_id: uuid.UUID, claimed: tuple[Claim, Step | None] | None, kind: str | None) -> None:
        """After a commit that claimed the next step in the same statement (`claimed`; None if it could not): go on
        with it — or, if it was not claimed because another queue's workers run it, wake them."""
        if claimed is None and queue_for(run_id, kind or "") not in self.serves:
            wake(run_id, kind=kind)
            return
        self._keep(Kept(made=True, claimed=claimed))

    def _keep(self, kept: Kept) -> None:
        self.steps_left -= 1
        self.kept = kept

    def take(self) -> Kept | None:
        """Once after each commit that kept the run for this task: how it goes on."""
        kept, self.kept = self.kept, None
        return kept


__all__ = ["DEFAULT_QUEUE", "Batch", "Kept", "Slice"]

"""The chaos workload: refund_agent runs on orders of their own, Claude played through the fake Messages API,
and the invariant checks every chaos test ends with.

The fake answers with the refund example's own policy (`project.refunds.script.next_move`, the scripted
participant the demo uses), after a model-like pause, so the worker's "anthropic" participant runs the whole
SDK path. Its tool_use ids are minted by the fake on every answer: a turn asked twice would get new ids, hence
new effect keys, hence a second refund — which is why "0 duplicate refunds" is a strong check.

To run the loops against another workflow, change WORKFLOW and `Case.run_input` here (one place).
"""

from __future__ import annotations

import itertools
import os
import random
import statistics
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from decimal import Decimal

import pytest
from django.db import InterfaceError, OperationalError, connections
from django.utils import timezone

from durable_agents import api
from durable_agents.models import Effect, EffectStatus, Event, Run, RunStatus, Step, StepStatus, Turn
from durable_agents.testing.fake_anthropic import FakeAnthropic, Fault, RecordedRequest, Reply
from project.refunds.models import Order, OrderStatus, OutboundEmail, Refund
from project.refunds.script import next_move
from tests.chaos.apps import COMMIT_PREFIX, PID_HEADER
from tests.testapp.models import Execution

WORKFLOW = "refund_agent"
STEPS = ("load_order", "resolve", "review_email")
# Events after which a step executes again, so a turn that never got journaled may be asked again.
INTERRUPTIONS = ("lease_takeover", "step_retry", "zombie_commit_rejected")
MESSAGES_PATH = "/v1/messages"


def scale() -> float:
    """DURABLE_CHAOS_SCALE (default 1): every chaos count is multiplied by it."""
    value = float(os.environ.get("DURABLE_CHAOS_SCALE", "1"))
    if value <= 0:
        raise ValueError(f"DURABLE_CHAOS_SCALE must be > 0, got {value}")
    return value


def timeout() -> pytest.MarkDecorator:
    """The pytest-timeout of a chaos test: ten minutes at scale 1, growing with DURABLE_CHAOS_SCALE."""
    return pytest.mark.timeout(int(600 * max(1.0, scale())))


def scaled(count: int, minimum: int = 1) -> int:
    """`count` at scale 1, linear in DURABLE_CHAOS_SCALE."""
    return max(minimum, round(count * scale()))


# --- Cases: one order per run, so no two runs share a refundable amount ------------------------------------


@dataclass(frozen=True)
class Case:
    """One customer request on an order of its own, and the refund it must end with (None: no refund)."""

    number: str
    kind: str
    message: str
    paid: Decimal
    status: str
    refund: Decimal | None

    @property
    def run_input(self) -> dict[str, str]:
        return {"order_id": self.number, "message": self.message}


_ORDER_NUMBERS = itertools.count(100_001)
ITEMS = ("ceramic mug", "desk lamp", "rain jacket", "pour-over set", "phone case", "yoga mat", "teapot")


def make_cases(count: int, rng: random.Random, prefix: str = "C") -> list[Case]:
    """`count` cases: full refunds, shipping refunds, questions and unpaid orders (refunds stay <= 50.00,
    below the approval threshold, so no run waits for a human)."""
    cases = []
    for _ in range(count):
        number = f"{prefix}-{next(_ORDER_NUMBERS)}"  # the scripts read "order X-123"; unique in this process
        kind = rng.choices(("refund", "shipping", "question", "unpaid"), weights=(45, 20, 20, 15))[0]
        item = rng.choice(ITEMS)
        price = Decimal(rng.randrange(500, 4500)) / 100
        if kind == "refund":
            message = f"My {item} arrived broken. Could I get a refund, please?"
            cases.append(Case(number, kind, message, price, OrderStatus.DELIVERED, price))
        elif kind == "shipping":
            message = "I was charged €4.95 for shipping although my free-shipping code was accepted. Please refund it."
            cases.append(Case(number, kind, message, price + Decimal("4.95"), OrderStatus.DELIVERED, Decimal("4.95")))
        elif kind == "question":
            cases.append(Case(number, kind, f"Hello! When will my {item} arrive?", price, OrderStatus.SHIPPED, None))
        else:
            cases.append(Case(number, kind, "Please refund me, I changed my mind.", price, OrderStatus.PLACED, None))
    return cases


def seed(cases: Iterable[Case], *, using: str = "default") -> None:
    """Create the orders of `cases`."""
    now = timezone.now()
    Order.objects.using(using).bulk_create(
        Order(
            number=case.number,
            customer_name=f"Chaos Customer {case.number}",
            customer_email=f"{case.number.lower()}@example.com",
            status=case.status,
            amount_paid=case.paid if case.status != OrderStatus.PLACED else Decimal("0.00"),
            lines=[{"item": "goods", "quantity": 1, "price": str(case.paid)}],
            placed_at=now - timedelta(days=3),
            shipped_at=now - timedelta(days=2) if case.status != OrderStatus.PLACED else None,
            delivered_at=now - timedelta(days=1) if case.status == OrderStatus.DELIVERED else None,
        )
        for case in cases
    )


def start(case: Case) -> uuid.UUID:
    return api.start(WORKFLOW, case.run_input).id


# --- The model's side ---------------------------------------------------------------------------------------


def script_reply(request: RecordedRequest) -> Reply:
    """Claude's answer, as the refund example's scripted participant would give it."""
    tools = [tool["name"] for tool in request.body.get("tools") or []]
    blocks = next_move(request.messages, tools)
    stop = "tool_use" if any(block["type"] == "tool_use" for block in blocks) else "end_turn"
    return Reply(content=blocks, stop_reason=stop)


@dataclass
class Model:
    """The fake's responder: the script after a model-like pause, with optional injected faults.

    `fault(request)` returns a Fault to serve instead of the answer, or None. Every answer and every fault
    served is counted per (conversation, turn), so a test can tell answered requests from failed ones.
    """

    latency: tuple[float, float] = (0.05, 0.25)
    fault: Callable[[RecordedRequest], Fault | None] | None = None
    seed: int = 0
    answered: Counter[tuple[str, int]] = field(default_factory=Counter)
    faults: list[tuple[str, int, str, bool]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def __call__(self, request: RecordedRequest) -> Reply | Fault:
        key = (request.conversation, request.turn)
        fault = self.fault(request) if self.fault else None
        with self._lock:
            pause = self._rng.uniform(*self.latency)
            if fault is not None:
                self.faults.append((*key, fault_name(fault), request.stream))
            else:
                self.answered[key] += 1
        if fault is not None:
            return fault
        time.sleep(pause)
        return script_reply(request)


def fault_name(fault: Fault) -> str:
    if fault.kind == "status":
        return str(fault.status_code)
    if fault.kind == "delay":
        return "timeout"
    if fault.kind == "reset":
        return "reset-mid-stream" if fault.mid_stream else "reset"
    return "stream-error"


# --- Invariants -----------------------------------------------------------------------------------------------


@dataclass
class Report:
    """What the checks found: figures to print, and every broken invariant (empty when all hold)."""

    runs: int = 0
    statuses: Counter[str] = field(default_factory=Counter)
    refunds: int = 0
    emails: int = 0
    effects: int = 0
    turns: int = 0
    requests: int = 0
    reasked: int = 0
    executions: int = 0
    commits: int = 0
    zombie_asks: int = 0
    zombie_executions: int = 0
    problems: list[str] = field(default_factory=list)

    def fail(self, message: str) -> None:
        self.problems.append(message)

    def summary(self) -> str:
        return (
            f"runs {self.runs} {dict(self.statuses)}; effects {self.effects} (refunds {self.refunds}, emails "
            f"{self.emails}); turns journaled {self.turns}, model requests {self.requests}, turns asked again before "
            f"being journaled (after a lost worker or a retry) {self.reasked}; step executions {self.executions}, "
            f"step commits {self.commits}"
        )

    def assert_ok(self) -> None:
        shown = "\n  ".join(self.problems[:25])
        more = f"\n  ... and {len(self.problems) - 25} more" if len(self.problems) > 25 else ""
        assert not self.problems, f"{len(self.problems)} broken invariants ({self.summary()}):\n  {shown}{more}"


def check(
    runs: dict[uuid.UUID, Case],
    fake: FakeAnthropic,
    *,
    using: str = "default",
    expect: str = RunStatus.COMPLETED,
    strict_turns: bool = False,
) -> Report:
    """Check the chaos invariants over `runs` (run id → its case):

    1. every run is terminal, with status `expect`;
    2. effects happen once: every Effect row is `applied`; each order has exactly the refund its case
       expects (Refund rows, unique idempotency keys) and exactly one email, each made under the key of an
       applied Effect of its run;
    3. no step is committed twice: no step body started after its checkpoint committed (Execution rows with
       after_commit), at most one fenced commit per step (`commit:` rows), every live step `done`;
    4. no model turn is requested again once journaled: for every journaled Turn (conversation
       "<run>:<step>", turn t), no request for (conversation, t) reached the fake after the Turn row was
       written, and the requests before it number at most 1 + the interruptions of that run in between
       (lease takeovers, retries, rejected zombie commits: the only ways a step executes again). With
       `strict_turns` (no kills, no faults) every journaled turn was requested exactly once, unless a worker
       lost its lease to another meanwhile (a machine busy enough that a heartbeat missed the lease).

    The one thing no check-then-act can close is allowed, and only that: a worker that lost its lease (frozen by
    SIGSTOP, or starved on a busy machine until its lease ran out) between proving its lease and acting may
    still start the step body it was about to start or send the model request it was about to send — at most
    one such act per lost lease, by that process, after another worker took the run over. Its request is never
    journaled and its usage is counted (an `unjournaled_usage` event); its commit is rejected (3. still holds).
    Counted in `zombie_executions` and `zombie_asks`; anything else after a commit or a journal still fails.
    """
    report = Report(runs=len(runs))
    ids = list(runs)
    run_rows = {r.id: r for r in Run.objects.using(using).filter(id__in=ids)}
    for run_id, case in runs.items():
        run = run_rows.get(run_id)
        status = run.status if run else "missing"
        report.statuses[status] += 1
        if status != expect:
            report.fail(
                f"run {run_id} ({case.number}, {case.kind}) is {status}, expected {expect}: {run and run.error}"
            )
    acts = _ZombieActs(report, list(runs), using)
    _check_effects(report, runs, using)
    _check_steps(report, runs, using, acts)
    _check_turns(report, runs, fake, using, strict=strict_turns, acts=acts)
    acts.check()
    return report


@dataclass(frozen=True)
class _Takeover:
    """A worker lost its lease on a run to another worker: the only way a zombie comes to be (a SIGSTOP, a
    SIGKILL's survivor thread, or just a machine so busy that its heartbeat missed the lease)."""

    run_id: uuid.UUID
    pid: int
    at: float


class _ZombieActs:
    """Acts of zombies (a step body started after its commit, a request after its turn's journal): each must be
    by a process that lost its lease on that run before the act, at most one act per lost lease."""

    def __init__(self, report: Report, runs: Sequence[uuid.UUID], using: str) -> None:
        self.report = report
        self.takeovers: dict[tuple[uuid.UUID, int], list[_Takeover]] = defaultdict(list)
        events = Event.objects.using(using).filter(run_id__in=list(runs), kind="lease_takeover").order_by("id")
        for run_id, detail, at in events.values_list("run_id", "detail", "created_at"):
            pid = str(detail.get("previous_owner", "")).rsplit(":", 1)[-1]
            if pid.isdigit():
                self.takeovers[(run_id, int(pid))].append(_Takeover(run_id, int(pid), at.timestamp()))
        self.acts: dict[_Takeover, list[str]] = defaultdict(list)

    def allow(self, run_id: uuid.UUID, pid: int, at: float, what: str) -> bool:
        """True if `what` (by `pid` at `at`) is the act of a zombie of that run; counted against its lost lease."""
        lost = [t for t in self.takeovers.get((run_id, pid), []) if t.at <= at]
        if not lost:
            return False
        self.acts[lost[-1]].append(what)
        return True

    def check(self) -> None:
        for takeover, acts in self.acts.items():
            if len(acts) > 1:
                self.report.fail(f"process {takeover.pid} acted {len(acts)} times after losing one lease: {acts}")


def _check_effects(report: Report, runs: dict[uuid.UUID, Case], using: str) -> None:
    effects = list(Effect.objects.using(using).filter(run_id__in=list(runs)))
    report.effects = len(effects)
    applied = {e.idempotency_key: e for e in effects if e.status == EffectStatus.APPLIED}
    for effect in effects:
        if effect.status != EffectStatus.APPLIED:
            report.fail(f"effect {effect.idempotency_key} ({effect.tool}) is {effect.status}, not applied")
    refunds = defaultdict(list)
    for refund in (
        Refund.objects.using(using).select_related("order").filter(order__number__in=[c.number for c in runs.values()])
    ):
        refunds[refund.order.number].append(refund)
    emails = defaultdict(list)
    for email in (
        OutboundEmail.objects.using(using)
        .select_related("order")
        .filter(order__number__in=[c.number for c in runs.values()])
    ):
        emails[email.order.number].append(email)
    for run_id, case in runs.items():
        made = refunds[case.number]
        report.refunds += len(made)
        expected = [case.refund] if case.refund is not None else []
        if sorted(r.amount for r in made) != expected:
            report.fail(f"{case.number} ({case.kind}): refunds {[str(r.amount) for r in made]}, expected {expected}")
        sent = emails[case.number]
        report.emails += len(sent)
        if len(sent) != 1:
            report.fail(f"{case.number} ({case.kind}): {len(sent)} emails, expected exactly 1")
        for row in [*made, *sent]:
            effect = applied.get(row.idempotency_key)
            if effect is None or effect.run_id != run_id:
                report.fail(f"{case.number}: {type(row).__name__} {row.pk} has no applied effect of run {run_id}")


def _check_steps(report: Report, runs: dict[uuid.UUID, Case], using: str, acts: _ZombieActs) -> None:
    executions = list(Execution.objects.using(using).filter(run_id__in=list(runs)))
    commits = Counter((e.run_id, e.step_id) for e in executions if e.step_id.startswith(COMMIT_PREFIX))
    report.executions = sum(1 for e in executions if not e.step_id.startswith(COMMIT_PREFIX))
    report.commits = sum(commits.values())
    for execution in executions:
        if not execution.after_commit:
            continue
        what = f"run {execution.run_id}: step {execution.step_id} executed again after its commit"
        if acts.allow(execution.run_id, execution.pid, execution.at.timestamp(), what):
            report.zombie_executions += 1
        else:
            report.fail(what)
    for (run_id, step_id), n in commits.items():
        if n > 1:
            report.fail(f"run {run_id}: step {step_id.removeprefix(COMMIT_PREFIX)} committed {n} times")
    live = defaultdict(dict)
    for step in Step.objects.using(using).live().filter(run_id__in=list(runs)):
        live[step.run_id][step.step_id] = step.status
    for run_id in runs:
        if live[run_id] != dict.fromkeys(STEPS, StepStatus.DONE):
            report.fail(f"run {run_id}: live steps {live[run_id]}, expected all of {STEPS} done")


def _check_turns(
    report: Report, runs: dict[uuid.UUID, Case], fake: FakeAnthropic, using: str, *, strict: bool, acts: _ZombieActs
) -> None:
    requests: dict[tuple[str, int], list[float]] = defaultdict(list)
    senders: dict[tuple[str, int], list[tuple[float, int]]] = defaultdict(list)
    for request in fake.requests:
        if request.path == MESSAGES_PATH:
            requests[(request.conversation, request.turn)].append(request.time)
            pid = request.headers.get(PID_HEADER, "")
            senders[(request.conversation, request.turn)].append((request.time, int(pid) if pid.isdigit() else 0))
    unjournaled: dict[uuid.UUID, list[float]] = defaultdict(list)
    for run_id, at in (
        Event.objects.using(using)
        .filter(run_id__in=list(runs), kind="unjournaled_usage")
        .values_list("run_id", "created_at")
    ):
        unjournaled[run_id].append(at.timestamp())
    interruptions: dict[uuid.UUID, list[float]] = defaultdict(list)
    takeovers: dict[uuid.UUID, list[float]] = defaultdict(list)
    for run_id, kind, at in (
        Event.objects.using(using)
        .filter(run_id__in=list(runs), kind__in=INTERRUPTIONS)
        .values_list("run_id", "kind", "created_at")
    ):
        interruptions[run_id].append(at.timestamp())
        if kind == "lease_takeover":
            takeovers[run_id].append(at.timestamp())
    journaled = set()
    turns = Turn.objects.using(using).filter(run_id__in=list(runs)).select_related("step")
    for turn in turns.only("run_id", "index", "purpose", "created_at", "step__step_id"):
        # The fake numbers a request by its assistant messages: the agent's turn index, 0 for a judge's verdict.
        key = (f"{turn.run_id}:{turn.step.step_id}", turn.index if turn.purpose == "turn" else 0)
        journaled.add(key)
        report.turns += 1
        asked = sorted(requests.get(key, []))
        written = turn.created_at.timestamp()
        late = [t for t in asked if t > written]
        if late:
            what = f"{key[0]} turn {key[1]} was requested {len(late)} more time(s) after it was journaled"
            # Who asked late: the pid each request carried (tests/chaos/apps.py).
            late_senders = [(at, pid) for at, pid in senders[key] if at > written]
            if all(acts.allow(turn.run_id, pid, at, what) for at, pid in late_senders):
                report.zombie_asks += len(late)
                counted = [t for t in unjournaled[turn.run_id] if t >= min(late)]
                if len(counted) < len(late):
                    report.fail(f"{what}, by a thawed zombie, but its usage was not counted (unjournaled_usage)")
            else:
                report.fail(f"{what}, by processes {sorted({pid for _, pid in late_senders})} that held no lost lease")
            asked = [t for t in asked if t <= written]
        if not asked:
            report.fail(f"{key[0]} turn {key[1]} is journaled but the model was never asked for it")
            continue
        if len(asked) > 1:
            report.reasked += 1
        lost = sum(1 for t in interruptions[turn.run_id] if asked[0] <= t <= written)
        # Strict (no kills, no faults): only a lease lost on a busy machine may have asked a turn again.
        allowed = sum(1 for t in takeovers[turn.run_id] if asked[0] <= t <= written) if strict else lost
        if len(asked) - 1 > allowed:
            report.fail(
                f"{key[0]} turn {key[1]} was requested {len(asked)} times with {lost} interruption(s) of the run "
                "before it was journaled: a turn was asked again without a lost worker or a retry"
            )
    for key, times in requests.items():
        report.requests += len(times)
        run_id = _run_of(key[0])
        if run_id in runs and key not in journaled:
            later = [t for t in interruptions[run_id] if t >= min(times)]
            if not later:
                report.fail(f"{key[0]} turn {key[1]} was requested {len(times)} time(s) but never journaled")


def _run_of(conversation: str) -> uuid.UUID | None:
    try:
        return uuid.UUID(conversation.split(":", 1)[0])
    except ValueError:
        return None


# --- Figures --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Kill:
    """One SIGKILL (or SIGSTOP): when, what, and the runs whose lease the victim held."""

    at: datetime
    kind: str
    pids: tuple[int, ...]
    runs: tuple[uuid.UUID, ...]


def recoveries(kills: Sequence[Kill], *, using: str = "default") -> list[float]:
    """Seconds from each kill to the moment another worker took over a run the victim held (its lease expired,
    the sweep re-woke the run, a worker claimed it): how long a run stands still after losing its worker."""
    seconds = []
    for kill in kills:
        for run_id in kill.runs:
            takeover = (
                Event.objects.using(using)
                .filter(run_id=run_id, kind="lease_takeover", created_at__gt=kill.at)
                .order_by("id")
                .values_list("created_at", flat=True)
                .first()
            )
            if takeover is not None:
                seconds.append((takeover - kill.at).total_seconds())
    return seconds


def percentiles(values: Sequence[float]) -> str:
    if not values:
        return "n/a"
    ordered = sorted(values)
    p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
    return f"p50 {statistics.median(ordered):.2f}s, p95 {p95:.2f}s, max {ordered[-1]:.2f}s (n={len(ordered)})"


def lease_holders(run_ids: Iterable[uuid.UUID], *, using: str = "default") -> dict[uuid.UUID, int]:
    """Runs currently leased by a process, with that process's pid (lease_owner is host:pid)."""
    held = {}
    rows = Run.objects.using(using).filter(id__in=list(run_ids), status=RunStatus.RUNNING).exclude(lease_owner="")
    for run_id, owner in rows.values_list("id", "lease_owner"):
        pid = owner.rsplit(":", 1)[-1]
        if pid.isdigit():
            held[run_id] = int(pid)
    return held


def unfinished(run_ids: Iterable[uuid.UUID], *, using: str = "default") -> list[uuid.UUID]:
    finished = ("completed", "failed", "cancelled")
    return list(
        Run.objects.using(using).filter(id__in=list(run_ids)).exclude(status__in=finished).values_list("id", flat=True)
    )


def wait_until_finished(run_ids: Iterable[uuid.UUID], *, timeout: float, using: str = "default") -> list[uuid.UUID]:
    """Poll until every run is terminal or `timeout` passes; returns those still unfinished."""
    left = list(run_ids)
    deadline = time.monotonic() + timeout
    while True:
        try:
            left = unfinished(left, using=using)
        except (OperationalError, InterfaceError):
            connections[using].close()  # the database restarts under the test: ask again on a new connection
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


def describe(run_ids: Iterable[uuid.UUID], *, using: str = "default") -> str:
    """Where unfinished runs stand, for a failure message."""
    lines = []
    for run in Run.objects.using(using).filter(id__in=list(run_ids))[:10]:
        last = Event.objects.using(using).filter(run=run).order_by("-id").first()
        lines.append(
            f"{run.id} {run.status} cursor {run.cursor}/{run.step_count} attempt {run.attempt} "
            f"lease {run.lease_owner or '-'} wake_at {run.wake_at} last event {last and (last.kind, last.detail)}"
        )
    return "\n  ".join(lines)

"""The one-command demo: refund agents on real workers, one worker SIGKILLed mid-run, no refund made twice.

What it does, on whatever DATABASE_URL and CELERY_BROKER_URL say (SQLite and a broker in files by default):
seeds five orders, starts a refund_agent run per customer message on two `celery worker` subprocesses,
prints what happens as it happens, SIGKILLs the worker holding a run between its refund and its email,
starts another worker, approves the one refund above 50.00 after a pause (the run holds nothing while it
waits), and ends with a summary (report.py). True only if every run ended as expected.

The agent: Claude when ANTHROPIC_API_KEY is set; with `stand_in`, Claude's default model played through the real
SDK by the strict stand-in of the Messages API (durable_agents.testing.fake_anthropic: thinking blocks with
signatures, prefill and forced tool choice refused, every request checked against the documented rules);
else the scripted participant, offline. With `batch` (`--batch`, which implies the stand-in), the reviewer's turns go
through the stand-in's Message Batches endpoints at half price: each run parks while its batch processes, the
workers' sweep sends the batcher, and the feed shows each turn queued, sent, answered and its cost.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

from django.conf import settings
from django.utils import timezone

from durable_agents import api
from durable_agents.conf import settings as durable_settings
from durable_agents.models import (
    BatchTurn,
    BatchTurnStatus,
    Effect,
    EffectKind,
    EffectStatus,
    Event,
    Run,
    RunStatus,
    Turn,
    Wait,
    WaitKind,
    WaitStatus,
)
from durable_agents.testing import WorkerProcess
from durable_agents.testing.fake_anthropic import FakeAnthropic
from project import tracing as project_tracing
from project.refunds import workflows
from project.refunds.models import money
from project.refunds.report import Kill, Outcome, report
from project.refunds.script import THINK_SECONDS, stand_in_reply
from project.refunds.seed import CASES, Case, seed_shop
from project.refunds.tools import REFUND_APPROVAL_ABOVE

WORKFLOW = "refund_agent"
POLL_SECONDS = 0.1
# The demo's workers recover a killed worker's run within seconds: a short lease, a frequent sweep.
WORKER_ENV_DEFAULTS = {"DURABLE_LEASE_SECONDS": "3", "DURABLE_SWEEP_SECONDS": "1", "DURABLE_IDLE_RESWEEP_SECONDS": "3"}
# --batch: the stand-in's batches end after BATCH_PROCESSING_SECONDS; the batcher sends within half a second and
# polls every second, so the demo sees a batch's whole life in seconds (the API's: minutes to 24 h).
BATCH_PROCESSING_SECONDS = 3.0
BATCH_WORKER_ENV = {
    "REFUNDS_REVIEW_DELIVERY": "batch",
    "DURABLE_BATCH_WINDOW_SECONDS": "0.5",
    "DURABLE_BATCH_POLL_SECONDS": "1",
    "DURABLE_BATCH_POLL_MAX_SECONDS": "1",
}


@dataclass
class Demo:
    """One demo: its runs by id, its workers, and what happened so far."""

    write: Callable[[str], None]
    started: datetime = field(default_factory=timezone.now)
    runs: dict[uuid.UUID, Case] = field(default_factory=dict)
    workers: dict[str, WorkerProcess] = field(default_factory=dict)
    kill: Kill | None = None
    batch: bool = False
    approved_at: datetime | None = None
    clock: float = 0.0

    def say(self, text: str, *, at: datetime | None = None, order: str = "") -> None:
        # Lines come from several tables, polled: keep the clock on screen from running backwards.
        self.clock = max(self.clock, ((at or timezone.now()) - self.started).total_seconds())
        self.write(f"{self.clock:6.1f}s  {order:<7} {text}".rstrip())

    def order_of(self, run_id: uuid.UUID) -> str:
        return self.runs[run_id].number


def run_demo(
    write: Callable[[str], None] = print,
    *,
    timeout: float = 180.0,
    approve_after: float = 3.0,
    kill_fallback_after: float = 20.0,
    stand_in: bool = False,
    batch: bool = False,
) -> bool:
    """Run the demo; True if every run ended as expected and the SIGKILL landed mid-run (with `batch`: and every
    review was answered in a Message Batch)."""
    demo = Demo(write, batch=batch)
    fake = None
    if stand_in or batch:
        fake = FakeAnthropic(
            responder=stand_in_reply, latency=THINK_SECONDS, batch_processing_seconds=BATCH_PROCESSING_SECONDS
        ).start()
    try:
        return _run(demo, timeout, approve_after, kill_fallback_after, fake)
    finally:
        if fake is not None:
            fake.stop()
            refused = _refused(fake)
            if refused:
                write(f"The stand-in refused {len(refused)} request(s); the first: {refused[0]}")


def _run(
    demo: Demo, timeout: float, approve_after: float, kill_fallback_after: float, fake: FakeAnthropic | None
) -> bool:
    _header(demo, fake)
    _cancel_leftovers(demo)
    seed_shop()
    _show_orders(demo)
    log_dir = Path(settings.VAR_DIR) / "demo"
    log_dir.mkdir(parents=True, exist_ok=True)
    worker_env = {name: os.environ.get(name, value) for name, value in WORKER_ENV_DEFAULTS.items()}
    worker_env["DURABLE_VAR_DIR"] = str(settings.VAR_DIR)
    if fake is not None:
        worker_env.update(fake.environ(api_key="stand-in-key"))
    if demo.batch:
        worker_env.update({name: os.environ.get(name, value) for name, value in BATCH_WORKER_ENV.items()})
    queues = [getattr(settings, "CELERY_TASK_DEFAULT_QUEUE", "celery"), durable_settings.MODEL_QUEUE]
    queues = [queue for queue in queues if queue]

    def start_worker(name: str) -> WorkerProcess:
        worker = WorkerProcess(
            name=f"demo-{name.lower()}-{os.getpid()}",
            beat=True,
            env=worker_env,
            log_path=log_dir / f"worker-{name}.log",
            cwd=settings.BASE_DIR,
            extra_args=["--queues", ",".join(queues)],  # every step: the demo has no model worker
        ).start()
        demo.workers[name] = worker
        demo.say(f"started worker {name} (pid {worker.pid}), a real `celery worker` process")
        return worker

    try:
        start_worker("A")
        start_worker("B")
        for case in CASES:
            with _customer_request(case):
                run = api.start(WORKFLOW, case.run_input)
            demo.runs[run.id] = case
            demo.say(f'run {str(run.id)[:8]} started: "{_clip(case.message, 70)}"', order=case.number)
        feed = Feed(demo)
        began = time.monotonic()
        try:
            while time.monotonic() - began < timeout:
                feed.poll()
                if demo.kill is None:
                    _maybe_kill(demo, start_worker, fallback=time.monotonic() - began > kill_fallback_after)
                _maybe_approve(demo, approve_after)
                if all(row.is_finished for row in feed.rows.values()):
                    feed.poll()
                    break
                time.sleep(POLL_SECONDS)
            else:
                demo.say(f"!! timed out after {timeout:.0f}s; worker logs are in {log_dir}")
        except KeyboardInterrupt:
            demo.say("!! interrupted; the next demo cancels the runs left active")
    finally:
        # Stopped, not killed: a worker's last spans are exported as it shuts down (with tracing on).
        for worker in demo.workers.values():
            if worker.process is not None and worker.process.poll() is None:
                worker.signal(signal.SIGTERM)
        for worker in demo.workers.values():
            worker.stop()
    outcome = Outcome(runs=demo.runs, kill=demo.kill, started=demo.started, log_dir=log_dir)
    batched = _report_batches(demo) if demo.batch else True
    passed = report(demo.write, outcome) and batched
    return passed and not (fake is not None and _refused(fake))


def _customer_request(case: Case) -> contextlib.AbstractContextManager[Any]:
    """With tracing on (OTEL_TRACES_EXPORTER), a run starts inside a span standing for the customer's request, as in
    a web app it starts inside the request's span (opentelemetry-instrumentation-django): its trace's root."""
    if not project_tracing.enabled():
        return contextlib.nullcontext()
    tracer = importlib.import_module("opentelemetry.trace").get_tracer("project.refunds.demo")
    return tracer.start_as_current_span(f"refund request {case.number}", attributes={"refunds.order": case.number})


def _report_batches(demo: Demo) -> bool:
    """The reviewer's turns through Message Batches: how many, in how many batches, at what price. True if every run's
    review was answered in a batch."""
    answered = BatchTurn.objects.filter(run_id__in=demo.runs, status=BatchTurnStatus.SUCCEEDED)
    cost = sum((turn.cost_usd for turn in answered), Decimal(0))
    batches = answered.values("batch").distinct().count()
    reviewed = set(answered.values_list("run_id", flat=True))
    demo.write(
        f"Reviews in Message Batches: {answered.count()} turn(s) of {len(reviewed)} run(s) in {batches} batch(es), "
        f"${cost:.4f} at the batch price (${2 * cost:.4f} live: batches bill half)."
    )
    if reviewed != set(demo.runs):
        demo.write(f"!! {len(demo.runs) - len(reviewed)} run(s) were reviewed without a batch")
        return False
    return True


def _refused(fake: FakeAnthropic) -> list[str]:
    """What the stand-in refused (a 400 the real API would have sent): the demo fails on any."""
    return [request.refused for request in fake.requests if request.refused]


def _header(demo: Demo, fake: FakeAnthropic | None) -> None:
    engine = settings.DATABASES["default"]["ENGINE"].rsplit(".", 1)[-1]
    database = {"sqlite3": "SQLite", "postgresql": "Postgres"}.get(engine, engine)
    scheme = settings.CELERY_BROKER_URL.split("://", 1)[0]
    broker = {"filesystem": "a broker in files (no server)", "redis": "Redis", "amqp": "RabbitMQ"}.get(scheme, scheme)
    lease = os.environ.get("DURABLE_LEASE_SECONDS", WORKER_ENV_DEFAULTS["DURABLE_LEASE_SECONDS"])
    demo.write(f"durable_agents demo: a refund agent on {database}, {broker}, real celery workers, a {lease}s lease.")
    if demo.batch:
        demo.write(
            f"The reviewer sends its turns in Message Batches (half price) to the stand-in, whose batches take "
            f"{BATCH_PROCESSING_SECONDS:g}s; each run parks, holding no worker, until its batch answers."
        )
    if fake is not None:
        demo.write(
            f"The agent is Claude's default model ({durable_settings.DEFAULT_MODEL}) played by the strict stand-in of "
            f"the Messages API at {fake.url}: the real SDK, thinking blocks, the documented rules."
        )
    elif workflows.PARTICIPANT == "anthropic":
        demo.write(f"The agent is Claude ({durable_settings.DEFAULT_MODEL}): ANTHROPIC_API_KEY is set.")
    else:
        demo.write(
            f"The agent is {workflows.SCRIPT!r}, a scripted stand-in for Claude (offline, deterministic); "
            "set ANTHROPIC_API_KEY to talk to Claude."
        )
    demo.write("")


def _cancel_leftovers(demo: Demo) -> None:
    """Runs left active by an interrupted demo would act on the fresh orders: cancel them first."""
    for run in Run.objects.active().filter(workflow=WORKFLOW):
        api.cancel(run.id, "left over from an earlier demo", actor="durable_demo")
        demo.write(f"cancelled run {str(run.id)[:8]}, left active by an earlier demo")


def _show_orders(demo: Demo) -> None:
    demo.write("The shop's orders, and what each customer wrote:")
    for case in CASES:
        paid = money(case.paid)
        note = f", already refunded {money(case.already_refunded)}" if case.already_refunded else ""
        demo.write(f"  {case.number}  {case.customer:<12} {case.status:<9} paid {paid:>8}{note}")
        demo.write(f'           "{case.message}"')
    demo.write("")


def _maybe_kill(demo: Demo, start_worker: Callable[[str], WorkerProcess], *, fallback: bool) -> None:
    """SIGKILL the worker holding a run between its refund and its email (or, late, any run mid-step)."""
    held = dict(
        Run.objects.filter(pk__in=demo.runs, status=RunStatus.RUNNING)
        .exclude(lease_owner="")
        .values_list("id", "lease_owner")
    )
    if not held:
        return
    applied = Effect.objects.filter(run_id__in=held, kind=EffectKind.EFFECT, status=EffectStatus.APPLIED)
    refunded = set(applied.filter(tool="issue_refund").values_list("run_id", flat=True))
    emailed = set(applied.filter(tool="email_customer").values_list("run_id", flat=True))
    candidates = [(run_id, "between its refund and its email") for run_id in refunded - emailed]
    if fallback:
        candidates += [(run_id, "in the middle of a step") for run_id in held]
    for run_id, why in candidates:
        name, worker = next(((n, w) for n, w in demo.workers.items() if w.owns(held[run_id])), (None, None))
        if worker is None:
            continue
        worker.kill()
        demo.kill = Kill(name, worker.pid, run_id, demo.order_of(run_id), why, timezone.now())
        demo.say(
            f"!! SIGKILL worker {name} (pid {worker.pid}): it was running this order, {why}", order=demo.kill.order
        )
        next_name = chr(ord(max(demo.workers)) + 1)
        start_worker(next_name)
        return


def _maybe_approve(demo: Demo, approve_after: float) -> None:
    """A manager approves the open refund after a pause, once the SIGKILL happened (or nothing else runs)."""
    if demo.approved_at is not None:
        return
    opened = Wait.objects.filter(run_id__in=demo.runs, kind=WaitKind.APPROVAL, status=WaitStatus.OPEN)
    wait = opened.order_by("created_at").first()
    if wait is None or (timezone.now() - wait.created_at).total_seconds() < approve_after:
        return
    others_active = Run.objects.active().filter(pk__in=demo.runs).exclude(pk=wait.run_id).exists()
    if demo.kill is None and others_active:
        return
    demo.approved_at = timezone.now()
    api.decide(wait.pk, True, by="demo-manager", comment="Defective within the warranty period: approved.")


class Feed:
    """Prints what the runs do, read from the database: model turns, effects, waits, takeovers, endings."""

    SHOWN_EVENTS = ("lease_takeover", "waiting", "wait_decided", "step_retry", "redo_from_step")

    def __init__(self, demo: Demo) -> None:
        self.demo = demo
        self.last_turn = 0
        self.last_event = 0
        self.effects: set[int] = set()
        self.batch_stages: dict[int, int] = {}  # BatchTurn id → its stages shown (1 queued, 2 sent, 3 ended)
        self.rows: dict[uuid.UUID, Run] = {}

    def poll(self) -> None:
        lines: list[tuple[datetime, str, str]] = []
        ids = list(self.demo.runs)
        for turn in Turn.objects.filter(run_id__in=ids, pk__gt=self.last_turn).select_related("step").order_by("pk"):
            self.last_turn = turn.pk
            lines += [(turn.created_at, self.demo.order_of(turn.run_id), text) for text in _turn_lines(turn)]
        applied = Effect.objects.filter(run_id__in=ids, kind=EffectKind.EFFECT, status=EffectStatus.APPLIED)
        for effect in applied.exclude(pk__in=self.effects).order_by("applied_at"):
            self.effects.add(effect.pk)
            lines.append((effect.applied_at or timezone.now(), self.demo.order_of(effect.run_id), _effect_line(effect)))
        events = Event.objects.filter(run_id__in=ids, pk__gt=self.last_event).order_by("pk")
        for event in events:
            self.last_event = event.pk
            if event.kind in self.SHOWN_EVENTS and (event.detail or {}).get("wait_kind") != WaitKind.BATCH:
                lines.append((event.created_at, self.demo.order_of(event.run_id), self._event_line(event)))
        if self.demo.batch:
            lines += self._batch_lines(ids)
        for run in Run.objects.filter(pk__in=ids):
            before = self.rows.get(run.id)
            self.rows[run.id] = run
            if run.is_finished and (before is None or not before.is_finished):
                error = f": {run.error.get('type')}: {run.error.get('message')}" if run.error else ""
                lines.append(
                    (run.finished_at or timezone.now(), self.demo.order_of(run.id), f"■ run {run.status}{error}")
                )
        for at, order, text in sorted(lines, key=lambda line: line[0]):
            self.demo.say(text, at=at, order=order)

    def _batch_lines(self, ids: list[uuid.UUID]) -> list[tuple[datetime, str, str]]:
        """A batched turn's life, each stage shown once: queued (the run parks), sent in a batch, answered."""
        lines = []
        for turn in BatchTurn.objects.filter(run_id__in=ids).select_related("batch").order_by("pk"):
            shown = self.batch_stages.get(turn.pk, 0)
            order = self.demo.order_of(turn.run_id)
            batch = turn.batch.provider_id if turn.batch is not None else ""
            if shown < 1:
                lines.append(
                    (turn.created_at, order, "⧗ the reviewer's turn is queued for a Message Batch; the run parks")
                )
                shown = 1
            if shown < 2 and batch and turn.submitted_at is not None:  # the id comes with the API's answer
                lines.append((turn.submitted_at, order, f"→ sent in batch {batch}"))
                shown = 2
            if shown < 3 and turn.ended_at is not None:
                if turn.status == BatchTurnStatus.SUCCEEDED:
                    text = f"✓ batch {batch} answered: ${turn.cost_usd:.4f} at the batch price; the run wakes"
                else:
                    text = f"batch {batch or '(not sent)'}: the turn {turn.status}"
                lines.append((turn.ended_at, order, text))
                shown = 3
            self.batch_stages[turn.pk] = shown
        return lines

    def _event_line(self, event: Event) -> str:
        detail = event.detail or {}
        kill = self.demo.kill
        if event.kind == "lease_takeover":
            if kill is not None and event.run_id == kill.run_id and kill.recovered_at is None:
                kill.recovered_at = event.created_at
                after = (event.created_at - kill.at).total_seconds()
                return (
                    f"↻ another worker took the run over {after:.1f}s after the kill and replays its journal: "
                    "no turn is asked again, no refund repeated"
                )
            return "↻ another worker took the run over"
        if event.kind == "waiting":
            what = (
                f"a refund over {money(REFUND_APPROVAL_ABOVE)}" if detail.get("name") == "issue_refund" else "the run"
            )
            return f"⏸ {what} waits for a manager's approval; the run is parked and holds no worker"
        if event.kind == "wait_decided":
            return f"▶ {detail.get('decision')} by {event.actor}: {detail.get('comment', '')}"
        if event.kind == "redo_from_step":
            return f"↺ the reviewer sent the email back; {detail.get('target', 'resolve')} runs again with its reasons"
        error = detail.get("error") or {}
        return f"retrying {event.step_id} ({error.get('type', 'error')}: {_clip(str(error.get('message', '')), 60)})"


def _turn_lines(turn: Turn) -> list[str]:
    lines = []
    for block in turn.content or []:
        if block.get("type") == "tool_use":
            args: dict[str, Any] = block.get("input") or {}
            name = block.get("name")
            if name == "submit_verdict":
                verdict = "passed" if args.get("passed") else "failed"
                lines.append(f"review: {verdict} ({args.get('score')}): {_clip(str(args.get('reasons', '')), 70)}")
            elif name == "issue_refund":
                lines.append(f"agent → issue_refund({args.get('order_id')}, {args.get('amount')})")
            elif name == "email_customer":
                lines.append(f'agent → email_customer("{_clip(str(args.get("subject", "")), 60)}")')
            else:
                lines.append(f"agent → {name}({', '.join(str(v) for v in args.values())})")
        elif block.get("type") == "text" and turn.stop_reason == "end_turn" and turn.purpose == "turn":
            lines.append(f"agent: {_clip(block.get('text', ''), 90)}")
    return lines


def _effect_line(effect: Effect) -> str:
    result = effect.result or {}
    if effect.tool == "issue_refund":
        return f"✓ refund #{result.get('refund_id')} of {_money_of(result)} committed"
    if effect.tool == "email_customer":
        return f"✓ email #{result.get('email_id')} sent to {result.get('to')}"
    if effect.tool == "reverse_refund":
        return f"✓ refund #{result.get('refund_id')} reversed"
    return f"✓ {effect.tool} applied"


def _money_of(receipt: dict[str, Any]) -> str:
    return money(Decimal(receipt.get("amount", "0")), receipt.get("currency", "EUR"))


def _clip(text: str, limit: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"

"""The demo's summary: each run against what it should have done, then how to look at the same runs yourself."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from pathlib import Path

from django.db.models import Sum

from durable_agents.models import Run, RunStatus, Step, StepStatus, Wait, WaitKind, WaitStatus
from project.refunds.models import Order, OutboundEmail, Refund, money
from project.refunds.seed import SEEDED, Case


@dataclass
class Kill:
    """The SIGKILL: which worker, which run it held, and when another worker took the run over."""

    worker: str
    pid: int
    run_id: uuid.UUID
    order: str
    why: str
    at: datetime
    recovered_at: datetime | None = None


@dataclass(frozen=True)
class Outcome:
    """What the demo did: its runs (with the case each plays), the SIGKILL, where the logs are."""

    runs: dict[uuid.UUID, Case]
    kill: Kill | None
    started: datetime
    log_dir: Path


@dataclass(frozen=True)
class Row:
    case: Case
    run: Run
    refunds: list[Refund]
    emails: int
    review: str
    approval: Wait | None
    problems: list[str]


def report(write: Callable[[str], None], outcome: Outcome) -> bool:
    """Print the summary; True if every run ended as expected and the SIGKILL landed mid-run."""
    rows = [_check(case, Run.objects.get(pk=run_id)) for run_id, case in outcome.runs.items()]
    write("")
    write("Summary")
    columns = f"  {'order':<7} {'run':<8}  {'expected':<31} {'status':<9}  {'refunds made':<14} {'emails':<6}  review"
    write(columns)
    write("  " + "-" * (len(columns) + 10))
    for row in rows:
        made = " + ".join(money(r.amount, r.order.currency) for r in row.refunds) or "none"
        mark = "✓" if not row.problems else "✗ " + "; ".join(row.problems)
        write(
            f"  {row.case.number:<7} {str(row.run.id)[:8]:<8}  {row.case.expectation:<31} {row.run.status:<9}  "
            f"{made:<14} {row.emails:<6}  {row.review:<12} {mark}"
        )
    write("")
    ok = all(not row.problems for row in rows)
    ok = _recovery(write, outcome, rows) and ok
    _approval(write, rows)
    _spend(write, rows)
    write("")
    if ok:
        write("Every run ended as expected: one refund per refunded order, one email per customer, none repeated.")
    else:
        write(f"NOT every run ended as expected (see ✗ above); worker logs: {outcome.log_dir}")
    _how_to_look(write, rows, outcome)
    return ok


def _check(case: Case, run: Run) -> Row:
    order = Order.objects.get(number=case.number)
    # The shop is seeded afresh for each demo: every refund of the order but the seeded ones is this run's.
    refunds = list(order.refunds.select_related("order").exclude(idempotency_key__startswith=SEEDED))
    emails = OutboundEmail.objects.filter(order=order).count()
    review_step = Step.objects.live().filter(run=run, step_id="review_email", status=StepStatus.DONE).first()
    verdict = review_step.result if review_step else None
    review = f"passed {verdict['score']}" if verdict and verdict.get("passed") else ("failed" if verdict else "—")
    approval = Wait.objects.filter(run=run, kind=WaitKind.APPROVAL).order_by("-id").first()
    problems = []
    if run.status != RunStatus.COMPLETED:
        problems.append(f"run {run.status}")
    expected = [case.refund] if case.refund is not None else []
    if [r.amount for r in refunds] != expected:
        problems.append(f"expected {len(expected)} refund(s) of {expected[0] if expected else '-'}, got {len(refunds)}")
    if emails != 1:
        problems.append(f"{emails} emails sent, expected 1")
    if case.needs_approval and (approval is None or approval.status != WaitStatus.APPROVED):
        problems.append("the refund did not wait for approval")
    if not case.needs_approval and approval is not None:
        problems.append("an approval was asked for a small refund")
    if review_step is not None and not (verdict or {}).get("passed"):
        problems.append("the review failed")
    return Row(case, run, refunds, emails, review, approval, problems)


def _recovery(write: Callable[[str], None], outcome: Outcome, rows: list[Row]) -> bool:
    kill = outcome.kill
    if kill is None:
        write("SIGKILL: no worker was caught mid-run, so nothing was shown (is the machine very slow?).")
        return False
    row = next(r for r in rows if r.run.id == kill.run_id)
    write(f"SIGKILL: worker {kill.worker} (pid {kill.pid}) died while running {kill.order}, {kill.why}.")
    if kill.recovered_at is None:
        write("  No other worker took the run over.")
        return row.run.status == RunStatus.COMPLETED
    after = (kill.recovered_at - kill.at).total_seconds()
    refunds = len(row.refunds)
    write(f"  Time to recover: {after:.1f}s. The lease ran out, the sweep woke the run, another worker took it over")
    write(
        f"  and went on from its last checkpoint and journal: {refunds} refund, {row.emails} email, {row.run.status}."
    )
    return True


def _approval(write: Callable[[str], None], rows: list[Row]) -> None:
    for row in rows:
        wait = row.approval
        if wait is None or wait.decided_at is None:
            continue
        waited = (wait.decided_at - wait.created_at).total_seconds()
        write(
            f"Approval: {row.case.number} waited {waited:.1f}s for a manager while holding no worker; "
            f"{wait.status} by {wait.decided_by}, then the refund was made once."
        )


def _spend(write: Callable[[str], None], rows: list[Row]) -> None:
    runs = Run.objects.filter(pk__in=[row.run.id for row in rows])
    totals = runs.aggregate(
        i=Sum("input_tokens"), o=Sum("output_tokens"), w=Sum("cache_write_tokens"), r=Sum("cache_read_tokens")
    )
    cost = runs.aggregate(c=Sum("cost_usd"))["c"] or Decimal(0)
    prompt = (totals["i"] or 0) + (totals["w"] or 0) + (totals["r"] or 0)
    scripted = all(row.run.turns.exclude(participant="anthropic").exists() for row in rows)
    note = " (estimated: the scripted agent costs nothing)" if scripted else ""
    write(f"Tokens: {prompt:,} prompt + {totals['o'] or 0:,} output; cost ${cost:.4f}{note}.")


def _how_to_look(write: Callable[[str], None], rows: list[Row], outcome: Outcome) -> None:
    env = " ".join(
        f"{name}={os.environ[name]}"
        for name in ("DURABLE_VAR_DIR", "CELERY_BROKER_URL", "DJANGO_LOCAL_SECRET_KEY")
        if name in os.environ
    )
    database = ", with the same DATABASE_URL" if "DATABASE_URL" in os.environ else ""
    victim = str(outcome.kill.run_id) if outcome.kill else str(rows[0].run.id)
    write("")
    write(f"Look at the same runs (in this directory{database}):")
    write("  . .venv/bin/activate" + (f" && export {env}" if env else ""))
    write("  python manage.py durable_runs --workflow refund_agent")
    write(f"  python manage.py durable_show {victim}       # the run that lost its worker")
    # DEBUG stays off: the admin's CSS is served by WhiteNoise from what collectstatic gathered.
    write("  python manage.py collectstatic --noinput --verbosity 0")
    write("  python manage.py createsuperuser && python manage.py runserver")
    write("  then open http://127.0.0.1:8000/admin/durable_agents/run/ (runs, steps, turns, effects, waits)")
    write("       and http://127.0.0.1:8000/admin/refunds/order/ (the orders, their refunds and emails)")

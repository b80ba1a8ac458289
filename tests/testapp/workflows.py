"""Workflows the tests run on real workers: each step records its execution in a side table."""

from __future__ import annotations

import json
import os
import random
import threading
import time
import urllib.error
import urllib.request
from datetime import timedelta
from decimal import Decimal
from typing import Any

from django.db import connections

from durable_agents.api import (
    PlannedStep,
    RetryableError,
    RetryPolicy,
    StepContext,
    agent,
    approval,
    call,
    sleep,
    tool,
    tool_step,
    wait_for_signal,
    workflow,
)
from durable_agents.models import Step, StepStatus
from tests.testapp.models import Execution, LedgerEntry


def record_execution(ctx: StepContext) -> int:
    """Insert an Execution row (autocommit); returns how many times this step body ran, this one included."""
    already = Step.objects.filter(pk=ctx.step.pk, status=StepStatus.DONE).exists()
    Execution.objects.create(
        run_id=ctx.run_id, step_id=ctx.step_id, pid=os.getpid(), attempt=ctx.attempt, after_commit=already
    )
    return Execution.objects.filter(run_id=ctx.run_id, step_id=ctx.step_id).count()


def _record_step(ctx: StepContext) -> dict[str, Any]:
    record_execution(ctx)
    low, high = ctx.input.get("sleep_ms", [0, 0])
    if high:
        time.sleep(random.uniform(low, high) / 1000)
    return {"step": ctx.step_id}


workflow(
    "record",
    steps=[call("work", _record_step)],
    plan=lambda inp: [PlannedStep(f"s{i:03d}", "work") for i in range(1, inp.get("steps", 1) + 1)],
    description="N steps that record each execution",
)

# Found by its order number (tests/integration/test_search.py).
workflow("searchable", steps=[call("work", _record_step)], search=("order_id", "customer", "order.id"))


def _flaky(ctx: StepContext) -> dict[str, Any]:
    runs = record_execution(ctx)
    if runs <= ctx.input.get("failures", 0):
        raise RetryableError(f"flaky failure {runs}")
    return {"ok_after": runs}


def _permanent(ctx: StepContext) -> dict[str, Any]:
    record_execution(ctx)
    raise ValueError("the order data is malformed")


def _slow(ctx: StepContext) -> dict[str, Any]:
    """Sleeps `seconds`; with `until` (a file path), runs until the test creates that file (at most two minutes):
    a step that is certainly still running while the test acts, however busy the machine."""
    record_execution(ctx)
    if ctx.input.get("until"):
        wait_or_sleep(ctx.input["until"])
        return {"released": True}
    time.sleep(ctx.input.get("seconds", 1.0))
    return {"slept": ctx.input.get("seconds", 1.0)}


def _big(ctx: StepContext) -> dict[str, Any]:
    return {"blob": "x" * ctx.input.get("size", 100_000)}


def _reads_big(ctx: StepContext) -> dict[str, Any]:
    return {"length": len(ctx.result("big")["blob"])}


workflow("flaky", steps=[call("flaky", _flaky, retry=RetryPolicy(max_attempts=4)), call("after", _record_step)])
# A backoff of 14-28 s: longer than MAX_COUNTDOWN_SECONDS, so a retry parks the run for the sweep instead of sending
# a broker countdown (tests move the engine's clock past it rather than wait).
workflow(
    "flaky_long_backoff",
    steps=[
        call("flaky", _flaky, retry=RetryPolicy(max_attempts=4, backoff=28, backoff_max=28)),
        call("after", _record_step),
    ],
)
workflow("broken", steps=[call("first", _record_step), call("broken", _permanent), call("never", _record_step)])
workflow("slow", steps=[call("slow", _slow), call("after", _record_step)])
workflow("big", steps=[call("big", _big), call("reads_big", _reads_big)])
# The big result is written by one worker; after the signal, another worker (another machine) reads it.
workflow("big_handoff", steps=[call("big", _big), wait_for_signal("go"), call("reads_big", _reads_big)])

# Values Postgres cannot store (jsonb refuses \u0000, lone surrogates, NaN and Infinity), by input["kind"].
UNSTORABLE = {
    "nul": {"items": [{"name": "ok"}, {"name": "a\x00b"}]},
    "surrogate": {"text": "caf\udce9"},
    "nan": {"scores": [1.0, float("nan")]},
    "infinity": {"total": float("inf")},
    "nul-key": {"labels": {"a\x00": 1}},
}


def _unstorable(ctx: StepContext) -> Any:
    record_execution(ctx)
    value = UNSTORABLE[ctx.input["kind"]]
    return {**value, "padding": "x" * ctx.input.get("padding", 0)}


workflow("unstorable", steps=[call("bad", _unstorable), call("after", _record_step)])


def _raises_unstorable(ctx: StepContext) -> Any:
    record_execution(ctx)
    raise ValueError(f"bad row {UNSTORABLE['nul']['items'][1]['name']!s} in caf\udce9.csv")


workflow("raises_unstorable", steps=[call("bad", _raises_unstorable)])


# --- Unexpected errors: stored with their tracebacks (bounded, redacted) ----------------------------------


def share_of(total: int, parts: int) -> float:
    return total / parts  # parts == 0: the ZeroDivisionError whose traceback names this line


def _crashes(ctx: StepContext) -> dict[str, Any]:
    record_execution(ctx)
    return {"share": share_of(100, ctx.input.get("parts", 0))}


LEAKED_KEY = "sk-ant-api03-Leak3dKeyF0rTests_0123456789abcdefABCDEF-xyzQ"


def _leaks_secrets(ctx: StepContext) -> dict[str, Any]:
    api_key = LEAKED_KEY  # a local holding a secret: never part of a stored traceback
    service_token = os.environ["DURABLE_TEST_SERVICE_TOKEN"]
    headers = {"Authorization": f"Bearer {service_token}", "x-api-key": api_key}
    raise ConnectionRefusedError(f"upstream refused {headers} with password=hunter2-{service_token} for {api_key}")


def _recurses(ctx: StepContext, depth: int = 0) -> Any:
    return _recurses(ctx, depth + 1)


def _flaky_io(ctx: StepContext) -> dict[str, Any]:
    record_execution(ctx)
    if ctx.attempt <= ctx.input.get("failures", 0):
        raise ConnectionResetError(f"the peer reset attempt {ctx.attempt}")
    return {"ok_after": ctx.attempt}


workflow("crashes", steps=[call("crash", _crashes)])
workflow("leaks_secrets", steps=[call("leak", _leaks_secrets, retry=RetryPolicy(max_attempts=1))])
workflow("recurses", steps=[call("recurse", _recurses)])
workflow("flaky_io", steps=[call("io", _flaky_io, retry=RetryPolicy(max_attempts=3))])


# --- Effects: a transactional ledger tool with its compensator, and an external HTTP tool ------------------


def mark(ctx: StepContext, point: str) -> bool:
    """Record that `point` was reached, visibly at once even inside a transaction; False if reached before."""
    name = f"{ctx.step_id}:{point}"
    created: list[bool] = []

    def insert() -> None:
        # A thread has its own connection, so the marker commits even while the caller's transaction is open.
        try:
            if not Execution.objects.filter(run_id=ctx.run_id, step_id=name).exists():
                Execution.objects.create(run_id=ctx.run_id, step_id=name, pid=os.getpid(), attempt=ctx.attempt)
                created.append(True)
        finally:
            connections.close_all()

    thread = threading.Thread(target=insert)
    thread.start()
    thread.join()
    return bool(created)


def pause_once(ctx: StepContext, point: str) -> None:
    """Sleep at `point` the first time it is reached, if the run input asks to (a window for SIGKILL).

    The input names one point (`pause_at`, `pause_s`) or several (`pauses`: {point: seconds}). Instead of seconds,
    a file path: the pause lasts until the test creates that file (at most two minutes), so the step is certainly
    still paused while the test acts, however busy the machine.
    """
    if ctx is None:
        return
    pauses = ctx.input.get("pauses") or {ctx.input.get("pause_at"): ctx.input.get("pause_s", 30)}
    if point in pauses and mark(ctx, point):
        wait_or_sleep(pauses[point])


def wait_or_sleep(until: float | str) -> None:
    """Sleep `until` seconds, or, given a file path, until that file exists (at most two minutes)."""
    if not isinstance(until, str):
        time.sleep(until)
        return
    deadline = time.monotonic() + 120
    while not os.path.exists(until) and time.monotonic() < deadline:
        time.sleep(0.05)


@tool(effectful=True, transactional=True, compensate="refund_charge")
def charge(order_id: str, amount: Decimal, *, idempotency_key: str, ctx: StepContext | None) -> dict[str, Any]:
    """Charge an order: a ledger row, in the same database as the run."""
    entry = LedgerEntry.objects.create(idempotency_key=idempotency_key, order_id=order_id, amount=amount, kind="charge")
    pause_once(ctx, "inside_charge")
    return {"entry": entry.pk, "amount": str(amount)}


@tool(effectful=True, transactional=True)
def refund_charge(order_id: str, amount: Decimal, *, idempotency_key: str, ctx: StepContext | None) -> dict[str, Any]:
    """Give a charge back: a negative ledger row."""
    entry = LedgerEntry.objects.create(
        idempotency_key=idempotency_key, order_id=order_id, amount=-amount, kind="refund"
    )
    pause_once(ctx, "inside_refund")
    return {"entry": entry.pk}


@tool(effectful=True)
def notify(url: str, order_id: str, *, idempotency_key: str, ctx: StepContext) -> dict[str, Any]:
    """Tell an outside system about the order, passing the key on so it can dedupe."""
    request = urllib.request.Request(
        url,
        data=json.dumps({"order_id": order_id}).encode(),
        method="POST",
        headers={"Idempotency-Key": idempotency_key, "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            answer = json.loads(response.read())
    except urllib.error.URLError as exc:
        raise RetryableError(f"notify failed: {exc.reason}") from exc
    pause_once(ctx, "after_request")
    return answer


def _charge_step(ctx: StepContext) -> dict[str, Any]:
    pause_once(ctx, "before_call")
    result = ctx.call_tool(charge, {"order_id": ctx.input["order_id"], "amount": ctx.args.get("amount", "10.00")})
    pause_once(ctx, "after_effect")
    return result


def _notify_step(ctx: StepContext) -> dict[str, Any]:
    return ctx.call_tool(notify, {"url": ctx.input["url"], "order_id": ctx.input["order_id"]})


def _hold(ctx: StepContext) -> dict[str, Any]:
    pause_once(ctx, "hold")
    return {}


workflow("charge", steps=[call("charge", _charge_step), call("after", _record_step)])


@tool(effectful=True, transactional=True)
def charge_with_a_nan_receipt(order_id: str, *, idempotency_key: str) -> dict[str, Any]:
    """Charge an order and answer with a receipt jsonb cannot store (a NaN fee)."""
    LedgerEntry.objects.create(idempotency_key=idempotency_key, order_id=order_id, amount=Decimal(1), kind="charge")
    return {"receipt": {"fee": float("nan")}}


workflow(
    "charge_nan_receipt",
    steps=[call("charge", lambda ctx: ctx.call_tool(charge_with_a_nan_receipt, {"order_id": ctx.input["order_id"]}))],
)
workflow("notify", steps=[call("notify", _notify_step), call("after", _record_step)])
workflow(
    "two_charges",
    steps=[call("charge", _charge_step), call("hold", _hold), call("after", _record_step)],
    plan=lambda inp: [
        PlannedStep("charge-a", "charge", {"amount": "10.00"}),
        PlannedStep("charge-b", "charge", {"amount": "20.00"}),
        PlannedStep("hold", "hold"),
        PlannedStep("after", "after"),
    ],
)
workflow(
    "three_charges",
    steps=[call("charge", _charge_step), call("hold", _hold)],
    plan=lambda inp: [
        PlannedStep("charge-a", "charge", {"amount": "10.00"}),
        PlannedStep("charge-b", "charge", {"amount": "20.00"}),
        PlannedStep("charge-c", "charge", {"amount": "30.00"}),
        PlannedStep("hold", "hold"),
    ],
)
workflow(
    "charge_then_break",
    steps=[call("charge", _charge_step), call("broken", _permanent)],
    on_failure="compensate",
)
workflow(
    "bad_tool_args",
    steps=[tool_step("charge", charge, lambda ctx: {"order_id": ctx.input["order_id"], "amount": "ten"})],
)


# --- Agents: a billing assistant that looks an order up and charges it ------------------------------------


@tool
def lookup_order(order_id: str, ctx: StepContext | None = None) -> dict[str, Any]:
    """Look an order up: its amount and status."""
    if ctx is not None:
        pause_once(ctx, "in_lookup")
        Execution.objects.create(run_id=ctx.run_id, step_id="lookup_order", pid=os.getpid(), attempt=ctx.attempt)
    return {"order_id": order_id, "amount": "30.00", "status": "paid"}


workflow(
    "agent_charge",
    steps=[
        agent(
            "assistant",
            instructions="You are a billing assistant. Look the order up, then charge it.",
            tools=[lookup_order, charge],
            prompt=lambda ctx: ctx.input["message"],
            max_tokens=512,
        ),
        call("after", _record_step),
    ],
)


# --- Humans in the loop: approvals, signals, timers ---------------------------------------------------------


def _charge_if_approved(ctx: StepContext) -> dict[str, Any]:
    record_execution(ctx)
    if not ctx.result("approve")["approved"]:
        return {"charged": False}
    ctx.call_tool(charge, {"order_id": ctx.input["order_id"], "amount": "40.00"})
    return {"charged": True}


workflow(
    "approve_charge",
    steps=[
        call("prepare", _record_step),
        approval(
            "approve",
            question="Charge the customer 40.00?",
            on_approve="the card is charged 40.00",
            on_reject="nothing is charged",
            reject="continue",
            notify_to=["ops@example.com"],
        ),
        call("charge", _charge_if_approved),
    ],
)

for _policy in ("reject", "fail", "escalate"):
    workflow(
        f"deadline_{_policy}",
        steps=[
            approval(
                "approve",
                question="Ship it?",
                reject="continue",
                deadline=timedelta(hours=1),
                on_deadline=_policy,
                escalate_to="boss@example.com" if _policy == "escalate" else "",
                warn_before=timedelta(minutes=10),
                remind_every=timedelta(minutes=20),
                notify_to=["ops@example.com"],
            ),
            call("after", _record_step),
        ],
    )


# Two requests in a row on one run: a decision meant for the small one must never land on the large one.
workflow(
    "two_refunds",
    steps=[
        approval(
            "small_refund",
            question="Refund 5.00 to order TR-1?",
            on_approve="5.00 is refunded",
            on_reject="nothing is refunded",
            reject="continue",
        ),
        approval(
            "large_refund",
            question="Refund 5000.00 to order TR-1?",
            on_approve="5000.00 is refunded",
            on_reject="nothing is refunded",
            reject="continue",
        ),
        call("after", _record_step),
    ],
)


def _payload(ctx: StepContext) -> dict[str, Any]:
    return {"got": ctx.result("paid")["payload"]}


workflow(
    "signal_flow",
    steps=[wait_for_signal("paid", signal="payment.confirmed", timeout=timedelta(hours=1)), call("after", _payload)],
)
workflow("timer_flow", steps=[sleep("nap", seconds=3600), call("after", _record_step)])


@tool(effectful=True, transactional=True, needs_approval=lambda args: Decimal(args["amount"]) > 50)
def big_refund(order_id: str, amount: Decimal, *, idempotency_key: str) -> dict[str, Any]:
    """Refund an order; amounts above 50.00 need a human's approval first."""
    LedgerEntry.objects.create(idempotency_key=idempotency_key, order_id=order_id, amount=-amount, kind="refund")
    return {"refunded": str(amount)}


workflow(
    "refund_tool",
    steps=[tool_step("refund", big_refund, lambda ctx: {"order_id": "R-1", "amount": ctx.input["amount"]})],
)


# --- Tokens: a long ticking agent for compaction, budgets and prompt caching (tests/integration/test_tokens.py) ---

TICK_NOTE = (
    "Tick recorded. The ticker keeps a durable count: each call stores one tick with its number, the time it was "
    "seen and the worker that saw it, so a replay can tell a repeated tick from a new one. Nothing else changes."
)


@tool
def tick(n: int) -> dict[str, Any]:
    """Record tick number `n` (1, 2, 3, ...); returns the number with a note."""
    return {"n": n, "note": TICK_NOTE}


def _ticks_prompt(ctx: StepContext) -> str:
    return f"Call the tick tool {ctx.input['ticks']} times, with n = 1, 2, 3 and so on, one call a turn. Then say done."


TICKER = agent(
    "ticker",
    instructions="You are a patient ticker. Call the tick tool exactly as asked, one call per turn.",
    tools=[tick],
    prompt=_ticks_prompt,
    max_tokens=256,
    max_turns=1000,
    # Low enough that a few dozen turns compact, high enough that the first 20 turns do not.
    compact_at_prompt_tokens=4000,
    keep_recent_turns=4,
)
workflow("agent_ticks", steps=[TICKER])
workflow("agent_ticks_capped", steps=[TICKER], token_budget=12_000)

# --- Eager continuation: each step says which Celery task and which claim ran it -----------------------------


@tool(effectful=True, transactional=True)
def eager_ledger(step_id: str, *, idempotency_key: str) -> dict[str, Any]:
    """One ledger entry per step: an effect through the effect API, applied exactly once."""
    LedgerEntry.objects.create(idempotency_key=idempotency_key, order_id=step_id, amount=Decimal(1), kind="eager")
    return {"entered": step_id}


def _celery_task_id() -> str | None:
    from celery import current_task

    return current_task.request.id if current_task else None


def _eager_step(ctx: StepContext) -> dict[str, Any]:
    record_execution(ctx)
    if ctx.input.get("effects"):
        ctx.call_tool(eager_ledger, {"step_id": ctx.step_id})
    low, high = ctx.input.get("sleep_ms", [0, 0])
    if high:
        time.sleep(random.uniform(low, high) / 1000)
    return {"token": ctx.lease_token, "task": _celery_task_id(), "pid": os.getpid()}


def _eager_flaky(ctx: StepContext) -> dict[str, Any]:
    if ctx.attempt == 1:
        record_execution(ctx)
        raise RetryableError("the first attempt fails")
    return _eager_step(ctx)


workflow(
    "eager",
    steps=[call("work", _eager_step)],
    plan=lambda inp: [PlannedStep(f"s{i:03d}", "work") for i in range(1, inp.get("steps", 1) + 1)],
    description="N steps that record their execution, claim and task",
)
workflow(
    "eager_wait",
    steps=[call("a", _eager_step), call("b", _eager_step), wait_for_signal("go"), call("c", _eager_step)],
)
workflow(
    "eager_retry",
    steps=[
        call("a", _eager_step),
        call("flaky", _eager_flaky, retry=RetryPolicy(max_attempts=3)),
        call("c", _eager_step),
    ],
)
workflow(
    "eager_model",
    steps=[
        call("a", _eager_step),
        call("b", _eager_step),
        approval("approve", question="Go on?", reject="continue"),
        call("c", _eager_step),
    ],
)


# --- Concurrency keys (tests/integration/test_concurrency_keys.py) -----------------------------------------
# Every step records its execution: the Execution ids order the steps of all runs on all workers, so a run's
# first "enter" and last "leave" bound its time in flight.
workflow(
    "keyed",
    steps=[call("enter", _record_step), call("leave", _record_step)],
    concurrency_key=lambda inp: inp["customer"],
    description="two recorded steps; at most one run per customer in flight",
)
workflow(
    "keyed_slow",
    steps=[call("enter", _record_step), call("slow", _slow), call("leave", _record_step)],
    concurrency_key=lambda inp: inp["customer"],
)
workflow(
    "keyed_approval",
    steps=[
        call("enter", _record_step),
        approval("ok", question="Go on?", on_approve="the run goes on", on_reject="the run fails"),
        call("leave", _record_step),
    ],
    concurrency_key=lambda inp: inp["customer"],
)


# The workflow docs/howto/schedules.md declares a schedule for in settings (its settings fragment is checked
# against these settings, so the name must be registered here).
workflow("digest_email", steps=[call("send", lambda ctx: {"days": (ctx.input or {}).get("days", 1)})])


from tests.testapp import family, machine, parallel, plans, relations, trust  # noqa: E402,F401  (register the other tests' workflows)

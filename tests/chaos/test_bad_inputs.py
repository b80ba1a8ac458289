"""Bad inputs on every surface: each gets a clear error (what is wrong and what to do) and changes nothing.

Surfaces: the `durable_*` commands (exit 2, one line on stderr, no traceback), the public API (a domain
error), the admin's action forms, tool arguments the model produces (an is_error tool result the model reads;
the run goes on), oversized payloads, and tampered or stale approval links. Every case snapshots the
database before and after (row counts of every table the app and the examples write, the runs' and waits'
states): nothing may be created, changed or half-applied.
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import anthropic
import pytest
from django.contrib.auth.models import Permission, User
from django.contrib.contenttypes.models import ContentType
from django.test import Client
from django.test.utils import override_settings
from django.urls import reverse

from durable_agents import api
from durable_agents.agents.claude import AnthropicParticipant
from durable_agents.agents.participants import participants
from durable_agents.errors import UnknownParticipantError
from durable_agents.links import decision_path
from durable_agents.models import Effect, EffectStatus, Event, Run, RunStatus, Step, Turn, Wait, WaitStatus
from durable_agents.testing import drive
from durable_agents.testing.fake_anthropic import FakeAnthropic, RecordedRequest, Reply, tool_use_block
from project.refunds import script
from project.refunds.models import Order, OutboundEmail, Refund
from project.refunds.script import next_move
from tests.chaos.workload import Case, make_cases, seed, timeout
from tests.testapp.models import Execution, LedgerEntry

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, timeout()]

MISSING_RUN = "00000000-0000-4000-8000-000000000000"
# A byte that is not UTF-8 (é in Latin-1) reaches Python's argv as a lone surrogate.
BAD_BYTE = os.fsdecode(b"\xe9")
LONG_AS = ["--as", "a" * 201]


@dataclass
class World:
    """A few runs in every state, and waits open and closed, for bad inputs to aim at."""

    done: Run
    pending: Run
    failed: Run
    waiting: Run
    wait: Wait
    closed: Wait
    refund: Run
    model: Run  # pending, with a model step: budget and participant actions apply to it


@pytest.fixture
def world(monkeypatch) -> World:
    monkeypatch.setattr(script, "THINK_SECONDS", 0)
    done = drive(api.start("noop", {"steps": 1}, idempotency_key="k-used").id)
    pending = api.start("noop", {"steps": 2})
    failed = drive(api.start("broken").id)
    waiting = drive(api.start("approve_charge", {"order_id": "W-1"}).id)
    decided = drive(api.start("approve_charge", {"order_id": "W-2"}).id)
    closed = api.decide(Wait.objects.get(run=decided, status=WaitStatus.OPEN).pk, True, by="erin")
    (case,) = make_cases(1, random.Random(3))
    seed([case])
    refund = api.start("refund_agent", case.run_input)
    api.swap_participant(refund.id, "refund-script")  # offline whatever ANTHROPIC_API_KEY says
    refund = drive(refund.id)
    assert (done.status, failed.status, waiting.status, refund.status) == (
        "completed",
        "failed",
        "waiting",
        "completed",
    )
    model = api.start("agent_ticks", {"ticks": 1})
    return World(done, pending, failed, waiting, Wait.objects.get(run=waiting), closed, refund, model)


def snapshot() -> dict[str, Any]:
    """Every table the app, the examples and the tests write (row counts), and the state of runs and waits."""
    state: dict[str, Any] = {
        model.__name__: model.objects.count()
        for model in (Run, Step, Effect, Wait, Event, Turn, Order, Refund, OutboundEmail, LedgerEntry, Execution)
    }
    state["runs"] = sorted(
        map(
            str,
            Run.objects.values_list(
                "id", "status", "cursor", "lease_token", "participant", "token_budget", "cost_budget_usd", "error"
            ),
        )
    )
    state["waits"] = sorted(map(str, Wait.objects.values_list("id", "status", "decided_by", "decision")))
    return state


# --- The commands ------------------------------------------------------------------------------------------------

CLI_CASES = [
    ("start-unknown-workflow", lambda w: ["durable_start", "no_such_flow"], "unknown workflow 'no_such_flow'"),
    ("start-invalid-json", lambda w: ["durable_start", "noop", "--input", "{steps: 3"], "--input is not valid JSON"),
    (
        "start-input-refused-by-workflow",
        lambda w: ["durable_start", "refund_agent", "--input", '{"order_id": "A-1"}'],
        "refund_agent needs 'message', a non-empty string",
    ),
    (
        "start-oversized-message",
        lambda w: ["durable_start", "refund_agent", "--input", '{"order_id": "A-1", "message": "%s"}' % ("x" * 6000)],
        "the customer message is over 5000 characters",
    ),
    (
        "start-key-reused-with-other-input",
        lambda w: ["durable_start", "noop", "--input", '{"steps": 2}', "--key", "k-used"],
        "with a different input; use a new key",
    ),
    ("start-unknown-version", lambda w: ["durable_start", "noop", "--version", "9"], "has no version 9"),
    ("show-not-a-uuid", lambda w: ["durable_show", "not-a-run"], "no run has id 'not-a-run'"),
    ("show-unknown-run", lambda w: ["durable_show", MISSING_RUN], "no run has id"),
    ("cancel-finished-run", lambda w: ["durable_cancel", str(w.done.id)], "is already completed; there is nothing"),
    ("resume-completed-run", lambda w: ["durable_resume", str(w.done.id)], "only failed or cancelled runs resume"),
    (
        "resume-from-unknown-step",
        lambda w: ["durable_resume", str(w.done.id), "--from-step", "nope"],
        "has no step 'nope'",
    ),
    (
        "resume-from-step-two-runs",
        lambda w: ["durable_resume", str(w.done.id), str(w.failed.id), "--from-step", "first"],
        "--from-step takes exactly one RUN_ID",
    ),
    ("decide-unknown-wait", lambda w: ["durable_decide", "424242", "--approve"], "no wait has id '424242'"),
    ("decide-not-a-wait-id", lambda w: ["durable_decide", "abc", "--reject"], "no wait has id 'abc'"),
    ("decide-closed-wait", lambda w: ["durable_decide", str(w.closed.pk), "--reject"], "is already approved by erin"),
    (
        "signal-invalid-json",
        lambda w: ["durable_signal", str(w.pending.id), "paid", "--payload", "{nope"],
        "--payload is not valid JSON",
    ),
    ("signal-finished-run", lambda w: ["durable_signal", str(w.done.id), "paid"], "it takes no more signals"),
    (
        "budget-negative-tokens",
        lambda w: ["durable_budget", str(w.pending.id), "--tokens", "-5"],
        "a token budget is a whole number >= 0",
    ),
    (
        "budget-cost-not-a-number",
        lambda w: ["durable_budget", str(w.pending.id), "--cost", "lots"],
        "a cost budget is a decimal amount in USD",
    ),
    ("budget-nothing-given", lambda w: ["durable_budget", str(w.pending.id)], "give a token budget, a cost budget"),
    (
        "swap-unknown-participant",
        lambda w: ["durable_swap", str(w.pending.id), "gpt-17"],
        "unknown participant 'gpt-17'",
    ),
    ("swap-finished-run", lambda w: ["durable_swap", str(w.done.id), "anthropic"], "changes nothing"),
    ("fork-unknown-step", lambda w: ["durable_fork", str(w.done.id), "--at-step", "nope"], "has no step 'nope'"),
    (
        "fork-invalid-json",
        lambda w: ["durable_fork", str(w.done.id), "--at-step", "tick-1", "--input", "[1,"],
        "--input is not valid JSON",
    ),
    ("migrate-unknown-version", lambda w: ["durable_migrate", str(w.pending.id), "--version", "7"], "has no version 7"),
    ("migrate-finished-run", lambda w: ["durable_migrate", str(w.done.id), "--version", "1"], "nothing to migrate"),
    ("runs-unknown-status", lambda w: ["durable_runs", "--status", "lost"], "unknown status 'lost'"),
    ("runs-bad-duration", lambda w: ["durable_runs", "--older-than", "soon"], "invalid duration 'soon'"),
    # Issue 13 item 17: values Postgres or Python cannot hold, numbers past their columns, over-long names.
    ("start-input-nan", lambda w: ["durable_start", "noop", "--input", '{"x": NaN}'], "NaN is not a JSON"),
    (
        "start-input-infinity",
        lambda w: ["durable_start", "noop", "--input", '{"x": Infinity}'],
        "Infinity is not a JSON number",
    ),
    (
        "start-input-minus-infinity",
        lambda w: ["durable_start", "noop", "--input", "[-Infinity]"],
        "-Infinity is not a JSON number",
    ),
    (
        "start-input-nul",
        lambda w: ["durable_start", "noop", "--input", '{"steps": 1, "note": "a\\u0000b"}'],
        'input["note"] contains \\u0000, which Postgres cannot store',
    ),
    (
        "start-input-lone-surrogate-escape",
        lambda w: ["durable_start", "noop", "--input", '{"steps": 1, "note": "\\ud800"}'],
        'input["note"] contains a lone surrogate (\\ud800)',
    ),
    (
        "start-input-undecodable-bytes",
        lambda w: ["durable_start", "noop", "--input", f'{{"steps": 1, "note": "caf{BAD_BYTE}"}}'],
        'input["note"] contains a lone surrogate (\\udce9)',
    ),
    ("start-workflow-undecodable", lambda w: ["durable_start", BAD_BYTE], "a workflow name contains a lone"),
    ("start-key-undecodable", lambda w: ["durable_start", "noop", "--key", BAD_BYTE], "idempotency key con"),
    ("start-key-too-long", lambda w: ["durable_start", "noop", "--key", "k" * 256], "at most 255 fit"),
    (
        "start-version-huge",
        lambda w: ["durable_start", "noop", "--version", "9" * 25],
        "a workflow version is a whole number >= 1",
    ),
    (
        "signal-payload-nan",
        lambda w: ["durable_signal", str(w.pending.id), "paid", "--payload", "NaN"],
        "--payload is not valid JSON: NaN is not a JSON number",
    ),
    (
        "signal-payload-nul",
        lambda w: ["durable_signal", str(w.pending.id), "paid", "--payload", '{"note": "\\u0000"}'],
        'payload["note"] contains \\u0000',
    ),
    (
        "signal-name-too-long",
        lambda w: ["durable_signal", str(w.pending.id), "n" * 201],
        "the signal name is 201 characters long; at most 200 fit",
    ),
    (
        "signal-name-undecodable",
        lambda w: ["durable_signal", str(w.pending.id), BAD_BYTE],
        "the signal name contains a lone surrogate",
    ),
    ("signal-as-too-long", lambda w: ["durable_signal", str(w.pending.id), "paid", *LONG_AS], "at most 200"),
    ("runs-limit-negative", lambda w: ["durable_runs", "--limit", "-1"], "--limit (how many runs to list) is"),
    ("runs-limit-zero", lambda w: ["durable_runs", "--limit", "0"], "is a whole number >= 1"),
    ("runs-limit-not-a-number", lambda w: ["durable_runs", "--limit", "ten"], "got 'ten'"),
    ("runs-limit-past-bigint", lambda w: ["durable_runs", "--limit", "9" * 20], "at most 9223372036854775807"),
    (
        "runs-older-than-overflow",
        lambda w: ["durable_runs", "--older-than", "999999w"],
        "duration '999999w' is longer than 100 years",
    ),
    ("runs-older-than-400-digits", lambda w: ["durable_runs", "--older-than", "9" * 400 + "s"], "invalid dur"),
    ("runs-workflow-undecodable", lambda w: ["durable_runs", "--workflow", BAD_BYTE], "--workflow contains"),
    (
        "runs-search-undecodable",
        lambda w: ["durable_runs", "--search", f"order_id={BAD_BYTE}"],
        "the search value of 'order_id' contains a lone surrogate",
    ),
    ("runs-search-no-equals", lambda w: ["durable_runs", "--search", "A-1001"], "--search takes field=value"),
    (
        "budget-tokens-1e20",
        lambda w: ["durable_budget", str(w.pending.id), "--tokens", "1e20"],
        "a token budget is a whole number >= 0, at most 9223372036854775807; got '1e20'",
    ),
    (
        "budget-tokens-past-bigint",
        lambda w: ["durable_budget", str(w.pending.id), "--tokens", "9223372036854775808"],
        "a token budget is a whole number >= 0",
    ),
    (
        "budget-tokens-not-an-int",
        lambda w: ["durable_budget", str(w.pending.id), "--tokens", "many"],
        "a token budget is a whole number",
    ),
    (
        "budget-cost-nan",
        lambda w: ["durable_budget", str(w.pending.id), "--cost", "NaN"],
        "a cost budget is a decimal amount in USD and finite",
    ),
    (
        "budget-cost-infinity",
        lambda w: ["durable_budget", str(w.pending.id), "--cost", "Infinity"],
        "and finite",
    ),
    (
        "budget-cost-minus-infinity",
        lambda w: ["durable_budget", str(w.pending.id), "--cost=-Infinity"],
        "and finite",
    ),
    (
        "budget-cost-1e20",
        lambda w: ["durable_budget", str(w.pending.id), "--cost", "1e20"],
        "a cost budget is at most 99999999.999999",
    ),
    (
        "budget-cost-too-precise",
        lambda w: ["durable_budget", str(w.pending.id), "--cost", "1.1234567"],
        "at most 6 decimal places",
    ),
    ("budget-as-too-long", lambda w: ["durable_budget", str(w.pending.id), "--tokens", "5", *LONG_AS], "200"),
    ("cancel-as-too-long", lambda w: ["durable_cancel", str(w.pending.id), *LONG_AS], "at most 200 fit"),
    (
        "cancel-batch-as-too-long",
        lambda w: ["durable_cancel", str(w.pending.id), str(w.waiting.id), *LONG_AS],
        "the actor (who is acting, --as) is 201 characters long; at most 200 fit",
    ),
    (
        "cancel-reason-undecodable",
        lambda w: ["durable_cancel", str(w.pending.id), "--reason", BAD_BYTE],
        "the reason contains a lone surrogate",
    ),
    (
        "cancel-reason-too-long",
        lambda w: ["durable_cancel", str(w.pending.id), "--reason", "r" * 1001],
        "at most 1000 fit",
    ),
    ("resume-as-too-long", lambda w: ["durable_resume", str(w.failed.id), *LONG_AS], "at most 200 fit"),
    (
        "resume-from-step-undecodable",
        lambda w: ["durable_resume", str(w.done.id), "--from-step", BAD_BYTE],
        "the step id (--from-step) contains a lone surrogate",
    ),
    ("decide-as-too-long", lambda w: ["durable_decide", str(w.wait.pk), "--approve", *LONG_AS], "200 fit"),
    (
        "decide-comment-undecodable",
        lambda w: ["durable_decide", str(w.wait.pk), "--approve", "--comment", BAD_BYTE],
        "the comment contains a lone surrogate",
    ),
    (
        "decide-comment-too-long",
        lambda w: ["durable_decide", str(w.wait.pk), "--reject", "--comment", "c" * 2001],
        "at most 2000 fit",
    ),
    (
        "fork-input-nan",
        lambda w: ["durable_fork", str(w.done.id), "--at-step", "tick-1", "--input", '{"x": NaN}'],
        "--input is not valid JSON: NaN",
    ),
    (
        "fork-at-step-undecodable",
        lambda w: ["durable_fork", str(w.done.id), "--at-step", BAD_BYTE],
        "the step id (--at-step) contains",
    ),
    (
        "fork-as-too-long",
        lambda w: ["durable_fork", str(w.done.id), "--at-step", "tick-1", *LONG_AS],
        "at most 200 fit",
    ),
    (
        "migrate-version-huge",
        lambda w: ["durable_migrate", str(w.pending.id), "--version", "9" * 25],
        "a workflow version is a whole number",
    ),
    (
        "migrate-as-too-long",
        lambda w: ["durable_migrate", str(w.pending.id), "--version", "1", *LONG_AS],
        "at most 200 fit",
    ),
    (
        "swap-participant-undecodable",
        lambda w: ["durable_swap", str(w.pending.id), BAD_BYTE],
        "the participant name contains",
    ),
    ("swap-as-too-long", lambda w: ["durable_swap", str(w.pending.id), "anthropic", *LONG_AS], "200 fit"),
]
# Mistakes argparse catches before the command runs: exit 2 and its usage line, then the error line.
ARGPARSE_CASES = [
    ("start-version-not-an-int", lambda w: ["durable_start", "noop", "--version", "one"], "--version"),
    ("decide-neither-approve-nor-reject", lambda w: ["durable_decide", str(w.wait.pk)], "--approve"),
    ("migrate-version-missing", lambda w: ["durable_migrate", str(w.pending.id)], "--version"),
]


@pytest.mark.parametrize(("args", "message"), [pytest.param(a, m, id=i) for i, a, m in CLI_CASES])
def test_bad_input__command_exits_2_with_one_clear_line_and_changes_nothing(world, manage, args, message):
    before = snapshot()
    result = manage(*args(world))
    assert result.returncode == 2, f"exit {result.returncode}; stderr: {result.stderr[-1500:]}"
    assert "Traceback" not in result.stderr, result.stderr[-1500:]
    assert len(result.stderr.strip().splitlines()) == 1, f"one line on stderr, got:\n{result.stderr}"
    assert message in result.stderr, f"expected {message!r} in: {result.stderr}"
    assert snapshot() == before, "a refused command changed the database"


@pytest.mark.parametrize(("args", "message"), [pytest.param(a, m, id=i) for i, a, m in ARGPARSE_CASES])
def test_bad_input__command_line_mistakes_exit_2_with_usage_and_change_nothing(world, manage, args, message):
    before = snapshot()
    result = manage(*args(world))
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-1500:]
    assert lines[0].startswith("usage:") and "error:" in lines[-1] and message in lines[-1], result.stderr
    assert snapshot() == before


@pytest.mark.parametrize("command", ["durable_cancel", "durable_resume"])
def test_bad_input__a_batch_with_an_unknown_run_changes_nothing(world, manage, command):
    target = world.pending if command == "durable_cancel" else world.failed
    before = snapshot()
    result = manage(command, str(target.id), "not-a-run")
    assert result.returncode == 2 and "no run has id 'not-a-run'" in result.stderr
    assert snapshot() == before, (
        f"{command} {target.id} not-a-run exited 2 with only the error, but changed {target.id}: "
        f"{Run.objects.get(pk=target.id).status}"
    )


BATCH_CASES = [
    ("cancel-with-a-finished-run", "durable_cancel", ["pending", "done"], ["done"]),
    ("cancel-with-two-bad-runs-and-a-typo", "durable_cancel", ["pending", "done", "missing", "failed"], None),
    ("resume-with-a-waiting-run", "durable_resume", ["failed", "waiting"], ["waiting"]),
    ("resume-with-a-completed-and-a-missing-run", "durable_resume", ["failed", "done", "missing"], None),
]
BATCH_REASONS = {
    ("durable_cancel", "done"): "is already completed; there is nothing to cancel",
    ("durable_cancel", "failed"): "is already failed; there is nothing to cancel",
    ("durable_resume", "waiting"): "is waiting; only failed or cancelled runs resume (decide its wait)",
    ("durable_resume", "done"): "is completed; only failed or cancelled runs resume",
}


@pytest.mark.parametrize(("command", "targets", "bad"), [pytest.param(*c[1:], id=c[0]) for c in BATCH_CASES])
def test_bad_input__a_batch_with_a_run_that_cannot_take_it_changes_nothing_and_names_each(
    world, manage, command, targets, bad
):
    """Issue 13 item 18: `durable_cancel A B` with B finished used to cancel A, then exit 2 about B only."""
    ids = {t: MISSING_RUN if t == "missing" else str(getattr(world, t).id) for t in targets}
    before = snapshot()
    result = manage(command, *ids.values())
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-1500:]
    assert len(result.stderr.strip().splitlines()) == 1, f"one line on stderr, got:\n{result.stderr}"
    assert "nothing changed" in result.stderr, result.stderr
    for target in bad or [t for t in targets if (command, t) in BATCH_REASONS or t == "missing"]:
        why = (
            f"no run has id '{MISSING_RUN}'"
            if target == "missing"
            else f"run {ids[target]} " + BATCH_REASONS[(command, target)]
        )
        assert why in result.stderr, f"the error should name {target} and why ({why!r}): {result.stderr}"
    assert snapshot() == before, f"{command} refused the batch but changed runs of it"


# --- The public API --------------------------------------------------------------------------------------------------

API_CASES = [
    ("start-unknown-workflow", lambda w: api.start("no_such_flow"), api.UnknownWorkflowError, "unknown workflow"),
    (
        "start-input-not-json",
        lambda w: api.start("noop", {"steps": 1, "when": object()}),
        api.InvalidInputError,
        "must be JSON-serialisable",
    ),
    (
        "start-input-over-the-limit",
        lambda w: api.start("noop", {"steps": 1, "blob": "x" * (1024 * 1024 + 1)}),
        api.InputTooLargeError,
        "over the 1048576-byte limit (DURABLE_AGENTS['INPUT_MAX_BYTES']); pass a reference",
    ),
    ("start-empty-key", lambda w: api.start("noop", idempotency_key=" "), api.InvalidInputError, "non-empty string"),
    ("start-long-key", lambda w: api.start("noop", idempotency_key="k" * 256), api.InvalidInputError, "at most 255"),
    (
        "start-key-reused",
        lambda w: api.start("noop", {"steps": 3}, idempotency_key="k-used"),
        api.IdempotencyKeyReusedError,
        "use a new key for a new run",
    ),
    ("start-unknown-version", lambda w: api.start("noop", version=42), api.UnknownWorkflowError, "no version 42"),
    (
        "start-input-refused-by-workflow",
        lambda w: api.start("refund_agent", ["A-1", "refund please"]),
        api.InvalidInputError,
        'refund_agent takes {"order_id"',
    ),
    (
        "start-plan-refused",
        lambda w: api.start("noop", {"steps": -1}),
        api.InvalidInputError,
        "an integer from 0 to",
    ),
    ("cancel-finished", lambda w: api.cancel(w.done.id), api.InvalidTransitionError, "nothing to cancel"),
    ("cancel-unknown", lambda w: api.cancel(MISSING_RUN), api.RunNotFoundError, "durable_runs"),
    ("resume-waiting", lambda w: api.resume(w.waiting.id), api.InvalidTransitionError, "decide its wait"),
    ("resume-unknown-step", lambda w: api.resume(w.done.id, "nope"), api.StepNotFoundError, "durable_show"),
    ("resume-not-a-uuid", lambda w: api.resume("42; drop table"), api.RunNotFoundError, "no run has id"),
    ("decide-unknown", lambda w: api.decide(999_999, True, by="x"), api.WaitNotFoundError, "durable_runs"),
    ("decide-closed", lambda w: api.decide(w.closed.pk, False, by="x"), api.WaitClosedError, "nothing changed"),
    ("signal-finished", lambda w: api.send_signal(w.done.id, "paid"), api.InvalidTransitionError, "no more signals"),
    ("signal-unknown-run", lambda w: api.send_signal(MISSING_RUN, "paid"), api.RunNotFoundError, "no run has id"),
    ("budget-negative", lambda w: api.set_budget(w.pending.id, tokens=-1), api.InvalidInputError, ">= 0"),
    ("budget-not-int", lambda w: api.set_budget(w.pending.id, tokens="many"), api.InvalidInputError, "whole number"),
    ("budget-bad-cost", lambda w: api.set_budget(w.pending.id, cost_usd="abc"), api.InvalidInputError, "decimal"),
    ("budget-negative-cost", lambda w: api.set_budget(w.pending.id, cost_usd="-1"), api.InvalidInputError, ">= 0"),
    ("budget-nothing", lambda w: api.set_budget(w.pending.id), api.InvalidInputError, "or both"),
    ("fork-unknown-step", lambda w: api.fork(w.done.id, "nope"), api.StepNotFoundError, "has no step 'nope'"),
    ("fork-scalar-input", lambda w: api.fork(w.done.id, "tick-1", input="x"), api.InvalidInputError, "object or list"),
    (
        "fork-input-over-the-limit",
        lambda w: api.fork(w.done.id, "tick-1", input={"blob": "x" * (1024 * 1024 + 1)}),
        api.InputTooLargeError,
        "INPUT_MAX_BYTES",
    ),
    ("migrate-unknown-version", lambda w: api.migrate(w.pending.id, 5), api.UnknownWorkflowError, "no version 5"),
    ("migrate-finished", lambda w: api.migrate(w.done.id, 1), api.InvalidTransitionError, "nothing to migrate"),
    (
        "swap-unknown-participant",
        lambda w: api.swap_participant(w.pending.id, "gpt-17"),
        UnknownParticipantError,
        "registered:",
    ),
    ("swap-finished", lambda w: api.swap_participant(w.done.id, "anthropic"), api.InvalidTransitionError, "nothing"),
    # Issue 13 item 17: JSON Postgres cannot store, text it cannot store or that does not fit, numbers past columns.
    ("start-input-nan", lambda w: api.start("noop", {"x": NAN}), api.InvalidInputError, 'input["x"] is NaN'),
    ("start-input-infinity", lambda w: api.start("noop", [INF]), api.InvalidInputError, "input[0] is Infinity"),
    (
        "start-input-nul",
        lambda w: api.start("noop", {"steps": 1, "note": "a\x00"}),
        api.InvalidInputError,
        'input["note"] contains \\u0000, which Postgres cannot store; remove it or encode the text',
    ),
    (
        "start-input-lone-surrogate",
        lambda w: api.start("noop", {"steps": 1, "notes": ["ok", "\ud800"]}),
        api.InvalidInputError,
        'input["notes"][1] contains a lone surrogate (\\ud800)',
    ),
    (
        "start-input-nul-in-a-key",
        lambda w: api.start("noop", {"steps": 1, "a\x00": 1}),
        api.InvalidInputError,
        'a key of input ("a\\u0000") contains \\u0000',
    ),
    (
        "start-input-nested-too-deeply",
        lambda w: api.start("noop", _nested(50_000)),
        api.InvalidInputError,
        "must be JSON-serialisable",
    ),
    ("start-key-nul", lambda w: api.start("noop", idempotency_key="k\x00"), api.InvalidInputError, "key contains"),
    ("start-key-surrogate", lambda w: api.start("noop", idempotency_key="\udcff"), api.InvalidInputError, "lone"),
    ("start-key-not-text", lambda w: api.start("noop", idempotency_key=42), api.InvalidInputError, "must be a string"),
    ("start-workflow-a-list", lambda w: api.start(["noop"]), api.InvalidInputError, "a workflow name must be a str"),
    ("start-version-text", lambda w: api.start("noop", version="one"), api.InvalidInputError, "a workflow version"),
    ("start-version-bool", lambda w: api.start("noop", version=True), api.InvalidInputError, "a workflow version"),
    ("cancel-reason-nul", lambda w: api.cancel(w.pending.id, "a\x00"), api.InvalidInputError, "reason contains"),
    ("cancel-reason-long", lambda w: api.cancel(w.pending.id, "r" * 1001), api.InvalidInputError, "at most 1000"),
    ("cancel-actor-long", lambda w: api.cancel(w.pending.id, actor="a" * 201), api.InvalidInputError, "at most 200"),
    ("cancel-actor-none", lambda w: api.cancel(w.pending.id, actor=None), api.InvalidInputError, "must be a string"),
    ("resume-step-nul", lambda w: api.resume(w.done.id, "s\x00"), api.InvalidInputError, "(--from-step) contains"),
    ("resume-actor-long", lambda w: api.resume(w.failed.id, actor="a" * 201), api.InvalidInputError, "at most 200"),
    ("decide-by-long", lambda w: api.decide(w.wait.pk, True, by="b" * 201), api.InvalidInputError, "at most 200"),
    (
        "decide-comment-nul",
        lambda w: api.decide(w.wait.pk, True, by="x", comment="\x00"),
        api.InvalidInputError,
        "the comment contains \\u0000",
    ),
    ("decide-approved-text", lambda w: api.decide(w.wait.pk, "no", by="x"), api.InvalidInputError, "True or False"),
    ("decide-wait-id-float", lambda w: api.decide(1.5, True, by="x"), api.WaitNotFoundError, "whole numbers"),
    (
        "signal-payload-nan",
        lambda w: api.send_signal(w.pending.id, "paid", {"amount": NAN}),
        api.InvalidInputError,
        'payload["amount"] is NaN, which JSON and Postgres cannot store',
    ),
    (
        "signal-payload-nul",
        lambda w: api.send_signal(w.pending.id, "paid", ["\x00"]),
        api.InvalidInputError,
        "payload[0] contains \\u0000",
    ),
    ("signal-name-nul", lambda w: api.send_signal(w.pending.id, "p\x00"), api.InvalidInputError, "name contains"),
    ("signal-name-long", lambda w: api.send_signal(w.pending.id, "n" * 201), api.InvalidInputError, "at most 200"),
    ("signal-name-empty", lambda w: api.send_signal(w.pending.id, " "), api.InvalidInputError, "signal name is empty"),
    ("signal-by-long", lambda w: api.send_signal(w.pending.id, "p", by="b" * 201), api.InvalidInputError, "200"),
    ("budget-tokens-past-bigint", lambda w: api.set_budget(w.pending.id, tokens=2**63), api.InvalidInputError, "most"),
    ("budget-tokens-bool", lambda w: api.set_budget(w.pending.id, tokens=True), api.InvalidInputError, "whole number"),
    ("budget-tokens-float", lambda w: api.set_budget(w.pending.id, tokens=1e20), api.InvalidInputError, "whole num"),
    ("budget-cost-nan", lambda w: api.set_budget(w.pending.id, cost_usd="NaN"), api.InvalidInputError, "finite"),
    ("budget-cost-float-nan", lambda w: api.set_budget(w.pending.id, cost_usd=NAN), api.InvalidInputError, "finite"),
    (
        "budget-cost-decimal-nan",
        lambda w: api.set_budget(w.pending.id, cost_usd=Decimal("NaN")),
        api.InvalidInputError,
        "finite",
    ),
    ("budget-cost-infinity", lambda w: api.set_budget(w.pending.id, cost_usd=INF), api.InvalidInputError, "finite"),
    ("budget-cost-1e20", lambda w: api.set_budget(w.pending.id, cost_usd="1e20"), api.InvalidInputError, "at most"),
    (
        "budget-cost-too-precise",
        lambda w: api.set_budget(w.pending.id, cost_usd="0.0000001"),
        api.InvalidInputError,
        "at most 6 decimal places",
    ),
    ("budget-actor-long", lambda w: api.set_budget(w.pending.id, tokens=1, actor="a" * 201), api.InvalidInputError, ""),
    ("fork-input-nan", lambda w: api.fork(w.done.id, "tick-1", input=[NAN]), api.InvalidInputError, "input[0] is NaN"),
    ("fork-step-nul", lambda w: api.fork(w.done.id, "t\x00"), api.InvalidInputError, "(--at-step) contains"),
    ("fork-actor-long", lambda w: api.fork(w.done.id, "tick-1", actor="a" * 201), api.InvalidInputError, "200"),
    ("migrate-version-none", lambda w: api.migrate(w.pending.id, None), api.InvalidInputError, "a workflow version"),
    ("migrate-version-list", lambda w: api.migrate(w.pending.id, [1]), api.InvalidInputError, "a workflow version"),
    ("migrate-actor-long", lambda w: api.migrate(w.pending.id, 1, actor="a" * 201), api.InvalidInputError, "200"),
    ("swap-participant-list", lambda w: api.swap_participant(w.pending.id, ["x"]), api.InvalidInputError, "a string"),
    (
        "swap-actor-long",
        lambda w: api.swap_participant(w.pending.id, "anthropic", actor="a" * 201),
        api.InvalidInputError,
        "at most 200",
    ),
]
NAN, INF = float("nan"), float("inf")


def _nested(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(("call", "error", "message"), [pytest.param(c, e, m, id=i) for i, c, e, m in API_CASES])
def test_bad_input__public_api_raises_a_clear_domain_error_and_changes_nothing(world, call, error, message):
    before = snapshot()
    with pytest.raises(error) as raised:
        call(world)
    assert message in str(raised.value), f"expected {message!r} in {raised.value!r}"
    assert snapshot() == before, "a refused call changed the database"


@pytest.mark.parametrize(
    ("payload", "error"),
    [({"blob": "x" * (4 * 1024 * 1024)}, api.InputTooLargeError), ({"when": object()}, api.InvalidInputError)],
    ids=["oversized-signal-payload", "signal-payload-not-json"],
)
def test_bad_input__signal_payload_is_checked_like_a_run_input(world, payload, error):
    before = snapshot()
    with pytest.raises(error):
        api.send_signal(world.pending.id, "paid", payload)
    assert snapshot() == before


def test_bad_input__fork_with_an_input_the_workflow_refuses_is_refused(world):
    before = snapshot()
    with pytest.raises(api.InvalidInputError, match="refund_agent needs 'message'"):
        api.fork(world.refund.id, "resolve", input={"order_id": "A-1"})
    assert snapshot() == before


# --- The admin's action forms ----------------------------------------------------------------------------------------

ACTION_PERMISSIONS = ("resume_run", "cancel_run", "retry_step", "set_budget", "swap_participant", "decide_wait")


@pytest.fixture
def operator() -> Client:
    content_type = ContentType.objects.get_for_model(Run)
    for codename in ACTION_PERMISSIONS:
        Permission.objects.get_or_create(codename=codename, content_type=content_type, defaults={"name": codename})
    user = User.objects.create_user("chaos-operator", password="pw", is_staff=True)
    user.user_permissions.add(
        *Permission.objects.filter(content_type=content_type, codename__in=["view_run", *ACTION_PERMISSIONS])
    )
    client = Client()
    client.force_login(user)
    return client


def action_url(run_id: Any, slug: str) -> str:
    return reverse("admin:durable_agents_run_action", args=[run_id, slug])


ADMIN_CASES = [
    ("budget-negative-tokens", "model", "budget", {"tokens": "-5"}, 200, "greater than or equal to 0"),
    ("budget-empty", "model", "budget", {}, 200, "Give a token budget, a cost budget, or both."),
    ("budget-cost-not-a-number", "model", "budget", {"cost_usd": "lots"}, 200, "Enter a number."),
    ("budget-cost-too-precise", "model", "budget", {"cost_usd": "1.1234567"}, 200, "decimal places"),
    ("swap-unknown-participant", "model", "swap", {"participant": "gpt-17"}, 200, "Select a valid choice."),
    ("cancel-reason-too-long", "pending", "cancel", {"reason": "x" * 1001}, 200, "at most 1000 characters"),
    ("cancel-a-completed-run", "done", "cancel", {"reason": "x"}, 302, "Cancel does not apply to a completed run."),
    ("retry-a-completed-run", "done", "retry", {}, 302, "does not apply to a completed run."),
    ("unknown-action", "pending", "explode", {}, 404, ""),
    ("unknown-run", None, "cancel", {"reason": "x"}, 404, ""),
]


@pytest.mark.parametrize(
    ("target", "slug", "data", "status", "message"), [pytest.param(*c[1:], id=c[0]) for c in ADMIN_CASES]
)
def test_bad_input__admin_action_form_says_what_is_wrong_and_changes_nothing(
    world, operator, target, slug, data, status, message
):
    run_id = getattr(world, target).id if target else MISSING_RUN
    before = snapshot()
    response = operator.post(action_url(run_id, slug), data)
    assert response.status_code == status, response.content[:500]
    if status == 302:
        response = operator.get(response["Location"])
    html = response.content.decode()
    assert message in html, f"expected {message!r} in the page"
    assert "Traceback" not in html
    assert snapshot() == before, "a refused admin action changed the database"


# --- Tool arguments the model produces --------------------------------------------------------------------------------

TOOL_CASES = [
    ("amount-not-a-number", "issue_refund", {"amount": "lots"}, "amount: must match the pattern"),
    ("amount-negative", "issue_refund", {"amount": "-5.00"}, "amount: must match the pattern"),
    ("amount-a-float", "issue_refund", {"amount": 5.5}, "amount: expected string, got number"),
    ("reason-missing", "issue_refund", {"reason": None}, "reason"),
    ("more-than-refundable", "issue_refund", {"amount": "49.99"}, "can be refunded at most"),
    ("key-smuggled-in", "issue_refund", {"idempotency_key": "mine"}, "idempotency_key: unexpected property"),
    ("order-id-an-int", "issue_refund", {"order_id": 1001}, "order_id: expected string"),
    ("unknown-tool", "delete_all_orders", {}, "unknown tool 'delete_all_orders'"),
    ("order-id-too-long", "lookup_order", {"order_id": "A-" + "9" * 40}, "order_id"),
    ("lookup-no-such-order", "lookup_order", {"order_id": "Z-404"}, "there is no order 'Z-404'"),
    ("email-body-oversized", "email_customer", {"body": "x" * 6000}, "body"),
    ("email-extra-recipient", "email_customer", {"to": "attacker@example.com"}, "to: unexpected property"),
]


@pytest.fixture
def model_server(monkeypatch):
    """This process's "anthropic" participant talks to a fake Messages API through the real SDK."""
    monkeypatch.setattr(script, "THINK_SECONDS", 0)
    with FakeAnthropic() as server:
        client = anthropic.Anthropic(api_key="test-key", base_url=server.url, max_retries=0, timeout=5.0)
        previous = participants._participants.get("anthropic")
        participants.register("anthropic", AnthropicParticipant(client=client))
        yield server
        participants._participants.pop("anthropic", None)
        if previous is not None:
            participants.register("anthropic", previous)


def bad_call(case: Case, tool: str, changes: dict[str, Any]) -> dict[str, Any]:
    base = {
        "issue_refund": {"order_id": case.number, "amount": "5.00", "reason": "broken"},
        "lookup_order": {"order_id": case.number},
        "email_customer": {"order_id": case.number, "subject": "Your order", "body": "Dear customer"},
    }.get(tool, {})
    args = {**base, **changes}
    return {k: v for k, v in args.items() if v is not None}


@pytest.mark.parametrize(("tool", "changes", "message"), [pytest.param(*c[1:], id=c[0]) for c in TOOL_CASES])
def test_bad_input__model_produced_tool_arguments_become_a_tool_error_and_apply_nothing(
    model_server, tool, changes, message
):
    """After looking the order up, the model sends one bad call and reads an is_error result; then it goes on
    as if it had not (the script, shown the conversation without the bad exchange): the run completes with
    exactly the refund and the email its case expects, none of them from the bad call."""
    paid = Decimal("20.00")
    case = Case("C-777001", "refund", "My mug arrived broken. Could I get a refund, please?", paid, "delivered", paid)
    seed([case])

    def respond(request: RecordedRequest) -> Reply:
        if request.conversation.endswith(":resolve") and request.turn == 1:
            call = tool_use_block(tool, bad_call(case, tool, changes), id=BAD_ID)
            return Reply(content=[call], stop_reason="tool_use")
        blocks = next_move(_without_bad_call(request.messages), [t["name"] for t in request.body.get("tools") or []])
        stop = "tool_use" if any(block["type"] == "tool_use" for block in blocks) else "end_turn"
        return Reply(content=blocks, stop_reason=stop)

    model_server.responder = respond
    run = api.start("refund_agent", case.run_input)
    api.swap_participant(run.id, "anthropic", actor="chaos")
    run = drive(run.id)

    result = Turn.objects.get(run=run, step__step_id="resolve", index=1).tool_results[0]
    assert result["is_error"] is True and message in result["content"], result
    assert run.status == RunStatus.COMPLETED, run.error
    refunds = list(Refund.objects.filter(order__number=case.number).values_list("amount", "idempotency_key"))
    assert [amount for amount, _ in refunds] == [paid] and not refunds[0][1].endswith(BAD_ID), refunds
    assert OutboundEmail.objects.filter(order__number=case.number).count() == 1
    bad = Effect.objects.filter(run=run, idempotency_key__endswith=f":{BAD_ID}")
    assert all(e.status != EffectStatus.APPLIED for e in bad), "the bad call's effect was applied"
    assert not Effect.objects.filter(run=run, status=EffectStatus.PENDING).exists(), "an effect was left half-applied"


BAD_ID = "toolu_bad"


def _without_bad_call(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation minus the bad tool call and its result."""
    kept, skip_result = [], False
    for message in messages:
        blocks = message.get("content") if isinstance(message.get("content"), list) else []
        if message.get("role") == "assistant" and any(b.get("id") == BAD_ID for b in blocks):
            skip_result = True
            continue
        if skip_result and message.get("role") == "user":
            skip_result = False
            continue
        kept.append(message)
    return kept


# --- Tampered and stale approval links --------------------------------------------------------------------------------


@pytest.fixture
def approver() -> Client:
    user = User.objects.create_user("chaos-approver", password="pw", is_staff=True)
    user.user_permissions.add(Permission.objects.get(codename="decide_wait"))
    client = Client()
    client.force_login(user)
    return client


def _tamper(path: str) -> str:
    token = path.rstrip("/").rsplit("/", 1)[1]
    return path.replace(token, token[:-3] + ("xyz" if not token.endswith("xyz") else "abc"))


def _truncate(path: str) -> str:
    token = path.rstrip("/").rsplit("/", 1)[1]
    return path.replace(token, token[: len(token) // 2])


def _other_wait(world: World) -> str:
    other = drive(api.start("approve_charge", {"order_id": "W-3"}).id)
    return decision_path(Wait.objects.get(run=other, status=WaitStatus.OPEN)).replace(
        f"/waits/{Wait.objects.get(run=other, status=WaitStatus.OPEN).pk}/", f"/waits/{world.wait.pk}/"
    )


LINK_CASES = [
    ("tampered-signature", lambda w: _tamper(decision_path(w.wait)), "get", {}, 400, "not valid"),
    (
        "tampered-signature-post",
        lambda w: _tamper(decision_path(w.wait)),
        "post",
        {"decision": "approve"},
        400,
        "not valid",
    ),
    ("truncated-token", lambda w: _truncate(decision_path(w.wait)), "post", {"decision": "approve"}, 400, "not valid"),
    ("token-of-another-wait", _other_wait, "post", {"decision": "approve"}, 400, "belongs to another request"),
    (
        "wait-id-that-does-not-exist",
        lambda w: decision_path(w.wait).replace(f"/waits/{w.wait.pk}/", "/waits/99999999/"),
        "post",
        {"decision": "approve"},
        400,
        "belongs to another request",
    ),
    (
        "decision-neither",
        lambda w: decision_path(w.wait),
        "post",
        {"decision": "maybe"},
        400,
        "Choose approve or reject.",
    ),
    ("decision-missing", lambda w: decision_path(w.wait), "post", {}, 400, "Choose approve or reject."),
    (
        "comment-with-nul",
        lambda w: decision_path(w.wait),
        "post",
        {"decision": "approve", "comment": "ok\x00"},
        400,
        "the comment contains \\u0000",
    ),
    (
        "link-of-a-closed-wait",
        lambda w: decision_path(w.closed),
        "post",
        {"decision": "reject"},
        409,
        "already approved",
    ),
]


@pytest.mark.parametrize(
    ("link", "method", "data", "status", "message"), [pytest.param(*c[1:], id=c[0]) for c in LINK_CASES]
)
def test_bad_input__tampered_or_stale_approval_link_is_refused_and_decides_nothing(
    world, approver, link, method, data, status, message
):
    path = link(world)
    before = snapshot()
    response = getattr(approver, method)(path, data)
    assert response.status_code == status and message in response.content.decode(), response.content[:800]
    assert snapshot() == before, "a refused link changed the database"
    assert Wait.objects.get(pk=world.wait.pk).is_open


def test_bad_input__an_expired_approval_link_is_refused_and_decides_nothing(world, approver):
    path = decision_path(world.wait)
    before = snapshot()
    with override_settings(DURABLE_AGENTS={"LINK_MAX_AGE_SECONDS": 0}):
        time.sleep(1.1)
        response = approver.post(path, {"decision": "approve"})
    assert response.status_code == 400 and "expired" in response.content.decode()
    assert snapshot() == before and Wait.objects.get(pk=world.wait.pk).is_open

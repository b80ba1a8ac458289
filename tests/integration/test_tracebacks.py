"""An unexpected step error keeps its traceback: on the run, the step and the event, in durable_show, on the
run page and in the worker's log (once) — bounded, and with no secret in it."""

from __future__ import annotations

import inspect
import io
import json
import logging

import pytest
from django.core.management import call_command
from django.urls import reverse

from durable_agents import api
from durable_agents.engine.retry import TRACEBACK_MAX_CHARS
from durable_agents.management.commands import durable_show
from durable_agents.models import Event, Run, RunStatus, Step
from durable_agents.testing import drive, wait_for, wait_for_run
from tests.testapp import workflows

pytestmark = pytest.mark.django_db
SERVICE_TOKEN = "svc-token-9b7e5c1d2a"


def share_of_line() -> int:
    """The line of `share_of` that divides by zero."""
    lines, first = inspect.getsourcelines(workflows.share_of)
    return first + next(i for i, line in enumerate(lines) if "total / parts" in line)


def stored_errors(run: Run) -> dict[str, object]:
    """Every place a run's failure is stored: the run, its steps, its events."""
    return {
        "run.error": run.error,
        **{f"step {s.step_id}": s.error for s in Step.objects.filter(run=run)},
        **{f"event {e.kind} #{e.pk}": e.detail for e in Event.objects.filter(run=run)},
    }


def test_failure__an_unexpected_error_stores_the_traceback_of_its_line(caplog):
    caplog.set_level(logging.INFO, logger="durable_agents")
    run = drive(api.start("crashes").id)

    assert run.status == RunStatus.FAILED
    error = run.error
    assert (error["type"], error["message"], error["step"]) == ("ZeroDivisionError", "division by zero", "crash")
    trace = error["traceback"]
    assert trace.startswith("Traceback (most recent call last):"), trace
    assert f"line {share_of_line()}, in share_of\n    return total / parts" in trace, (
        f"the traceback names the nested function and its line:\n{trace}"
    )
    assert "in _crashes" in trace and trace.endswith("ZeroDivisionError: division by zero")
    assert Step.objects.get(run=run, step_id="crash").error == error, "the step keeps the same error"
    failed = Event.objects.get(run=run, kind="failed")
    assert failed.detail["error"]["traceback"] == trace, "the failed event keeps it too"
    assert caplog.text.count("in share_of") == 1, (
        f"the warning logs the traceback, the event's line not again:\n{caplog.text}"
    )


def test_failure__secrets_in_the_message_and_locals_are_not_stored(monkeypatch, caplog):
    monkeypatch.setenv("DURABLE_TEST_SERVICE_TOKEN", SERVICE_TOKEN)
    caplog.set_level(logging.WARNING, logger="durable_agents")

    run = drive(api.start("leaks_secrets").id)

    assert run.status == RunStatus.FAILED and run.error["type"] == "ConnectionRefusedError"
    assert "in _leaks_secrets" in run.error["traceback"], run.error
    stored = json.dumps(stored_errors(run)) + caplog.text
    for secret in (workflows.LEAKED_KEY, workflows.LEAKED_KEY[14:40], SERVICE_TOKEN, "hunter2"):
        assert secret not in stored, f"{secret!r} was stored or logged; redaction.py must catch its shape or value"
    assert "[redacted]" in run.error["message"] and "[redacted]" in run.error["traceback"], (
        "secrets are replaced, not the message or the traceback dropped"
    )


def test_failure__a_recursion_error_traceback_stays_bounded():
    run = drive(api.start("recurses").id)

    trace = run.error["traceback"]
    assert run.error["type"] == "RecursionError" and len(trace) <= TRACEBACK_MAX_CHARS, len(trace)
    assert "in _recurses" in trace and trace.endswith("RecursionError: maximum recursion depth exceeded")


def test_retry__each_attempt_keeps_its_traceback_in_its_event():
    run = drive(api.start("flaky_io", {"failures": 5}).id)

    assert run.status == RunStatus.FAILED
    events = list(Event.objects.filter(run=run, kind__in=["step_retry", "failed"]).order_by("id"))
    assert [(e.kind, e.detail["attempt"]) for e in events] == [("step_retry", 1), ("step_retry", 2), ("failed", 3)]
    for event in events:
        trace = event.detail["error"]["traceback"]
        attempt = event.detail["attempt"]
        assert "in _flaky_io" in trace and trace.endswith(f"the peer reset attempt {attempt}"), (
            f"attempt {attempt}'s event keeps that attempt's traceback:\n{trace}"
        )


def test_failure__a_library_error_raised_on_purpose_has_no_traceback():
    run = drive(api.start("flaky", {"failures": 10}).id)

    assert run.error == {"type": "RetryableError", "message": "flaky failure 4", "step": "flaky"}, (
        "a RetryableError's message is its diagnosis: no traceback is stored (retry.has_traceback)"
    )


def test_durable_show__prints_the_end_of_the_traceback_under_the_error():
    run = drive(api.start("crashes").id)

    out = io.StringIO()
    call_command("durable_show", str(run.id), stdout=out)
    lines = out.getvalue().splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("  error: ZeroDivisionError"))
    shown = lines[at + 1 : at + 1 + len(run.error["traceback"].splitlines())]
    assert shown == ["    " + line for line in run.error["traceback"].splitlines()], (
        f"the traceback is printed, indented, under the error:\n{out.getvalue()}"
    )
    events = lines[lines.index("events:") :]
    assert not any("Traceback" in line for line in events), "event lines stay one line each; --json has it all"

    out = io.StringIO()
    call_command("durable_show", str(run.id), "--json", stdout=out)
    data = json.loads(out.getvalue())
    assert data["error"]["traceback"] == run.error["traceback"]


def test_durable_show__a_long_traceback_shows_its_last_lines(monkeypatch):
    monkeypatch.setattr(durable_show, "TRACEBACK_LINES_SHOWN", 4)
    run = drive(api.start("crashes").id)

    out = io.StringIO()
    call_command("durable_show", str(run.id), stdout=out)
    lines = out.getvalue().splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("  error: ZeroDivisionError"))
    cut = len(run.error["traceback"].splitlines()) - 4
    assert lines[at + 1] == f"    [… {cut} earlier lines of the traceback: durable_show --json has them]"
    assert lines[at + 2 : at + 6] == ["    " + line for line in run.error["traceback"].splitlines()[-4:]]


def test_run_page__shows_the_traceback_collapsed_under_the_error(admin_client):
    run = drive(api.start("crashes").id)

    html = admin_client.get(reverse("admin:durable_agents_run_change", args=[run.pk])).content.decode()

    block = html[html.index('<details class="durable-details" id="error-traceback">') :]
    block = block[: block.index("</details>")]
    assert "<summary>traceback</summary>" in block and "in share_of" in block
    assert "return total / parts" in block and "ZeroDivisionError: division by zero" in block


@pytest.mark.django_db(transaction=True)
def test_worker_log__a_step_error_is_logged_once_with_its_traceback(start_worker):
    worker = start_worker()
    run = api.start("crashes")

    wait_for_run(run.id, "failed", timeout=60)
    line = f"run_id={run.id} step_id=crash attempt=1 step error ZeroDivisionError: division by zero"

    def logged() -> str:
        text = worker.log_path.read_text()  # appended to by earlier runs of this test: only this run counts
        return text[text.index(line) :] if line in text else ""

    log = wait_for(logged, what="the worker to log the step error")

    assert log.count(line) == 1, f"the step error is logged once, not twice (the settings LOGGING):\n{log}"
    assert f"line {share_of_line()}, in share_of" in log, f"the log line carries the traceback:\n{log}"

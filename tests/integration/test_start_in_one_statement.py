"""A run is started in one statement with its idempotency key: two racing starts with one key get one run,
invalid input is a domain error that writes nothing, and a long plan is inserted whole past the statement's
parameter limit.

The races are made deterministic by the database itself (a second connection blocked on the first's row lock,
seen in pg_stat_activity).
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from django.conf import settings
from django.db import connection, transaction
from django.test.utils import override_settings

from durable_agents import api
from durable_agents.errors import InvalidInputError
from durable_agents.models import Run, Step
from tests.integration.interleavings import until_blocked_on_a_lock

woken: list[str] = []


def record_wake(run_id: str, countdown: float | None = None, **routed: str) -> None:
    """A WAKER that only records what the engine asked for."""
    woken.append(str(run_id))


def _in_process(**changes: object):
    woken.clear()
    return override_settings(DURABLE_AGENTS={**settings.DURABLE_AGENTS, "WAKER": f"{__name__}.record_wake", **changes})


# --- starting a run ---------------------------------------------------------------------------------------------


def _race_one_key(inside_a_transaction: bool) -> tuple[list[Any], list[BaseException]]:
    """Start A inserts key K and holds its transaction open; start B (same key) blocks on the unique index; A
    commits; B's insert fails on the key: what does B answer?"""
    answers: list[Any] = []
    errors: list[BaseException] = []
    first_inserted, let_first_commit = threading.Event(), threading.Event()

    def first() -> None:
        try:
            with transaction.atomic():
                answers.append(api.start("noop", {"steps": 1}, idempotency_key="K17"))
                first_inserted.set()
                let_first_commit.wait(60)
        finally:
            connection.close()

    def second() -> None:
        try:
            if inside_a_transaction:
                with transaction.atomic():
                    answers.append(api.start("noop", {"steps": 1}, idempotency_key="K17"))
            else:
                answers.append(api.start("noop", {"steps": 1}, idempotency_key="K17"))
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)
        finally:
            connection.close()

    a = threading.Thread(target=first)
    a.start()
    assert first_inserted.wait(60)
    b = threading.Thread(target=second)
    b.start()
    until_blocked_on_a_lock(b, "WITH v AS (SELECT * FROM unnest(")  # the start statement (its head: the text is cut)
    let_first_commit.set()
    a.join(60)
    b.join(60)
    return answers, errors


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("inside_a_transaction", [False, True], ids=["autocommit", "in_atomic"])
def test_start__two_racing_starts_with_one_key_get_one_run(inside_a_transaction):
    with _in_process():
        answers, errors = _race_one_key(inside_a_transaction)
    assert errors == [], f"the losing start raised {errors!r}"
    assert len(answers) == 2 and answers[0].id == answers[1].id
    assert Run.objects.filter(idempotency_key="K17").count() == 1


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    "bad",
    [
        {"input": {"steps": 1, "note": "a\x00b"}},
        {"input": {"steps": 1, "\x00": 1}},
        {"input": {"steps": 1, "x": float("nan")}},
        {"input": {"steps": 1, "x": "y" * 5_000_000}},
        {"input": {"steps": 1}, "idempotency_key": "k\x00"},
        {"input": {"steps": 1}, "idempotency_key": "k" * 300},
    ],
    ids=["nul_value", "nul_key", "nan", "oversized", "nul_idempotency_key", "long_idempotency_key"],
)
def test_start__invalid_input_is_a_domain_error_and_writes_nothing(bad):
    with _in_process(), pytest.raises(InvalidInputError):
        api.start("noop", bad["input"], idempotency_key=bad.get("idempotency_key"))
    assert not Run.objects.exists() and not Step.objects.exists() and woken == []


@pytest.mark.django_db(transaction=True)
def test_start__a_long_plan_is_inserted_whole_past_the_statements_parameter_limit():
    steps = 70_000 // len(Step._meta.concrete_fields) + 1  # more parameters than a bound statement may carry
    with _in_process():
        run = api.start("noop", {"steps": steps})
    assert Step.objects.filter(run_id=run.id).count() == steps == Run.objects.get(pk=run.id).step_count

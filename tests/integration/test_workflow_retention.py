"""Retention declared by workflows: a workflow named `default` does not lend its ages to every workflow, an
age past 100 years is refused when defined, and an empty workflow name is refused rather than read as every
workflow.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.conf import settings
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import override_settings

from durable_agents import clock, retention
from durable_agents.errors import DefinitionError, InvalidInputError
from durable_agents.models import Run, RunStatus
from durable_agents.workflows import call, registry, workflow

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _reset_clock():
    yield
    clock.reset()


def durable(**extra):
    return override_settings(DURABLE_AGENTS={**settings.DURABLE_AGENTS, **extra})


def old_runs(n: int, *, workflow: str = "record", age_days: float = 400) -> list:
    then = clock.now() - timedelta(days=age_days)
    runs = Run.objects.bulk_create(
        Run(
            workflow=workflow,
            workflow_version=1,
            status=RunStatus.COMPLETED,
            input={"n": i},
            input_hash="x",
            created_at=then,
            updated_at=then,
            finished_at=then,
        )
        for i in range(n)
    )
    return sorted(run.id for run in runs)


def exists(ids) -> set:
    return set(Run.objects.filter(id__in=list(ids)).values_list("id", flat=True))


def _work(ctx) -> dict:
    return {}


# Retention declared by a workflow


def test_workflow_retention__a_workflow_named_default_does_not_lend_its_ages_to_every_workflow():
    """RETENTION's "default" key means every workflow the policy does not name. A workflow that happens to be named
    "default" and declares retention={"completed": "1d"} must not prune every other workflow's runs after a day
    (runs of "record" here, which nothing in the settings or in its definition lets go)."""
    ids = old_runs(2, age_days=2)
    with registry.isolated():
        try:
            workflow("default", steps=[call("work", _work)], retention={"completed": "1d"})
        except DefinitionError as exc:
            assert "default" in str(exc), exc
        with durable(RETENTION=None, RETENTION_DUTY_CYCLE=1):
            assert retention.load_policy().age("record", "completed") is None, "record has no age of its own"
            retention.prune()
    assert exists(ids) == set(ids), "runs of 'record' were pruned by the ages a workflow named 'default' declared"


@pytest.mark.parametrize("age", [timedelta(days=365 * 200), timedelta.max])
def test_workflow_retention__an_age_past_100_years_is_refused_when_defined(age):
    """A timedelta skips parse_duration's bound: `now - age` then overflows in every prune pass (a traceback from
    the beat task, nothing pruned ever again) instead of a DefinitionError when the workflow is defined."""
    with registry.isolated(), pytest.raises(DefinitionError, match="longer than 100 years"):
        workflow("brief", steps=[call("work", _work)], retention={"completed": age})


# --workflow and --older-than


def test_prune__an_empty_workflow_is_refused_not_read_as_every_workflow():
    """`durable_prune --older-than 1d --workflow "$WF"` with WF unset deleted every workflow's runs older than a day."""
    ids = old_runs(2, age_days=2)
    with durable(RETENTION=None), pytest.raises(InvalidInputError, match="--workflow is empty"):
        retention.prune(workflow="", older_than="1d", duty_cycle=1)
    with pytest.raises(CommandError, match="--workflow is empty") as raised:
        call_command("durable_prune", "--older-than", "1d", "--workflow", "")
    assert raised.value.returncode == 2
    assert exists(ids) == set(ids)

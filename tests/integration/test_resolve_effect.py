"""'Outcome unknown' is not a dead end: an operator records what happened, by API, command or admin (issue 13,
item 12), and the run goes on from there."""

from __future__ import annotations

import json

import pytest
from django.test import override_settings

from durable_agents import api
from durable_agents.models import Effect, EffectStatus, Event, Run, RunStatus
from durable_agents.testing import drive
from durable_agents.testing.receiver import IdempotentReceiver
from tests.integration.test_admin import action_url, login, page_url
from tests.testapp.trust import HOOKS

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def carrier():
    HOOKS.clear()
    with IdempotentReceiver() as receiver:
        yield receiver
    HOOKS.clear()


def stopped_on_unknown_outcome(carrier: IdempotentReceiver) -> tuple[Run, Effect]:
    """A run that failed because its external call was made twice and never answered (here: the connection
    broke before the request left, which the engine cannot know)."""

    def broken(ctx):
        raise ConnectionResetError("connection reset")

    HOOKS["before_post"] = broken
    with override_settings(DURABLE_AGENTS={"EFFECT_MAX_INVOCATIONS": 2, "RETRY_BACKOFF_SECONDS": 0.01}):
        run = drive(api.start("ship_then_hold", {"order_id": "U-1", "url": carrier.url}).id)
    HOOKS.clear()
    assert run.status == RunStatus.FAILED and run.error["type"] == "EffectOutcomeUnknownError", run.error
    effect = Effect.objects.get(run=run)
    assert effect.needs_attention and not carrier.requests
    return run, effect


def test_resolve__applied_resumes_the_run_without_calling_again(carrier):
    run, effect = stopped_on_unknown_outcome(carrier)
    api.resolve_effect(effect.idempotency_key, True, result={"id": "n-1"}, actor="ops", reason="seen at the receiver")
    run = drive(run.id)
    assert run.status == RunStatus.COMPLETED, run.error
    effect.refresh_from_db()
    assert effect.status == EffectStatus.APPLIED and effect.result == {"id": "n-1"} and not effect.needs_attention
    assert effect.attempts == 2 and not carrier.requests, "an applied effect is not called again"
    event = Event.objects.get(run=run, kind="effect_resolved")
    assert event.actor == "ops" and event.detail["outcome"] == "applied"


def test_resolve__not_applied_calls_again_under_the_same_key(carrier):
    run, effect = stopped_on_unknown_outcome(carrier)
    api.resolve_effect(effect.idempotency_key, False, actor="ops", reason="not at the carrier")
    run = drive(run.id)
    assert run.status == RunStatus.COMPLETED, run.error
    assert carrier.requests_for(effect.idempotency_key) == 1 and list(carrier.applied) == [effect.idempotency_key]


def test_resolve__refuses_what_makes_no_sense(carrier):
    run, effect = stopped_on_unknown_outcome(carrier)
    with pytest.raises(api.InvalidInputError, match="no effect has key"):
        api.resolve_effect("no-such-key", True, actor="ops")
    api.resolve_effect(effect.idempotency_key, True, actor="ops", resume=False)
    assert Run.objects.get(pk=run.id).status == RunStatus.FAILED, "resume=False records only"
    with pytest.raises(api.InvalidTransitionError, match="already applied"):
        api.resolve_effect(effect.idempotency_key, False, actor="ops")


def test_resolve__the_command_records_and_resumes(manage, carrier):  # noqa: F811 - the fixture
    run, effect = stopped_on_unknown_outcome(carrier)
    done = manage(
        "durable_effect", effect.idempotency_key, "--applied", "--result", '{"id": "n-2"}', "--as", "ops-cli", "--json"
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["status"] == "applied"
    assert Run.objects.get(pk=run.id).status == RunStatus.PENDING, "the command resumes the stopped run"
    assert Event.objects.filter(run=run, kind="effect_resolved", actor="ops-cli").exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (["no-such-key", "--applied"], "no effect has key"),
        (["{key}", "--failed", "--result", "{{}}"], "--result goes with --applied"),
        (["{key}", "--applied", "--result", "{{not json"], "--result is not valid JSON"),
    ],
)
def test_resolve__the_command_says_what_is_wrong_in_one_line(manage, carrier, args, message):  # noqa: F811
    _run, effect = stopped_on_unknown_outcome(carrier)
    done = manage("durable_effect", *[a.format(key=effect.idempotency_key) for a in args])
    assert done.returncode == 2, done.stdout + done.stderr
    assert message in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_resolve__the_admin_action_is_permissioned_confirmed_and_recorded(carrier):
    run, effect = stopped_on_unknown_outcome(carrier)
    viewer = login("viewer")
    assert viewer.get(action_url(run, "resolve")).status_code == 403

    operator = login("operator", codenames=("resolve_effect",))
    page = operator.get(page_url(run)).content.decode()
    assert action_url(run, "resolve") in page, "the run page offers the action for an unresolved effect"
    form = operator.get(action_url(run, "resolve")).content.decode()
    assert effect.idempotency_key in form and 'id="confirm"' in form

    refused = operator.post(action_url(run, "resolve"), {"effect": effect.idempotency_key, "outcome": "applied"})
    assert refused.status_code == 200 and "This field is required" in refused.content.decode(), "a reason is asked"
    response = operator.post(
        action_url(run, "resolve"),
        {"effect": effect.idempotency_key, "outcome": "applied", "result": '{"id": "n-3"}', "reason": "checked"},
        follow=True,
    )
    assert response.redirect_chain[-1][0] == page_url(run)
    effect.refresh_from_db()
    assert effect.status == EffectStatus.APPLIED and effect.result == {"id": "n-3"}
    assert Event.objects.filter(run=run, kind="effect_resolved", actor="operator").exists()
    assert Run.objects.get(pk=run.id).status == RunStatus.PENDING
    assert action_url(run, "resolve") not in operator.get(page_url(run)).content.decode(), "nothing left to resolve"

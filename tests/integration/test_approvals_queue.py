"""The approvals queue and the wait page (issue 16): a real queue, a decision on the wait's own page that
decides exactly the call it showed, truthful messages, a styled 403, and e-mail subjects that say which run."""

from __future__ import annotations

import re

import pytest
from django.contrib.auth.models import Permission, User
from django.contrib.contenttypes.models import ContentType
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from durable_agents import api
from durable_agents.admin.actions import actions_for
from durable_agents.engine.notices import notification_for
from durable_agents.models import Run, RunStatus, Wait, WaitStatus
from durable_agents.testing import drive
from tests.integration.test_admin import action_url, charged_run, login, page_url
from tests.integration.test_admin_waits import messages_of, posted_form, waiting_run

pytestmark = pytest.mark.django_db(transaction=True)
WAITS = reverse("admin:durable_agents_wait_changelist")
HOSTILE = "<script>alert(1)</script>"


def tool_approval(order_id: str = "Q-1") -> Wait:
    """An open approval of the call big_refund(order_id=..., amount=60.00), asked by a plain step."""
    run = drive(api.start("approval_args", {"order_id": order_id}).id)
    assert run.status == RunStatus.WAITING, run.error
    return Wait.objects.get(run=run, status=WaitStatus.OPEN)


def wait_url(wait: Wait) -> str:
    return reverse("admin:durable_agents_wait_change", args=[wait.pk])


def decide_url(wait: Wait) -> str:
    return reverse("admin:durable_agents_wait_decide", args=[wait.pk])


def with_wait_permissions(username: str, *codenames: str) -> Client:
    client = login(username)
    User.objects.get(username=username).user_permissions.add(
        *Permission.objects.filter(content_type=ContentType.objects.get_for_model(Wait), codename__in=codenames)
    )
    return client


def user(username: str, codenames: tuple[str, ...] = ()) -> User:
    """A staff user with these run-action permissions (as the admin checks them, freshly loaded)."""
    if not User.objects.filter(username=username).exists():
        login(username, codenames=codenames)
    return User.objects.get(username=username)


def test_queue__titled_with_the_open_filter_highlighted_and_each_call_as_a_tool_and_an_escaped_arguments_table():
    wait = tool_approval(HOSTILE)
    operator = login("operator", codenames=("decide_wait",))
    html = operator.get(WAITS).content.decode()

    assert "Approvals and waits" in html and "Select wait to view" not in html
    selected = re.search(r'<li class="selected">\s*<a href="[^"]*"[^>]*>([^<]+)</a>', html)
    assert selected and selected.group(1).strip() == "Open approvals", "the default filter is highlighted"
    args = re.search(r'<table class="durable-args">(.*?)</table>', html, re.S)
    assert args, "the question is a tool and an arguments table, not raw big_refund({...})"
    assert "big_refund" in html and ">amount</th>" in args.group(1) and "60.00" in args.group(1)
    assert ">order_id</th>" in args.group(1) and "&lt;script&gt;alert(1)&lt;/script&gt;" in args.group(1)
    assert HOSTILE not in html, "arguments are escaped"
    assert str(wait.run_id)[:8] in html and "approval_args" in html, "the run is linked with its workflow"
    assert "Decision needed" in html, "the brief is with the question"


def test_wait_page__approve_with_a_comment_decides_that_wait_and_says_the_run_is_scheduled():
    wait = tool_approval()
    operator = login("operator", codenames=("decide_wait",))
    page = operator.get(wait_url(wait))
    html = page.content.decode()
    assert page.status_code == 200 and 'id="approve"' in html and 'id="reject"' in html
    assert '<table class="durable-args">' in html and "Q-1" in html

    response = operator.post(decide_url(wait), posted_form(page, decision="approve", comment="checked the order"))

    assert response.status_code == 302 and response["Location"] == wait_url(wait)
    wait.refresh_from_db()
    assert (wait.status, wait.decided_by, wait.decision["comment"]) == ("approved", "operator", "checked the order")
    said = " ".join(messages_of(response))
    assert "Approved wait" in said and "scheduled to resume" in said, said
    assert drive(wait.run_id).status == RunStatus.COMPLETED


def test_wait_page__a_stale_page_decides_nothing_and_says_why():
    decided_meanwhile, changed = tool_approval("Q-1"), tool_approval("Q-2")
    operator = login("operator", codenames=("decide_wait",))
    first = operator.get(wait_url(decided_meanwhile))
    second = operator.get(wait_url(changed))

    api.decide(decided_meanwhile.pk, False, by="manager-2", comment="fraud")
    response = operator.post(decide_url(decided_meanwhile), posted_form(first, decision="approve", comment="ok"))
    decided_meanwhile.refresh_from_db()
    assert (decided_meanwhile.status, decided_meanwhile.decided_by) == ("rejected", "manager-2")
    assert "already rejected by manager-2" in " ".join(messages_of(response))

    shown_other_call = posted_form(second, decision="approve", comment="ok", args_hash="0" * 64)
    response = operator.post(decide_url(changed), shown_other_call)
    assert Wait.objects.get(pk=changed.pk).is_open, "a page that showed another call decides nothing"
    assert "asks for another call than the one your page showed" in " ".join(messages_of(response))


def test_wait_page__without_the_decide_permission_a_styled_403_names_it():
    wait = tool_approval()
    viewer = with_wait_permissions("viewer", "view_wait")
    page = viewer.get(wait_url(wait)).content.decode()
    assert 'id="approve"' not in page and "durable_agents.decide_wait" in page, "no form, and the reason is given"

    refused = viewer.post(decide_url(wait), {"decision": "approve", "args_hash": wait.args_hash})
    html = refused.content.decode()
    assert refused.status_code == 403
    assert 'id="header"' in html and 'id="missing-permission">durable_agents.decide_wait<' in html, html[:500]
    assert "decide approvals" in html and "administrator" in html
    assert Wait.objects.get(pk=wait.pk).is_open

    run_viewer = login("run-viewer")
    refused = run_viewer.post(action_url(Run.objects.get(pk=wait.run_id), "approve"), {"wait": wait.pk})
    assert refused.status_code == 403 and 'id="missing-permission">durable_agents.decide_wait<' in (
        refused.content.decode()
    ), "the run page's actions refuse in the same styled page"


def test_bulk_approve__the_confirmation_lists_each_call_with_a_comment_and_decides_only_those():
    picked, other = tool_approval("Q-1"), tool_approval("Q-2")
    operator = login("operator", codenames=("decide_wait",))
    confirm = operator.post(WAITS, {"action": "approve_selected", "index": 0, "_selected_action": [picked.pk]})
    html = confirm.content.decode()
    assert "Approve 1 wait?" in html and 'name="comment"' in html
    assert '<table class="durable-args">' in html and "Q-1" in html and "Q-2" not in html

    operator.post(
        WAITS,
        {"action": "approve_selected", "index": 0, "_selected_action": [picked.pk], "confirm": "yes", "comment": "ok"},
    )
    picked.refresh_from_db()
    assert (picked.status, picked.decision["comment"]) == ("approved", "ok")
    assert Wait.objects.get(pk=other.pk).is_open


def test_actions__a_compensated_run_offers_no_resume_or_replan_and_resume_reports_scheduled():
    operator = login("operator", codenames=("resume_run", "replan_run"))
    compensated = charged_run()
    api.cancel(compensated.id, "undo", compensate=True, actor="someone")
    compensated = drive(compensated.id)
    assert (compensated.status, compensated.finish_as) == (RunStatus.CANCELLED, RunStatus.CANCELLED)
    offered = {action.slug for action, _ in actions_for(compensated, user("operator"))}
    assert not offered & {"resume", "retry", "replan"}, offered

    cancelled = api.cancel(api.start("noop", {"steps": 2}).id, "pause", actor="someone")
    response = operator.post(action_url(cancelled, "resume"), follow=True)
    html = response.content.decode()
    assert "Resume: scheduled — a worker will pick the run up" in html and ": done" not in html
    assert response.redirect_chain[-1][0] == page_url(cancelled)


def test_actions__budget_and_participant_only_for_workflows_with_a_model_step():
    operator = user("operator", codenames=("set_budget", "swap_participant"))
    no_model = api.start("noop", {"steps": 1})
    with_model = api.start("agent_ticks", {"ticks": 1})
    assert not {a.slug for a, _ in actions_for(no_model, operator)} & {"budget", "swap"}
    assert {"budget", "swap"} <= {a.slug for a, _ in actions_for(with_model, operator)}


def test_email_subject__names_the_workflow_the_run_and_the_tool():
    wait = tool_approval()
    subject = notification_for(wait, "requested").subject
    assert subject == f"Approval needed: approval_args run {str(wait.run_id)[:8]} — big_refund", subject
    plain = Wait.objects.get(run=waiting_run(), status=WaitStatus.OPEN)
    assert notification_for(plain, "reminder", 2).subject.startswith(
        "Reminder 2: approval still needed: approve_charge run "
    )


def test_queue__a_page_of_calls_too_long_for_their_question_costs_the_same_queries_as_one():
    """The list reads each call's arguments from its question only: a row costs no query, and a call whose
    question was cut short says its arguments are on the wait page."""
    operator = login("operator", codenames=("decide_wait",))
    tool_approval("L" * 300)
    with CaptureQueriesContext(connection) as one:
        assert operator.get(WAITS).status_code == 200
    for n in range(5):
        tool_approval(f"{n}" * 300)
    with CaptureQueriesContext(connection) as six:
        html = operator.get(WAITS).content.decode()
    assert len(six) == len(one), [q["sql"][:120] for q in six.captured_queries]
    assert html.count("big_refund") >= 6

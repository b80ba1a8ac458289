"""The operator console through the Django test client: filters, search, the run page, actions, permissions.

Every action goes through the public API, so each test checks the run's state *and* the event recorded
with the operator's name. Query-count tests pin that the list and the run page do not grow with data.
"""

from __future__ import annotations

import re
from datetime import timedelta
from decimal import Decimal

import pytest
from django.conf import settings
from django.contrib.auth.models import Permission, User
from django.contrib.contenttypes.models import ContentType
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext, override_settings
from django.urls import reverse

from durable_agents import api, clock
from durable_agents.admin.counting import EstimatedCountPaginator, estimated_count
from durable_agents.admin.timeline import human_duration
from durable_agents.engine.advance import advance
from durable_agents.models import Effect, EffectStatus, Event, Run, RunStatus, Step, Turn, Wait
from durable_agents.testing import drive
from durable_agents.testing.runs import take_lease

pytestmark = pytest.mark.django_db

ACTION_PERMISSIONS = {
    "resume_run": "Can resume runs",
    "cancel_run": "Can cancel runs",
    "retry_step": "Can retry a failed step",
    "set_budget": "Can set a run's budget",
    "swap_participant": "Can swap a run's participant",
    "decide_wait": "Can approve or reject waits",
    "replan_run": "Can re-plan runs",
    "resolve_effect": "Can record the outcome of an effect",
}
LIST = reverse("admin:durable_agents_run_changelist")


def page_url(run: Run) -> str:
    return reverse("admin:durable_agents_run_change", args=[run.pk])


def action_url(run: Run, slug: str) -> str:
    return reverse("admin:durable_agents_run_action", args=[run.pk, slug])


def login(username: str, *, staff: bool = True, codenames: tuple[str, ...] = ()) -> Client:
    content_type = ContentType.objects.get_for_model(Run)
    for codename, name in ACTION_PERMISSIONS.items():
        Permission.objects.get_or_create(codename=codename, content_type=content_type, defaults={"name": name})
    user = User.objects.create_user(username, password="secret", is_staff=staff)
    user.user_permissions.add(
        *Permission.objects.filter(content_type=content_type, codename__in=["view_run", *codenames])
    )
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def operator() -> Client:
    """Staff with every action permission."""
    return login("operator", codenames=tuple(ACTION_PERMISSIONS))


@pytest.fixture
def viewer() -> Client:
    """Staff who may look at runs but not act on them."""
    return login("viewer")


@pytest.fixture
def outsider() -> Client:
    """Logged in, not staff."""
    return login("outsider", staff=False, codenames=tuple(ACTION_PERMISSIONS))


def listed(client: Client, query: str = "") -> list[Run]:
    response = client.get(f"{LIST}?{query}")
    assert response.status_code == 200, f"the run list answered {response.status_code} for ?{query}"
    assert "e=1" not in response.get("Location", ""), f"the run list rejected ?{query}"
    return list(response.context["cl"].result_list)


def ids(runs: list[Run]) -> set:
    return {run.pk for run in runs}


def make_stuck(run: Run, *, lease_expired: bool = True) -> Run:
    now = clock.now()
    if lease_expired:
        Run.objects.filter(pk=run.pk).update(
            status=RunStatus.RUNNING, lease_owner="dead-worker", lease_expires_at=now - timedelta(minutes=1)
        )
    else:
        Run.objects.filter(pk=run.pk).update(updated_at=now - timedelta(hours=2))
    run.refresh_from_db()
    return run


def events(run: Run, kind: str) -> list[Event]:
    return list(Event.objects.filter(run=run, kind=kind))


# --- The run list ---------------------------------------------------------------------------------------


def test_run_list__shows_the_columns_operators_need(operator):
    done = drive(api.start("noop", {"steps": 2}).id)
    Run.objects.filter(pk=done.pk).update(input_tokens=1200, output_tokens=34, cost_usd=Decimal("0.0123"))
    fresh = api.start("noop", {"steps": 3})

    html = operator.get(LIST).content.decode()

    for run in (done, fresh):
        assert str(run.pk)[:8] in html, "each run is listed by its short id"
    assert "noop@1" in html, "workflow@version column"
    assert 'class="durable-badge durable-completed"' in html and 'class="durable-badge durable-pending"' in html
    assert "tick-1 · 1/3" in html, "the current step of a fresh run is its first"
    assert "1,234" in html and "$0.0123" in html, "tokens and cost columns"
    assert 'id="durable-overview"' in html, "the overview sits on top of the list"


@pytest.mark.parametrize("status", RunStatus.values)
def test_run_list__filter_by_status(operator, status):
    runs = {s: api.start("noop", {"steps": 1}) for s in RunStatus.values}
    for s, run in runs.items():
        Run.objects.filter(pk=run.pk).update(status=s)
    assert ids(listed(operator, f"status__exact={status}")) == {runs[status].pk}


def test_run_list__filter_by_workflow(operator):
    noop = api.start("noop", {"steps": 1})
    record = api.start("record", {"steps": 1})
    assert ids(listed(operator, "workflow=record")) == {record.pk}
    assert ids(listed(operator, "workflow=noop")) == {noop.pk}
    html = operator.get(LIST).content.decode()
    assert "?workflow=two_charges" in html, "every registered workflow is offered, without scanning the table"


def test_run_list__filter_stuck(operator):
    expired = make_stuck(api.start("noop", {"steps": 2}))
    silent = make_stuck(api.start("noop", {"steps": 2}), lease_expired=False)
    healthy = api.start("noop", {"steps": 2})
    Run.objects.filter(pk=healthy.pk).update(
        status=RunStatus.RUNNING, lease_owner="live", lease_expires_at=clock.now() + timedelta(seconds=30)
    )
    api.start("noop", {"steps": 2})

    assert ids(listed(operator, "stuck=yes")) == {expired.pk, silent.pk}
    assert [r.pk for r in listed(operator, "stuck=yes")] == [silent.pk, expired.pk], "newest first"
    age = operator.get(LIST).context["cl"].list_display.index("age")
    assert [r.pk for r in listed(operator, f"stuck=yes&o={age}")] == [expired.pk, silent.pk], "sortable by age"
    html = operator.get(f"{LIST}?stuck=yes").content.decode()
    assert html.count('class="durable-badge durable-stuck"') == 2, "stuck runs carry a stuck badge in the list"


@pytest.mark.parametrize(("aging", "expected"), [("1h", {"2h", "2d", "4d"}), ("1d", {"2d", "4d"}), ("3d", {"4d"})])
def test_run_list__filter_aging(operator, aging, expected):
    now = clock.now()
    runs = {}
    for label, age in [("new", timedelta(minutes=5)), ("2h", timedelta(hours=2)), ("2d", timedelta(days=2))]:
        runs[label] = api.start("noop", {"steps": 1})
        Run.objects.filter(pk=runs[label].pk).update(created_at=now - age)
    runs["4d"] = api.start("noop", {"steps": 1})
    Run.objects.filter(pk=runs["4d"].pk).update(created_at=now - timedelta(days=4), status=RunStatus.WAITING)
    finished = drive(api.start("noop", {"steps": 1}).id)
    Run.objects.filter(pk=finished.pk).update(created_at=now - timedelta(days=5))

    assert ids(listed(operator, f"aging={aging}")) == {runs[label].pk for label in expected}, (
        "aging lists open runs (pending, running, waiting) older than the threshold, never finished ones"
    )


def test_run_list__filter_waiting_past_deadline(operator):
    overdue = drive(api.start("deadline_reject").id)
    in_time = drive(api.start("deadline_reject").id)
    no_deadline = drive(api.start("approve_charge", {"order_id": "W-1"}).id)
    assert {r.status for r in (overdue, in_time, no_deadline)} == {RunStatus.WAITING}
    Wait.objects.filter(run=overdue).update(deadline=clock.now() - timedelta(minutes=5))

    assert ids(listed(operator, "wait=overdue")) == {overdue.pk}
    overview = operator.get(LIST).context["overview"]
    assert overview.waits_past_deadline.count.value == 1 and overview.oldest_waiting is not None


def test_run_list__filter_failed_by_error_type(operator):
    broken = drive(api.start("broken").id)
    other = api.start("noop", {"steps": 1})
    Run.objects.filter(pk=other.pk).update(
        status=RunStatus.FAILED, error={"type": "BudgetExceededError", "message": "over budget", "step": "tick-1"}
    )
    api.start("noop", {"steps": 1})

    html = operator.get(LIST).content.decode()
    assert "?error_type=ValueError" in html and "?error_type=BudgetExceededError" in html, (
        "the error types of recent failed runs are offered as filter choices"
    )
    assert ids(listed(operator, "error_type=ValueError")) == {broken.pk}
    assert ids(listed(operator, "error_type=BudgetExceededError")) == {other.pk}


def test_run_list__search_by_run_id_prefix_and_idempotency_key(operator):
    keyed = api.start("noop", {"steps": 1}, idempotency_key="order-42")
    others = [api.start("noop", {"steps": 1}) for _ in range(3)]

    assert ids(listed(operator, f"q={keyed.pk}")) == {keyed.pk}, "the full run id finds the run"
    assert keyed.pk in ids(listed(operator, f"q={str(keyed.pk)[:8]}")), "the short id finds the run"
    assert ids(listed(operator, "q=order-42")) == {keyed.pk}, "the idempotency key finds the run"
    assert ids(listed(operator, f"q={str(others[0].pk).upper()}")) == {others[0].pk}, "ids match in any case"
    assert listed(operator, "q=no-such-key") == []
    assert listed(operator, "q=-") == [], "a lone dash is not an empty id prefix that matches every run"


def test_run_list__date_hierarchy_drills_down_without_distinct_scans(operator):
    run = api.start("noop", {"steps": 1})
    Run.objects.filter(pk=run.pk).update(created_at=clock.now().replace(year=2024, month=3, day=9))
    recent = api.start("noop", {"steps": 1})

    with CaptureQueriesContext(connection) as queries:
        html = operator.get(LIST).content.decode()
    assert "created_at__year=2024" in html and f"created_at__year={recent.created_at.year}" in html
    assert not [q for q in queries if "DISTINCT" in q["sql"].upper()], "the date hierarchy never runs SELECT DISTINCT"

    assert ids(listed(operator, "created_at__year=2024")) == {run.pk}
    html = operator.get(f"{LIST}?created_at__year=2024").content.decode()
    assert "created_at__month=3" in html and "created_at__month=12" in html, "a year offers its months"
    assert ids(listed(operator, "created_at__year=2024&created_at__month=3&created_at__day=9")) == {run.pk}


def test_run_list__counts_are_estimated_past_the_limit_never_counted_in_full(operator):
    for _ in range(6):
        api.start("noop", {"steps": 1})
    with connection.cursor() as cursor:
        cursor.execute(f"ANALYZE {Run._meta.db_table}")
    limited = {**settings.DURABLE_AGENTS, "ADMIN_EXACT_COUNT_LIMIT": 3}

    with override_settings(DURABLE_AGENTS=limited), CaptureQueriesContext(connection) as queries:
        response = operator.get(LIST)
    counts = [q["sql"] for q in queries if "COUNT(" in q["sql"].upper()]
    assert counts and all("LIMIT" in sql.upper() for sql in counts), f"every COUNT is capped by a LIMIT: {counts}"
    assert any("reltuples" in q["sql"] for q in queries), "the unfiltered list reads the table estimate"
    assert response.context["cl"].paginator.row_count.exact is False
    assert "≈ 6" in response.content.decode(), "an estimated count says so"

    with override_settings(DURABLE_AGENTS=limited):
        exact = estimated_count(Run.objects.filter(workflow="record"))
        assert exact.exact and exact.value == 0, "below the limit a count is exact"
        filtered = estimated_count(Run.objects.filter(workflow="noop"))
        assert not filtered.exact and filtered.value >= 4, "past the limit a filtered count is the planner's estimate"


def test_paginator__a_page_past_an_overestimated_end_is_empty_not_an_error():
    api.start("noop", {"steps": 1})
    paginator = EstimatedCountPaginator(Run.objects.order_by("pk"), 10)
    paginator.count = 100  # as if the estimate were high
    assert list(paginator.page(5).object_list) == []


def test_run_list__query_count_does_not_grow_with_runs(operator):
    def count_queries(query: str) -> int:
        with CaptureQueriesContext(connection) as queries:
            assert operator.get(f"{LIST}?{query}").status_code == 200
        return len(queries)

    def seed(n: int) -> None:
        for i in range(n):
            run = api.start("noop" if i % 2 else "record", {"steps": 3})
            if i % 3 == 0:
                make_stuck(run)
            if i % 5 == 0:
                drive(run.id)

    seed(3)
    few = {q: count_queries(q) for q in ["", "stuck=yes", "status__exact=pending", "aging=1h", "q=abc"]}
    seed(30)
    many = {q: count_queries(q) for q in few}
    assert few == many, f"queries per list page must not grow with the number of runs: {few} vs {many}"


# --- The run page ---------------------------------------------------------------------------------------


def test_run_page__troubleshooting_answers_timeline_steps_and_events(operator):
    run = drive(api.start("flaky", {"failures": 2}).id)
    assert run.status == RunStatus.COMPLETED and len(events(run, "step_retry")) == 2

    response = operator.get(page_url(run))
    html = response.content.decode()

    assert response.status_code == 200
    assert re.search(r'id="last-committed">\s*<span class="durable-mono">after</span> \(2 of 2\)', html), (
        "the last committed step is named at the top"
    )
    assert "2 retries" in html and "flaky failure 1" in html, "the retry history lists each retry with its error"
    assert "flaky@1" in html and "(latest)" in html, "the version is shown, with drift against the registry"
    svg = re.search(r'<svg[^>]*class="durable-timeline".*?</svg>', html, re.S).group(0)
    assert svg.count("<title>flaky: done") == 1 and svg.count("<title>after: done") == 1, "one bar per step"
    assert svg.count("retry after attempt") == 2, "each retry is marked on its step's bar"
    for label in ("done", "running", "failed", "wait", "superseded", "retry (failed attempt)"):
        assert f">{label}</text>" in svg, f"the legend names {label!r}"
    assert "t = 0 at" in svg and ">+" in svg, "the time axis is labelled"
    assert html.count('class="durable-badge durable-done"') >= 2, "the steps table lists both steps"
    assert ">step_retry<" in html, "events are listed"


def test_run_page__waits_are_listed_answered_and_hatched_on_the_timeline(operator):
    run = drive(api.start("approve_charge", {"order_id": "W-2"}).id)
    assert run.status == RunStatus.WAITING

    html = operator.get(page_url(run)).content.decode()
    open_wait = re.search(r'id="open-wait">(.*?)</dd>', html, re.S).group(1)
    assert "approval" in open_wait and "Charge the customer 40.00?" in open_wait, "what the run waits for is on top"
    assert 'id="waits"' in html and "ops@example.com" not in open_wait
    svg = re.search(r'<svg[^>]*class="durable-timeline".*?</svg>', html, re.S).group(0)
    assert svg.count('class="wait"') == 1 and "approval approve, open" in svg, "the open wait is hatched on its step"


def test_run_page__effects_with_keys_compensation_and_in_flight(operator):
    run = api.start("two_charges", {"order_id": "A-7"})
    advance(run.id)
    advance(run.id)
    Effect.objects.create(
        run=run, idempotency_key="pending-key-1", tool="notify", args={}, args_hash="x", status=EffectStatus.PENDING
    )

    html = operator.get(page_url(run)).content.decode()
    applied = list(Effect.objects.filter(run=run, status=EffectStatus.APPLIED))
    assert len(applied) == 2
    for effect in applied:
        assert effect.idempotency_key in html, "effects are listed with their idempotency keys"
    assert "not compensated" in html
    in_flight = re.search(r'id="in-flight">(.*?)</dd>', html, re.S).group(1)
    assert "pending-key-1" in in_flight, "the in-flight (pending) effect is answered at the top"

    api.cancel(run.id, "customer withdrew", compensate=True, actor="someone")
    drive(run.id)
    html = operator.get(page_url(run)).content.decode()
    assert html.count("compensated by") == 4 and html.count("undoes") == 2, (
        "each compensated effect says so in the steps table and the effects table; each undo names its effect"
    )


def test_run_page__turn_transcripts_are_truncated_and_expandable(operator):
    run = api.start("noop", {"steps": 1})
    step = Step.objects.get(run=run)
    long_text = "The customer asked about order A-1. " * 40
    Turn.objects.create(
        run=run,
        step=step,
        index=0,
        request_digest="d" * 64,
        content=[{"type": "text", "text": long_text}, {"type": "tool_use", "name": "charge", "input": {"a": 1}}],
        stop_reason="tool_use",
        model="claude-test",
        participant="anthropic",
        input_tokens=100,
        output_tokens=20,
    )
    html = operator.get(page_url(run)).content.decode()
    turns = re.search(r'id="turns">(.*?)</table>', html, re.S).group(1)
    assert "<details" in turns and "<summary>" in turns, "a long transcript is folded in <details>"
    assert "→ charge({&quot;a&quot;: 1})" in turns, "tool calls read as name(arguments)"
    summary = re.search(r"<summary>(.*?)</summary>", turns, re.S).group(1)
    assert len(summary) < 200, "the summary line is truncated"


def test_run_page__query_count_does_not_grow_with_steps_and_history(operator):
    def count_queries(run: Run) -> int:
        with CaptureQueriesContext(connection) as queries:
            assert operator.get(page_url(run)).status_code == 200
        return len(queries)

    small = drive(api.start("record", {"steps": 2}).id)
    large = drive(api.start("record", {"steps": 40}).id)
    charged = api.start("two_charges", {"order_id": "B-1"})
    advance(charged.id)
    advance(charged.id)
    for i in range(30):
        Event.objects.create(run=large, kind="note", detail={"i": i})
    flaky = drive(api.start("flaky", {"failures": 3}).id)
    waiting = drive(api.start("approve_charge", {"order_id": "Q-1"}).id)

    counts = {run.workflow: count_queries(run) for run in (small, large, charged, flaky, waiting)}
    assert len(set(counts.values())) == 1, f"the run page reads a fixed number of queries: {counts}"


def test_run_page__unknown_run_redirects_with_a_message(operator):
    response = operator.get(reverse("admin:durable_agents_run_change", args=["not-a-uuid"]), follow=True)
    assert response.status_code == 200 and "doesn’t exist" in response.content.decode()


# --- Actions --------------------------------------------------------------------------------------------


def cancelled_run() -> Run:
    run = api.start("noop", {"steps": 2})
    return api.cancel(run.id, "test", actor="setup")


def failed_run() -> Run:
    return drive(api.start("broken").id)


def charged_run() -> Run:
    run = api.start("two_charges", {"order_id": "C-3"})
    advance(run.id)
    advance(run.id)
    return Run.objects.get(pk=run.pk)


ACTION_CASES = {
    # slug: (make the run, POST data, event kind recorded, check the run after)
    "resume": (cancelled_run, {}, "resumed", lambda run: run.status == RunStatus.PENDING),
    "retry": (failed_run, {}, "resumed", lambda run: run.status == RunStatus.PENDING and run.error is None),
    "cancel": (
        lambda: api.start("noop", {"steps": 2}),
        {"reason": "customer withdrew"},
        "cancelled",
        lambda run: run.status == RunStatus.CANCELLED and run.cancel_reason == "customer withdrew",
    ),
    "compensate": (
        charged_run,
        {"reason": "refund everything"},
        "cancel_compensating",
        lambda run: run.finish_as == RunStatus.CANCELLED,
    ),
    "budget": (
        lambda: api.start("agent_ticks", {"ticks": 1}),
        {"tokens": "50000", "cost_usd": "2.50"},
        "budget_set",
        lambda run: run.token_budget == 50000 and run.cost_budget_usd == Decimal("2.5"),
    ),
    "swap": (
        lambda: api.start("agent_ticks", {"ticks": 1}),
        {"participant": "anthropic"},
        "participant_swapped",
        lambda run: run.participant == "anthropic",
    ),
}


@pytest.mark.parametrize("slug", ACTION_CASES)
def test_action__with_permission_goes_through_the_api_and_is_recorded_with_the_user(operator, slug):
    make, data, kind, check = ACTION_CASES[slug]
    run = make()

    form = operator.get(action_url(run, slug))
    assert form.status_code == 200 and 'id="confirm"' in form.content.decode(), "every action has a confirm page"
    assert not events(run, kind) or kind == "resumed", "the GET changes nothing"

    response = operator.post(action_url(run, slug), data, follow=True)
    assert response.redirect_chain[-1][0] == page_url(run), "after acting, the operator is back on the run page"
    run.refresh_from_db()
    assert check(run), f"{slug} did not take effect: status {run.status}"
    recorded = [e for e in events(run, kind) if e.actor == "operator"]
    assert len(recorded) == 1, f"{slug} must be recorded once as a {kind!r} event by the operator"
    assert f"(run {run.pk}). It is recorded in the run" in response.content.decode(), (
        "success is reported as an admin message"
    )


@pytest.mark.parametrize("slug", ACTION_CASES)
def test_action__staff_without_the_permission_sees_but_cannot_act(viewer, slug):
    make, data, kind, _ = ACTION_CASES[slug]
    run = make()
    before = Event.objects.filter(run=run).count()

    html = viewer.get(page_url(run)).content.decode()
    assert viewer.get(page_url(run)).status_code == 200, "a viewer sees the run page"
    assert action_url(run, slug) not in html, "a viewer is offered no way to act"
    assert "needs the permission durable_agents." in html, "the disabled button says which permission is missing"
    assert viewer.get(action_url(run, slug)).status_code == 403
    assert viewer.post(action_url(run, slug), data).status_code == 403
    assert Event.objects.filter(run=run).count() == before, "a refused action records nothing"


@pytest.mark.parametrize("slug", ACTION_CASES)
def test_action__non_staff_cannot_enter(outsider, slug):
    make, data, _, _ = ACTION_CASES[slug]
    run = make()
    status = Run.objects.get(pk=run.pk).status
    for response in (outsider.get(page_url(run)), outsider.post(action_url(run, slug), data)):
        assert response.status_code == 302 and "/admin/login/" in response["Location"]
    assert Run.objects.get(pk=run.pk).status == status


def test_action__anonymous_is_sent_to_log_in():
    run = api.start("noop", {"steps": 1})
    for url in (LIST, page_url(run), action_url(run, "cancel")):
        response = Client().get(url)
        assert response.status_code == 302 and "/admin/login/" in response["Location"]


def test_action__resume_button_posts_directly_and_cancel_asks_for_confirmation(operator):
    run = make_stuck(api.start("noop", {"steps": 2}))
    html = operator.get(page_url(run)).content.decode()
    assert f'<form method="post" action="{action_url(run, "resume")}">' in html, "resume is one click"
    assert f'href="{action_url(run, "cancel")}"' in html, "cancel goes to a confirmation page"

    confirm = operator.get(action_url(run, "cancel")).content.decode()
    assert "This cannot be undone." in confirm and 'name="reason"' in confirm
    assert Run.objects.get(pk=run.pk).status == RunStatus.RUNNING, "the confirmation page changes nothing"

    operator.post(action_url(run, "resume"))
    woken = events(run, "woken")
    assert len(woken) == 1 and woken[0].actor == "operator", "resuming a stuck run re-wakes it, recorded"


def test_action__domain_errors_become_messages_not_tracebacks(operator, monkeypatch):
    run = failed_run()

    def refuse(*args, **kwargs):
        raise api.InvalidTransitionError(f"run {run.id} changed while resuming; look at it again and retry")

    monkeypatch.setattr(api, "resume", refuse)
    response = operator.post(action_url(run, "retry"), follow=True)
    html = response.content.decode()
    assert response.status_code == 200 and "Retry failed step failed: run" in html and "changed while resuming" in html


def test_action__that_does_not_apply_to_the_status_is_refused_with_a_message(operator):
    run = drive(api.start("noop", {"steps": 1}).id)
    html = operator.get(page_url(run)).content.decode()
    assert action_url(run, "cancel") not in html, "a completed run offers no cancel"
    response = operator.post(action_url(run, "cancel"), {"reason": "x"}, follow=True)
    assert "Cancel does not apply to a completed run." in response.content.decode()
    assert not events(run, "cancelled")


def test_action__budget_form_needs_a_value(operator):
    run = api.start("agent_ticks", {"ticks": 1})
    response = operator.post(action_url(run, "budget"), {})
    assert response.status_code == 200 and "Give a token budget, a cost budget, or both." in response.content.decode()
    assert not events(run, "budget_set")


def test_bulk__resume_selected_stuck_runs(operator, viewer):
    stuck = [make_stuck(api.start("noop", {"steps": 2})) for _ in range(3)]
    response = operator.post(
        f"{LIST}?stuck=yes",
        {"action": "resume_selected", "index": 0, "_selected_action": [str(r.pk) for r in stuck]},
        follow=True,
    )
    assert "Resume scheduled (a worker picks each up) for 3 runs" in response.content.decode()
    assert Event.objects.filter(run__in=stuck, kind="woken", actor="operator").count() == 3

    action_form = viewer.get(LIST).context["action_form"]
    offered = dict(action_form.fields["action"].choices) if action_form else {}
    assert "resume_selected" not in offered and "cancel_selected" not in offered, "a viewer gets no bulk actions"


def test_bulk__cancel_selected_confirms_then_cancels_and_reports_errors(operator):
    open_runs = [api.start("noop", {"steps": 2}) for _ in range(2)]
    done = drive(api.start("noop", {"steps": 1}).id)
    selected = [str(r.pk) for r in [*open_runs, done]]

    confirm = operator.post(LIST, {"action": "cancel_selected", "index": 0, "_selected_action": selected})
    assert confirm.status_code == 200 and "Cancel 2 runs?" in confirm.content.decode(), "finished: not counted"
    assert not Event.objects.filter(kind="cancelled").exists(), "the confirmation page cancels nothing"

    response = operator.post(
        LIST,
        {"action": "cancel_selected", "index": 0, "_selected_action": selected, "confirm": "yes", "reason": "bulk"},
        follow=True,
    )
    html = response.content.decode()
    assert "Cancelled 2 runs" in html and "is already completed" in html, "the finished run is reported, not raised"
    assert Event.objects.filter(run__in=open_runs, kind="cancelled", actor="operator").count() == 2


def test_bulk__cancel_reports_a_run_a_worker_holds_as_asked_to_stop_not_cancelled(operator):
    idle = api.start("noop", {"steps": 2})
    held = api.start("noop", {"steps": 2})
    take_lease(held.id)  # a worker executes its step now: the cancel can only be requested
    # ... for as long as the lease holds: longer than any stall of this test (the tests' lease is seconds).
    Run.objects.filter(pk=held.pk).update(lease_expires_at=clock.now() + timedelta(hours=1))
    selected = [str(idle.pk), str(held.pk)]
    response = operator.post(
        LIST,
        {"action": "cancel_selected", "index": 0, "_selected_action": selected, "confirm": "yes", "reason": "bulk"},
        follow=True,
    )
    html = response.content.decode()
    assert "Cancelled 1 run;" in html
    assert "Asked to stop, once the step executing now is checkpointed, 1 run;" in html
    assert Run.objects.get(pk=held.pk).status == RunStatus.RUNNING


def test_timeline__durations_read_like_an_operator_writes_them():
    assert [human_duration(s) for s in (0, 0.25, 1.5, 150, 7200, 93600)] == [
        "0s",
        "250ms",
        "1.5s",
        "2m30s",
        "2h",
        "1d2h",
    ]

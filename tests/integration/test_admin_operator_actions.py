"""Every operator action in the console, through the Django test client as a logged-in staff user on Postgres:
delivering a signal, forking or resetting from a step, triggering, pausing and resuming a schedule — each with
its permission refused, bad input answered with a message (never a traceback), and its audit trail: a `LogEntry`
that the admin index's "Recent actions" and the run page both show.
"""

from __future__ import annotations

import io
import re

import pytest
from django.contrib.admin.models import ADDITION, CHANGE, LogEntry
from django.contrib.auth.models import Permission, User
from django.contrib.contenttypes.models import ContentType
from django.core.management import call_command
from django.test import Client
from django.urls import reverse

from durable_agents import api
from durable_agents.engine.advance import advance
from durable_agents.models import Event, Run, RunStatus, Schedule, Step, StepStatus, Wait, WaitStatus
from durable_agents.testing import drive
from durable_agents.testing.runs import take_lease

pytestmark = pytest.mark.django_db

RUN_PERMISSIONS = ("decide_wait", "signal_run", "replan_run", "fork_run", "cancel_run", "resume_run")


def page_url(run: Run) -> str:
    return reverse("admin:durable_agents_run_change", args=[run.pk])


def action_url(run: Run, slug: str) -> str:
    return reverse("admin:durable_agents_run_action", args=[run.pk, slug])


def schedule_url(schedule: Schedule, verb: str = "") -> str:
    if not verb:
        return reverse("admin:durable_agents_schedule_change", args=[schedule.pk])
    return reverse("admin:durable_agents_schedule_operate", args=[schedule.pk, verb])


def login(username: str, codenames: tuple[str, ...] = ()) -> Client:
    """Staff who may view runs and schedules, with the named permissions of the app."""
    for model, codename, name in [
        (Run, "decide_wait", "Can approve or reject waits"),
        (Run, "signal_run", "Can deliver a signal to a run"),
        (Run, "replan_run", "Can re-plan runs"),
        (Run, "fork_run", "Can fork a run from a step"),
        (Run, "cancel_run", "Can cancel runs"),
        (Run, "resume_run", "Can resume runs"),
        (Schedule, "pause_schedule", "Can pause and resume schedules"),
        (Schedule, "trigger_schedule", "Can trigger a schedule now"),
    ]:
        content_type = ContentType.objects.get_for_model(model)
        Permission.objects.get_or_create(codename=codename, content_type=content_type, defaults={"name": name})
    user = User.objects.create_user(username, password="secret", is_staff=True)
    user.user_permissions.add(
        *Permission.objects.filter(
            content_type__app_label="durable_agents", codename__in=["view_run", "view_schedule", *codenames]
        )
    )
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def operator() -> Client:
    return login("operator", (*RUN_PERMISSIONS, "pause_schedule", "trigger_schedule"))


@pytest.fixture
def viewer() -> Client:
    return login("viewer")


def waiting_on_signal() -> tuple[Run, Wait]:
    run = drive(api.start("big_handoff", {"size": 10}).id)
    assert run.status == RunStatus.WAITING, f"big_handoff should park on its signal, is {run.status}"
    return run, Wait.objects.get(run=run, status=WaitStatus.OPEN)


def logged(obj, user: str = "operator") -> list[LogEntry]:
    content_type = ContentType.objects.get_for_model(type(obj))
    return list(
        LogEntry.objects.filter(content_type=content_type, object_id=str(obj.pk), user__username=user).order_by("id")
    )


def recent_actions(client: Client) -> str:
    return client.get(reverse("admin:index")).content.decode()


# --- Deliver a signal ----------------------------------------------------------------------------------------


def test_signal__a_signal_wait_offers_deliver_not_approve_or_reject(operator):
    run, _ = waiting_on_signal()
    html = operator.get(page_url(run)).content.decode()
    assert f'href="{action_url(run, "signal")}"' in html, "a run waiting on a signal offers Deliver signal"
    assert action_url(run, "approve") not in html and action_url(run, "reject") not in html, (
        "approve and reject apply to approvals only: a signal wait refuses them"
    )
    waiting_for = re.search(r'id="open-wait">(.*?)</dd>', html, re.S).group(1)
    assert waiting_for.count("go") == 1, f"'Waiting for' names the signal once: {waiting_for}"
    form = operator.get(action_url(run, "signal")).content.decode()
    assert 'value="go"' in form, "the signal's name is prefilled from the open wait"


def test_signal__approve_posted_on_a_signal_wait_says_to_deliver_and_decides_nothing(operator):
    run, wait = waiting_on_signal()
    response = operator.post(action_url(run, "approve"), {"wait": wait.pk, "comment": ""}, follow=True)
    assert "waits for signal &#x27;go&#x27;: use Deliver signal" in response.content.decode()
    wait.refresh_from_db()
    assert wait.status == WaitStatus.OPEN and not LogEntry.objects.exists()


def test_signal__an_approval_wait_still_offers_approve_and_no_deliver(operator):
    run = drive(api.start("approve_charge", {"order_id": "A-1"}).id)
    html = operator.get(page_url(run)).content.decode()
    assert action_url(run, "approve") in html and action_url(run, "signal") not in html


def test_signal__delivered_with_its_payload_logged_and_shown_in_recent_actions(operator):
    run, wait = waiting_on_signal()
    response = operator.post(
        action_url(run, "signal"), {"wait": wait.pk, "name": "go", "payload": '{"paid": true}'}, follow=True
    )
    assert response.redirect_chain[-1][0] == page_url(run)
    assert "Deliver signal: delivered" in response.content.decode()
    wait.refresh_from_db()
    assert wait.status == WaitStatus.APPROVED and wait.decided_by == "operator"
    assert wait.decision["payload"] == {"paid": True}, "the payload reaches the wait as JSON"
    assert [e.change_message for e in logged(run)] == ["Delivered signal 'go'"]
    assert logged(run)[0].action_flag == CHANGE
    assert "Delivered signal &#x27;go&#x27;" in recent_actions(operator), "the index's Recent actions lists it"
    page = operator.get(page_url(run)).content.decode()
    section = page[page.index('id="operator-actions"') : page.index('id="events"')]
    assert "Delivered signal" in section and "operator" in section, "the run page shows who did what"
    received = Event.objects.get(run=run, kind="signal_received")
    assert f'href="#event-{received.pk}"' in section, "the log entry links the event the engine recorded"
    assert f'id="event-{received.pk}"' in page
    drive(run.id)
    assert Run.objects.get(pk=run.pk).status == RunStatus.COMPLETED


def test_signal__the_form_names_the_wait_it_delivers_to_and_its_name_cannot_be_changed(operator):
    run, wait = waiting_on_signal()
    form = operator.get(action_url(run, "signal")).content.decode()
    shown = " ".join(re.sub(r"<[^>]+>", "", re.search(r'<p id="decided-wait">(.*?)</p>', form, re.S).group(1)).split())
    assert f"You deliver to wait {wait.pk}" in shown and "You decide" not in shown, "a signal is no decision"

    # A name the run does not wait for, posted anyway (an edited form): the wait shown gets its own name's signal.
    response = operator.post(
        action_url(run, "signal"), {"wait": wait.pk, "name": "typo", "payload": '{"paid": true}'}, follow=True
    )
    assert response.status_code == 200
    received = Event.objects.get(run=run, kind="signal_received")
    assert received.detail.get("name") == "go", received.detail


@pytest.mark.parametrize("posted", ["another run's wait", "", "-1", "99999999999999999999999", "its approval"])
def test_signal__a_post_naming_no_signal_wait_of_this_run_is_refused_and_nothing_is_sent(operator, posted):
    # The console delivers to the wait it showed, never by a typed name: a name nothing waits for would be kept for
    # a later wait (a buffered signal) while the page said "delivered".
    run, wait = waiting_on_signal()
    _, elsewhere = waiting_on_signal()
    approval = drive(api.start("approve_charge", {"amount": "40.00"}).id)
    wait_field = {
        "another run's wait": str(elsewhere.pk),
        "its approval": str(Wait.objects.get(run=approval).pk),
    }.get(posted, posted)
    target = approval if posted == "its approval" else run

    response = operator.post(
        action_url(target, "signal"), {"wait": wait_field, "name": "typo", "payload": "1"}, follow=True
    )

    said = response.content.decode()
    refusal = "Deliver signal does not apply: the run waits on no signal." if posted == "its approval" else ""
    assert response.status_code == 200 and (refusal or "nothing was sent") in said, said[-2000:]
    assert not Wait.objects.filter(name="typo").exists(), "a signal was sent by the typed name"
    assert not Event.objects.filter(kind="signal_received").exists()


def test_signal__a_link_cannot_preset_the_wait_or_the_name_the_form_shows(operator):
    run, wait = waiting_on_signal()
    _, elsewhere = waiting_on_signal()

    form = operator.get(action_url(run, "signal") + f"?wait={elsewhere.pk}&name=evil").content.decode()

    assert f'name="wait" value="{wait.pk}"' in form, "the hidden wait is the one the page names"
    assert 'value="evil"' not in form, "the Signal box shows the wait's own name"


def test_signal__bad_json_is_a_message_on_the_form_and_nothing_is_sent(operator):
    run, wait = waiting_on_signal()
    response = operator.post(action_url(run, "signal"), {"wait": wait.pk, "name": "go", "payload": '{"paid": tru'})
    html = response.content.decode()
    assert response.status_code == 200, "the form is shown again, not a traceback"
    assert "The payload is not valid JSON" in html and "line 1, column" in html, "it says what is wrong and where"
    assert "{&quot;paid&quot;: tru" in html, "what the operator typed is kept"
    wait.refresh_from_db()
    assert wait.status == WaitStatus.OPEN and not logged(run), "nothing was sent, nothing logged"


def test_signal__a_payload_the_api_refuses_is_a_message_on_the_form(operator):
    run, wait = waiting_on_signal()
    unstorable = '{"note": "a\\u0000b"}'  # valid JSON; Postgres text holds no NUL
    response = operator.post(action_url(run, "signal"), {"wait": wait.pk, "name": "go", "payload": unstorable})
    assert response.status_code == 200
    html = response.content.decode()
    assert "Deliver signal refused" in html and "payload" in html, "the API's reason is shown on the form"
    assert "a\\u0000b" in html, "what the operator typed is kept"
    wait.refresh_from_db()
    assert wait.status == WaitStatus.OPEN and not logged(run)


def test_signal__posted_twice_delivers_once(operator):
    run, wait = waiting_on_signal()
    data = {"wait": wait.pk, "name": "go", "payload": "1"}
    operator.post(action_url(run, "signal"), data)
    second = operator.post(action_url(run, "signal"), data, follow=True).content.decode()
    assert "nothing was sent" in second, "the second submit says the wait was already answered"
    received = Event.objects.filter(run=run, kind="signal_received")
    assert received.count() == 1, "one signal_received event: the second post sent nothing"
    assert not Wait.objects.filter(run=run, step__isnull=True).exists(), "no signal kept for a later wait"
    assert len(logged(run)) == 1


def test_signal__api_to_a_named_wait_that_closed_keeps_nothing():
    run, wait = waiting_on_signal()
    api.send_signal(run.id, "go", 1, by="a", wait_id=wait.pk)
    with pytest.raises(api.WaitClosedError):
        api.send_signal(run.id, "go", 2, by="b", wait_id=wait.pk)
    assert Event.objects.filter(run=run, kind="signal_received").count() == 1


def test_signal__refused_without_the_permission(viewer):
    run, wait = waiting_on_signal()
    html = viewer.get(page_url(run)).content.decode()
    assert action_url(run, "signal") not in html and "needs the permission durable_agents.signal_run" in html
    assert viewer.post(action_url(run, "signal"), {"wait": wait.pk, "name": "go"}).status_code == 403
    wait.refresh_from_db()
    assert wait.status == WaitStatus.OPEN and not LogEntry.objects.exists()


def missing_permission(response) -> str:
    """The permission a 403 page names (admin/durable_agents/403.html)."""
    assert response.status_code == 403, f"expected a refusal, got {response.status_code}"
    return response.content.decode().split('id="missing-permission">')[1].split("<")[0]


def test_signal__needs_signal_run_deciding_approvals_is_not_enough():
    run, wait = waiting_on_signal()
    approver = login("approver", ("decide_wait",))
    assert action_url(run, "signal") not in approver.get(page_url(run)).content.decode()
    refused = approver.post(action_url(run, "signal"), {"wait": wait.pk, "name": "go", "payload": "1"})
    assert missing_permission(refused) == "durable_agents.signal_run"
    assert "Can deliver a signal to a run" in refused.content.decode(), "the 403 page says what the permission is"
    wait.refresh_from_db()
    assert wait.status == WaitStatus.OPEN

    signaller = login("signaller", ("signal_run",))
    assert f'href="{action_url(run, "signal")}"' in signaller.get(page_url(run)).content.decode()
    signaller.post(action_url(run, "signal"), {"wait": wait.pk, "name": "go", "payload": "1"})
    wait.refresh_from_db()
    assert wait.status == WaitStatus.APPROVED and wait.decided_by == "signaller"


# --- Fork and reset from a step --------------------------------------------------------------------------------


def test_fork__from_a_step_of_the_timeline_opens_the_new_run_and_is_logged_on_both(operator):
    run = drive(api.start("record", {"steps": 3}).id)
    html = operator.get(page_url(run)).content.decode()
    link = f"{action_url(run, 'fork')}?step_id=s002"
    assert 'id="fork-2"' in html and "Fork from here" in html, "each step offers a fork"
    assert 'id="reset-2"' in html, "a completed run can be reset to a step"
    confirm = operator.get(link)
    assert confirm.status_code == 200 and 'value="s002" selected' in confirm.content.decode(), (
        "the confirmation page preselects the step"
    )
    assert Run.objects.count() == 1, "the GET starts nothing"

    response = operator.post(action_url(run, "fork"), {"step_id": "s002", "input": ""}, follow=True)
    fork = Run.objects.exclude(pk=run.pk).get()
    assert response.redirect_chain[-1][0] == page_url(fork), "the operator is taken to the new run"
    assert f"from run {run.pk}" in response.content.decode()
    assert [e.change_message for e in logged(run)] == [f"Forked at step s002 into run {fork.pk}"]
    assert logged(fork)[0].action_flag == ADDITION
    assert Step.objects.get(run=fork, step_id="s001").status == StepStatus.DONE, "the checkpoint is copied"


def test_fork__bad_input_json_is_a_message_and_starts_nothing(operator):
    run = drive(api.start("record", {"steps": 2}).id)
    response = operator.post(action_url(run, "fork"), {"step_id": "s002", "input": "{nope"})
    assert response.status_code == 200 and "The new input is not valid JSON" in response.content.decode()
    assert Run.objects.count() == 1 and not logged(run)


def test_fork__a_fork_input_the_api_refuses_is_shown_on_the_form(operator):
    run = drive(api.start("record", {"steps": 2}).id)
    response = operator.post(action_url(run, "fork"), {"step_id": "s002", "input": "42"})
    assert response.status_code == 200 and "Fork from a step refused" in response.content.decode()
    assert Run.objects.count() == 1


def test_fork__refused_without_the_permission(viewer):
    run = drive(api.start("record", {"steps": 2}).id)
    assert 'id="fork-1"' not in viewer.get(page_url(run)).content.decode()
    assert viewer.post(action_url(run, "fork"), {"step_id": "s002"}).status_code == 403
    assert Run.objects.count() == 1


def test_fork__needs_fork_run_re_planning_is_not_enough():
    run = drive(api.start("record", {"steps": 2}).id)
    planner = login("planner", ("replan_run",))
    page = planner.get(page_url(run)).content.decode()
    assert 'id="fork-1"' not in page and 'id="reset-1"' in page, "re-planning (reset) keeps its own permission"
    refused = planner.post(action_url(run, "fork"), {"step_id": "s002", "input": ""})
    assert missing_permission(refused) == "durable_agents.fork_run"
    assert Run.objects.count() == 1

    forker = login("forker", ("fork_run",))
    page = forker.get(page_url(run)).content.decode()
    assert 'id="fork-1"' in page and 'id="reset-1"' not in page
    forker.post(action_url(run, "fork"), {"step_id": "s002", "input": ""})
    fork = Run.objects.exclude(pk=run.pk).get()
    assert Event.objects.get(run=fork, kind="forked").actor == "forker", "the fork started a run, as forker"


def test_reset__to_a_step_reruns_from_it_and_is_logged(operator):
    run = drive(api.start("record", {"steps": 3}).id)
    confirm = operator.get(f"{action_url(run, 'replan')}?step_id=s002").content.decode()
    assert 'value="s002" selected' in confirm and 'name="csrfmiddlewaretoken"' in confirm
    operator.post(action_url(run, "replan"), {"step_id": "s002"})
    assert Run.objects.get(pk=run.pk).status == RunStatus.PENDING
    assert logged(run)[0].change_message.startswith("Reset to step s002")


# --- The existing actions are logged too -------------------------------------------------------------------------


def test_audit__cancel_with_compensation_says_so_in_recent_actions(operator):
    run = api.start("record", {"steps": 3})
    operator.post(action_url(run, "compensate"), {"reason": "customer asked"})
    assert [e.change_message for e in logged(run)] == ["Cancelled (with compensation) (reason: customer asked)"]
    assert "Cancelled (with compensation)" in recent_actions(operator)


def test_audit__bulk_cancel_logs_each_run(operator):
    runs = [api.start("record", {"steps": 2}) for _ in range(2)]
    operator.post(
        reverse("admin:durable_agents_run_changelist"),
        {"action": "cancel_selected", "_selected_action": [r.pk for r in runs], "confirm": "yes", "reason": ""},
    )
    assert all(logged(r)[0].change_message == "Cancelled (without compensation, bulk action)" for r in runs)


def test_audit__a_refused_or_failed_action_logs_nothing(operator):
    run = drive(api.start("record", {"steps": 1}).id)
    operator.post(action_url(run, "cancel"), {"reason": "x"})  # a completed run is not cancelled
    assert not LogEntry.objects.exists()


def test_audit__an_approval_decided_from_the_wait_page_is_logged_on_its_run(operator):
    run = drive(api.start("approve_charge", {"order_id": "A-2"}).id)
    wait = Wait.objects.get(run=run, status=WaitStatus.OPEN)
    operator.post(
        reverse("admin:durable_agents_wait_decide", args=[wait.pk]),
        {"decision": "approve", "comment": "fine", "args_hash": wait.args_hash},
    )
    wait.refresh_from_db()
    assert wait.status == WaitStatus.APPROVED
    assert logged(run)[0].change_message.startswith("Approved") and "(comment: fine)" in logged(run)[0].change_message


# --- Schedules ---------------------------------------------------------------------------------------------------


def test_schedule__trigger_now_starts_one_run_even_posted_twice_and_is_logged(operator):
    schedule = api.schedule("nightly", "record", cron="0 3 * * *", input={"steps": 1})
    page = operator.get(schedule_url(schedule)).content.decode()
    assert 'id="schedule-trigger"' in page and 'id="schedule-pause"' in page
    token = page.split('name="token" value="')[1].split('"')[0]
    for _ in range(2):
        response = operator.post(schedule_url(schedule, "trigger"), {"token": token}, follow=True)
    run = Run.objects.get(schedule="nightly")
    assert "started run" in response.content.decode()
    assert Event.objects.get(run=run, kind="scheduled").actor == "operator"
    assert logged(schedule)[0].change_message == f"Triggered now: started run {run.pk}"
    assert "Triggered now" in recent_actions(operator)


def test_schedule__pause_and_resume_buttons_leave_a_history(operator):
    schedule = api.schedule("nightly", "record", cron="0 3 * * *")
    operator.post(schedule_url(schedule, "pause"))
    paused = Schedule.objects.get(pk=schedule.pk)
    assert paused.paused and paused.paused_changed_by == "operator", "the schedule keeps who paused it"
    assert 'id="schedule-resume"' in operator.get(schedule_url(schedule)).content.decode()
    operator.post(schedule_url(schedule, "resume"))
    assert not Schedule.objects.get(pk=schedule.pk).paused
    assert [e.change_message for e in logged(schedule)] == [
        "Paused: no slot starts until resumed",
        "Resumed from the next slot after now",
    ]
    history = operator.get(reverse("admin:durable_agents_schedule_history", args=[schedule.pk])).content.decode()
    assert "Paused: no slot starts until resumed" in history, "the schedule's History page lists them"


def test_schedule__bulk_pause_and_trigger_are_logged(operator):
    schedule = api.schedule("nightly", "record", cron="0 3 * * *", input={"steps": 1})
    changelist = reverse("admin:durable_agents_schedule_changelist")
    operator.post(changelist, {"action": "pause_selected", "_selected_action": [schedule.pk]})
    assert Schedule.objects.get(pk=schedule.pk).paused_changed_by == "operator", "a bulk pause keeps who paused"
    operator.post(changelist, {"action": "trigger_selected", "_selected_action": [schedule.pk]})
    assert Run.objects.filter(schedule="nightly").count() == 1
    assert [e.change_message.split(":")[0] for e in logged(schedule)] == ["Paused", "Triggered now"]


def test_schedule__operations_are_post_only_and_refused_without_the_permission(viewer, operator):
    schedule = api.schedule("nightly", "record", cron="0 3 * * *")
    assert operator.get(schedule_url(schedule, "pause")).status_code == 405, "a GET changes nothing"
    assert 'id="schedule-trigger"' not in viewer.get(schedule_url(schedule)).content.decode()
    for verb in ("pause", "trigger"):
        assert viewer.post(schedule_url(schedule, verb), {"token": "abc"}).status_code == 403
    assert not Schedule.objects.get(pk=schedule.pk).paused and not Run.objects.exists()
    assert not LogEntry.objects.exists()


def test_schedule__trigger_needs_trigger_schedule_pausing_is_not_enough():
    schedule = api.schedule("nightly", "record", cron="0 3 * * *", input={"steps": 1})
    changelist = reverse("admin:durable_agents_schedule_changelist")
    pauser = login("pauser", ("pause_schedule",))
    page = pauser.get(schedule_url(schedule)).content.decode()
    assert 'id="schedule-pause"' in page and 'id="schedule-trigger"' not in page
    assert missing_permission(pauser.post(schedule_url(schedule, "trigger"), {"token": "abc"})) == (
        "durable_agents.trigger_schedule"
    )
    assert 'value="trigger_selected"' not in pauser.get(changelist).content.decode(), "no bulk trigger offered"
    pauser.post(changelist, {"action": "trigger_selected", "_selected_action": [schedule.pk]})
    assert not Run.objects.exists() and not LogEntry.objects.exists()

    trigger = login("trigger", ("trigger_schedule",))
    page = trigger.get(schedule_url(schedule)).content.decode()
    assert 'id="schedule-trigger"' in page and 'id="schedule-pause"' not in page
    assert trigger.post(schedule_url(schedule, "pause")).status_code == 403
    assert 'value="trigger_selected"' in trigger.get(changelist).content.decode()
    trigger.post(changelist, {"action": "trigger_selected", "_selected_action": [schedule.pk]})
    trigger.post(schedule_url(schedule, "trigger"), {"token": "abc"})
    assert Run.objects.filter(schedule="nightly").count() == 2, "the bulk action and the button each started one"
    assert not Schedule.objects.get(pk=schedule.pk).paused


def test_schedule__a_bad_trigger_token_is_a_message_not_a_traceback(operator):
    schedule = api.schedule("nightly", "record", cron="0 3 * * *")
    response = operator.post(schedule_url(schedule, "trigger"), {"token": "not a token!"}, follow=True)
    assert response.status_code == 200 and "started nothing" in response.content.decode()
    assert not Run.objects.exists() and not LogEntry.objects.exists()


# --- One step status for the run page and durable_show --------------------------------------------------------------


def test_durable_show__an_executing_step_reads_running_as_on_the_run_page(operator):
    run = api.start("record", {"steps": 3})
    advance(run.id)
    assert take_lease(run.id) is not None
    assert Step.objects.get(run=run, position=1).status == StepStatus.PENDING, "its row still reads pending"
    out = io.StringIO()
    call_command("durable_show", str(run.pk), stdout=out)
    line = next(line for line in out.getvalue().splitlines() if " s002 " in line)
    assert " running " in line and " pending " not in line, line
    html = operator.get(page_url(run)).content.decode()
    row = html.split('id="step-2"')[1].split("</tr>")[0]
    assert ">running</span>" in row, "the run page says the same"


def test_schedule_list__a_paused_schedule_reads_paused_not_a_green_tick(operator):
    api.schedule("nightly", "record", cron="0 3 * * *")
    api.schedule("daily", "record", cron="0 4 * * *")
    api.pause_schedule("nightly")
    page = operator.get(reverse("admin:durable_agents_schedule_changelist")).content.decode()
    assert "icon-yes.svg" not in page and "icon-no.svg" not in page, "a boolean icon says nothing about a schedule"
    assert '<span class="durable-badge durable-paused">paused</span>' in page
    assert '<span class="durable-badge durable-active">active</span>' in page
    nightly = re.search(r"<tr>(?:(?!</tr>).)*nightly(?:(?!</tr>).)*</tr>", page, re.S).group(0)
    cells = [" ".join(re.sub(r"<[^>]+>", " ", cell).split()) for cell in re.findall(r"<td[^>]*>(.*?)</td>", nightly)]
    assert "none while paused" in cells and cells.count("paused") == 1, f"paused is said once, in its state: {cells}"
    assert cells[-1] == "—", f"nothing that cannot start reads as the list's other empty cells: {cells}"


def test_resume__a_run_that_queues_behind_its_key_says_so_not_that_a_worker_picks_it_up(operator):
    first, second = (api.start("keyed", {"customer": "c-9"}) for _ in range(2))
    api.cancel(first.id)  # the second takes the key
    response = operator.post(action_url(first, "resume"), {}, follow=True)
    said = " ".join(str(message) for message in response.context["messages"])
    assert "waiting for concurrency key 'c-9'" in said, said
    assert "a worker will pick" not in said, said


def test_bulk_cancel__the_confirmation_counts_only_the_runs_it_can_cancel(operator):
    live = api.start("record", {"steps": 2})
    done = drive(api.start("record", {"steps": 1}).id)
    page = operator.post(
        reverse("admin:durable_agents_run_changelist"),
        {"action": "cancel_selected", "_selected_action": [live.pk, done.pk]},
    ).content.decode()
    assert "Cancel 1 run?" in page and "Yes, cancel 1 run" in page, "one of the two selected runs can be cancelled"
    assert "already completed: left as it is" in page


@pytest.mark.django_db(transaction=True)
def test_bulk_cancel__a_run_already_compensating_is_left_as_it_is_and_logged_as_nothing(operator):
    # The engine ignores a second cancel of a compensating run (the saga goes on): the bulk action must neither
    # count it as cancellable, nor say it started undoing its effects, nor log "Cancelled" for it.
    from tests.integration.test_sagas import _charged_twice

    saga = _charged_twice("BC-1")
    api.cancel(saga.id, "first", compensate=True, actor="ops")
    live = api.start("record", {"steps": 2})
    changelist = reverse("admin:durable_agents_run_changelist")

    page = operator.post(changelist, {"action": "cancel_selected", "_selected_action": [saga.pk, live.pk]})
    done = operator.post(
        changelist,
        {"action": "cancel_selected", "_selected_action": [saga.pk, live.pk], "confirm": "yes", "reason": "bulk"},
        follow=True,
    )

    assert "Cancel 1 run?" in page.content.decode(), "only the live run can be cancelled"
    assert "already compensating" in page.content.decode()
    said = " ".join(str(m) for m in done.context["messages"])
    assert "Started undoing" not in said and "already compensating" in said, said
    assert [e.change_message for e in logged(Run.objects.get(pk=saga.pk))] == [], "nothing was done to the saga"

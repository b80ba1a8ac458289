"""The console's decisions: approve / reject a waiting run, the pending approvals queue, signed decision
links, re-plan from a step. Every decision surface decides exactly the wait it showed (DESIGN §2.9)."""

from __future__ import annotations

import re
from urllib.parse import quote

import pytest
from django.contrib.auth.models import Permission, User
from django.contrib.messages import get_messages
from django.test import Client
from django.urls import reverse

from durable_agents import api
from durable_agents.links import decision_path
from durable_agents.models import Event, Run, RunStatus, Step, Wait, WaitStatus
from durable_agents.testing import drive
from tests.integration.test_admin import action_url, login, page_url
from tests.testapp.models import LedgerEntry

pytestmark = pytest.mark.django_db(transaction=True)
WAITS = reverse("admin:durable_agents_wait_changelist")


def waiting_run(order_id: str = "AD-1") -> Run:
    run = drive(api.start("approve_charge", {"order_id": order_id}).id)
    assert run.status == RunStatus.WAITING
    return run


def open_wait(run: Run) -> Wait:
    return Wait.objects.get(run=run, status=WaitStatus.OPEN)


def shown_wait_id(page) -> str:
    """The wait id the decision form carries, read from its HTML as a browser would post it."""
    found = re.search(r'<input type="hidden" name="wait" value="(\d+)"', page.content.decode())
    assert found, "the decision form must carry the id of the wait it shows in a hidden field"
    return found.group(1)


def posted_form(page, **fields: str) -> dict[str, str]:
    """What a browser posts back from a form page: its hidden inputs, plus the fields the operator fills in."""
    hidden = re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)"', page.content.decode())
    return {**{name: value for name, value in hidden if name != "csrfmiddlewaretoken"}, **fields}


def messages_of(response) -> list[str]:
    return [str(m) for m in get_messages(response.wsgi_request)]


def two_refunds_on_the_small_one() -> tuple[Run, Wait]:
    """A run asking for a 5.00 refund now and for a 5000.00 refund once that one is decided."""
    run = drive(api.start("two_refunds", {}).id)
    assert run.status == RunStatus.WAITING, run.error
    small = open_wait(run)
    assert small.question == "Refund 5.00 to order TR-1?"
    return run, small


def test_admin__approve_shows_the_brief_and_wakes_the_run():
    operator = login("operator", codenames=("decide_wait",))
    run = waiting_run()
    page = operator.get(action_url(run, "approve"))
    assert page.status_code == 200 and b"If you approve: the card is charged 40.00" in page.content
    assert shown_wait_id(page) == str(open_wait(run).pk)
    done = operator.post(action_url(run, "approve"), {"wait": shown_wait_id(page), "comment": "verified"})
    assert done.status_code == 302
    wait = Wait.objects.get(run=run)
    assert (wait.status, wait.decided_by, wait.decision["via"]) == (WaitStatus.APPROVED, "operator", "admin")
    assert drive(run.id).output == {"charged": True} and LedgerEntry.objects.count() == 1


def test_admin__reject_needs_confirmation_and_the_permission():
    viewer = login("viewer")
    run = waiting_run()
    assert viewer.post(action_url(run, "reject"), {"comment": "no"}).status_code == 403
    assert Wait.objects.get(run=run).is_open, "a viewer cannot decide"
    operator = login("operator", codenames=("decide_wait",))
    confirm = operator.get(action_url(run, "reject"))
    assert confirm.status_code == 200 and b"Yes, reject" in confirm.content
    operator.post(action_url(run, "reject"), {"wait": shown_wait_id(confirm), "comment": "fraud"})
    assert Wait.objects.get(run=run).status == WaitStatus.REJECTED
    assert Event.objects.get(run=run, kind="wait_decided").actor == "operator"


def test_admin__pending_approvals_queue_sorted_by_deadline_and_decided_in_bulk():
    late = drive(api.start("deadline_reject", {}).id)
    plain = waiting_run()
    operator = login("operator", codenames=("decide_wait",))
    queue = operator.get(WAITS)
    assert queue.status_code == 200
    listed = [w.run_id for w in queue.context["cl"].result_list]
    assert listed == [late.id, plain.id], "waits with a deadline come first"
    selected = [str(w.pk) for w in Wait.objects.all()]
    confirm = operator.post(WAITS, {"action": "approve_selected", "index": 0, "_selected_action": selected})
    assert confirm.status_code == 200 and b"Approve 2 waits?" in confirm.content
    response = operator.post(
        WAITS, {"action": "approve_selected", "index": 0, "_selected_action": selected, "confirm": "yes"}
    )
    assert response.status_code == 302
    assert set(Wait.objects.values_list("status", flat=True)) == {WaitStatus.APPROVED}


def test_admin__replan_from_a_step_reruns_it_without_repeating_effects():
    operator = login("operator", codenames=("replan_run",))
    run = drive(api.start("charge", {"order_id": "AD-2"}).id)
    response = operator.post(action_url(run, "replan"), {"step_id": "charge"})
    assert response.status_code == 302
    run = drive(run.id)
    assert run.status == RunStatus.COMPLETED and LedgerEntry.objects.count() == 1
    assert Step.objects.filter(run=run, step_id="charge").count() == 2
    assert Event.objects.get(run=run, kind="rerun_from_step").actor == "operator"
    assert operator.get(page_url(run)).status_code == 200


# --- A decision means what the decider saw (issue 13, item 2) ---------------------------------------------


def test_admin_decision__an_old_form_never_decides_the_request_opened_after_it():
    operator = login("manager-1", codenames=("decide_wait",))
    run, small = two_refunds_on_the_small_one()
    form = operator.get(action_url(run, "approve"))
    assert b"Refund 5.00 to order TR-1?" in form.content, "manager-1 is shown the 5.00 refund"

    # While manager-1 reads, manager-2 decides the small refund elsewhere; the run parks on the large one.
    api.decide(small.pk, True, by="manager-2", comment="fine", via="link")
    large = open_wait(drive(run.id))
    assert large.question == "Refund 5000.00 to order TR-1?"

    response = operator.post(action_url(run, "approve"), posted_form(form, comment="ok, 5 euros"))

    large.refresh_from_db()
    assert large.is_open and large.decided_by == "", "manager-1's 'ok, 5 euros' must not approve the 5000.00 refund"
    small.refresh_from_db()
    assert (small.decided_by, small.decision["comment"]) == ("manager-2", "fine"), "the decided wait is untouched"
    assert Event.objects.filter(run=run, kind="wait_decided").count() == 1, "nothing new is recorded"
    assert response.status_code == 302, "a stale form sends the operator back to the run page"
    said = " ".join(messages_of(response))
    for expected in ("already approved by manager-2 at ", f"wait {large.pk}", "Refund 5000.00 to order TR-1?"):
        assert expected in said, f"the error must say who decided, when, and what the run waits on now: {said!r}"


def test_admin_decision__an_old_form_posted_before_the_run_moves_on_says_who_decided():
    operator = login("manager-1", codenames=("decide_wait",))
    run, small = two_refunds_on_the_small_one()
    form = operator.get(action_url(run, "approve"))
    api.decide(small.pk, True, by="manager-2", via="link")  # the run is pending, not yet parked on the next one

    response = operator.post(action_url(run, "approve"), posted_form(form, comment="ok, 5 euros"))

    said = " ".join(messages_of(response))
    assert "already approved by manager-2" in said, f"'does not apply to a pending run' hides who decided: {said!r}"
    assert Event.objects.filter(run=run, kind="wait_decided").count() == 1, "nothing new is recorded"


def test_admin_decision__a_form_naming_another_runs_wait_or_none_decides_nothing():
    operator = login("operator", codenames=("decide_wait",))
    run, other = waiting_run("AD-1"), waiting_run("AD-2")
    for data in ({"wait": str(open_wait(other).pk)}, {}, {"wait": "not-a-number"}):
        response = operator.post(action_url(run, "approve"), {**data, "comment": "yes"})
        assert response.status_code == 200 and b"This form names no request of this run" in response.content, (
            f"a form posted with {data} must be refused with a form error, not decide the open wait"
        )
    assert set(Wait.objects.values_list("status", flat=True)) == {WaitStatus.OPEN}


def test_admin_decision__the_run_page_race_loses_to_the_other_decider_with_a_message(monkeypatch):
    """Decided between the form's check and the API's compare-and-set: the API refuses, the operator reads why."""
    operator = login("operator", codenames=("decide_wait",))
    run, small = two_refunds_on_the_small_one()
    form = operator.get(action_url(run, "reject"))
    real_decide = api.decide

    def decided_by_someone_else_first(wait_id, approved, **kwargs):
        real_decide(wait_id, True, by="manager-2")
        return real_decide(wait_id, approved, **kwargs)

    monkeypatch.setattr(api, "decide", decided_by_someone_else_first)
    response = operator.post(action_url(run, "reject"), {"wait": shown_wait_id(form)}, follow=True)
    html = response.content.decode()
    assert "Reject failed: This request, wait" in html and "already approved by manager-2" in html, html[-2000:]
    assert Wait.objects.get(pk=small.pk).status == WaitStatus.APPROVED


# --- The pending approvals queue decides exactly the waits it listed -----------------------------------------


def test_wait_queue__bulk_approve_confirms_the_listed_waits_with_a_comment_and_reports_closed_ones():
    operator = login("operator", codenames=("decide_wait",))
    first, second, unselected = waiting_run("AD-1"), waiting_run("AD-2"), waiting_run("AD-3")
    picked = [open_wait(first), open_wait(second)]
    selected = [str(w.pk) for w in picked]

    confirm = operator.post(WAITS, {"action": "approve_selected", "index": 0, "_selected_action": selected})
    html = confirm.content.decode()
    assert confirm.status_code == 200 and "Approve 2 waits?" in html and 'name="comment"' in html
    for wait in picked:
        assert f'name="_selected_action" value="{wait.pk}"' in html and str(wait.run_id)[:8] in html
    assert str(unselected.pk)[:8] not in html, "only the selected waits are listed"
    assert "Charge the customer 40.00?" in html, "each listed wait shows its question"
    assert set(Wait.objects.values_list("status", flat=True)) == {WaitStatus.OPEN}, "the confirmation decides nothing"

    api.decide(picked[1].pk, False, by="manager-2", comment="fraud")  # decided elsewhere while the page is read
    response = operator.post(
        WAITS,
        {"action": "approve_selected", "index": 0, "_selected_action": selected, "confirm": "yes", "comment": "batch"},
    )

    assert response.status_code == 302
    decided = Wait.objects.get(pk=picked[0].pk)
    assert (decided.status, decided.decided_by, decided.decision["comment"]) == ("approved", "operator", "batch")
    closed = Wait.objects.get(pk=picked[1].pk)
    assert (closed.status, closed.decided_by) == ("rejected", "manager-2"), "a wait closed meanwhile stays as decided"
    assert open_wait(unselected), "an unselected wait stays open"
    said = " ".join(messages_of(response))
    assert "Approved 1 wait" in said and f"wait {picked[1].pk}" in said and "already rejected by manager-2" in said, (
        f"a closed wait is reported, not silently dropped by the 'pending' filter: {said!r}"
    )


def test_wait_queue__select_all_decides_only_the_waits_the_confirmation_listed():
    operator = login("operator", codenames=("decide_wait",))
    listed = waiting_run("AD-1")
    confirm = operator.post(
        WAITS,
        {"action": "reject_selected", "index": 0, "select_across": "1", "_selected_action": [open_wait(listed).pk]},
    )
    html = confirm.content.decode()
    assert "Reject 1 wait?" in html and 'name="select_across" value="0"' in html, "confirming never re-selects all"

    late = waiting_run("AD-2")  # opened after the confirmation page was shown
    ids = re.findall(r'name="_selected_action" value="(\d+)"', html)
    operator.post(WAITS, {"action": "reject_selected", "index": 0, "_selected_action": ids, "confirm": "yes"})

    assert Wait.objects.get(run=listed).status == WaitStatus.REJECTED
    assert open_wait(late), "a wait opened after the confirmation page must not be decided by it"


def test_wait_queue__ticked_waits_closed_before_the_confirmation_are_reported():
    operator = login("operator", codenames=("decide_wait",))
    run = waiting_run()
    wait = open_wait(run)
    api.decide(wait.pk, True, by="manager-2")
    response = operator.post(WAITS, {"action": "approve_selected", "index": 0, "_selected_action": [wait.pk]})
    assert response.status_code == 302
    said = " ".join(messages_of(response))
    assert "already approved by manager-2" in said and "None of the selected waits is open" in said, said


# --- Signed decision links (issue 13, items 2 and 15) ------------------------------------------------------


def signed_in(username: str, *, may_decide: bool) -> Client:
    user = User.objects.create_user(username, password="pw", is_staff=True)
    if may_decide:
        user.user_permissions.add(Permission.objects.get(codename="decide_wait"))
    client = Client()
    client.force_login(user)
    return client


def test_link__a_user_without_the_permission_sees_nothing_of_the_wait():
    run = waiting_run()
    wait = open_wait(run)
    path = decision_path(wait)
    refused = signed_in("dave", may_decide=False)
    for response in (refused.get(path), refused.post(path, {"decision": "approve"})):
        html = response.content.decode()
        assert response.status_code == 403 and "you may not decide approvals" in html
        for secret in ("Charge the customer", "40.00", wait.brief.splitlines()[0], str(run.pk)):
            assert secret not in html, f"the refusal page leaks {secret!r} of the wait to a user who may not decide"
    bad_token = refused.get(path.rstrip("/") + "x/")
    assert bad_token.status_code == 403, "without the permission, even a broken link says only that"
    assert Wait.objects.get(pk=wait.pk).is_open


def test_link__anonymous_signs_in_at_login_url_and_comes_back_to_the_decision():
    wait = open_wait(waiting_run())
    path = decision_path(wait)
    client = Client()
    anonymous = client.get(path)
    assert anonymous.status_code == 302 and anonymous["Location"] == f"{reverse('admin:login')}?next={quote(path)}", (
        f"LOGIN_URL = 'admin:login' must send the approver to the admin's login and back: {anonymous['Location']}"
    )
    assert b"Charge the customer" not in anonymous.content
    user = User.objects.create_user("carol", password="pw", is_staff=True)
    user.user_permissions.add(Permission.objects.get(codename="decide_wait"))
    login_page = client.get(anonymous["Location"])
    assert login_page.status_code == 200
    signed = client.post(anonymous["Location"], {"username": "carol", "password": "pw", "next": path})
    assert signed.status_code == 302 and signed["Location"] == path, "after signing in, the approver is back"
    assert b"Charge the customer 40.00?" in client.get(path).content


def test_link__a_spent_link_names_the_request_the_run_waits_on_now_and_decides_nothing():
    run, small = two_refunds_on_the_small_one()
    path = decision_path(small)
    approver = signed_in("carol", may_decide=True)
    assert b"Refund 5.00 to order TR-1?" in approver.get(path).content
    api.decide(small.pk, True, by="manager-2", via="admin")
    large = open_wait(drive(run.id))

    for response in (approver.post(path, {"decision": "approve", "comment": "ok, 5 euros"}), approver.get(path)):
        html = response.content.decode()
        assert response.status_code == 409 and "already approved by manager-2" in html
        assert f"wait {large.pk}" in html and "Refund 5000.00 to order TR-1?" in html, (
            "the page must name the request the run waits on now, so the approver knows this yes did not reach it"
        )
    assert Wait.objects.get(pk=large.pk).is_open and Wait.objects.get(pk=small.pk).decided_by == "manager-2"

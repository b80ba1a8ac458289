"""The replay lab in the console, through the Django test client as logged-in staff on Postgres: starting a replay
from the run list (its permission, its form refusing bad input with a message), the replay's report (lanes, CI
verdict, links), one case side by side, replay runs hidden from the run list unless asked for, and the banner on a
replay run's page.

The recordings are runs of the test app's `agent_charge` (a scripted participant plays the model, in this process);
the replay runs are advanced in this process too (`api.replay_here`).
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from django.contrib.admin.models import ADDITION, LogEntry
from django.contrib.auth.models import Permission, User
from django.contrib.contenttypes.models import ContentType
from django.test import Client
from django.urls import reverse

from durable_agents import api
from durable_agents.agents.messages import ModelRequest, text, tool_use
from durable_agents.agents.participants import ScriptedParticipant, participants
from durable_agents.engine.starts import start_run
from durable_agents.models import Cohort, Replay, ReplayRun, Run, RunStatus
from durable_agents.testing import drive
from tests.testapp.models import LedgerEntry

pytestmark = pytest.mark.django_db

BILLING, GREEDY = "billing-script", "billing-greedy"


def billing(amount: str) -> Any:
    """The model's side of the billing conversation: look the order up, charge `amount`, say so."""

    def play(request: ModelRequest) -> list[dict[str, Any]]:
        if request.turn_number == 0:
            return [text("Looking the order up."), tool_use("lookup_order", {"order_id": "A-1"})]
        if request.turn_number == 1:
            return [tool_use("charge", {"order_id": "A-1", "amount": amount})]
        return [text(f"Order A-1 is charged {amount}.")]

    return play


@pytest.fixture(autouse=True)
def scripts():
    with participants.isolated():
        participants.register(BILLING, ScriptedParticipant(billing("30.00"), name=BILLING))
        participants.register(GREEDY, ScriptedParticipant(billing("31.00"), name=GREEDY))
        yield


def login(username: str, codenames: tuple[str, ...] = ()) -> Client:
    """Staff who may view runs (and so replays and cohorts), with the named permissions of the app."""
    content_type = ContentType.objects.get_for_model(Run)
    Permission.objects.get_or_create(
        codename="replay_run", content_type=content_type, defaults={"name": "Can replay runs"}
    )
    user = User.objects.create_user(username, password="secret", is_staff=True)
    viewing = ["view_run"]
    user.user_permissions.add(
        *Permission.objects.filter(content_type__app_label="durable_agents", codename__in=[*viewing, *codenames])
    )
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def operator() -> Client:
    return login("operator", ("replay_run",))


@pytest.fixture
def viewer() -> Client:
    return login("viewer")


def recorded() -> Run:
    run = drive(start_run("agent_charge", {"message": "Charge A-1"}, participant=BILLING).id)
    assert run.status == RunStatus.COMPLETED, run.error
    return run


def replayed(runs: list[Run]) -> Replay:
    made = api.replay(runs=[r.id for r in runs], candidate={"participant": GREEDY}, actor="operator")
    api.replay_here(made.id)
    return made


def lane_run(made: Replay, lane: str) -> Run:
    return Run.objects.get(pk=ReplayRun.objects.filter(replay=made, lane=lane).values("run_id")[:1])


def runs_changelist(client: Client, query: str = "") -> str:
    return client.get(reverse("admin:durable_agents_run_changelist") + query).content.decode()


def replay_action(client: Client, runs: list[Run], **fields: Any) -> Any:
    data = {"action": "replay_selected", "_selected_action": [str(r.pk) for r in runs], "index": 0, **fields}
    return client.post(reverse("admin:durable_agents_run_changelist"), data, follow=True)


def messages_of(response: Any) -> list[str]:
    return [str(m) for m in response.context["messages"]] if response.context else []


# --- Starting a replay from the run list -------------------------------------------------------------------------


def test_replay_action__offered_and_refused_by_the_replay_run_permission(operator, viewer):
    run = recorded()
    assert "replay_selected" in runs_changelist(operator), "an operator with replay_run is offered the action"
    assert "replay_selected" not in runs_changelist(viewer), "staff without replay_run must not be offered it"

    response = replay_action(viewer, [run], confirm="yes", participant=GREEDY, lanes=["baseline", "candidate"])

    assert not Replay.objects.exists(), "a replay was started without the replay_run permission"
    assert 'id="replay-form"' not in response.content.decode(), "the form must not be shown without replay_run"


def test_replay_action__replay_run_is_granted_to_no_one_by_default():
    granted = Permission.objects.filter(codename="replay_run")
    assert not User.objects.filter(user_permissions__in=granted).exists()
    assert not granted.filter(group__isnull=False).exists(), "no group is given replay_run by a migration"


def test_replay_action__form_then_replay_started_logged_and_report_opened(operator):
    run = recorded()
    form = replay_action(operator, [run]).content.decode()
    assert 'id="replay-form"' in form and f'value="{run.pk}"' in form, "the action asks for the candidate first"
    assert f'<option value="{GREEDY}">' in form, "the participant is chosen from the registered ones"

    response = replay_action(
        operator, [run], confirm="yes", participant=GREEDY, lanes=["baseline", "candidate"], budget_usd="2", stubs=""
    )

    made = Replay.objects.get()
    assert response.redirect_chain[-1][0] == reverse("admin:durable_agents_replay_change", args=[made.pk])
    assert made.candidate == {"participant": GREEDY} and made.created_by == "operator"
    assert ReplayRun.objects.filter(replay=made).count() == 2, "one replay run per lane"
    entry = LogEntry.objects.get(object_id=str(made.pk))
    assert entry.action_flag == ADDITION and GREEDY in entry.change_message and entry.user.username == "operator"


@pytest.mark.parametrize(
    ("fields", "said"),
    [
        ({"participant": GREEDY, "lanes": ["candidate"], "stubs": "{not json"}, "Stubs must be JSON"),
        ({"participant": GREEDY, "lanes": ["candidate"], "stubs": "[1, 2]"}, "Stubs must be a JSON object"),
        ({"participant": GREEDY, "lanes": ["candidate"], "budget_usd": "-1"}, "greater than or equal to"),
        ({"participant": GREEDY, "lanes": ["candidate"], "concurrency": "0"}, "greater than or equal to 1"),
        ({"participant": "nobody", "lanes": ["candidate"]}, "Select a valid choice"),
        ({"lanes": ["candidate"]}, "the candidate changes nothing"),
        ({"model": "claude-haiku-4-5", "effort": "max", "lanes": ["candidate"]}, "does not take effort"),
        ({"participant": GREEDY}, "This field is required"),
    ],
)
def test_replay_action__bad_input_is_a_message_on_the_form_never_a_traceback(operator, fields, said):
    run = recorded()

    response = replay_action(operator, [run], confirm="yes", **fields)

    assert response.status_code == 200
    page = response.content.decode()
    assert said in page, f"the form should say {said!r}; it showed: {messages_of(response)}"
    assert "The replay was not started" in " ".join(messages_of(response))
    assert 'id="replay-form"' in page, "the form is shown again with what was typed"
    assert not Replay.objects.exists()


def test_replay_action__a_run_that_is_not_finished_is_refused_with_a_message(operator):
    waiting = drive(api.start("approve_charge", {"order_id": "A-1"}).id)
    assert waiting.status == RunStatus.WAITING

    response = replay_action(operator, [waiting], confirm="yes", participant=GREEDY, lanes=["candidate"])

    assert "only a finished run replays" in " ".join(messages_of(response))
    assert not Replay.objects.exists()


# --- The report and the side-by-side view ------------------------------------------------------------------------


def test_report__lanes_verdict_changed_most_and_links(operator):
    run = recorded()
    made = replayed([run])
    baseline, candidate = lane_run(made, "baseline"), lane_run(made, "candidate")
    url = reverse("admin:durable_agents_replay_change", args=[made.pk])

    page = operator.get(url).content.decode()

    for lane in ("observed", "baseline", "candidate"):
        assert f'id="lane-{lane}"' in page, f"the lane table has a row for {lane}"
    baseline_row = re.search(r'id="lane-baseline">(.*?)</tr>', page, re.S).group(1)
    candidate_row = re.search(r'id="lane-candidate">(.*?)</tr>', page, re.S).group(1)
    assert "1/1 (100 %)" in baseline_row, f"the recorded script asked again agrees with itself: {baseline_row}"
    assert "0/1 (0 %)" in candidate_row, f"the greedy candidate charges another amount: {candidate_row}"
    assert "0.000–0.793" in candidate_row, "the agreement carries its 95 % interval"
    assert re.search(r'id="verdict-result">fails<', page), "a candidate that agrees on nothing fails the verdict"
    assert "candidate agreement 0.0% is under 95.0%" in page
    assert f'href="{reverse("admin:durable_agents_run_change", args=[candidate.pk])}"' in page
    assert f'href="{reverse("admin:durable_agents_run_change", args=[baseline.pk])}"' in page
    assert f'href="{reverse("admin:durable_agents_run_change", args=[run.pk])}"' in page, "the recorded run links"
    changed = re.search(r'id="changed-most">(.*?)id="cases"', page, re.S).group(1)
    compare = reverse(
        "admin:durable_agents_replay_case", args=[made.pk, ReplayRun.objects.get(run_id=candidate.pk).recording_id]
    )
    assert compare in changed, "each run that changed links to its side-by-side view"
    assert 'call 2: <span class="durable-mono">charge</span>' in changed, "the first divergence is the charge"

    lenient = operator.get(url + "?fail_under=0").content.decode()
    assert "below the baseline&#x27;s interval" in lenient, (
        "at fail under 0 the candidate still fails: it is worse than the recorded model's own noise"
    )
    nonsense = operator.get(url + "?fail_under=lots", follow=True)
    assert "fail under must be a share between 0 and 1" in " ".join(messages_of(nonsense))


def test_side_by_side__observed_beside_candidate_and_baseline_with_the_divergence_marked(operator):
    run = recorded()
    made = replayed([run])
    candidate = lane_run(made, "candidate")
    recording = ReplayRun.objects.get(run_id=candidate.pk).recording_id

    page = operator.get(reverse("admin:durable_agents_replay_case", args=[made.pk, recording])).content.decode()

    columns = {
        name: re.search(
            rf'id="lane-{name}">(.*?)(?=<div class="module" id="lane-|</div>\s*</div>\s*</div>)', page, re.S
        ).group(1)
        for name in ("observed", "candidate", "baseline")
    }
    assert "&quot;amount&quot;: &quot;30.00&quot;" in columns["observed"], "the recorded charge is shown"
    assert "&quot;amount&quot;: &quot;31.00&quot;" in columns["candidate"], "the candidate's charge is shown"
    assert "Looking the order up." in columns["candidate"] and "calls lookup_order" in columns["candidate"]
    assert "tool answered" in columns["candidate"], "the recorded answer the candidate read is shown"
    assert columns["candidate"].count("first divergence</strong>") == 1, "the candidate's divergence is marked once"
    assert "a call the recording never made" in columns["candidate"]
    assert "first divergence" not in columns["baseline"].replace("same calls", ""), "the baseline did not diverge"
    assert "Order A-1 is charged 30.00." in columns["baseline"]
    assert f'href="{reverse("admin:durable_agents_run_change", args=[candidate.pk])}"' in columns["candidate"]


def test_replay_and_cohort_lists__candidate_finished_agreement_and_a_json_lines_download(operator):
    made = replayed([recorded()])

    replays_page = operator.get(reverse("admin:durable_agents_replay_changelist")).content.decode()
    assert f"participant: {GREEDY}" in replays_page and "2/2" in replays_page and "0/1 (0%)" in replays_page

    cohorts_page = operator.get(reverse("admin:durable_agents_cohort_changelist")).content.decode()
    assert made.cohort.name in cohorts_page and "Download JSON lines" in cohorts_page
    download = operator.get(reverse("admin:durable_agents_cohort_export", args=[made.cohort.pk]))
    assert download.streaming and "attachment" in download["Content-Disposition"]
    lines = b"".join(download.streaming_content).decode().splitlines()
    assert [json.loads(line)["workflow"] for line in lines] == ["agent_charge"]


def test_cohort_action__replays_the_cohort_with_the_candidate(operator):
    recorded()
    cohort = api.save_cohort("charges", workflow="agent_charge")
    url = reverse("admin:durable_agents_cohort_changelist")
    data = {"action": "replay_cohort", "_selected_action": [cohort.pk], "index": 0}
    assert 'id="replay-form"' in operator.post(url, data).content.decode()

    response = operator.post(
        url, {**data, "confirm": "yes", "participant": GREEDY, "lanes": ["candidate"]}, follow=True
    )

    made = Replay.objects.get()
    assert made.cohort == cohort and response.redirect_chain[-1][0].endswith(f"{made.pk}/change/")
    assert Cohort.objects.count() == 1, "replaying a cohort makes no new cohort"


# --- Replay runs in the run list and on their pages --------------------------------------------------------------


def test_run_list__replay_runs_hidden_by_default_with_a_note_and_shown_by_the_filter(operator):
    run = recorded()
    made = replayed([run])
    baseline, candidate = lane_run(made, "baseline"), lane_run(made, "candidate")

    default = runs_changelist(operator)
    assert str(run.pk)[:8] in default
    assert str(candidate.pk)[:8] not in default and str(baseline.pk)[:8] not in default, "replay runs drown nothing"
    note = re.search(r'id="replay-runs-hidden">(.*?)</p>', default, re.S).group(1)
    assert "2 replay runs hidden" in note and "replay=all" in note

    every = runs_changelist(operator, "?replay=all")
    assert all(str(r.pk)[:8] in every for r in (run, baseline, candidate))
    assert "replay · candidate</span>" in every and "replay · baseline</span>" in every, "replay runs are badged"
    assert 'id="replay-runs-hidden"' not in every
    only_candidate = runs_changelist(operator, "?replay=candidate")
    assert str(candidate.pk)[:8] in only_candidate and str(baseline.pk)[:8] not in only_candidate
    assert str(run.pk)[:8] not in only_candidate


def test_run_page__a_replay_run_says_so_and_links_its_replay_and_recording(operator):
    run = recorded()
    made = replayed([run])
    candidate = lane_run(made, "candidate")

    page = operator.get(reverse("admin:durable_agents_run_change", args=[candidate.pk])).content.decode()

    banner = re.search(r'id="replay-banner">(.*?)</p>', page, re.S).group(1)
    assert "Replay run (candidate lane) of replay" in banner
    assert f'href="{reverse("admin:durable_agents_replay_change", args=[made.pk])}"' in banner
    assert f'href="{reverse("admin:durable_agents_run_change", args=[run.pk])}"' in banner
    assert "tool calls answered from the recording; nothing was applied." in banner
    assert LedgerEntry.objects.count() == 1, "only the recorded run charged; the replays applied nothing"
    real = operator.get(reverse("admin:durable_agents_run_change", args=[run.pk])).content.decode()
    assert 'id="replay-banner"' not in real, "a real run carries no replay banner"


def test_run_page__a_replay_run_is_never_forked_into_a_real_run(operator):
    candidate = lane_run(replayed([recorded()]), "candidate")
    fork_run = Permission.objects.filter(content_type__app_label="durable_agents", codename="fork_run")
    User.objects.get(username="operator").user_permissions.add(*fork_run)
    fork_url = reverse("admin:durable_agents_run_action", args=[candidate.pk, "fork"])

    page = operator.get(reverse("admin:durable_agents_run_change", args=[candidate.pk])).content.decode()
    response = operator.post(fork_url, {"step_id": "assistant"}, follow=True)

    assert fork_url not in page, "a replay run's page must not offer Fork (its fork would apply the candidate's calls)"
    assert "a replay run is never forked" in " ".join(messages_of(response))
    assert not Run.objects.filter(forked_from=candidate).exists()


def test_report__cases_are_paged_and_a_retried_replay_run_is_read_anew(operator, monkeypatch):
    monkeypatch.setattr("durable_agents.admin.replays.CASES_PER_PAGE", 1)
    made = replayed([recorded(), recorded()])
    url = reverse("admin:durable_agents_replay_change", args=[made.pk])

    first, second = operator.get(url).content.decode(), operator.get(url + "?page=2").content.decode()

    assert "Cases 1–1 of 2" in first and "Cases 2–2 of 2" in second
    assert 'data-case="' in first and re.findall(r'data-case="(\d+)"', first) != re.findall(
        r'data-case="(\d+)"', second
    ), "each page shows its own cases"
    candidate = lane_run(made, "candidate")
    api.resume(candidate.pk, actor="operator")  # the report of a finished replay is cached: a retry must show
    assert "runs still going" in operator.get(url).content.decode()


def test_report__shown_to_whoever_may_view_runs_and_refused_to_staff_who_may_not(viewer):
    made = replayed([recorded()])
    url = reverse("admin:durable_agents_replay_change", args=[made.pk])
    stranger = Client()
    stranger.force_login(User.objects.create_user("stranger", password="secret", is_staff=True))

    assert viewer.get(url).status_code == 200, "a replay run is a run: who may view runs may read its report"
    assert stranger.get(url).status_code == 403
    assert stranger.get(reverse("admin:durable_agents_cohort_export", args=[made.cohort.pk])).status_code == 403

"""durable_replay on the refund example as CI and an ML engineer run it: exit codes, the JSON verdict, the report,
cohorts through files, mistakes as one line; and replay runs marked in durable_runs and durable_show.

The recordings are real runs of `refund_agent` (the scripted participant plays the model, in this process). A
replay runs `--here` (in the command's process, as CI without workers would) or on a real worker.
"""

from __future__ import annotations

import json
from decimal import Decimal
from io import StringIO

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from durable_agents import api
from durable_agents.models import Replay, ReplayRun, Run
from tests.integration.refund_recordings import CASE, GREEDY, recorded, shop, world  # noqa: F401 - shop: a fixture

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("shop")]


@pytest.fixture
def cli(manage, worker_env):
    """`manage.py ARGS` in a subprocess whose scripted model answers at once."""
    worker_env["REFUND_SCRIPT_THINK_SECONDS"] = "0"
    return manage


def replay_command(*args: str) -> tuple[int, str, str]:
    """call_command in this process (where the greedy participant is registered): exit code, stdout, stderr."""
    out, err = StringIO(), StringIO()
    try:
        call_command("durable_replay", *args, stdout=out, stderr=err)
    except CommandError as exc:
        return exc.returncode, out.getvalue(), str(exc)
    return 0, out.getvalue(), err.getvalue()


def test_durable_replay__a_candidate_that_refunds_another_amount_fails_ci_with_exit_1_and_applies_nothing():
    runs = [recorded("A-1001"), recorded("A-1002")]
    before = world()
    ids = [str(r.id) for r in runs]

    code, out, err = replay_command(
        "--runs", *ids, "--candidate-participant", GREEDY, "--fail-under", "0.95", "--json", "--here"
    )

    assert code == 1, f"a candidate under the threshold must fail CI with exit 1: {err}"
    assert err.startswith("verdict failed: candidate agreement 0.0% is under 95.0%"), err
    report = json.loads(out)
    assert report["verdict"] == {"passed": False, "fail_under": 0.95, "why": err.removeprefix("verdict failed: ")}
    assert report["finished"] is True
    assert (report["lanes"]["baseline"]["agree"], report["lanes"]["candidate"]["agree"]) == (2, 0)
    assert {c["source_run"] for c in report["changed_most"]} == set(ids)
    assert all(
        c["admin_path"].startswith(f"/admin/durable_agents/replay/{report['replay']}/case/")
        for c in report["changed_most"]
    )
    assert world() == before, "the replay applied an effect, sent an email or opened a wait"


def test_durable_replay__an_identical_candidate_passes_ci_with_exit_0(cli):
    run = recorded()

    result = cli(
        "durable_replay",
        "--runs",
        str(run.id),
        "--candidate-participant",
        "refund-script",
        "--fail-under",
        "0.95",
        "--json",
        "--here",
    )

    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["verdict"]["passed"] is True, report["verdict"]
    assert report["lanes"]["candidate"]["agree"] == 1 and report["lanes"]["baseline"]["agree"] == 1
    assert result.stderr == "", "--json prints no progress lines"


def test_durable_replay__the_baseline_alone_replays_and_reports_in_text_with_exit_0(cli):
    run = recorded()

    result = cli("durable_replay", "--runs", str(run.id)[:8], "--lanes", "baseline", "--here")

    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].endswith("1 recordings; no candidate (baseline only)"), lines
    baseline = next(line for line in lines if line.strip().startswith("baseline"))
    assert "agree 1/1 (100.0%, 95% interval" in baseline and "diverged 0" in baseline, baseline
    assert "verdict: none asked" in result.stdout
    assert "no run changed: the baseline lane agrees with the recording on every finished run" in result.stdout
    assert "replay runs of cohort" in result.stderr, "progress goes to stderr without --json"


def test_durable_replay__the_report_of_an_existing_replay_names_the_divergence_and_the_side_by_side_view(cli):
    run = recorded()
    replay = api.replay(runs=[run.id], candidate={"participant": GREEDY})
    api.replay_here(replay.id)

    result = cli("durable_replay", "--report", str(replay.id), "--fail-under", "0.95")

    assert result.returncode == 1, result.stderr
    assert result.stderr.strip() == "CommandError: verdict failed: candidate agreement 0.0% is under 95.0%"
    text = result.stdout
    candidate = next(line for line in text.splitlines() if line.strip().startswith("candidate "))
    assert "agree 0/1 (0.0%, 95% interval 0.0%–" in candidate and "diverged 1" in candidate, candidate
    assert "verdict: FAILED: candidate agreement 0.0% is under 95.0%" in text
    assert (
        f"run {run.id}: candidate failed, observed completed; first divergence at call 2: issue_refund with amount "
        "35.90 (recorded 34.90), never recorded: that run's replay ended there"
    ) in text, text
    recording = ReplayRun.objects.filter(replay=replay).first().recording_id
    assert f"side by side: /admin/durable_agents/replay/{replay.id}/case/{recording}/" in text

    passed = cli("durable_replay", "--report", str(replay.id), "--json")
    assert passed.returncode == 0, "without --fail-under a finished replay's report exits 0"
    assert "verdict" not in json.loads(passed.stdout)


def test_durable_replay__the_ci_form_waits_for_the_workers_and_passes(cli, start_worker):
    """`durable_replay --cohort NAME --candidate-model M --fail-under 0.95 --json`, verbatim: the replay runs go
    to a worker; the scripted participant answers whatever model is asked, so the candidate agrees."""
    run = recorded()
    api.save_cohort("refunds-nov", runs=[run.id])
    start_worker(env={"REFUND_SCRIPT_THINK_SECONDS": "0"})

    result = cli(
        "durable_replay",
        "--cohort",
        "refunds-nov",
        "--candidate-model",
        "claude-haiku-4-5",
        "--fail-under",
        "0.95",
        "--json",
        "--timeout",
        "100",
    )

    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["finished"] and report["verdict"]["passed"], report["verdict"]
    assert report["candidate"] == {"model": "claude-haiku-4-5"}


def test_durable_replay__each_candidate_option_reaches_the_replay(tmp_path):
    run = recorded()
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("You are a careful support agent.", encoding="utf-8")

    code, out, err = replay_command(
        "--runs", str(run.id), "--lanes", "candidate", "--candidate-participant", "refund-script",
        "--instructions-file", str(prompt), "--tool-description", "issue_refund=Refund at most what was paid.",
        "--thinking", '{"type": "enabled", "budget_tokens": 2048}', "--effort", "high",
        "--stub", 'issue_refund={"status": "issued"}', "--budget-usd", "2.50", "--concurrency", "3",
        "--as", "alice", "--here", "--json",
    )  # fmt: skip

    assert code == 0, err
    replay = Replay.objects.get()
    assert replay.candidate == {
        "participant": "refund-script",
        "instructions": "You are a careful support agent.",
        "tool_descriptions": {"issue_refund": "Refund at most what was paid."},
        "thinking": {"type": "enabled", "budget_tokens": 2048},
        "effort": "high",
    }
    assert replay.stubs == {"issue_refund": {"status": "issued"}}
    assert (replay.budget_usd, replay.created_by) == (Decimal("2.50"), "alice")
    assert Run.objects.get(replay_lane="candidate").concurrency_limit == 3
    assert json.loads(out)["replay"] == str(replay.id)


def test_durable_replay__without_workers_the_timeout_exits_1_saying_so(cli):
    run = recorded()

    result = cli("durable_replay", "--runs", str(run.id), "--lanes", "baseline", "--timeout", "0", "--json")

    assert result.returncode == 1, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert "timed out after 0 s with 0 of 1 replay runs finished" in line and "--report" in line, line
    assert json.loads(result.stdout)["finished"] is False


def test_durable_replay__a_cohort_exported_to_a_file_imports_and_replays_the_same(cli, tmp_path):
    run = recorded()
    path = tmp_path / "november.jsonl"

    saved = cli("durable_replay", "--save-cohort", "november", "--runs", str(run.id), "--json")
    assert saved.returncode == 0, saved.stderr
    assert json.loads(saved.stdout) == {"cohort": "november", "recordings": 1}
    exported = cli("durable_replay", "--export", "november", "--output", str(path))
    assert exported.returncode == 0, exported.stderr
    to_stdout = cli("durable_replay", "--export", "november")
    assert to_stdout.stdout == path.read_text(), "--output writes what stdout would show"
    [line] = path.read_text().splitlines()
    assert json.loads(line)["source_run"] == str(run.id)

    imported = cli("durable_replay", "--import", str(path), "--cohort", "november-copy")
    assert imported.returncode == 0, imported.stderr
    listed = json.loads(cli("durable_replay", "--cohorts", "--json").stdout)
    assert {(c["name"], c["recordings"]) for c in listed} == {("november", 1), ("november-copy", 1)}
    replayed = cli(
        "durable_replay", "--cohort", "november-copy", "--lanes", "baseline", "--here", "--json", "--as", "alice"
    )
    assert replayed.returncode == 0, replayed.stderr
    assert json.loads(replayed.stdout)["lanes"]["baseline"]["agree"] == 1
    replays = json.loads(cli("durable_replay", "--replays", "--cohort", "november-copy", "--json").stdout)
    assert [(r["cohort"], r["lanes"], r["finished"], r["runs"], r["created_by"]) for r in replays] == [
        ("november-copy", ["baseline"], 1, 1, "alice")
    ]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--cohort", "nope", "--candidate-model", "claude-haiku-4-5"], "no cohort is named 'nope'"),
        (["--workflow", "refund_agent", "--candidate-participant", "nobody"], "unknown participant 'nobody'"),
        (
            ["--workflow", "refund_agent", "--candidate-model", "claude-haiku-4-5", "--stub", "issue_refund={bad"],
            "--stub issue_refund is not valid JSON",
        ),
        (["--workflow", "refund_agent", "--candidate-model", "x", "--stub", "nope=1"], "no tool named 'nope'"),
        (["--cohort", "c", "--candidate-model", "x", "--fail-under", "1.5"], "--fail-under is the share of runs"),
        (["--cohort", "c", "--lanes", "baseline", "--fail-under", "0.9"], "--fail-under judges the candidate lane"),
        (["--cohorts", "--replays"], "--cohorts and --replays do not go together"),
        (["--report", "abc", "--export", "c"], "--report and --export do not go together"),
        (["--export", "c", "--candidate-model", "x"], "--candidate-model does not go with --export"),
        (["--output", "f.jsonl", "--cohort", "c"], "--output goes with --export only"),
        (["--candidate-model", "claude-haiku-4-5"], "choose the runs to replay"),
        (["--import", "missing.jsonl", "--cohort", "c"], "cannot read 'missing.jsonl'"),
        (["--import", "missing.jsonl"], "--import needs --cohort NAME"),
        (["--report", "abc"], "'abc' is not a replay id"),
        (["--cohort", "c", "--effort", "hgih"], "effort must be one of"),
        (["--since", "yesterday", "--candidate-model", "x"], "--since takes an ISO time"),
        (["--runs", "abcdef12", "--lanes", "baseline", "--here", "--timeout", "5"], "--timeout is how long to wait"),
        (["--cohort", "c", "--instructions", "x", "--instructions-file", "y"], "do not go together: give one"),
        (["--cohort", "c", "--tool-description", "issue_refund"], "--tool-description takes NAME=TEXT"),
        (["--cohort", "c", "--candidate-model", "x", "--budget-usd", "nan"], "--budget-usd takes a positive amount"),
        (["--sample"], "argument --sample: expected one argument"),
        (["--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_durable_replay__mistakes_exit_2_with_one_line_on_stderr(cli, args, message):
    result = cli("durable_replay", *args)

    assert result.returncode == 2, f"{args}: exit {result.returncode}, stderr {result.stderr}"
    assert message in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_durable_runs_and_show__mark_replay_runs_and_hide_them_unless_asked(cli):
    run = recorded()
    replay = api.replay(runs=[run.id], candidate={"participant": GREEDY})
    api.replay_here(replay.id)
    candidate = Run.objects.get(replay_lane="candidate")

    listed = cli("durable_runs", "--json")
    assert listed.returncode == 0, listed.stderr
    rows = json.loads(listed.stdout)
    assert [row["id"] for row in rows] == [str(run.id)]
    assert rows[0]["replay_lane"] is None
    assert listed.stderr.strip() == "2 replay runs hidden (--replays lists them)"
    text = cli("durable_runs").stdout.splitlines()
    assert text[-1] == "2 replay runs hidden (--replays lists them)", text

    everything = json.loads(cli("durable_runs", "--replays", "--json").stdout)
    assert sorted(str(row["replay_lane"]) for row in everything) == ["None", "baseline", "candidate"]
    lane = cli("durable_runs", "--lane", "candidate").stdout.splitlines()
    assert len(lane) == 1 and lane[0].startswith(str(candidate.id)) and "replay run (candidate lane)" in lane[0]
    of_replay = json.loads(cli("durable_runs", "--replay", str(replay.id), "--json").stdout)
    assert len(of_replay) == 2
    wrong_lane = cli("durable_runs", "--lane", "observed")
    assert wrong_lane.returncode == 2, wrong_lane.stderr
    assert "unknown lane 'observed'; choose from baseline, candidate" in wrong_lane.stderr

    shown = cli("durable_show", str(candidate.id))
    assert (
        f"replay run (candidate lane) of replay {replay.id}, recording of run {run.id}: tool calls answered from "
        "the recording; nothing was applied"
    ) in shown.stdout, shown.stdout
    data = json.loads(cli("durable_show", str(candidate.id), "--json").stdout)
    assert data["replay"]["id"] == str(replay.id) and data["replay"]["source_run"] == str(run.id)
    assert json.loads(cli("durable_show", str(run.id), "--json").stdout)["replay"] is None
    assert Replay.objects.count() == 1

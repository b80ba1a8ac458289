"""The README's first command: `durable_demo` on embedded defaults (SQLite, a broker in files, no API key), with
the scripted agent and with Claude's default model played by the strict stand-in (`--stand-in`).

It runs as a new user runs it — `manage.py migrate` then `manage.py durable_demo` in subprocesses, in a
temp dir of its own — and the test then reads the demo's SQLite file to check what the summary claims:
every run completed, one refund per refunded order although a worker was SIGKILLed mid-run, and the
big refund went through a manager's approval.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from decimal import Decimal
from pathlib import Path

import pytest

from project.refunds.seed import CASES, SEEDED

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def demo_env(tmp_path: Path) -> dict[str, str]:
    """The environment scripts/demo gives the command, and nothing of the test suite's own."""
    dropped = ("DATABASE_URL", "CELERY_BROKER_URL", "ANTHROPIC_API_KEY", "ANTHROPIC_BASE_URL", "DJANGO_SECRET_KEY")
    env = {k: v for k, v in os.environ.items() if k not in dropped and not k.startswith("DURABLE_")}
    env.update(
        DJANGO_SETTINGS_MODULE="project.settings",
        DURABLE_VAR_DIR=str(tmp_path),
        CELERY_BROKER_URL="filesystem://",
        DJANGO_LOCAL_SECRET_KEY="1",
        DURABLE_LEASE_SECONDS="3",
        DURABLE_SWEEP_SECONDS="1",
        PYTHONUNBUFFERED="1",
    )
    return env


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "agent",
    [
        pytest.param([], id="scripted"),
        # Claude's default model through the real SDK, played by the strict stand-in of the Messages API: thinking
        # blocks, no prefill, no forced tool choice for the reviewer (`scripts/demo --stand-in`).
        pytest.param(["--stand-in"], id="stand-in"),
        # The same, with the reviewer's turns in Message Batches at half price (`scripts/demo --batch`).
        pytest.param(["--batch"], id="batch"),
    ],
)
def test_demo__refund_agents_survive_a_sigkill_without_a_second_refund(demo_env, tmp_path, agent):
    def manage(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "manage.py", *args],
            cwd=ROOT,
            env=demo_env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    migrated = manage("migrate", "--verbosity", "0", timeout=180)
    assert migrated.returncode == 0, migrated.stderr
    # Generous: a busy 2-core machine boots celery workers slowly; the assertions are on outcomes, not time.
    demo = manage("durable_demo", "--timeout", "400", *agent, timeout=480)
    output = f"{demo.stdout}\n{demo.stderr}"
    assert demo.returncode == 0, (
        f"durable_demo failed (exit {demo.returncode}); worker logs in {tmp_path}/demo\n{output}"
    )
    assert "Every run ended as expected" in demo.stdout, output
    assert "SIGKILL worker" in demo.stdout and "Time to recover" in demo.stdout, output

    db = sqlite3.connect(tmp_path / "durable_agents.sqlite3")
    statuses = db.execute("SELECT status, COUNT(*) FROM durable_agents_run WHERE workflow = 'refund_agent' GROUP BY 1")
    assert dict(statuses.fetchall()) == {"completed": len(CASES)}, output

    refunds = _refunds_by_order(db)
    for case in CASES:
        expected = [case.refund] if case.refund is not None else []
        assert refunds.get(case.number, []) == expected, (
            f"{case.number}: the agent's refunds are {refunds.get(case.number)}, expected {expected} — "
            "a refund made twice means a retried or resumed tool call was not deduplicated by its key"
        )
    emails = dict(
        db.execute(
            "SELECT o.number, COUNT(*) FROM refunds_outboundemail e "
            "JOIN refunds_order o ON o.id = e.order_id GROUP BY 1"
        )
    )
    assert emails == {case.number: 1 for case in CASES}, f"one email per customer, got {emails}"

    takeovers = db.execute(
        "SELECT DISTINCT e.run_id FROM durable_agents_event e JOIN durable_agents_run r ON r.id = e.run_id "
        "WHERE e.kind = 'lease_takeover' AND r.workflow = 'refund_agent'"
    ).fetchall()
    assert takeovers, f"no run was taken over after the SIGKILL: the kill did not land mid-run\n{output}"

    approval = next(case for case in CASES if case.needs_approval)
    decided = db.execute(
        "SELECT w.status, w.decided_by, w.name FROM durable_agents_wait w JOIN durable_agents_run r ON r.id = w.run_id "
        "WHERE r.workflow = 'refund_agent' AND w.kind = 'approval'"
    ).fetchall()
    assert decided == [("approved", "demo-manager", "issue_refund")], (
        f"only {approval.number}'s refund (over 50.00) should wait for a manager, and be approved: {decided}"
    )
    verdicts = db.execute(
        "SELECT s.result FROM durable_agents_step s JOIN durable_agents_run r ON r.id = s.run_id "
        "WHERE r.workflow = 'refund_agent' AND s.step_id = 'review_email' AND s.status = 'done'"
    ).fetchall()
    assert len(verdicts) == len(CASES) and all('"passed": true' in row[0] for row in verdicts), verdicts
    if agent:
        assert "played by the strict stand-in" in demo.stdout, output
        turns = db.execute(
            "SELECT DISTINCT t.participant, t.model FROM durable_agents_turn t JOIN durable_agents_run r "
            "ON r.id = t.run_id WHERE r.workflow = 'refund_agent'"
        ).fetchall()
        assert turns == [("anthropic", "claude-sonnet-5-5")], turns
        thinking = db.execute("SELECT COUNT(*) FROM durable_agents_turn WHERE content LIKE '%\"thinking\"%'")
        assert thinking.fetchone()[0] > 0, "the default model thinks: its turns carry thinking blocks"
    if "--batch" in agent:
        batched = db.execute(
            "SELECT s.step_id, t.status, COUNT(DISTINCT t.run_id), MIN(t.cost_usd) > 0 "
            "FROM durable_agents_batchturn t "
            "JOIN durable_agents_step s ON s.id = t.step_id GROUP BY 1, 2"
        ).fetchall()
        assert batched == [("review_email", "succeeded", len(CASES), 1)], (
            f"every run's review, and only the review, should be answered in a Message Batch at a cost: {batched}"
        )
        assert "⧗ the reviewer's turn is queued for a Message Batch" in demo.stdout, output
        assert "at the batch price" in demo.stdout and "Reviews in Message Batches" in demo.stdout, output


def _refunds_by_order(db: sqlite3.Connection) -> dict[str, list[Decimal]]:
    rows = db.execute(
        "SELECT o.number, f.amount FROM refunds_refund f JOIN refunds_order o ON o.id = f.order_id "
        "WHERE f.idempotency_key NOT LIKE ? ORDER BY f.id",
        (f"{SEEDED}%",),
    )
    refunds: dict[str, list[Decimal]] = {}
    for number, amount in rows:
        refunds.setdefault(number, []).append(Decimal(str(amount)).quantize(Decimal("0.01")))
    return refunds

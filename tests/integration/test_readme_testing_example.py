"""The README's testing example, run as it is printed: its files in a user's project, its test on a real worker.

README.md ("Testing your workflows") shows MODELS, WORKFLOWS and TESTS verbatim: change them together.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.user_project import run_user_tests, write_user_project

pytest_plugins = ["pytester"]

MODELS = """\
# shop/models.py
from django.db import models


class Refund(models.Model):
    order_id = models.CharField(max_length=20)
    amount = models.DecimalField(max_digits=10, decimal_places=2)
    idempotency_key = models.CharField(max_length=200, unique=True)
"""

WORKFLOWS = """\
# shop/workflows.py
from decimal import Decimal

from durable_agents.api import agent, tool, workflow
from shop.models import Refund


@tool(effectful=True, transactional=True, needs_approval=lambda args: Decimal(args["amount"]) > 50)
def issue_refund(order_id: str, amount: Decimal, *, idempotency_key: str) -> dict:
    \"\"\"Refund part of an order to the customer's card; above 50.00 a person approves first.\"\"\"
    refund, _ = Refund.objects.get_or_create(
        idempotency_key=idempotency_key, defaults={"order_id": order_id, "amount": amount}
    )
    return {"refund": refund.pk, "amount": str(refund.amount)}


workflow("refund_request", steps=[
    agent("resolve", instructions="You handle refund requests.", tools=[issue_refund],
          prompt=lambda ctx: ctx.input["message"]),
])
"""

TESTS = """\
# tests/test_refund_request.py
from decimal import Decimal

from durable_agents import api
from durable_agents.testing import wait_for_run
from durable_agents.testing.fake_anthropic import Reply
from shop.models import Refund


def test_refund_request__a_large_refund_waits_for_approval_then_is_made_once(start_worker, fake_anthropic):
    # Claude's side of the conversation, in order: call the tool, then answer the customer.
    fake_anthropic.enqueue(
        Reply.tool_use("issue_refund", {"order_id": "A-1", "amount": "80.00"}),
        Reply.text("Your refund of 80.00 is on its way."),
    )
    start_worker()  # a real `celery worker` on the test database; SIGKILLed after the test

    run = api.start("refund_request", {"message": "Please refund the 80.00 I paid for order A-1."})
    run = wait_for_run(run.id, "waiting")  # 80.00 is above 50.00: the run parks, holding no worker
    approval = run.waits.get(status="open")
    assert "80.00" in approval.question
    api.decide(approval.pk, True, by="lead@example.com")

    run = wait_for_run(run.id, "completed")
    assert Refund.objects.get().amount == Decimal("80.00")
    assert run.steps.get(step_id="resolve").result["text"] == "Your refund of 80.00 is on its way."
    assert len(fake_anthropic.requests) == 2  # the journaled first turn was not asked again
"""


def test_readme__the_testing_example_passes_in_a_users_project(pytester: pytest.Pytester, monkeypatch):
    write_user_project(pytester, models=MODELS, workflows=WORKFLOWS, tests={"test_refund_request.py": TESTS})

    result = run_user_tests(pytester, monkeypatch)

    result.assert_outcomes(passed=1)


def test_readme__shows_the_example_verbatim():
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    for name, text in (("MODELS", MODELS), ("WORKFLOWS", WORKFLOWS), ("TESTS", TESTS)):
        assert text in readme, f"README.md's testing section no longer shows {name} as this test runs it"

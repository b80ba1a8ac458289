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

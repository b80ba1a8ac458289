from decimal import Decimal

from durable_agents.api import agent, tool, workflow

from shop.models import Refund


@tool(effectful=True, transactional=True, needs_approval=lambda args: Decimal(args["amount"]) > 50)
def issue_refund(order_id: str, amount: Decimal, *, idempotency_key: str) -> dict:
    """Refund part of an order to the customer's card; above 50.00 a person approves first."""
    refund, _ = Refund.objects.get_or_create(
        idempotency_key=idempotency_key, defaults={"order_id": order_id, "amount": amount}
    )
    return {"refund": refund.pk, "amount": str(refund.amount)}


workflow(
    "refund_request",
    steps=[
        agent(
            "resolve",
            instructions="You handle refund requests.",
            tools=[issue_refund],
            prompt=lambda ctx: ctx.input["message"],
        ),
    ],
)

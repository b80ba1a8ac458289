"""The support agent's tools: look an order up, refund it, email the customer, and reverse a refund.

* `lookup_order` is read-only and its answer stays true for ten minutes (a resume past that re-plans);
* `issue_refund` writes to this database, so the engine commits the refund and its outbox row in one
  transaction (exactly once); above REFUND_APPROVAL_ABOVE a manager approves it first; a run cancelled
  with compensation undoes it through `reverse_refund`;
* `email_customer` stands for a mail provider: it is called outside any transaction with the key, and
  the provider keeps one message per key (at-least-once call, exactly-once email).

Business rules fail with a plain exception whose message the agent reads and explains to the customer.
"""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal
from typing import Annotated, Any

from django.db import transaction
from django.utils import timezone

from durable_agents.api import Field, tool
from durable_agents.tools import ToolRegistry
from project.refunds.models import (
    REFUNDABLE_ORDER_STATUSES,
    Order,
    OutboundEmail,
    Refund,
    RefundStatus,
    money,
)

REFUND_APPROVAL_ABOVE = Decimal("50.00")

OrderNumber = Annotated[str, Field(description="The order number the customer quotes, e.g. A-1001", max_length=32)]
Amount = Annotated[
    Decimal,
    Field(
        description="Amount in the order's currency, as a string with two decimals, e.g. 34.90",
        pattern=r"^\d{1,8}(\.\d{1,2})?$",
    ),
]


class OrderNotFoundError(LookupError):
    """There is no order with that number."""


class RefundNotAllowedError(ValueError):
    """The refund breaks a rule: nothing was paid, or it is more than what is left to refund."""


def needs_manager(args: dict[str, Any]) -> bool:
    """Refunds above REFUND_APPROVAL_ABOVE wait for a manager's approval."""
    return Decimal(args["amount"]) > REFUND_APPROVAL_ABOVE


def _order(number: str, *, for_update: bool = False) -> Order:
    orders = Order.objects.select_for_update() if for_update else Order.objects
    try:
        return orders.get(number=number)
    except Order.DoesNotExist:
        raise OrderNotFoundError(f"there is no order {number!r}; check the number the customer gave") from None


# Read-only tools are never looked up by name (no outbox row, no compensation), so this one lives in the
# app's own registry: its common name may then be taken in the global one (the test suite's billing app has one).
shop_tools = ToolRegistry()


@tool(fresh_for=timedelta(minutes=10), registry=shop_tools)
def lookup_order(order_id: OrderNumber) -> dict[str, Any]:
    """Look an order up: customer, status, items, amount paid, refunds so far, and what can still be refunded.

    Read-only. Call it before acting on an order: act on what it returns, not on what the customer remembers.
    """
    return _order(order_id).snapshot()


@tool(effectful=True, transactional=True, compensate="reverse_refund", needs_approval=needs_manager)
def issue_refund(
    order_id: OrderNumber,
    amount: Amount,
    reason: Annotated[str, Field(description="Why, in a few words, for the order's history", max_length=300)],
    *,
    idempotency_key: str,
) -> dict[str, Any]:
    """Refund money to the customer's original payment method; returns the refund receipt.

    The amount may not exceed the order's `refundable` amount (see lookup_order). Refunds above 50.00 wait
    for a manager's approval before they are made. Call it at most once per customer request.
    """
    # The receiving side checks the key first: a repeated call returns the first refund, never a second one.
    existing = Refund.objects.select_related("order").filter(idempotency_key=idempotency_key).first()
    if existing is not None:
        return existing.receipt()
    # Locked so two refunds of one order cannot both fit under what was paid.
    order = _order(order_id, for_update=True)
    if order.status not in REFUNDABLE_ORDER_STATUSES:
        raise RefundNotAllowedError(
            f"order {order.number} is {order.get_status_display()}: no payment was taken, so nothing can be refunded"
        )
    if amount <= 0:
        raise RefundNotAllowedError("a refund must be more than 0.00")
    refundable = order.refundable_amount()
    if amount > refundable:
        raise RefundNotAllowedError(
            f"order {order.number} can be refunded at most {money(refundable, order.currency)} "
            f"(paid {money(order.amount_paid, order.currency)}, "
            f"already refunded {money(order.refunded_amount(), order.currency)})"
        )
    refund = Refund.objects.create(order=order, amount=amount, reason=reason, idempotency_key=idempotency_key)
    return refund.receipt()


@tool(effectful=True, transactional=True)
def reverse_refund(order_id: OrderNumber, amount: Amount, reason: str = "", *, idempotency_key: str) -> dict[str, Any]:
    """Take back a refund made by issue_refund with these arguments, before it settles (compensation).

    Reverses the newest issued refund of `amount` on the order; the same key never reverses a second one.
    """
    done = Refund.objects.select_related("order").filter(reversal_key=idempotency_key).first()
    if done is not None:
        return done.receipt()
    refund = (
        Refund.objects.select_for_update()
        .select_related("order")
        .filter(order__number=order_id, amount=amount, status=RefundStatus.ISSUED)
        .order_by("-created_at", "-id")
        .first()
    )
    if refund is None:
        raise RefundNotAllowedError(f"order {order_id} has no issued refund of {amount} to reverse")
    refund.status = RefundStatus.REVERSED
    refund.reversal_key = idempotency_key
    refund.reversed_at = timezone.now()
    refund.save(update_fields=["status", "reversal_key", "reversed_at"])
    return refund.receipt()


@tool(effectful=True)
def email_customer(
    order_id: OrderNumber,
    subject: Annotated[str, Field(description="The subject line", max_length=200)],
    body: Annotated[str, Field(description="Plain text, signed 'The support team'", max_length=5000)],
    *,
    idempotency_key: str,
) -> dict[str, Any]:
    """Email the customer of an order at the address on file. Send exactly one email per request, at the end."""
    order = _order(order_id)
    # The provider's dedupe: one message per key, however many times the call is made.
    with transaction.atomic():
        email, _ = OutboundEmail.objects.get_or_create(
            idempotency_key=idempotency_key,
            defaults={"order": order, "to": order.customer_email, "subject": subject, "body": body},
        )
    return {"email_id": email.pk, "to": email.to, "subject": email.subject}

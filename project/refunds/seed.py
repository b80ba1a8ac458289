"""The demo shop: five orders, what each customer wrote, and how each run should end.

Example::

    seed_shop()             # the orders, as new (earlier demo orders, refunds and emails are removed)
    for case in CASES: api.start("refund_agent", case.run_input)
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from decimal import Decimal

from django.db import transaction
from django.utils import timezone

from project.refunds.models import Order, OrderStatus, OutboundEmail, Refund, money

# The idempotency-key prefix of refunds the seed made (not the agent).
SEEDED = "seed:"


@dataclass(frozen=True)
class Case:
    """One customer request and the outcome the demo checks."""

    number: str
    customer: str
    email: str
    status: str
    lines: tuple[tuple[str, int, str], ...]
    message: str
    # What this run refunds (None: nothing); refunds above 50.00 wait for a manager first.
    refund: Decimal | None
    needs_approval: bool = False
    days_ago: int = 3
    already_refunded: Decimal | None = None

    @property
    def paid(self) -> Decimal:
        return sum((Decimal(price) * quantity for _, quantity, price in self.lines), Decimal("0.00"))

    @property
    def run_input(self) -> dict[str, str]:
        return {"order_id": self.number, "message": self.message}

    @property
    def expectation(self) -> str:
        if self.refund is None:
            return "no refund: explained why" if "refund" in self.message.lower() else "question answered"
        return f"refund {money(self.refund)}" + (", after approval" if self.needs_approval else "")


CASES = (
    Case(
        "A-1001",
        "Maya Chen",
        "maya.chen@example.com",
        OrderStatus.DELIVERED,
        (("Ceramic pour-over set", 1, "34.90"),),
        "Hi, my pour-over set arrived with the dripper cracked in two. Could I get a refund, please?",
        refund=Decimal("34.90"),
    ),
    Case(
        "A-1002",
        "Tomás Ruiz",
        "tomas.ruiz@example.com",
        OrderStatus.DELIVERED,
        (("Wireless headphones", 1, "129.00"),),
        "The left earcup of my headphones stopped working after a week. I'd like my money back.",
        refund=Decimal("129.00"),
        needs_approval=True,
        days_ago=9,
    ),
    Case(
        "A-1003",
        "Priya Nair",
        "priya.nair@example.com",
        OrderStatus.DELIVERED,
        (("Rain jacket, size M", 1, "58.00"),),
        "I sent the rain jacket back two weeks ago. Please refund me.",
        refund=None,
        days_ago=20,
        already_refunded=Decimal("58.00"),
    ),
    Case(
        "A-1004",
        "Jonas Weber",
        "jonas.weber@example.com",
        OrderStatus.DELIVERED,
        (("Trail running shoes", 1, "89.95"), ("Shipping", 1, "4.95")),
        "I was charged €4.95 for shipping although my free-shipping code was accepted. Please refund the shipping.",
        refund=Decimal("4.95"),
    ),
    Case(
        "A-1005",
        "Aiko Tanaka",
        "aiko.tanaka@example.com",
        OrderStatus.SHIPPED,
        (("Brass desk lamp", 1, "42.00"),),
        "Hello! When will my desk lamp arrive?",
        refund=None,
        days_ago=2,
    ),
)


def seed_shop(cases: tuple[Case, ...] = CASES) -> list[Order]:
    """Create the cases' orders afresh: earlier demo orders go, with their refunds and emails."""
    now = timezone.now()
    numbers = [case.number for case in cases]
    with transaction.atomic():
        OutboundEmail.objects.filter(order__number__in=numbers).delete()
        Refund.objects.filter(order__number__in=numbers).delete()
        Order.objects.filter(number__in=numbers).delete()
        orders = []
        for case in cases:
            placed = now - timedelta(days=case.days_ago)
            shipped = (
                placed + timedelta(days=1) if case.status in (OrderStatus.SHIPPED, OrderStatus.DELIVERED) else None
            )
            order = Order.objects.create(
                number=case.number,
                customer_name=case.customer,
                customer_email=case.email,
                status=case.status,
                amount_paid=case.paid,
                lines=[{"item": item, "quantity": qty, "price": price} for item, qty, price in case.lines],
                placed_at=placed,
                shipped_at=shipped,
                delivered_at=placed + timedelta(days=2) if case.status == OrderStatus.DELIVERED else None,
            )
            if case.already_refunded:
                Refund.objects.create(
                    order=order,
                    amount=case.already_refunded,
                    reason="returned to the warehouse",
                    idempotency_key=f"{SEEDED}{case.number}",
                )
                Refund.objects.filter(order=order).update(created_at=now - timedelta(days=case.days_ago - 6))
            orders.append(order)
    return orders

"""The shop's records the refund agent reads and changes: orders, refunds, and the emails sent to customers.

Refunds and emails are the "receiving side" of the agent's effects: each stores the idempotency key it
was created under, unique in the database, so a retried or resumed call can never make a second one.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from django.db import models
from django.db.models import Q, Sum

CENT = Decimal("0.01")
CURRENCY_SIGNS = {"EUR": "€", "USD": "$", "GBP": "£"}


def money(amount: Decimal, currency: str = "EUR") -> str:
    """`€34.90`, `$5.00`, or `12.00 CHF` for a currency without a sign here."""
    value = f"{amount.quantize(CENT):,.2f}"
    sign = CURRENCY_SIGNS.get(currency)
    return f"{sign}{value}" if sign else f"{value} {currency}"


class OrderStatus(models.TextChoices):
    PLACED = "placed", "placed, not paid yet"
    PAID = "paid"
    SHIPPED = "shipped"
    DELIVERED = "delivered"
    CANCELLED = "cancelled", "cancelled before payment"


# Money was taken for these orders, so they can be refunded (up to what was paid).
REFUNDABLE_ORDER_STATUSES = (OrderStatus.PAID, OrderStatus.SHIPPED, OrderStatus.DELIVERED)


class Order(models.Model):
    """A customer's order: what they bought and what they paid."""

    number = models.CharField(max_length=32, unique=True, help_text="what the customer quotes, e.g. A-1001")
    customer_name = models.CharField(max_length=200)
    customer_email = models.EmailField()
    status = models.CharField(max_length=16, choices=OrderStatus.choices, default=OrderStatus.PLACED)
    currency = models.CharField(max_length=3, default="EUR")
    amount_paid = models.DecimalField(max_digits=10, decimal_places=2, default=Decimal("0.00"))
    lines = models.JSONField(default=list, blank=True, help_text='[{"item": "Mug", "quantity": 1, "price": "9.90"}]')
    placed_at = models.DateTimeField()
    shipped_at = models.DateTimeField(null=True, blank=True)
    delivered_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["number"]
        constraints = [
            models.CheckConstraint(condition=Q(amount_paid__gte=0), name="refunds_order_amount_paid_nonnegative"),
        ]

    def __str__(self) -> str:
        return self.number

    def refunded_amount(self) -> Decimal:
        """What was given back so far: issued refunds, not the reversed ones."""
        total = self.refunds.filter(status=RefundStatus.ISSUED).aggregate(total=Sum("amount"))["total"]
        return total or Decimal("0.00")

    def refundable_amount(self) -> Decimal:
        """What can still be refunded: the amount paid minus what was refunded; nothing if nothing was paid."""
        if self.status not in REFUNDABLE_ORDER_STATUSES:
            return Decimal("0.00")
        return max(self.amount_paid - self.refunded_amount(), Decimal("0.00"))

    def snapshot(self) -> dict[str, Any]:
        """The order as the agent sees it (JSON): status, lines, amounts as strings, refunds so far."""
        refunds = self.refunds.filter(status=RefundStatus.ISSUED).order_by("created_at")
        return {
            "order_id": self.number,
            "customer_name": self.customer_name,
            "customer_email": self.customer_email,
            "status": self.status,
            "currency": self.currency,
            "lines": self.lines,
            "amount_paid": str(self.amount_paid),
            "refunded": str(self.refunded_amount()),
            "refundable": str(self.refundable_amount()),
            "refunds": [
                {"amount": str(r.amount), "reason": r.reason, "issued_at": r.created_at.date().isoformat()}
                for r in refunds
            ],
            "placed_at": self.placed_at.date().isoformat(),
            "shipped_at": self.shipped_at.date().isoformat() if self.shipped_at else None,
            "delivered_at": self.delivered_at.date().isoformat() if self.delivered_at else None,
        }


class RefundStatus(models.TextChoices):
    ISSUED = "issued"
    # Taken back before it settled (a cancelled run's compensation, or support correcting a mistake).
    REVERSED = "reversed"


class Refund(models.Model):
    """Money given back to the customer's original payment method."""

    order = models.ForeignKey(Order, on_delete=models.PROTECT, related_name="refunds")
    amount = models.DecimalField(max_digits=10, decimal_places=2)
    reason = models.TextField(blank=True, default="")
    status = models.CharField(max_length=16, choices=RefundStatus.choices, default=RefundStatus.ISSUED)
    idempotency_key = models.CharField(max_length=300, help_text="the caller's key: one refund per key, ever")
    reversal_key = models.CharField(max_length=300, null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    reversed_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]
        constraints = [
            models.UniqueConstraint(fields=["idempotency_key"], name="refunds_refund_idempotency_key_uniq"),
            models.UniqueConstraint(
                fields=["reversal_key"],
                condition=Q(reversal_key__isnull=False),
                name="refunds_refund_reversal_key_uniq",
            ),
            models.CheckConstraint(condition=Q(amount__gt=0), name="refunds_refund_amount_positive"),
        ]

    def __str__(self) -> str:
        return f"refund #{self.pk}: {money(self.amount, self.order.currency)} on {self.order.number} ({self.status})"

    def receipt(self) -> dict[str, Any]:
        """What issue_refund and reverse_refund answer (JSON)."""
        return {
            "refund_id": self.pk,
            "order_id": self.order.number,
            "amount": str(self.amount),
            "currency": self.order.currency,
            "status": self.status,
        }


class OutboundEmail(models.Model):
    """An email sent to a customer; the mail provider keeps one message per idempotency key."""

    order = models.ForeignKey(Order, on_delete=models.PROTECT, related_name="emails", null=True, blank=True)
    to = models.EmailField()
    subject = models.CharField(max_length=200)
    body = models.TextField()
    idempotency_key = models.CharField(max_length=300)
    sent_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-sent_at"]
        constraints = [
            models.UniqueConstraint(fields=["idempotency_key"], name="refunds_email_idempotency_key_uniq"),
        ]

    def __str__(self) -> str:
        return f"to {self.to}: {self.subject}"

    def as_text(self) -> str:
        """The message as the customer reads it."""
        return f"To: {self.to}\nSubject: {self.subject}\n\n{self.body}"

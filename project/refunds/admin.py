"""The shop's records in the admin, each refund and email linked to the durable run that made it."""

from __future__ import annotations

import uuid

from django.contrib import admin
from django.urls import reverse
from django.utils.html import format_html
from django_celery_results.models import ChordCounter, GroupResult, TaskResult

from project.refunds.models import Order, OutboundEmail, Refund, money

# Every durable_agents task ignores its result (the run's rows are the record), so django_celery_results'
# tables stay empty: its admin section would only be noise. The app stays installed for the result backend.
for unused in (TaskResult, GroupResult, ChordCounter):
    if admin.site.is_registered(unused):
        admin.site.unregister(unused)


def run_id_of(idempotency_key: str) -> uuid.UUID | None:
    """The run an agent's effect came from: durable_agents keys start with the run id (run:step:tool_use_id)."""
    try:
        return uuid.UUID(idempotency_key.split(":", 1)[0])
    except ValueError:
        return None


@admin.display(description="run")
def run_link(obj: Refund | OutboundEmail) -> str:
    run_id = run_id_of(obj.idempotency_key)
    if run_id is None:
        return "—"
    url = reverse("admin:durable_agents_run_change", args=[run_id])
    return format_html('<a href="{}">{}</a>', url, str(run_id)[:8])


class ReadOnlyInline(admin.TabularInline):
    extra = 0
    can_delete = False

    def has_add_permission(self, request: object, obj: object = None) -> bool:
        return False


class RefundInline(ReadOnlyInline):
    model = Refund
    fields = ("created_at", "amount", "status", "reason", run_link)
    readonly_fields = fields


class EmailInline(ReadOnlyInline):
    model = OutboundEmail
    fields = ("sent_at", "to", "subject", run_link)
    readonly_fields = fields


@admin.register(Order)
class OrderAdmin(admin.ModelAdmin):
    list_display = ("number", "customer_name", "status", "paid", "refunded", "placed_at")
    list_filter = ("status",)
    search_fields = ("number", "customer_name", "customer_email")
    inlines = [RefundInline, EmailInline]

    @admin.display(description="paid")
    def paid(self, order: Order) -> str:
        return money(order.amount_paid, order.currency)

    @admin.display(description="refunded")
    def refunded(self, order: Order) -> str:
        return money(order.refunded_amount(), order.currency)


@admin.register(Refund)
class RefundAdmin(admin.ModelAdmin):
    list_display = ("id", "order", "amount", "status", "created_at", run_link)
    list_filter = ("status",)
    search_fields = ("order__number", "idempotency_key")
    list_select_related = ("order",)
    readonly_fields = (run_link,)

    # Money moves through the agent's tools, which key every refund; the admin only looks.
    def has_add_permission(self, request: object) -> bool:
        return False

    def has_change_permission(self, request: object, obj: object = None) -> bool:
        return False

    def has_delete_permission(self, request: object, obj: object = None) -> bool:
        return False


@admin.register(OutboundEmail)
class OutboundEmailAdmin(admin.ModelAdmin):
    list_display = ("sent_at", "to", "subject", "order", run_link)
    search_fields = ("to", "subject", "order__number")
    list_select_related = ("order",)
    readonly_fields = (run_link,)

    # What was sent stays as it was sent.
    def has_add_permission(self, request: object) -> bool:
        return False

    def has_change_permission(self, request: object, obj: object = None) -> bool:
        return False

    def has_delete_permission(self, request: object, obj: object = None) -> bool:
        return False

"""The Message Batches the batcher sent (agents/batcher.py), read-only: each batch's provider id, status, requests,
the API's counts, age, polls and next poll, and on its page the turns it carries, each linking to its run.

Nothing here changes a batch: the batcher owns them (a run's cancel abandons its turns, and the batcher cancels a
batch nobody waits for). Whoever may view runs may view their batches.
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest
from django.template.loader import render_to_string
from django.urls import reverse
from django.utils.html import format_html
from django.utils.safestring import SafeString

from durable_agents import clock
from durable_agents.admin.counting import EstimatedCountPaginator
from durable_agents.clock import DbNow
from durable_agents.display import coarse_duration, when_html, when_text
from durable_agents.models import BatchTurn, MessageBatch

# A batch may carry 100,000 turns: its page lists this many and says how many it holds.
TURNS_SHOWN = 100
# The API's request_counts, in the order an operator reads them.
COUNT_NAMES = ("processing", "succeeded", "errored", "expired", "canceled")


def counts_text(batch: MessageBatch) -> str:
    """The API's request counts as last polled, zeros left out: "processing 3, succeeded 7"; "" before a poll."""
    counts = batch.counts if isinstance(batch.counts, dict) else {}
    return ", ".join(f"{name} {counts[name]}" for name in COUNT_NAMES if counts.get(name))


def _now(batch: MessageBatch) -> Any:
    return getattr(batch, "db_now", None) or clock.now()


@admin.register(MessageBatch)
class MessageBatchAdmin(admin.ModelAdmin):
    list_display = ("batch_id", "status_badge", "requests", "counts_column", "age", "polls", "next_poll")
    list_display_links = ("batch_id",)
    list_filter = ("status",)
    search_fields = ("=provider_id",)
    ordering = ("-created_at",)
    list_per_page = 50
    show_full_result_count = False
    show_facets = admin.ShowFacets.NEVER
    paginator = EstimatedCountPaginator
    fields = (
        "provider_id",
        "status",
        "request_count",
        "request_bytes",
        "counts_column",
        "created",
        "submitted",
        "ended",
        "polled",
        "next_poll",
        "polls",
        "error",
        "turns_column",
    )
    readonly_fields = fields

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: MessageBatch | None = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: MessageBatch | None = None) -> bool:
        return False

    def has_view_permission(self, request: HttpRequest, obj: MessageBatch | None = None) -> bool:
        # A batch holds turns of runs: whoever may view runs sees what their turns wait on.
        return super().has_view_permission(request, obj) or request.user.has_perm("durable_agents.view_run")

    def has_module_permission(self, request: HttpRequest) -> bool:
        return super().has_module_permission(request) or request.user.has_perm("durable_agents.view_run")

    def get_queryset(self, request: HttpRequest) -> QuerySet[MessageBatch]:
        # The database's time read with the rows: ages without a query per row.
        return super().get_queryset(request).annotate(db_now=DbNow())

    @admin.display(description="batch", ordering="provider_id")
    def batch_id(self, batch: MessageBatch) -> str:
        return batch.provider_id or f"#{batch.pk} (not yet created)"

    @admin.display(description="status", ordering="status")
    def status_badge(self, batch: MessageBatch) -> SafeString:
        return format_html('<span class="durable-badge durable-{}">{}</span>', batch.status, batch.status)

    @admin.display(description="requests", ordering="request_count")
    def requests(self, batch: MessageBatch) -> int:
        return batch.request_count

    @admin.display(description="created")
    def created(self, batch: MessageBatch) -> SafeString:
        return when_html(batch.created_at)

    @admin.display(description="submitted")
    def submitted(self, batch: MessageBatch) -> SafeString:
        return when_html(batch.submitted_at)

    @admin.display(description="ended")
    def ended(self, batch: MessageBatch) -> SafeString:
        return when_html(batch.ended_at)

    @admin.display(description="last polled")
    def polled(self, batch: MessageBatch) -> SafeString:
        return when_html(batch.polled_at)

    @admin.display(description="counts")
    def counts_column(self, batch: MessageBatch) -> str:
        return counts_text(batch) or "—"

    @admin.display(description="age", ordering="created_at")
    def age(self, batch: MessageBatch) -> SafeString:
        seconds = ((batch.ended_at or _now(batch)) - batch.created_at).total_seconds()
        text = f"ended after {coarse_duration(seconds)}" if batch.ended_at else coarse_duration(seconds)
        return format_html('<span title="made {}">{}</span>', when_text(batch.created_at), text)

    @admin.display(description="next poll", ordering="next_poll_at")
    def next_poll(self, batch: MessageBatch) -> SafeString:
        return when_html(batch.next_poll_at if batch.ended_at is None else None)

    @admin.display(description="turns")
    def turns_column(self, batch: MessageBatch) -> SafeString:
        """The batch's turns (the first TURNS_SHOWN), each with its run, step and status."""
        turns = list(
            BatchTurn.objects.filter(batch=batch)
            .select_related("run", "step")
            .only("run__workflow", "step__step_id", "index", "purpose", "status", "custom_id", "ended_at")
            .order_by("id")[: TURNS_SHOWN + 1]
        )
        rows = [(t, reverse("admin:durable_agents_run_change", args=[t.run_id])) for t in turns[:TURNS_SHOWN]]
        context = {"rows": rows, "more": len(turns) > TURNS_SHOWN, "shown": TURNS_SHOWN, "batch": batch}
        return render_to_string("admin/durable_agents/messagebatch/_turns.html", context)

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> Any:
        return super().changelist_view(request, {"title": "Message Batches", **(extra_context or {})})

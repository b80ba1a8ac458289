"""The Run admin: the run list (filters, search, overview) and the run page with its actions.

Fast at a million runs: no column needs a query per row (the current step is one correlated subquery
in the page's single SELECT), counts are estimated past a limit, the date hierarchy is computed from
the URL instead of DISTINCT date scans, and facets are off.
"""

from __future__ import annotations

import calendar
import uuid
from datetime import date, timedelta
from typing import Any

from django.contrib import admin
from django.contrib.admin.utils import unquote
from django.contrib.admin.views.main import ChangeList
from django.core.exceptions import PermissionDenied
from django.db import connections
from django.db.models import (
    DateTimeField,
    ExpressionWrapper,
    F,
    Max,
    Min,
    OuterRef,
    Q,
    QuerySet,
    Subquery,
    Value,
)
from django.http import HttpRequest, HttpResponse, HttpResponseNotFound
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils import formats, timezone
from django.utils.html import format_html, format_html_join
from django.utils.safestring import mark_safe

from durable_agents import clock
from durable_agents.admin.actions import ACTIONS, actions_for, run_action_view
from durable_agents.admin.audit import recorded_for, with_events
from durable_agents.admin.bulk import cancel_selected, resume_selected
from durable_agents.admin.counting import EstimatedCountPaginator
from durable_agents.admin.filters import (
    REPLAY_PARAMETER,
    AgingFilter,
    ConcurrencyFilter,
    ErrorTypeFilter,
    ReplayFilter,
    StuckFilter,
    VersionDriftFilter,
    WaitDeadlineFilter,
    WorkflowFilter,
    stuck_reason,
)
from durable_agents.admin.guards import refuse_nul, show_direction_controls
from durable_agents.admin.live import is_refetch, leave_messages
from durable_agents.admin.overview import Overview, build_overview
from durable_agents.admin.replay_forms import PERMISSION as REPLAY_PERMISSION
from durable_agents.admin.replay_forms import replay_selected
from durable_agents.admin.run_forms import forkable_steps
from durable_agents.admin.run_page import RunPage, build_run_page
from durable_agents.admin.timeline import human_duration
from durable_agents.clock import DbNow
from durable_agents.display import when_text
from durable_agents.models import ReplayRun, Run, Step
from durable_agents.operations import concurrency_note
from durable_agents.search import MAX_VALUE_CHARS, holding, is_field_name, parse_filter
from durable_agents.search import matching as search_matching
from durable_agents.workflows import registry

HEX = frozenset("0123456789abcdef")
STUCK_BADGE = mark_safe(' <span class="durable-badge durable-stuck">stuck</span>')
# The error column shows this much of the message; the whole of it is in the cell's title.
ERROR_PREVIEW = 90


# Filters that usually select few runs. Postgres overestimates their matches (e.g. old `updated_at` and
# runnable are correlated) and walks the created_at index hoping to meet a page of them early: a walk of
# the whole table when they are rare. Sorting by an expression no index serves makes it fetch the matches
# through their own indexes and keep the newest (a top-N sort) instead.
SELECTIVE_FILTERS = ("stuck", "aging", "wait", "error_type")
# ?count=exact: the list's count exact, whatever it costs (the operator asked for it; the link is beside an estimate).
EXACT_COUNT_PARAMETER = "count"


def _unindexed(part: Any) -> Any:
    if isinstance(part, str) and part.lstrip("-") in ("created_at", "updated_at"):
        moment = ExpressionWrapper(F(part.lstrip("-")) + Value(timedelta(0)), output_field=DateTimeField())
        return moment.desc() if part.startswith("-") else moment.asc()
    return part


class RunChangeList(ChangeList):
    def get_ordering(self, request: HttpRequest, queryset: QuerySet[Run]) -> list[Any]:
        ordering = super().get_ordering(request, queryset)
        if any(self.params.get(name) for name in SELECTIVE_FILTERS):
            return [_unindexed(part) for part in ordering]
        return ordering

    def get_queryset(self, request: HttpRequest, exclude_parameters: Any = None) -> QuerySet[Run]:
        queryset = super().get_queryset(request, exclude_parameters)
        current_step = Step.objects.live().filter(run=OuterRef("pk"), position=OuterRef("cursor")).values("step_id")
        # Input and output can be up to a megabyte each and the list never shows them. Each row carries the
        # database's time, so ages and "stuck" are on the engine's clock without a query per row.
        return queryset.defer("input", "output").annotate(current_step_id=Subquery(current_step[:1]), db_now=DbNow())

    def date_links(self) -> dict[str, Any]:
        """The date hierarchy's links, from the URL and the table's first and last dates (two index probes).

        Django's own tag runs SELECT DISTINCT over the filtered rows per level: a scan at a million runs.
        This offers every period in range instead, some of which may hold no run.
        """
        field = self.date_hierarchy
        year, month, day = (self.params.get(f"{field}__{part}") for part in ("year", "month", "day"))

        def link(filters: dict[str, Any]) -> str:
            return self.get_query_string(filters, [f"{field}__"])

        try:
            if year and month and day:
                chosen = date(int(year), int(month), int(day))
                return {
                    "show": True,
                    "back": {"link": link({f"{field}__year": year, f"{field}__month": month}), "title": _ym(chosen)},
                    "choices": [{"title": formats.date_format(chosen, "MONTH_DAY_FORMAT")}],
                }
            if year and month:
                days = calendar.monthrange(int(year), int(month))[1]
                return {
                    "show": True,
                    "back": {"link": link({f"{field}__year": year}), "title": str(year)},
                    "choices": [
                        {
                            "link": link({f"{field}__year": year, f"{field}__month": month, f"{field}__day": d}),
                            "title": formats.date_format(date(int(year), int(month), d), "MONTH_DAY_FORMAT"),
                        }
                        for d in range(1, days + 1)
                    ],
                }
            if year:
                return {
                    "show": True,
                    "back": {"link": link({}), "title": "All dates"},
                    "choices": [
                        {
                            "link": link({f"{field}__year": year, f"{field}__month": m}),
                            "title": _ym(date(int(year), m, 1)),
                        }
                        for m in range(1, 13)
                    ],
                }
        except ValueError:
            return {"show": False}
        bounds = Run.objects.aggregate(first=Min(field), last=Max(field))
        if not bounds["first"]:
            return {"show": False}
        first, last = timezone.localtime(bounds["first"]).year, timezone.localtime(bounds["last"]).year
        return {
            "show": True,
            "back": None,
            "choices": [{"link": link({f"{field}__year": y}), "title": str(y)} for y in range(first, last + 1)],
        }


def _ym(day: date) -> str:
    return formats.date_format(day, "YEAR_MONTH_FORMAT")


def _now(run: Run) -> Any:
    """The database's time as read with the row (the list's queryset annotates it), else read now."""
    return getattr(run, "db_now", None) or clock.now()


def _step_actions(run: Run, page: RunPage, user: Any) -> dict[str, Any] | None:
    """The per-step links of the steps table the operator may follow: fork from a step, reset to it."""
    fork, reset = ACTIONS["fork"], ACTIONS["replan"]
    shown = {
        "forkable": {s.step_id for s in forkable_steps(page.steps)}
        if fork.is_allowed(user) and fork.applies(run)
        else set(),
        "reset": reset.is_allowed(user) and reset.applies(run),
    }
    return shown if shown["forkable"] or shown["reset"] else None


def _replay_runs_hidden(request: HttpRequest, overview: Overview) -> dict[str, Any] | None:
    """How many replay runs the list hides (none asked for), with the address that shows them: the overview counted
    them (on their own index) to leave them out of its cards."""
    if request.GET.get(REPLAY_PARAMETER) or not overview.replay_runs.value:
        return None
    shown = request.GET.copy()
    shown[REPLAY_PARAMETER] = "all"
    hidden = overview.replay_runs
    return {"count": str(hidden), "plural": hidden.value != 1, "query": shown.urlencode()}


def _replay_of(run: Run) -> dict[str, Any] | None:
    """For a replay run's banner: its lane, its replay and the recorded run it replays (None for a real run)."""
    if not run.replay_lane:
        return None
    link = ReplayRun.objects.select_related("recording").filter(run_id=run.pk).first()
    if link is None:
        return {"lane": run.replay_lane}
    source = link.recording.source_run_id
    return {
        "lane": link.lane,
        "replay_id": link.replay_id,
        "case_url": reverse("admin:durable_agents_replay_case", args=[link.replay_id, link.recording_id]),
        "source_run": source,
        "source_exists": bool(source) and Run.objects.filter(pk=source).exists(),
    }


@admin.register(Run)
class RunAdmin(admin.ModelAdmin):
    change_list_template = "admin/durable_agents/run/change_list.html"
    list_display = [
        "short_id",
        "workflow_label",
        "status_badge",
        "error_summary",
        "current_step",
        "age",
        "last_progress",
        "attempts",
        "tokens",
        "cost",
    ]
    list_display_links = ["short_id"]
    # Sorting is offered on indexed columns only: an unindexed ORDER BY sorts a million rows.
    sortable_by = ["age", "last_progress"]
    list_filter = [
        "status",
        WorkflowFilter,
        StuckFilter,
        AgingFilter,
        WaitDeadlineFilter,
        ErrorTypeFilter,
        VersionDriftFilter,
        ConcurrencyFilter,
        ReplayFilter,
    ]
    search_fields = ["idempotency_key"]  # the search itself: get_search_results
    search_help_text = (
        "A run id (or its first characters), an exact idempotency or concurrency key, or a search attribute's exact "
        "value: A-1001 (any field) or order_id:A-1001 (that field)."
    )
    date_hierarchy = "created_at"
    list_per_page = 50
    show_full_result_count = False
    show_facets = admin.ShowFacets.NEVER
    paginator = EstimatedCountPaginator
    actions = [resume_selected, cancel_selected, replay_selected]

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return RunChangeList

    def get_paginator(self, request: HttpRequest, queryset: QuerySet[Run], per_page: int, **kwargs: Any) -> Any:
        paginator = self.paginator(queryset, per_page, **kwargs)
        paginator.selective = any(request.GET.get(name) for name in SELECTIVE_FILTERS)
        paginator.exact = getattr(request, "durable_exact_count", False)
        return paginator

    # Runs are created by workflows and changed by the engine; the admin only reads and calls the API.
    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Run | None = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Run | None = None) -> bool:
        return False

    def has_resume_permission(self, request: HttpRequest) -> bool:
        return ACTIONS["resume"].is_allowed(request.user)

    def has_cancel_permission(self, request: HttpRequest) -> bool:
        return ACTIONS["cancel"].is_allowed(request.user)

    def has_replay_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm(REPLAY_PERMISSION)

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[Run], search_term: str
    ) -> tuple[QuerySet[Run], bool]:
        """A run id, a prefix of one (as an id range on the primary key), an exact idempotency or concurrency key, or
        a search attribute's exact value: in any field the registered workflows declare (`A-1001`), or in one
        (`order_id:A-1001`). Each is an index probe (the search attributes' GIN index on Postgres)."""
        term = search_term.strip()
        if not term:
            return queryset, False
        match = Q(idempotency_key=term) | Q(concurrency_key=term)
        vendor = connections[queryset.db].vendor
        parsed = parse_filter(term, separator=":")
        if parsed is not None and is_field_name(parsed[0]) and parsed[1]:
            # An idempotency key may hold a colon too (a schedule's "schedule:<name>:<slot>"): both are looked up.
            return queryset.filter(match | search_matching({parsed[0]: parsed[1]}, vendor)), False
        if len(term) <= MAX_VALUE_CHARS and (fields := registry.search_fields()):
            match |= holding(term, fields, vendor)
        digits = term.replace("-", "").lower()
        if digits and len(digits) <= 32 and set(digits) <= HEX:
            match |= Q(pk__gte=uuid.UUID(digits.ljust(32, "0")), pk__lte=uuid.UUID(digits.ljust(32, "f")))
        return queryset.filter(match), False

    @admin.display(description="run")
    def short_id(self, run: Run) -> str:
        return str(run.pk)[:8]

    @admin.display(description="workflow")
    def workflow_label(self, run: Run) -> str:
        """The workflow, and under it what the run is known by: its search attributes (`order_id: A-1001`), its
        idempotency key and its concurrency key — in the cell, not columns of their own, so the list fits 1,280 px."""
        lines = [(f"{field}: {value}", "search attribute") for field, value in sorted(run.search.items())]
        if run.idempotency_key:
            lines.append((run.idempotency_key, "idempotency key"))
        if run.concurrency_key is not None:
            lines.append((f"key {run.concurrency_key}", f"concurrency key (limit {run.concurrency_limit})"))
        replay = (
            format_html('<span class="durable-badge durable-replay">replay · {}</span> ', run.replay_lane)
            if run.replay_lane
            else ""
        )
        return format_html(
            "{}{}{}",
            replay,
            f"{run.workflow}@{run.workflow_version}",
            format_html_join(
                "", '<div class="durable-key durable-mono" title="{}">{}</div>', ((t, v) for v, t in lines)
            ),
        )

    @admin.display(description="status")
    def status_badge(self, run: Run) -> str:
        """The status, and when the run is stuck, why: in the row, not only in a tooltip."""
        reason = stuck_reason(run, _now(run))
        badge = format_html('<span class="durable-badge durable-{}">{}</span>', run.status, run.status)
        if run.is_queued:
            # Why a pending run has not started: its key's queue, in the row.
            return format_html('{}<div class="durable-reason durable-queued">{}</div>', badge, concurrency_note(run))
        if not reason:
            return badge
        return format_html('{}{}<div class="durable-reason">{}</div>', badge, STUCK_BADGE, reason)

    @admin.display(description="error")
    def error_summary(self, run: Run) -> str:
        """The error's type and the start of its message; the whole message in the title."""
        error = run.error if isinstance(run.error, dict) else {}
        if not error:
            return ""
        kind, message = str(error.get("type") or "Error"), str(error.get("message") or "")
        preview = message if len(message) <= ERROR_PREVIEW else message[: ERROR_PREVIEW - 1] + "…"
        step = f" (step {error['step']})" if error.get("step") else ""
        return format_html(
            '<div class="durable-error-cell" title="{}: {}{}"><strong>{}:</strong> {}</div>',
            kind,
            message,
            step,
            kind,
            preview,
        )

    @admin.display(description="current step")
    def current_step(self, run: Run) -> str:
        if run.cursor >= run.step_count:
            return f"— · {run.step_count}/{run.step_count}"
        return f"{getattr(run, 'current_step_id', None) or '?'} · {run.cursor + 1}/{run.step_count}"

    @admin.display(description="age", ordering="created_at")
    def age(self, run: Run) -> str:
        """How long ago the run started; the moment itself (with its zone) in the title."""
        return format_html(
            '<span title="created {}">{}</span>',
            when_text(run.created_at),
            human_duration((_now(run) - run.created_at).total_seconds()),
        )

    @admin.display(description="last progress", ordering="updated_at")
    def last_progress(self, run: Run) -> str:
        return format_html(
            '<span title="{}">{} ago</span>',
            when_text(run.updated_at),
            human_duration((_now(run) - run.updated_at).total_seconds()),
        )

    @admin.display(description="attempt")
    def attempts(self, run: Run) -> int:
        return run.attempt

    @admin.display(description="tokens")
    def tokens(self, run: Run) -> str:
        return f"{run.input_tokens + run.output_tokens:,}"

    @admin.display(description="cost")
    def cost(self, run: Run) -> str:
        return f"${run.cost_usd:,.4f}"

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        refused = refuse_nul(request)
        if refused is not None:
            return refused
        if request.GET.get(EXACT_COUNT_PARAMETER) == "exact":
            # Not a filter: taken out before the changelist reads its filters from the query string.
            request.GET = request.GET.copy()
            del request.GET[EXACT_COUNT_PARAMETER]
            request.durable_exact_count = True
        overview = build_overview()
        context = {
            "title": "Runs",
            "overview": overview,
            "replay_runs_hidden": _replay_runs_hidden(request, overview),
            **(extra_context or {}),
        }
        return leave_messages(request, show_direction_controls(super().changelist_view(request, context)))

    def change_view(
        self, request: HttpRequest, object_id: str, form_url: str = "", extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        """The run page: read-only data, the troubleshooting answers first, and the permitted actions."""
        run = self.get_object(request, unquote(object_id))
        if run is None:
            if is_refetch(request):  # live.js stops and says so; a redirect it followed would spend the messages
                return HttpResponseNotFound("This run no longer exists.")
            return self._get_obj_does_not_exist_redirect(request, self.opts, object_id)
        if not self.has_view_permission(request, run):
            raise PermissionDenied
        page = build_run_page(run, now=clock.now())
        context = {
            **self.admin_site.each_context(request),
            "title": f"Run {str(run.pk)[:8]} · {run.workflow}@{run.workflow_version}",
            "opts": self.opts,
            "original": run,
            "page": page,
            "run_actions": actions_for(run, request.user),
            "step_actions": _step_actions(run, page, request.user),
            "operator_actions": with_events(recorded_for(run), (event for event, _ in page.events)),
            "replay_of": _replay_of(run),
            **(extra_context or {}),
        }
        page_response = TemplateResponse(request, "admin/durable_agents/run/run_page.html", context)
        return leave_messages(request, show_direction_controls(page_response))

    def get_urls(self) -> list[Any]:
        action = self.admin_site.admin_view(self.action_view)
        return [
            path("<path:object_id>/actions/<slug:slug>/", action, name="durable_agents_run_action"),
            *super().get_urls(),
        ]

    def action_view(self, request: HttpRequest, object_id: str, slug: str) -> HttpResponse:
        return show_direction_controls(run_action_view(self, request, unquote(object_id), slug))

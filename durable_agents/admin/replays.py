"""The replay lab in the console: the replays (each one's report, and one case's conversations side by side) and the
cohorts (downloaded as JSON lines, replayed with a candidate).

Replays and cohorts are made by `api.replay` / `api.save_cohort` (the run list's and cohort list's actions, or
`durable_replay`); the admin reads them and adds or changes nothing itself. A report is `replays.report`: it reads
every replay run's turns, so a replay of thousands of runs takes a second or more. A finished replay's report no longer
changes: it is kept in Django's cache for a while (the report page, then each case side by side, read it once); one
still going is read anew each time. The replay list shows the candidate's agreement of small finished replays only.
"""

from __future__ import annotations

import re
from typing import Any

from django.contrib import admin, messages
from django.contrib.admin.utils import unquote
from django.core.cache import cache
from django.core.exceptions import PermissionDenied
from django.core.paginator import Paginator
from django.db.models import Count, F, Func, Max, OuterRef, Q, QuerySet, Subquery
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect, StreamingHttpResponse
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils.html import format_html

from durable_agents import replays
from durable_agents.admin.conversations import observed_conversation, run_conversation
from durable_agents.admin.guards import show_direction_controls
from durable_agents.admin.replay_forms import PERMISSION, candidate_summary, replay_cohort
from durable_agents.display import when_text
from durable_agents.errors import DurableAgentsError
from durable_agents.models import Cohort, Replay, ReplayRun, Run
from durable_agents.states import FINISHED_RUN_STATUSES

DEFAULT_FAIL_UNDER = 0.95
LANE_ORDER = (replays.OBSERVED, *replays.LANES)
# The replay list reads the report of a finished replay of at most this many runs (larger ones: open the report).
LIST_REPORT_LIMIT = 400
# A finished replay's report is kept this long (seconds); the cases table shows this many cases a page.
REPORT_CACHE_SECONDS = 600
CASES_PER_PAGE = 100


def read_report(replay_id: Any) -> replays.Report:
    """The replay's report; a finished replay's from the cache when it was read since its runs last changed (a run
    retried from the console changes it again)."""
    ids = ReplayRun.objects.filter(replay_id=replay_id).values("run_id")
    state = Run.objects.filter(pk__in=ids).aggregate(
        live=Count("pk", filter=~Q(status__in=FINISHED_RUN_STATUSES)), last=Max("updated_at")
    )
    if state["live"]:
        return replays.report(replay_id)
    key = f"durable_agents:replay-report:{replay_id}:{state['last'].isoformat() if state['last'] else ''}"
    found = cache.get(key)
    if found is None:
        found = replays.report(replay_id)
        cache.set(key, found, REPORT_CACHE_SECONDS)
    return found


def _count(queryset: QuerySet[Any]) -> Subquery:
    return Subquery(queryset.order_by().annotate(n=Func(F("pk"), function="COUNT")).values("n")[:1])


def _fail_under(request: HttpRequest) -> float:
    """The verdict's threshold from the address (?fail_under=0.9 or 90 %), else the default; nonsense is said."""
    raw = request.GET.get("fail_under", "").strip().rstrip("%").strip()
    if not raw:
        return DEFAULT_FAIL_UNDER
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value > 1 and value <= 100:
        value /= 100
    if not 0 <= value <= 1:
        messages.error(request, f"fail under must be a share between 0 and 1 (or a percentage), not {raw!r}.")
        return DEFAULT_FAIL_UNDER
    return value


def _may_view(request: HttpRequest, model_admin: admin.ModelAdmin, obj: Any) -> bool:
    """Replays and cohorts are shown to whoever may view them, and to whoever may view runs: a replay run is a run,
    and a recording holds what its run's page shows."""
    return admin.ModelAdmin.has_view_permission(model_admin, request, obj) or request.user.has_perm(
        "durable_agents.view_run"
    )


def _runs_url(run_id: Any) -> str:
    return reverse("admin:durable_agents_run_change", args=[run_id])


@admin.register(Replay)
class ReplayAdmin(admin.ModelAdmin):
    list_display = ["short_id", "cohort_link", "candidate_text", "created", "created_by", "finished", "agreement"]
    list_display_links = ["short_id"]
    list_per_page = 50
    show_facets = admin.ShowFacets.NEVER

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Replay | None = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Replay | None = None) -> bool:
        return False

    def has_view_permission(self, request: HttpRequest, obj: Replay | None = None) -> bool:
        return _may_view(request, self, obj)

    def get_queryset(self, request: HttpRequest) -> QuerySet[Replay]:
        links = ReplayRun.objects.filter(replay=OuterRef("pk"))
        done = Run.objects.filter(
            pk__in=ReplayRun.objects.filter(replay=OuterRef(OuterRef("pk"))).values("run_id"),
            status__in=FINISHED_RUN_STATUSES,
        )
        return (
            super()
            .get_queryset(request)
            .select_related("cohort")
            .annotate(run_total=_count(links), run_finished=_count(done))
        )

    @admin.display(description="replay")
    def short_id(self, obj: Replay) -> str:
        return str(obj.pk)[:8]

    @admin.display(description="cohort")
    def cohort_link(self, obj: Replay) -> str:
        return obj.cohort.name

    @admin.display(description="candidate")
    def candidate_text(self, obj: Replay) -> str:
        return candidate_summary(obj.candidate)

    @admin.display(description="created", ordering="created_at")
    def created(self, obj: Replay) -> str:
        return when_text(obj.created_at)

    @admin.display(description="finished")
    def finished(self, obj: Replay) -> str:
        return f"{obj.run_finished or 0}/{obj.run_total or 0}"

    @admin.display(description="candidate agreement")
    def agreement(self, obj: Replay) -> str:
        # Read for a finished replay only: the report reads its runs' turns (a page of 50 replays at most).
        if not obj.run_total or obj.run_finished != obj.run_total:
            return "—"
        if obj.run_total > LIST_REPORT_LIMIT:
            return "see the report"
        summary = read_report(obj.pk).lanes.get("candidate")
        if summary is None or summary.agreement is None:
            return "—"
        return f"{summary.agree}/{summary.finished} ({summary.agreement:.0%})"

    def change_view(
        self, request: HttpRequest, object_id: str, form_url: str = "", extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        """The replay's report: the lanes over the cohort, the CI verdict, the runs that changed most, every case."""
        made = self.get_object(request, unquote(object_id))
        if made is None:
            return self._get_obj_does_not_exist_redirect(request, self.opts, object_id)
        if not self.has_view_permission(request, made):
            raise PermissionDenied
        report = read_report(made.pk)
        fail_under = _fail_under(request)
        cases = Paginator(report.cases, CASES_PER_PAGE).get_page(request.GET.get("page"))
        passed, why = report.verdict(fail_under)
        context = {
            **self.admin_site.each_context(request),
            "title": f"Replay {str(made.pk)[:8]} of cohort {made.cohort.name}",
            "opts": self.opts,
            "original": made,
            "replay": made,
            "report": report,
            "candidate": candidate_summary(made.candidate),
            "lanes": [report.lanes[name] for name in LANE_ORDER if name in report.lanes],
            "fail_under": fail_under,
            "fail_under_percent": f"{fail_under * 100:g}",
            "verdict": {"passed": passed, "why": why},
            "changed_most": [_case_row(made, case) for case in report.changed_most()],
            "cases": [_case_row(made, case) for case in cases],
            "cases_page": cases,
            **(extra_context or {}),
        }
        response = TemplateResponse(request, "admin/durable_agents/replay/report.html", context)
        return show_direction_controls(response)

    def get_urls(self) -> list[Any]:
        case = self.admin_site.admin_view(self.case_view)
        return [
            path("<path:object_id>/case/<int:recording_id>/", case, name="durable_agents_replay_case"),
            *super().get_urls(),
        ]

    def case_view(self, request: HttpRequest, object_id: str, recording_id: int) -> HttpResponse:
        """One case side by side: the observed conversation beside each replayed lane's, the divergence marked."""
        made = self.get_object(request, unquote(object_id))
        if made is None:
            return self._get_obj_does_not_exist_redirect(request, self.opts, object_id)
        if not self.has_view_permission(request, made):
            raise PermissionDenied
        report = read_report(made.pk)
        case = next((c for c in report.cases if c.recording_id == recording_id), None)
        if case is None:
            messages.warning(request, f"Replay {str(made.pk)[:8]} has no case {recording_id}.")
            return HttpResponseRedirect(reverse("admin:durable_agents_replay_change", args=[made.pk]))
        recording = made.cohort.recordings.get(pk=recording_id)
        candidate = case.lanes.get("candidate")
        marked = candidate.first_divergence if candidate is not None else None
        columns = [
            {
                "name": replays.OBSERVED,
                "lane": case.lanes[replays.OBSERVED],
                "entries": observed_conversation(recording.data, marked),
                "run_url": _runs_url(case.source_run) if case.source_run and _exists(case.source_run) else "",
            }
        ]
        for name in reversed(replays.LANES):  # the candidate beside the recording, the baseline after it
            lane = case.lanes.get(name)
            if lane is not None:
                columns.append(
                    {
                        "name": name,
                        "lane": lane,
                        "entries": run_conversation(lane.run_id, lane.first_divergence) if lane.run_id else [],
                        "run_url": _runs_url(lane.run_id) if lane.run_id and lane.status != "pruned" else "",
                    }
                )
        context = {
            **self.admin_site.each_context(request),
            "title": f"Case {case.position + 1} of replay {str(made.pk)[:8]}, side by side",
            "opts": self.opts,
            "replay": made,
            "case": case,
            "columns": columns,
            "report_url": reverse("admin:durable_agents_replay_change", args=[made.pk]),
        }
        response = TemplateResponse(request, "admin/durable_agents/replay/case.html", context)
        return show_direction_controls(response)


def _exists(run_id: Any) -> bool:
    return Run.objects.filter(pk=run_id).exists()


def _case_row(made: Replay, case: replays.Case) -> dict[str, Any]:
    lanes = []
    for name in LANE_ORDER:
        lane = case.lanes.get(name)
        if lane is None:
            continue
        link = name != replays.OBSERVED and lane.run_id and lane.status != "pruned"
        lanes.append({"name": name, "lane": lane, "run_url": _runs_url(lane.run_id) if link else ""})
    return {
        "case": case,
        "number": case.position + 1,
        "lanes": lanes,
        "source_url": _runs_url(case.source_run) if case.source_run else "",
        "compare_url": reverse("admin:durable_agents_replay_case", args=[made.pk, case.recording_id]),
    }


@admin.register(Cohort)
class CohortAdmin(admin.ModelAdmin):
    list_display = ["name", "recordings_count", "created", "download"]
    list_per_page = 50
    search_fields = ["name"]
    show_facets = admin.ShowFacets.NEVER
    actions = [replay_cohort]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Cohort | None = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Cohort | None = None) -> bool:
        return False

    def has_view_permission(self, request: HttpRequest, obj: Cohort | None = None) -> bool:
        return _may_view(request, self, obj)

    def has_replay_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm(PERMISSION)

    def get_queryset(self, request: HttpRequest) -> QuerySet[Cohort]:
        return super().get_queryset(request).annotate(recording_total=Count("recordings"))

    @admin.display(description="recordings", ordering="recording_total")
    def recordings_count(self, obj: Cohort) -> int:
        return obj.recording_total

    @admin.display(description="created", ordering="created_at")
    def created(self, obj: Cohort) -> str:
        return when_text(obj.created_at)

    @admin.display(description="dataset")
    def download(self, obj: Cohort) -> str:
        return format_html(
            '<a href="{}" class="durable-download">Download JSON lines</a>',
            reverse("admin:durable_agents_cohort_export", args=[obj.pk]),
        )

    def get_urls(self) -> list[Any]:
        export = self.admin_site.admin_view(self.export_view)
        return [path("<path:object_id>/export/", export, name="durable_agents_cohort_export"), *super().get_urls()]

    def export_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """The cohort's recordings as JSON lines (replays.export_cohort), streamed: one recording a line."""
        cohort = self.get_object(request, unquote(object_id))
        if cohort is None:
            return self._get_obj_does_not_exist_redirect(request, self.opts, object_id)
        if not self.has_view_permission(request, cohort):
            raise PermissionDenied
        try:
            lines = replays.export_cohort(cohort.name)
        except DurableAgentsError as exc:
            messages.error(request, str(exc))
            return HttpResponseRedirect(reverse("admin:durable_agents_cohort_changelist"))
        response = StreamingHttpResponse((f"{line}\n" for line in lines), content_type="application/x-ndjson")
        filename = re.sub(r"[^A-Za-z0-9._-]+", "_", cohort.name).strip("._") or "cohort"
        response["Content-Disposition"] = f'attachment; filename="{filename}.jsonl"'
        return response

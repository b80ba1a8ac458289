"""Template filters of the console: `{% load durable %}`."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django import template
from django.urls import reverse
from django.utils.safestring import SafeString

from durable_agents.admin.live import leave_messages_rendered
from durable_agents.admin.overview import build_overview
from durable_agents.conf import settings
from durable_agents.display import ago_text, when_html

register = template.Library()


@register.filter
def when(value: datetime | None) -> SafeString:
    """`{{ run.created_at|when }}` → <time datetime="…">2026-12-01 14:03:07 EST</time>; "—" for None."""
    return when_html(value)


@register.filter
def when_precise(value: datetime | None) -> SafeString:
    """As `when`, with milliseconds: for step and attempt times."""
    return when_html(value, precise=True)


@register.filter
def ago(value: datetime | None, now: datetime) -> str:
    """`{{ run.updated_at|ago:page.now }}` → "4m12s ago", in the console's one duration style."""
    return ago_text(value, now)


@register.inclusion_tag("admin/durable_agents/_overview.html", takes_context=True)
def durable_overview(context: template.Context, *, live: bool = False) -> dict[str, Any]:
    """The console's overview (runs by status, stuck runs, health and load) on any admin page, e.g. the admin's
    index, for staff who may view runs; its cards lead to the run list, filtered. Nothing for anyone else::

        {% extends "admin/index.html" %}{% load durable %}
        {% block content %}{% durable_overview %}{{ block.super }}{% endblock %}

    With `live=True` its cards and health refresh themselves (the durable_live tag), as on the run list.
    """
    request = context.get("request")
    user = getattr(request, "user", None)
    if user is None or not user.has_perm("durable_agents.view_run"):
        return {"overview": None}
    if live:
        leave_messages_rendered(request)  # the admin's base template listed them above: a refetch spends none
    return {"overview": build_overview(), "runs_url": reverse("admin:durable_agents_run_changelist"), "live": live}


@register.inclusion_tag("admin/durable_agents/_live.html")
def durable_live(regions: str, *, final: bool = False) -> dict[str, Any]:
    """The live refresh of a console page: a "Live · updated 3 s ago" indicator with a Pause toggle, and the
    script (durable_agents/live.js) that refetches the page every DURABLE_AGENTS['ADMIN_REFRESH_SECONDS'] and
    swaps the regions named by CSS selectors. `final`: the page already shows a final state, nothing to refresh::

        {% durable_live "#content-main" final=run.is_finished %}
    """
    return {"interval_ms": round(settings.ADMIN_REFRESH_SECONDS * 1000), "regions": regions, "final": final}

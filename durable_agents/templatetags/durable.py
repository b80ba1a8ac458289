"""Template filters of the console: `{% load durable %}`."""

from __future__ import annotations

from datetime import datetime

from django import template
from django.utils.safestring import SafeString

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

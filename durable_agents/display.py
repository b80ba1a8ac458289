"""One way to show a moment: `2026-12-01 14:03:07 EST`, in the current time zone, with the zone named.

Every page of the console, the e-mails and the decision page use this (`{% load durable %}` then
`{{ value|when }}`), so one screen never mixes local and UTC times or two formats. `when_precise` adds
milliseconds for the step and attempt tables, where ordering within a second matters.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from django.utils import timezone
from django.utils.html import format_html
from django.utils.safestring import SafeString


def when_text(value: datetime | None, *, precise: bool = False) -> str:
    """The moment as text in the current time zone, its zone named; "" for None."""
    if value is None:
        return ""
    local = timezone.localtime(value) if timezone.is_aware(value) else value
    clock = local.strftime("%Y-%m-%d %H:%M:%S")
    if precise:
        clock += f".{local.microsecond // 1000:03d}"
    zone = local.strftime("%Z") or "UTC"
    return f"{clock} {zone}"


def when_html(value: datetime | None, *, precise: bool = False) -> SafeString:
    """A <time> element: the moment as `when_text` shows it, the exact ISO instant in its datetime attribute."""
    if value is None:
        return format_html('<span class="durable-quiet">{}</span>', "—")
    return format_html('<time datetime="{}">{}</time>', value.isoformat(), when_text(value, precise=precise))


def human_duration(seconds: float) -> str:
    """A short human duration, always with its unit: 0s, 250ms, 1.5s, 2m30s, 3h, 2d4h."""
    if seconds <= 0:
        return "0s"
    if seconds < 1:
        return f"{seconds * 1000:.0f}ms"
    if seconds < 60:
        return f"{seconds:.1f}".rstrip("0").rstrip(".") + "s"
    delta = timedelta(seconds=round(seconds))
    days, rest = delta.days, delta.seconds
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d{hours}h" if hours else f"{days}d"
    if hours:
        return f"{hours}h{minutes}m" if minutes else f"{hours}h"
    return f"{minutes}m{secs}s" if secs else f"{minutes}m"


def coarse_duration(seconds: float) -> str:
    """How long, as on-call reads an age or a wait: "4 s", "9 min", "3 h", "2 d". Every age in the console, the
    health verdicts and `durable_status` reads so; `human_duration` is for measured spans (a step's 250ms)."""
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.0f} h"
    return f"{seconds / 86400:.0f} d"


def ago_text(value: datetime | None, now: datetime) -> str:
    """How long before `now` the moment was, e.g. "just now" (under a second), "3 s ago", "4 min ago"; "" for
    None."""
    if value is None:
        return ""
    if (now - value).total_seconds() < 1:
        return "just now"
    return f"{coarse_duration((now - value).total_seconds())} ago"

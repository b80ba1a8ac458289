"""The run page's step timeline: a server-rendered SVG, one bar per step over time, retries and waits marked.

Plain SVG, no JavaScript: it renders in any browser, prints, and survives a screenshot pasted into an
incident channel. Every text that comes from data is escaped; every bar has a <title> tooltip.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.utils.html import escape
from django.utils.safestring import SafeString, mark_safe

from durable_agents.models import Step, StepStatus

WIDTH = 980
LABEL_WIDTH = 210
RIGHT_PAD = 28
PLOT_WIDTH = WIDTH - LABEL_WIDTH - RIGHT_PAD
LEGEND_HEIGHT = 30
AXIS_Y = LEGEND_HEIGHT + 26
ROW_HEIGHT = 20
BAR_HEIGHT = 12
LABEL_CHARS = 28

# Colours match the status badges of the run list and the steps table.
STATUS_COLOURS = {
    StepStatus.DONE: "#2e7d32",
    StepStatus.RUNNING: "#1565c0",
    StepStatus.FAILED: "#c62828",
    StepStatus.WAITING: "#ef6c00",
    StepStatus.PENDING: "#9e9e9e",
    StepStatus.SKIPPED: "#bdbdbd",
    StepStatus.SUPERSEDED: "#9e9e9e",
}
RETRY_COLOUR = "#d50000"
# Tick spacings, in seconds, from 1 ms to 30 days: the axis picks the first that gives at most 8 ticks.
TICK_STEPS = [m * 10**e for e in range(-3, 2) for m in (1, 2, 5)] + [
    60,
    120,
    300,
    600,
    900,
    1800,
    3600,
    7200,
    10800,
    21600,
    43200,
    86400,
    172800,
    604800,
    2592000,
]


@dataclass(frozen=True)
class WaitSpan:
    """A durable wait of a step: open from `began` until `ended` (None: still open)."""

    step_id: str
    began: datetime
    ended: datetime | None
    label: str


@dataclass(frozen=True)
class Retry:
    """A retry of a step: when it was scheduled, which attempt failed, and why."""

    step_id: str
    at: datetime
    attempt: int
    error: str


def render_timeline(
    steps: Sequence[Step],
    retries: Iterable[Retry],
    waits: Iterable[WaitSpan] = (),
    *,
    now: datetime,
    origin: datetime,
    active: bool,
) -> SafeString:
    """One row per step: a bar from started_at to finished_at (or now), coloured by status; a step's
    waits are hatched on its row and its retries are red ticks.

    `origin` is where the axis starts when no step has started yet (the run's creation).
    """
    by_step: dict[str, list[Retry]] = defaultdict(list)
    for retry in retries:
        by_step[retry.step_id].append(retry)
    waits_by_step: dict[str, list[tuple[datetime, datetime, str]]] = defaultdict(list)
    for wait in waits:
        waits_by_step[wait.step_id].append((wait.began, wait.ended or now, wait.label))
    spans = [_span(step, now) for step in steps]
    moments = [t for span in spans if span for t in span]
    moments += [r.at for rs in by_step.values() for r in rs]
    moments += [t for ws in waits_by_step.values() for began, ended, _ in ws for t in (began, ended)]
    start = min(moments, default=origin)
    end = max([*moments, now] if active else moments, default=start)
    total = max((end - start).total_seconds(), 0.001)

    def x(moment: datetime) -> float:
        return LABEL_WIDTH + (moment - start).total_seconds() / total * PLOT_WIDTH

    rows_top = AXIS_Y + 8
    height = rows_top + max(len(steps), 1) * ROW_HEIGHT + 30
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="durable-timeline" width="{WIDTH}" height="{height}" '
        f'viewBox="0 0 {WIDTH} {height}" role="img" aria-labelledby="timeline-title" '
        'font-family="system-ui, -apple-system, Segoe UI, Roboto, sans-serif" font-size="11">',
        '<title id="timeline-title">Step timeline</title>',
        "<defs>"
        '<pattern id="wait-hatch" width="6" height="6" patternUnits="userSpaceOnUse" patternTransform="rotate(45)">'
        f'<rect width="6" height="6" fill="{STATUS_COLOURS[StepStatus.WAITING]}" fill-opacity="0.35"/>'
        f'<line x1="0" y1="0" x2="0" y2="6" stroke="{STATUS_COLOURS[StepStatus.WAITING]}" stroke-width="3"/>'
        "</pattern></defs>",
        f'<rect x="0" y="0" width="{WIDTH}" height="{height}" fill="#fff"/>',
    ]
    parts += _legend()
    parts += _axis(start, total, rows_top, height - 30)
    for row, (step, span) in enumerate(zip(steps, spans, strict=True)):
        top = rows_top + row * ROW_HEIGHT
        # Retries and waits belong to the live plan element; a superseded one is drawn as history only.
        live = step.status != StepStatus.SUPERSEDED
        marks = (by_step.get(step.step_id, []), waits_by_step.get(step.step_id, [])) if live else ([], [])
        parts += _row(step, span, *marks, top=top, row=row, x=x)
    if not steps:
        parts.append(f'<text x="{LABEL_WIDTH}" y="{rows_top + 14}" fill="#666">this run has no steps</text>')
    if active:
        now_x = x(now)
        parts.append(
            f'<line x1="{now_x:.1f}" y1="{AXIS_Y}" x2="{now_x:.1f}" y2="{height - 30}" stroke="#1565c0" '
            'stroke-dasharray="4 3"><title>now</title></line>'
            f'<text x="{now_x:.1f}" y="{height - 18}" text-anchor="middle" fill="#1565c0">now</text>'
        )
    parts.append(
        f'<text x="4" y="{height - 6}" fill="#555">t = 0 at {escape(start.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3])} UTC'
        f" · span {escape(human_duration(total))}</text>"
    )
    parts.append("</svg>")
    return mark_safe("".join(parts))  # noqa: S308 - every data-derived text above went through escape()


def _span(step: Step, now: datetime) -> tuple[datetime, datetime] | None:
    began = step.started_at
    if began is None and step.status == StepStatus.WAITING:
        began = step.updated_at  # a wait that opened without executing: it has waited since it last changed
    if began is None:
        return None
    ended = step.finished_at or (now if step.status in (StepStatus.RUNNING, StepStatus.WAITING) else began)
    return began, max(ended, began)


def _legend() -> list[str]:
    entries = [
        ("done", f'fill="{STATUS_COLOURS[StepStatus.DONE]}"'),
        ("running", f'fill="{STATUS_COLOURS[StepStatus.RUNNING]}"'),
        ("failed", f'fill="{STATUS_COLOURS[StepStatus.FAILED]}"'),
        ("wait", 'fill="url(#wait-hatch)" stroke="#ef6c00"'),
        ("superseded", f'fill="{STATUS_COLOURS[StepStatus.SUPERSEDED]}" fill-opacity="0.45"'),
    ]
    parts, left = [], 4
    for label, paint in entries:
        parts.append(f'<rect x="{left}" y="9" width="14" height="10" rx="2" {paint}/>')
        parts.append(f'<text x="{left + 19}" y="18" fill="#333">{label}</text>')
        left += 30 + 7 * len(label)
    parts.append(f'<line x1="{left + 6}" y1="7" x2="{left + 6}" y2="21" stroke="{RETRY_COLOUR}" stroke-width="2"/>')
    parts.append(f'<circle cx="{left + 6}" cy="7" r="3" fill="{RETRY_COLOUR}"/>')
    parts.append(f'<text x="{left + 14}" y="18" fill="#333">retry (failed attempt)</text>')
    return parts


def _axis(start: datetime, total: float, top: int, bottom: int) -> list[str]:
    tick = next((s for s in TICK_STEPS if total / s <= 8), TICK_STEPS[-1])
    parts = [f'<line x1="{LABEL_WIDTH}" y1="{AXIS_Y}" x2="{LABEL_WIDTH + PLOT_WIDTH}" y2="{AXIS_Y}" stroke="#888"/>']
    count = int(total / tick + 1e-9)
    for i in range(count + 1):
        offset = i * tick
        tx = LABEL_WIDTH + offset / total * PLOT_WIDTH
        parts.append(f'<line x1="{tx:.1f}" y1="{AXIS_Y - 4}" x2="{tx:.1f}" y2="{bottom}" stroke="#e3e3e3"/>')
        parts.append(
            f'<text x="{tx:.1f}" y="{AXIS_Y - 7}" text-anchor="middle" fill="#555">+{human_duration(offset)}</text>'
        )
    parts.append(f'<text x="4" y="{AXIS_Y - 7}" fill="#555" font-weight="bold">step</text>')
    return parts


def _row(
    step: Step,
    span: tuple[datetime, datetime] | None,
    retries: list[Retry],
    waits: list[tuple[datetime, datetime, str]],
    *,
    top: int,
    row: int,
    x: Callable[[datetime], float],
) -> list[str]:
    """Background, label, waits (under the bar), the bar and its duration, then the retry ticks on top."""
    superseded = step.status == StepStatus.SUPERSEDED
    label = step.step_id if len(step.step_id) <= LABEL_CHARS else step.step_id[: LABEL_CHARS - 1] + "…"
    parts = []
    if row % 2:
        parts.append(f'<rect x="0" y="{top}" width="{WIDTH}" height="{ROW_HEIGHT}" fill="#f6f7f9"/>')
    decoration = ' text-decoration="line-through"' if superseded else ""
    parts.append(
        f'<text x="4" y="{top + 14}" fill="{"#888" if superseded or span is None else "#222"}"{decoration}>'
        f"<title>{escape(step.step_id)} ({escape(step.kind)})</title>{escape(label)}</text>"
    )
    for began, ended, note in waits:
        left, right = x(began), x(ended)
        parts.append(
            f'<rect class="wait" x="{left:.1f}" y="{top + 3}" width="{max(right - left, 3):.1f}" '
            f'height="{ROW_HEIGHT - 6}" rx="2" fill="url(#wait-hatch)" stroke="#ef6c00">'
            f"<title>{escape(note)}</title></rect>"
        )
    bar_y = top + (ROW_HEIGHT - BAR_HEIGHT) / 2
    if span is None:
        parts.append(
            f'<text x="{LABEL_WIDTH + 4}" y="{top + 14}" fill="#888" font-style="italic">'
            f"not started ({escape(step.status)})</text>"
        )
    else:
        began, ended = span
        left, right = x(began), x(ended)
        paint = f'fill="{STATUS_COLOURS.get(step.status, "#9e9e9e")}"'
        if step.status == StepStatus.WAITING:
            paint = 'fill="url(#wait-hatch)" stroke="#ef6c00"'
        elif superseded:
            paint += ' fill-opacity="0.45"'
        seconds = (ended - began).total_seconds()
        tooltip = f"{step.step_id}: {step.status}, {human_duration(seconds)}, attempt {step.attempts or 1}"
        parts.append(
            f'<rect x="{left:.1f}" y="{bar_y}" width="{max(right - left, 2):.1f}" height="{BAR_HEIGHT}" rx="2" {paint}>'
            f"<title>{escape(tooltip)}</title></rect>"
        )
        # The duration goes right of the bar, past any wait drawn beyond it.
        label_x = max([right, left + 2, *(x(w_end) for _, w_end, _ in waits)]) + 4
        if label_x < WIDTH - 40:
            parts.append(f'<text x="{label_x:.1f}" y="{top + 14}" fill="#555">{escape(human_duration(seconds))}</text>')
    for retry in retries:
        rx = x(retry.at)
        note = f"retry after attempt {retry.attempt}: {retry.error}"
        parts.append(
            f"<g><title>{escape(note)}</title>"
            f'<line x1="{rx:.1f}" y1="{top + 2}" x2="{rx:.1f}" y2="{top + ROW_HEIGHT - 2}" stroke="{RETRY_COLOUR}" '
            f'stroke-width="2"/><circle cx="{rx:.1f}" cy="{top + 3}" r="3" fill="{RETRY_COLOUR}"/></g>'
        )
    return parts


def human_duration(seconds: float) -> str:
    """A short human duration: 0, 250ms, 1.5s, 2m30s, 3h, 2d4h."""
    if seconds <= 0:
        return "0"
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

"""The run page's step timeline: a server-rendered SVG, one row per step, a bar per attempt, waits, stuck
stretches, effects and retries marked. It scales with the page (width 100% over a viewBox).

Plain SVG, no JavaScript: it renders in any browser, prints, and survives a screenshot pasted into an
incident channel. Every text that comes from data is escaped; every bar has a <title> tooltip.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime

from django.utils.html import escape
from django.utils.safestring import SafeString, mark_safe

from durable_agents.display import coarse_duration, human_duration, when_text
from durable_agents.models import Step, StepStatus

# The drawing's own units: the SVG scales to the page's width (width 100%, this viewBox), so at 1280 px a
# unit is about a pixel and at 1920 px text grows with the drawing instead of being clipped.
WIDTH = 1200
LABEL_WIDTH = 210
RIGHT_PAD = 28
PLOT_WIDTH = WIDTH - LABEL_WIDTH - RIGHT_PAD
LEGEND_HEIGHT = 30
AXIS_Y = LEGEND_HEIGHT + 26
ROW_HEIGHT = 22
BAR_HEIGHT = 12
LABEL_CHARS = 28
FOOTER = 30

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
STUCK_COLOUR = "#b71c1c"
EFFECT_COLOUR = "#6a1b9a"
# How each kind of attempt is painted: a killed or lapsed attempt is outlined, its end is only a bound.
ATTEMPT_PAINT = {
    "done": f'fill="{STATUS_COLOURS[StepStatus.DONE]}"',
    "running": f'fill="{STATUS_COLOURS[StepStatus.RUNNING]}"',
    "failed": f'fill="{STATUS_COLOURS[StepStatus.FAILED]}"',
    "killed": f'fill="#fff" stroke="{STATUS_COLOURS[StepStatus.FAILED]}" stroke-width="1.5" stroke-dasharray="3 2"',
    "lease expired": f'fill="#fff" stroke="{STATUS_COLOURS[StepStatus.RUNNING]}" stroke-width="1.5" '
    'stroke-dasharray="3 2"',
}
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
    row: int | None = None  # the pk of the step row it belongs to; None: the live row of step_id


@dataclass(frozen=True)
class Retry:
    """A retry of a step: when it was scheduled, which attempt failed, and why."""

    step_id: str
    at: datetime
    attempt: int
    error: str
    row: int | None = None  # the pk of the step row it belongs to; None: the live row of step_id


@dataclass(frozen=True)
class Attempt:
    """One claim of a step by a worker, other than the one its row records (`Step.started_at`…`finished_at`).

    outcome: "failed" (retried or not), "killed" (its worker died: taken over, `ended` is when its lease ran
    out), "running" (the current claim, `ended` now), "lease expired" (the current claim, its worker silent:
    `ended` is when its lease ran out).
    """

    step_id: str
    number: int
    began: datetime
    ended: datetime
    outcome: str
    worker: str = ""
    note: str = ""
    row: int | None = None  # the pk of the step row it belongs to; None: the live row of step_id
    did: str = ""  # what it changed in the world, e.g. "after applying issue_refund"

    @property
    def summary(self) -> str:
        """`attempt 1 killed after applying issue_refund`: what the attempt came to, and what it did."""
        return " ".join(filter(None, [f"attempt {self.number} {self.outcome}", self.did]))


@dataclass(frozen=True)
class Stuck:
    """A stretch when the run was runnable but nobody held a live lease: from a lease's expiry to its takeover
    (or now)."""

    step_id: str
    began: datetime
    ended: datetime
    label: str
    row: int | None = None  # the pk of the step row it belongs to; None: the live row of step_id


@dataclass(frozen=True)
class EffectMark:
    """An effect of a step, at the moment it was applied (or invoked, if it has no outcome yet)."""

    step_id: str
    at: datetime
    label: str
    row: int | None = None  # the pk of the step row it belongs to; None: the live row of step_id


@dataclass(frozen=True)
class History:
    """What is drawn on the steps' rows besides the steps themselves."""

    retries: Iterable[Retry] = ()
    waits: Iterable[WaitSpan] = ()
    attempts: Iterable[Attempt] = ()
    stuck: Iterable[Stuck] = ()
    effects: Iterable[EffectMark] = ()


@dataclass
class _Row:
    retries: list[Retry] = field(default_factory=list)
    waits: list[tuple[datetime, datetime, str]] = field(default_factory=list)
    attempts: list[Attempt] = field(default_factory=list)
    stuck: list[Stuck] = field(default_factory=list)
    effects: list[EffectMark] = field(default_factory=list)
    open_wait: bool = False


def render_timeline(
    steps: Sequence[Step],
    history: History,
    *,
    now: datetime,
    origin: datetime,
    active: bool,
) -> SafeString:
    """One row per step: the step's recorded span (started_at to finished_at) coloured by status, every other
    attempt of it (failed, killed, the current one), its waits hatched, the stretches it was stuck, its
    effects as diamonds, and its retries as red ticks.

    `origin` is where the axis starts when nothing has happened yet (the run's creation).
    """
    # A re-plan keeps the superseded rows under the same step id: a mark names its row, or goes to the live one.
    live = {step.step_id: step.pk for step in steps if step.status != StepStatus.SUPERSEDED}

    def key(mark: WaitSpan | Retry | Attempt | Stuck | EffectMark) -> int | None:
        return mark.row if mark.row is not None else live.get(mark.step_id)

    rows: dict[int | None, _Row] = defaultdict(_Row)
    for retry in history.retries:
        rows[key(retry)].retries.append(retry)
    for wait in history.waits:
        rows[key(wait)].waits.append((wait.began, wait.ended or now, wait.label))
        rows[key(wait)].open_wait |= wait.ended is None
    for attempt in history.attempts:
        rows[key(attempt)].attempts.append(attempt)
    for stretch in history.stuck:
        rows[key(stretch)].stuck.append(stretch)
    for effect in history.effects:
        rows[key(effect)].effects.append(effect)
    shown = {step.pk for step in steps}
    rows = defaultdict(_Row, {pk: row for pk, row in rows.items() if pk in shown})  # the window's steps only
    spans = [_span(step, now, rows.get(step.pk)) for step in steps]
    moments = [t for span in spans if span for t in span]
    for row in rows.values():
        moments += [r.at for r in row.retries] + [e.at for e in row.effects]
        moments += [t for began, ended, _ in row.waits for t in (began, ended)]
        moments += [t for a in row.attempts for t in (a.began, a.ended)]
        moments += [t for s in row.stuck for t in (s.began, s.ended)]
    start = min(moments, default=origin)
    end = max([*moments, now] if active else moments, default=start)
    total = max((end - start).total_seconds(), 0.001)

    def x(moment: datetime) -> float:
        return LABEL_WIDTH + (moment - start).total_seconds() / total * PLOT_WIDTH

    rows_top = AXIS_Y + 8
    height = rows_top + max(len(steps), 1) * ROW_HEIGHT + FOOTER
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="durable-timeline" width="100%" '
        f'viewBox="0 0 {WIDTH} {height}" preserveAspectRatio="xMinYMin meet" role="img" '
        'aria-labelledby="timeline-title" '
        'font-family="system-ui, -apple-system, Segoe UI, Roboto, sans-serif" font-size="12">',
        '<title id="timeline-title">Step timeline</title>',
        "<defs>"
        '<pattern id="wait-hatch" width="6" height="6" patternUnits="userSpaceOnUse" patternTransform="rotate(45)">'
        f'<rect width="6" height="6" fill="{STATUS_COLOURS[StepStatus.WAITING]}" fill-opacity="0.35"/>'
        f'<line x1="0" y1="0" x2="0" y2="6" stroke="{STATUS_COLOURS[StepStatus.WAITING]}" stroke-width="3"/>'
        "</pattern>"
        '<pattern id="stuck-hatch" width="6" height="6" patternUnits="userSpaceOnUse" patternTransform="rotate(-45)">'
        f'<rect width="6" height="6" fill="{STUCK_COLOUR}" fill-opacity="0.12"/>'
        f'<line x1="0" y1="0" x2="0" y2="6" stroke="{STUCK_COLOUR}" stroke-width="1.5"/>'
        "</pattern></defs>",
        f'<rect x="0" y="0" width="{WIDTH}" height="{height}" fill="#fff"/>',
    ]
    parts += _legend()
    parts += _axis(start, total, rows_top, height - FOOTER)
    for index, (step, span) in enumerate(zip(steps, spans, strict=True)):
        top = rows_top + index * ROW_HEIGHT
        marks = rows.get(step.pk, _Row())
        parts += _row(step, span, marks, top=top, index=index, x=x)
    if not steps:
        parts.append(f'<text x="{LABEL_WIDTH}" y="{rows_top + 14}" fill="#666">this run has no steps</text>')
    if active:
        now_x = x(now)
        parts.append(
            f'<line x1="{now_x:.1f}" y1="{AXIS_Y}" x2="{now_x:.1f}" y2="{height - FOOTER}" stroke="#1565c0" '
            'stroke-dasharray="4 3"><title>now</title></line>'
            f'<text x="{now_x:.1f}" y="{height - 18}" text-anchor="middle" fill="#1565c0">now</text>'
        )
    parts.append(
        f'<text x="4" y="{height - 6}" fill="#555">t = 0 at {escape(when_text(start, precise=True))}'
        f" · span {escape(human_duration(total))}</text>"
    )
    parts.append("</svg>")
    return mark_safe("".join(parts))  # noqa: S308 - every data-derived text above went through escape()


def _span(step: Step, now: datetime, row: _Row | None) -> tuple[datetime, datetime] | None:
    """The step's own bar: its recorded attempt. A pending or skipped step's started_at is an attempt already
    drawn from the history (a retry records it), and a failure recorded as an event is drawn from that."""
    if step.status in (StepStatus.PENDING, StepStatus.SKIPPED):
        return None
    if step.status == StepStatus.FAILED and row and any(a.outcome == "failed" for a in row.attempts):
        return None
    began = step.started_at
    if step.status == StepStatus.WAITING:
        began = began or step.updated_at  # a wait that opened without executing: it has waited since it changed
    if began is None:
        return None
    ended = step.finished_at or (now if step.status in (StepStatus.RUNNING, StepStatus.WAITING) else began)
    if step.status == StepStatus.WAITING and not step.finished_at and row and row.waits and not row.open_wait:
        # Its waits closed (cancelled with the run, decided, expired): the step stopped waiting when the last
        # one did. The engine keeps a cancelled run's step row waiting, so a resume asks again.
        ended = max(closed for _, closed, _ in row.waits)
    return began, max(ended, began)


def _legend() -> list[str]:
    entries = [
        ("done", f'fill="{STATUS_COLOURS[StepStatus.DONE]}"'),
        ("running", f'fill="{STATUS_COLOURS[StepStatus.RUNNING]}"'),
        ("failed", f'fill="{STATUS_COLOURS[StepStatus.FAILED]}"'),
        ("killed", ATTEMPT_PAINT["killed"]),
        ("wait", 'fill="url(#wait-hatch)" stroke="#ef6c00"'),
        ("stuck", f'fill="url(#stuck-hatch)" stroke="{STUCK_COLOUR}"'),
        ("superseded", f'fill="{STATUS_COLOURS[StepStatus.SUPERSEDED]}" fill-opacity="0.45"'),
    ]
    parts, left = [], 4
    for label, paint in entries:
        parts.append(f'<rect x="{left}" y="9" width="14" height="10" rx="2" {paint}/>')
        parts.append(f'<text x="{left + 19}" y="18" fill="#333">{label}</text>')
        left += 30 + 7 * len(label)
    parts.append(f'<path d="M{left + 6} 8 l5 5 l-5 5 l-5 -5 z" fill="{EFFECT_COLOUR}"/>')
    parts.append(f'<text x="{left + 15}" y="18" fill="#333">effect</text>')
    left += 60
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
    marks: _Row,
    *,
    top: int,
    index: int,
    x: Callable[[datetime], float],
) -> list[str]:
    """Background, label, waits and stuck stretches (under the bars), the step's bar and its other attempts,
    the duration, then effects and retry ticks on top."""
    superseded = step.status == StepStatus.SUPERSEDED
    drawn = span is not None or marks.attempts
    label = step.step_id if len(step.step_id) <= LABEL_CHARS else step.step_id[: LABEL_CHARS - 1] + "…"
    parts = []
    if index % 2:
        parts.append(f'<rect x="0" y="{top}" width="{WIDTH}" height="{ROW_HEIGHT}" fill="#f6f7f9"/>')
    decoration = ' text-decoration="line-through"' if superseded else ""
    parts.append(
        f'<text x="4" y="{top + 15}" fill="{"#888" if superseded or not drawn else "#222"}"{decoration}>'
        f"<title>{escape(step.step_id)} ({escape(step.kind)})</title>{escape(label)}</text>"
    )
    for began, ended, note in marks.waits:
        parts.append(
            _rect("wait", x(began), x(ended), top + 3, ROW_HEIGHT - 6, 'fill="url(#wait-hatch)" stroke="#ef6c00"', note)
        )
    rights = [x(ended) for _, ended, _ in marks.waits]
    for stretch in marks.stuck:
        parts += _stuck(stretch, x, top)
        rights.append(x(stretch.ended))
    bar_y = top + (ROW_HEIGHT - BAR_HEIGHT) / 2
    if span is not None:
        began, ended = span
        paint = f'fill="{STATUS_COLOURS.get(step.status, "#9e9e9e")}"'
        if step.status == StepStatus.WAITING:
            paint = 'fill="url(#wait-hatch)" stroke="#ef6c00"'
        elif superseded:
            paint += ' fill-opacity="0.45"'
        seconds = (ended - began).total_seconds()
        tooltip = f"{step.step_id}: {step.status}, {human_duration(seconds)}, attempt {step.attempts or 1}"
        parts.append(_rect(f"attempt attempt-{step.status}", x(began), x(ended), bar_y, BAR_HEIGHT, paint, tooltip))
        rights.append(x(ended))
    for attempt in marks.attempts:
        parts.append(_attempt(attempt, x, bar_y))
        rights.append(x(attempt.ended))
    if not drawn:
        parts.append(
            f'<text x="{LABEL_WIDTH + 4}" y="{top + 15}" fill="#888" font-style="italic">'
            f"not started ({escape(step.status)})</text>"
        )
    elif span is None:
        # Only other attempts are drawn (a re-plan superseded the row, or its attempts all failed or died):
        # the row says what the last of them came to, so it never reads as a step that did nothing.
        label_x = max(rights) + 4
        text = marks.attempts[-1].summary + ("; superseded" if superseded else "")
        parts.append(
            f'<text class="attempt-summary" x="{min(label_x, WIDTH - 300):.1f}" y="{top + 15}" fill="#555">'
            f"{escape(text)}</text>"
        )
    else:
        # The duration goes right of everything drawn on the row.
        label_x = max(rights) + 4
        seconds = (span[1] - span[0]).total_seconds()
        if label_x < WIDTH - 40:
            parts.append(f'<text x="{label_x:.1f}" y="{top + 15}" fill="#555">{escape(human_duration(seconds))}</text>')
    for effect in marks.effects:
        ex = x(effect.at)
        parts.append(
            f'<path class="effect" d="M{ex:.1f} {top + 4} l6 7 l-6 7 l-6 -7 z" fill="{EFFECT_COLOUR}" '
            f'stroke="#fff" stroke-width="1"><title>{escape(effect.label)}</title></path>'
        )
    for retry in marks.retries:
        rx = x(retry.at)
        note = f"retry after attempt {retry.attempt}: {retry.error}"
        parts.append(
            f"<g><title>{escape(note)}</title>"
            f'<line x1="{rx:.1f}" y1="{top + 2}" x2="{rx:.1f}" y2="{top + ROW_HEIGHT - 2}" stroke="{RETRY_COLOUR}" '
            f'stroke-width="2"/><circle cx="{rx:.1f}" cy="{top + 3}" r="3" fill="{RETRY_COLOUR}"/></g>'
        )
    return parts


def _rect(css: str, left: float, right: float, y: float, height: float, paint: str, tooltip: str) -> str:
    return (
        f'<rect class="{css}" x="{left:.1f}" y="{y}" width="{max(right - left, 2):.1f}" height="{height}" rx="2" '
        f"{paint}><title>{escape(tooltip)}</title></rect>"
    )


def _attempt(attempt: Attempt, x: Callable[[datetime], float], y: float) -> str:
    seconds = human_duration((attempt.ended - attempt.began).total_seconds())
    parts = [f"{attempt.step_id}: {attempt.summary}", seconds]
    if attempt.worker:
        parts.append(f"worker {attempt.worker}")
    if attempt.note:
        parts.append(attempt.note)
    paint = ATTEMPT_PAINT.get(attempt.outcome, ATTEMPT_PAINT["failed"])
    css = f"attempt attempt-{attempt.outcome.replace(' ', '-')}"
    return _rect(css, x(attempt.began), x(attempt.ended), y, BAR_HEIGHT, paint, ", ".join(parts))


def _stuck(stretch: Stuck, x: Callable[[datetime], float], top: int) -> list[str]:
    left, right = x(stretch.began), x(stretch.ended)
    paint = f'fill="url(#stuck-hatch)" stroke="{STUCK_COLOUR}" stroke-dasharray="2 2"'
    parts = [_rect("stuck", left, right, top + 2, ROW_HEIGHT - 4, paint, stretch.label)]
    # The stretch says what it is on the drawing itself, not only in its tooltip: inside it when it fits.
    text = f"stuck {coarse_duration((stretch.ended - stretch.began).total_seconds())}"
    if right - left > 60:
        parts.append(
            f'<text class="stuck-label" x="{(left + right) / 2:.1f}" y="{top + 15}" text-anchor="middle" '
            f'fill="{STUCK_COLOUR}" font-weight="bold">{text}</text>'
        )
    else:
        parts.append(
            f'<text class="stuck-label" x="{right + 3:.1f}" y="{top + 15}" fill="{STUCK_COLOUR}" '
            f'font-weight="bold">{text}</text>'
        )
    return parts

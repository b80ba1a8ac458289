"""Scheduled runs: define, pause and resume schedules, and start their due slots (called by the sweep).

A slot is started exactly once. The sweep locks a due schedule (SKIP LOCKED: a second sweep passes it by),
starts the run of each slot it owes and advances `next_slot`, in ONE transaction: a sweep killed in between
leaves neither the run nor the advance, and the next pass starts the same slot again. The run's idempotency
key, "schedule:<name>:<slot in UTC>", makes any other repeat (two sweeps on SQLite, a schedule redefined)
return the slot's first run instead of a second one.

Slots are computed in the schedule's time zone on the database's clock (`clock.now()`), never a worker's.
Daylight saving follows Vixie cron: when the clocks go back, a fixed time (`30 2 * * *`, `@daily`) fires in
the first pass of the repeated hour only, and a minute or hour field starting with `*` (`*/30 * * * *`,
`* 2 * * *`) follows real time, firing in both; when they go forward, a time in the missing hour fires at the
first minute after it.
Missed slots (beat down, a deploy): SKIP starts only the latest, CATCH_UP each, oldest first, at most
`catch_up_limit` (the most recent ones). Paused slots are never owed: resuming starts from the next slot.
Overlap: under SKIP (the default, as Temporal's) slots due while any run the schedule started (`Run.schedule`) is
still live (pending, running, waiting) are not started, nor owed later: the sweep advances `next_slot` past them
and adds them to `overlap_skipped`, in the same locked transaction, and writes nothing on the live run. Under
CATCH_UP that is every owed slot (they would all overlap it); with no run live, CATCH_UP starts the oldest owed
slot and passes over the rest (each would overlap its run). A run pruned away has finished. ALLOW starts them
anyway.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import CroniterError, croniter
from django.db import (
    DataError,
    IntegrityError,
    InterfaceError,
    InternalError,
    NotSupportedError,
    OperationalError,
    ProgrammingError,
    connection,
    transaction,
)
from django.db.models import F

from durable_agents import clock
from durable_agents.conf import settings
from durable_agents.engine.events import record_event
from durable_agents.engine.payloads import check_input
from durable_agents.engine.records import locked
from durable_agents.engine.starts import start_run
from durable_agents.errors import DurableAgentsError, InvalidInputError, ScheduleDeclaredError, ScheduleNotFoundError
from durable_agents.models import Declared, MissedSlots, Overlap, Run, Schedule
from durable_agents.states import ACTIVE_RUN_STATUSES
from durable_agents.storable import storable_text, whole_number
from durable_agents.workflows import registry

logger = logging.getLogger("durable_agents.engine")

CRON_ALIASES = frozenset({"@yearly", "@annually", "@monthly", "@weekly", "@daily", "@midnight", "@hourly"})
CRON_HINT = 'five fields "minute hour day-of-month month day-of-week" (e.g. "0 3 * * *", 03:00 daily) or @daily'
CATCH_UP_MOST = 1000
# A hair past `now`, so a slot falling exactly on `now` counts as due (croniter's get_prev is strict).
_JUST_AFTER = timedelta(microseconds=1)


@dataclass(frozen=True)
class Slots:
    """The slots one sweep starts for a schedule, and the first slot it leaves for later."""

    due: list[datetime]
    skipped: int  # missed slots not started (0 when nothing was missed, or under CATCH_UP within its limit)
    next_slot: datetime


# A trigger's token (a uuid4 hex, 32): "schedule:<name up to 200>:now:<token>" fits Run.idempotency_key (255).
TRIGGER_TOKEN_MAX_CHARS = 40


def slot_key(name: str, slot: datetime) -> str:
    """The idempotency key of a slot's run: one run per (schedule, slot), whoever starts it."""
    return f"schedule:{name}:{slot.astimezone(UTC).strftime('%Y-%m-%dT%H:%M:%SZ')}"


def zone(name: str) -> ZoneInfo:
    """The IANA time zone `name`, else InvalidInputError."""
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise InvalidInputError(
            f"unknown time zone {name!r}; use an IANA name such as 'UTC' or 'Europe/Paris'"
        ) from None


def check_cron(cron: str) -> str:
    """`cron` if it is a standard five-field expression (or an @alias) that ever fires, else InvalidInputError."""
    expression = " ".join(cron.split())
    if expression.startswith("@"):
        valid = expression in CRON_ALIASES
    else:
        valid = len(expression.split(" ")) == 5 and croniter.is_valid(expression)
    if not valid:
        raise InvalidInputError(f"invalid cron expression {cron!r}: use {CRON_HINT}")
    try:
        croniter(expression, datetime(2000, 1, 1, tzinfo=UTC)).get_next(datetime)
    except CroniterError:
        raise InvalidInputError(f"cron expression {cron!r} never fires (e.g. February 31st); use {CRON_HINT}") from None
    return expression


def each_slot(cron: str, tz: str, moment: datetime, *, backward: bool = False) -> Iterator[datetime]:
    """The slots strictly after `moment` (or, `backward`, before it, latest first), in UTC.

    A fixed time's second pass through an hour the clocks repeat is not a slot (see the module's docstring).
    """
    local = zone(tz)
    walk = croniter(cron, moment.astimezone(local))
    step = walk.get_prev if backward else walk.get_next
    once = not _follows_real_time(cron)
    while True:
        slot = step(datetime)
        if once and _second_pass(slot, local):
            continue
        yield _utc(slot)


def slot_after(cron: str, tz: str, moment: datetime) -> datetime:
    """The first slot strictly after `moment`, in UTC."""
    return next(each_slot(cron, tz, moment))


def owed_slots(schedule: Schedule, now: datetime) -> Slots:
    """The slots due at `now` (from `next_slot` on) that the schedule's missed-slot policy starts."""
    limit = 1 if schedule.missed == MissedSlots.SKIP else max(1, schedule.catch_up_limit)
    # Walk back from the latest due slot: a month of missed minutes costs `limit` steps, not 43,200.
    back = each_slot(schedule.cron, schedule.timezone, now + _JUST_AFTER, backward=True)
    due: list[datetime] = []
    while len(due) < limit:
        slot = next(back)
        if slot < schedule.next_slot:
            break
        due.append(slot)
    skipped = 0
    if due and len(due) == limit:
        # Count what the limit left out, bounded: the sweep must not walk a year of minutes to say so.
        while skipped < CATCH_UP_MOST and next(back) >= schedule.next_slot:
            skipped += 1
    return Slots(due=due[::-1], skipped=skipped, next_slot=slot_after(schedule.cron, schedule.timezone, now))


def start_due_schedules(now: datetime) -> int:
    """Start every due slot of every unpaused schedule (at most SWEEP_BATCH schedules a pass); how many runs."""
    names = Schedule.objects.filter(paused=False, next_slot__lte=now).order_by("next_slot")
    batch = list(names.values_list("name", flat=True)[: int(settings.SWEEP_BATCH)])
    return sum(_start_due(name, now) for name in batch)


def _start_due(name: str, now: datetime) -> int:
    with transaction.atomic():
        schedule = locked(Schedule.objects.filter(name=name, paused=False, next_slot__lte=now)).first()
        if schedule is None:
            return 0  # another sweep holds it, or it was paused or advanced meanwhile
        slots = owed_slots(schedule, now)
        due, passed_over = slots.due, 0
        if due and schedule.overlap == Overlap.SKIP:
            if _a_run_is_live_txn(schedule):
                # Passed over, not postponed: a slot owed until the run ends would start late, then overlap the next.
                Schedule.objects.filter(pk=schedule.pk).update(
                    next_slot=slots.next_slot,
                    # The missed slots beyond `due` (beat was down) were due while it was live too: counted, not lost.
                    overlap_skipped=F("overlap_skipped") + len(due) + slots.skipped,
                    last_error="",
                    updated_at=clock.DbNow(),
                )
                return 0
            # Catching up, each owed slot after the oldest would overlap the oldest's run, started a moment before.
            due, passed_over = due[:1], len(due) - 1
        try:
            with transaction.atomic():
                runs = [_start_slot_txn(schedule, slot, slots.skipped) for slot in due]
        except (OperationalError, InterfaceError, IntegrityError, InternalError, ProgrammingError, NotSupportedError):
            raise  # the database's trouble is the sweep's, not this schedule's
        except DataError as exc:
            # Data Postgres refuses (a NaN in the slot's step arguments): this schedule's, kept owed below.
            return _slot_failed(schedule, name, exc, expected=False)
        except Exception as exc:  # noqa: BLE001 - one schedule's failure must not starve the schedules after it
            return _slot_failed(schedule, name, exc, expected=isinstance(exc, DurableAgentsError))
        advance: dict[str, Any] = {"next_slot": slots.next_slot, "last_error": "", "updated_at": clock.DbNow()}
        if runs:
            advance.update(last_slot=due[-1], last_run=runs[-1])
        if passed_over:
            advance.update(overlap_skipped=F("overlap_skipped") + passed_over)
        Schedule.objects.filter(pk=schedule.pk).update(**advance)
    return len(runs)


def _slot_failed(schedule: Schedule, name: str, exc: Exception, *, expected: bool) -> int:
    """The workflow was removed, its input no longer fits, its plan raised, Postgres refused its data: the slot stays
    owed and the schedule says why (logged once, not at every sweep; the admin and `durable_schedules` show it until
    it is mended). No run started."""
    error = storable_text(str(exc) if expected else f"{type(exc).__name__}: {exc}")
    if error != schedule.last_error:
        logger.warning("schedule %s could not start its slot: %s", name, error, exc_info=not expected)
        Schedule.objects.filter(pk=schedule.pk).update(last_error=error, updated_at=clock.DbNow())
    return 0


def _a_run_is_live_txn(schedule: Schedule) -> bool:
    """True if any run this schedule started is pending, running or waiting (pruned runs have finished)."""
    # Under the schedule's lock, so two sweeps cannot both see it live-or-not and act twice; a run finishing
    # right after this read only means its overlapping slot was passed over, as it would have been a moment earlier.
    # Every run, not only the last: runs started under overlap="allow" may still be live after a later one ended.
    assert connection.in_atomic_block, "the schedule's runs are checked in the transaction that advances it"
    return Run.objects.filter(schedule=schedule.name, status__in=ACTIVE_RUN_STATUSES).exists()


def _start_slot_txn(schedule: Schedule, slot: datetime, skipped: int) -> Run:
    # Outside the schedule's transaction a killed sweep could start a slot and never advance past it.
    assert connection.in_atomic_block, "a slot is started in the transaction that advances its schedule"
    key = slot_key(schedule.name, slot)
    existing = Run.objects.filter(idempotency_key=key).first()
    if existing is not None:
        return existing  # started already (the schedule was redefined onto a slot it had started)
    run = start_run(schedule.workflow, schedule.input, idempotency_key=key, schedule=schedule.name)
    detail: dict[str, Any] = {"schedule": schedule.name, "slot": slot.isoformat()}
    if skipped:
        detail["skipped_slots"] = skipped
    record_event(run.id, "scheduled", **detail)
    return run


def schedule_fields(
    workflow: str,
    *,
    cron: str,
    run_input: Any = None,
    tz: str = "UTC",
    missed: str = MissedSlots.SKIP,
    catch_up_limit: int = 10,
    overlap: str = Overlap.SKIP,
) -> dict[str, Any]:
    """A schedule's definition checked and normalised, as its row stores it; InvalidInputError (or
    UnknownWorkflowError) says what is wrong. Shared by `api.schedule` and the declared schedules."""
    registry.get(workflow)
    run_input = {} if run_input is None else run_input
    check_input(run_input)
    # As the row will hold it (a tuple a list, an int key a string), so the same definition compares equal to its row.
    run_input = json.loads(json.dumps(run_input))
    cron = check_cron(cron)
    zone(tz)
    if missed not in MissedSlots.values:
        raise InvalidInputError(f"missed must be one of {', '.join(MissedSlots.values)}, got {missed!r}")
    if overlap not in Overlap.values:
        raise InvalidInputError(f"overlap must be one of {', '.join(Overlap.values)}, got {overlap!r}")
    catch_up_limit = whole_number(catch_up_limit, "catch_up_limit", low=1, high=CATCH_UP_MOST)
    return {
        "workflow": workflow,
        "cron": cron,
        "timezone": tz,
        "input": run_input,
        "missed": missed,
        "catch_up_limit": catch_up_limit,
        "overlap": overlap,
    }


def define_schedule(
    name: str,
    workflow: str,
    *,
    cron: str,
    run_input: Any = None,
    tz: str = "UTC",
    missed: str = MissedSlots.SKIP,
    catch_up_limit: int = 10,
    overlap: str = Overlap.SKIP,
) -> Schedule:
    """Create or update the schedule `name` (safe to call at every start-up: the same definition changes nothing).

    A new cron or time zone starts from the next slot after now; a paused schedule stays paused; a new missed or
    overlap policy applies from the next sweep, without retiming. A schedule declared in code is refused
    (ScheduleDeclaredError): the sweep would put its declaration back.
    """
    if not name.strip():
        raise InvalidInputError("the schedule name is empty; name it, e.g. 'nightly-report'")
    fields = schedule_fields(
        workflow,
        cron=cron,
        run_input=run_input,
        tz=tz,
        missed=missed,
        catch_up_limit=catch_up_limit,
        overlap=overlap,
    )
    cron = fields["cron"]
    with transaction.atomic():
        schedule = Schedule.objects.select_for_update().filter(name=name).first()
        if schedule is None:
            try:
                with transaction.atomic():
                    return Schedule.objects.create(name=name, next_slot=slot_after(cron, tz, clock.now()), **fields)
            except IntegrityError:
                schedule = Schedule.objects.select_for_update().get(name=name)  # a racing definition won
        if schedule.declared:
            raise ScheduleDeclaredError(
                f"schedule {name!r} is declared in code ({declared_where(schedule)}); change its declaration there, "
                "or give this one another name"
            )
        retimed = schedule.cron != cron or schedule.timezone != tz
        if all(getattr(schedule, field) == value for field, value in fields.items()):
            return schedule
        for field, value in fields.items():
            setattr(schedule, field, value)
        if retimed:
            schedule.next_slot = slot_after(cron, tz, clock.now())
        schedule.updated_at = clock.now()
        schedule.save()
    return schedule


def declared_where(schedule: Schedule) -> str:
    """Where code declares the schedule, in words, for messages: the setting, or the workflow."""
    if schedule.declared == Declared.SETTING:
        return f'DURABLE_AGENTS["SCHEDULES"][{schedule.name!r}]'
    return f"workflow {schedule.workflow!r}, schedule=cron(...)"


def pause_schedule(name: str, *, actor: str = "") -> Schedule:
    """Stop starting slots; a sweep starting one right now finishes first (the row lock), then none follow.

    `actor` (who paused it) is kept on the schedule with the time, and logged; pausing a paused schedule changes
    nothing, not even who paused it."""
    with transaction.atomic():
        schedule = _locked(name)
        if not schedule.paused:
            now = clock.now()
            schedule.paused, schedule.updated_at = True, now
            schedule.paused_changed_by, schedule.paused_changed_at = actor, now
            schedule.save(update_fields=["paused", "paused_changed_by", "paused_changed_at", "updated_at"])
            logger.info("schedule %r paused by %r", name, actor)
    return schedule


def resume_schedule(name: str, *, actor: str = "") -> Schedule:
    """Start slots again from the next one after now: the slots of the pause are not owed. `actor` (who resumed
    it) is kept on the schedule with the time, as for a pause."""
    with transaction.atomic():
        schedule = _locked(name)
        if schedule.paused:
            now = clock.now()
            schedule.paused, schedule.updated_at = False, now
            schedule.paused_changed_by, schedule.paused_changed_at = actor, now
            schedule.next_slot = slot_after(schedule.cron, schedule.timezone, now)
            schedule.save(update_fields=["paused", "paused_changed_by", "paused_changed_at", "next_slot", "updated_at"])
            logger.info("schedule %r resumed by %r", name, actor)
    return schedule


def trigger_schedule(name: str, *, actor: str, token: str) -> Run:
    """Start the schedule's workflow with its input now, beside its slots (which keep their times).

    `token` names this request: the same token starts one run however often it is posted. The run carries the
    schedule's name, so an overlap policy of "skip" passes over a slot due while it is live.
    """
    if not token or len(token) > TRIGGER_TOKEN_MAX_CHARS or not token.isalnum():
        raise InvalidInputError(f"a trigger token is 1 to {TRIGGER_TOKEN_MAX_CHARS} letters or digits, got {token!r}")
    schedule = Schedule.objects.filter(name=name).first()
    if schedule is None:
        raise ScheduleNotFoundError(f"no schedule is named {name!r}; `durable_schedules` lists them")
    key = f"schedule:{name}:now:{token}"
    with transaction.atomic():
        existing = Run.objects.filter(idempotency_key=key).first()
        if existing is not None:
            return existing
        run = start_run(schedule.workflow, schedule.input, idempotency_key=key, schedule=schedule.name)
        record_event(run.id, "scheduled", actor=actor, schedule=schedule.name, triggered=True)
    return run


def delete_schedule(name: str) -> None:
    """Remove the schedule; the runs it started stay. A schedule declared in code is refused (ScheduleDeclaredError):
    the next sweep would create it again."""
    declared = Schedule.objects.filter(name=name).exclude(declared="").first()
    if declared is not None:
        raise ScheduleDeclaredError(
            f"schedule {name!r} is declared in code ({declared_where(declared)}); the next sweep would create it "
            "again: remove its declaration and deploy (the sweep then deletes it), or pause it"
        )
    deleted, _ = Schedule.objects.filter(name=name, declared="").delete()
    if not deleted:
        raise ScheduleNotFoundError(f"no schedule is named {name!r}; `durable_schedules` lists them")


def _locked(name: str) -> Schedule:
    schedule = Schedule.objects.select_for_update().filter(name=name).first()
    if schedule is None:
        raise ScheduleNotFoundError(f"no schedule is named {name!r}; `durable_schedules` lists them")
    return schedule


def _follows_real_time(cron: str) -> bool:
    """Vixie cron's "wildcard job": a minute or hour field starting with `*` (`@hourly` is `0 * * * *`)."""
    if cron.startswith("@"):
        return cron == "@hourly"
    minute, hour = cron.split(" ")[:2]
    return minute.startswith("*") or hour.startswith("*")


def _second_pass(slot: datetime, local: ZoneInfo) -> bool:
    """True if `slot` is the later of two moments its wall-clock time names (the clocks went back over it)."""
    wall = slot.replace(tzinfo=None)
    first, second = wall.replace(tzinfo=local, fold=0), wall.replace(tzinfo=local, fold=1)
    # In a repeated hour fold 0 is the earlier moment; in a missing one (clocks forward) it is the later.
    return _utc(first) < _utc(second) and _utc(slot) == _utc(second)


def _utc(moment: datetime) -> datetime:
    return moment.astimezone(UTC).replace(fold=0)

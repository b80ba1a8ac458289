"""Declared schedules: the schedules code declares, read, checked and synced into Schedule rows at each sweep.

Two forms, as Celery beat's `beat_schedule` and DBOS's `@scheduled`::

    DURABLE_AGENTS = {"SCHEDULES": {"nightly-digest": {"workflow": "digest", "cron": "0 3 * * *",
                                                       "timezone": "Europe/Paris", "input": {"days": 1}}}}

    workflow("digest", steps=[...], schedule=cron("0 3 * * *", timezone="Europe/Paris", input={"days": 1}))

The options are `api.schedule`'s. A workflow's schedules are its newest registered version's; a `cron()` without
`name` is named after the workflow.

Each sweep pass syncs them (`sync_declared_schedules`): it creates the rows missing, updates those whose definition
changed, and deletes the declared rows no declaration names any more. It never writes a row `api.schedule` made
(`Schedule.declared` blank): a declared name already taken by one is refused, logged once per process, and reported
by `manage.py check --database default` (durable_agents.E019). A declaration the checks refuse (E017, E018) is
skipped and logged, and its row, if any, kept as it was (neither updated nor deleted); so are all the setting's
rows while DURABLE_AGENTS or its SCHEDULES is no dict (E001, E003).

The database referees two sweeps syncing at once (two beats during a rolling deploy): the name is unique, so of
two inserts one creates the row and the other finds it; an update locks the row (SELECT ... FOR UPDATE) and
compares again under the lock, so the second writer changes nothing. In the steady state a pass costs one SELECT.

Never written by the sync: `paused` (an operator's pause survives every redeploy; resume it by hand), the slot
bookkeeping (`last_slot`, `last_run`, `overlap_skipped`, `last_error`). A new cron or time zone starts from the
first slot after now on the database's clock, like `api.schedule`: a slot owed under the old cron is not
started, and a slot already started is never started again (its run's idempotency key names the schedule and the
slot). Two releases declaring different things, side by side during a rolling deploy, each write their own
until the old one stops: the last writer wins, and a slot is still started once.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.conf import settings as django_settings
from django.db import IntegrityError, transaction
from django.db.models import Q

from durable_agents import clock
from durable_agents.engine.schedules import schedule_fields, slot_after
from durable_agents.errors import DurableAgentsError
from durable_agents.models import Declared, Schedule
from durable_agents.storable import check_text, text_problem
from durable_agents.workflows import Cron, registry

logger = logging.getLogger("durable_agents.engine")

SETTING = 'DURABLE_AGENTS["SCHEDULES"]'
# The keys of a SCHEDULES entry: api.schedule's keyword arguments, by the same names.
OPTIONS = ("workflow", "cron", "timezone", "input", "missed", "catch_up_limit", "overlap")
REQUIRED = ("workflow", "cron")
NAME_MAX_CHARS = 200  # Schedule.name; a slot's run key "schedule:<name>:<slot>" then fits in 255
# The definition a declaration writes; `paused` and the slot bookkeeping are the operator's and the sweep's.
SYNCED = ("workflow", "cron", "timezone", "input", "missed", "catch_up_limit", "overlap", "declared")
EXAMPLE = '{"workflow": "digest", "cron": "0 3 * * *", "timezone": "Europe/Paris"}'


@dataclass(frozen=True)
class Declaration:
    """One declared schedule, checked: its name, where it is declared and the row's definition."""

    name: str
    source: str  # Declared.SETTING or Declared.WORKFLOW
    where: str
    fields: Mapping[str, Any]


@dataclass(frozen=True)
class Problem:
    """A declaration the sync skips: what is wrong and how to mend it (the system checks show both)."""

    name: str
    where: str
    message: str
    hint: str
    twice: bool = False  # the name is declared more than once (E018), else the declaration is invalid (E017)


@dataclass(frozen=True)
class Declarations:
    valid: list[Declaration] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    # DURABLE_AGENTS or its SCHEDULES is no dict (E001, E003): what it declares is unknown, so the rows the setting
    # declared before are kept as they are, as an invalid declaration's row is, not deleted as undeclared.
    setting_unreadable: bool = False

    @property
    def names(self) -> set[str]:
        """Every name declared, valid or not: a row of one of them is never deleted by the sync."""
        return {d.name for d in self.valid} | {p.name for p in self.problems}


@dataclass(frozen=True)
class SyncReport:
    created: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)  # names a dynamic (api.schedule) schedule holds


def declarations() -> Declarations:
    """Every schedule declared in the settings and on the registered workflows, checked (no database access)."""
    found: list[tuple[str, str, str, dict[str, Any] | Problem]] = []
    whole = getattr(django_settings, "DURABLE_AGENTS", {})
    # Read past a DURABLE_AGENTS that is no dict (E001 says so) or a SCHEDULES that is none (E003).
    configured = whole.get("SCHEDULES", {}) if isinstance(whole, dict) else None
    if isinstance(configured, Mapping):
        for name, entry in configured.items():
            where = f"{SETTING}[{name!r}]"
            found.append((str(name), Declared.SETTING, where, _from_setting(name, where, entry)))
    for workflow_name in registry.names():
        for declared in registry.get(workflow_name).schedules:
            name = declared.name if declared.name is not None else workflow_name
            where = f"workflow {workflow_name!r}, schedule=cron({declared.expression!r})"
            found.append((str(name), Declared.WORKFLOW, where, _from_cron(name, where, workflow_name, declared)))
    by_name: dict[str, list[str]] = {}
    for name, _, where, _ in found:
        by_name.setdefault(name, []).append(where)
    result = Declarations(setting_unreadable=not isinstance(configured, Mapping))
    for name, source, where, checked in found:
        if len(by_name[name]) > 1:
            others = "; ".join(w for w in by_name[name] if w != where)
            result.problems.append(
                Problem(
                    name,
                    where,
                    f"schedule {name!r} is declared more than once: {where}; and {others}",
                    "Keep one declaration, or name the others apart (cron(..., name=...) or another SCHEDULES key); "
                    "until then the sweep applies neither.",
                    twice=True,
                )
            )
        elif isinstance(checked, Problem):
            result.problems.append(checked)
        else:
            result.valid.append(Declaration(name, source, where, {**checked, "declared": source}))
    return result


def _from_setting(name: object, where: str, entry: Any) -> dict[str, Any] | Problem:
    if not isinstance(name, str):
        return Problem(str(name), where, f"{where}: a schedule's name is a string", f'Write "{name}" in quotes.')
    if not isinstance(entry, Mapping):
        return Problem(name, where, f"{where} must be a dict of api.schedule's options", f"e.g. {EXAMPLE}")
    unknown = sorted(str(key) for key in entry if key not in OPTIONS)
    if unknown:
        return Problem(
            name,
            where,
            f"{where} has unknown option(s) {', '.join(unknown)}",
            f"Use only {', '.join(OPTIONS)} (api.schedule's options), e.g. {EXAMPLE}.",
        )
    missing = [key for key in REQUIRED if key not in entry]
    if missing:
        return Problem(name, where, f"{where} lacks {' and '.join(missing)}", f"e.g. {EXAMPLE}")
    options = {key: entry[key] for key in OPTIONS if key in entry}
    return _checked(
        name,
        where,
        options.pop("workflow"),
        cron=options.pop("cron"),
        run_input=options.pop("input", None),
        tz=options.pop("timezone", "UTC"),
        **options,
    )


def _from_cron(name: str, where: str, workflow_name: str, declared: Cron) -> dict[str, Any] | Problem:
    return _checked(
        name,
        where,
        workflow_name,
        cron=declared.expression,
        run_input=declared.input,
        tz=declared.timezone,
        missed=declared.missed,
        catch_up_limit=declared.catch_up_limit,
        overlap=declared.overlap,
    )


def _checked(name: str, where: str, workflow: Any, **options: Any) -> dict[str, Any] | Problem:
    if not name.strip() or len(name) > NAME_MAX_CHARS:
        return Problem(
            name, where, f"{where}: a schedule's name is 1 to {NAME_MAX_CHARS} characters", "Give it a shorter name."
        )
    unstorable = text_problem(name, "the schedule's name")
    if unstorable:
        return Problem(name, where, f"{where}: {unstorable}", "Name it in plain text.")
    for key, value in (("workflow", workflow), ("cron", options["cron"]), ("timezone", options["tz"])):
        if not isinstance(value, str):
            return Problem(name, where, f"{where}: {key} must be a string, got {value!r}", f"e.g. {EXAMPLE}")
    # Checked as api.schedule checks them: a value its column cannot hold would fail the INSERT, and every sweep pass.
    for key, value, most in (("cron", options["cron"], 200), ("timezone", options["tz"], 64)):  # Schedule's columns
        try:
            check_text(value, key, max_chars=most)
        except DurableAgentsError as exc:
            return Problem(name, where, f"{where}: {exc}", f"e.g. {EXAMPLE}")
    try:
        return schedule_fields(workflow, **options)
    except DurableAgentsError as exc:
        return Problem(name, where, f"{where}: {exc}", _hint(exc, workflow))
    except (TypeError, ValueError) as exc:  # a value of the wrong kind (e.g. missed=None): the same kind of mistake
        return Problem(name, where, f"{where}: {exc}", f"e.g. {EXAMPLE}")


def _hint(exc: Exception, workflow: str) -> str:
    text = str(exc)
    if "unknown workflow" in text or "has no version" in text:
        return (
            f"Define workflow {workflow!r} in an installed app's workflows module, or fix the name "
            f"(registered: {', '.join(registry.names()) or 'none'})."
        )
    if "cron" in text:
        return 'Write five fields "minute hour day-of-month month day-of-week", e.g. "0 3 * * *", or @daily.'
    if "time zone" in text:
        return 'Use an IANA time zone name, e.g. "UTC" or "Europe/Paris".'
    return "Give the option a value api.schedule accepts (see its docstring)."


# --- Sync ---------------------------------------------------------------------------------------------------------

_logged: set[tuple[str, str]] = set()


def sync_declared_schedules(now: datetime | None = None) -> SyncReport:
    """Bring the declared Schedule rows in step with the code: create, update, delete; never a dynamic row.

    Idempotent and safe beside a concurrent sync (see the module's docstring). `now` (the database's time) times
    a new or retimed schedule's first slot.
    """
    declared = declarations()
    for problem in declared.problems:
        _log_once(problem.name, f"declared schedule skipped: {problem.message}. {problem.hint}")
    names = {d.name for d in declared.valid}
    # One read in the steady state: the rows the declarations name, and every row declared before.
    rows = {
        row["name"]: row for row in Schedule.objects.filter(Q(name__in=names) | ~Q(declared="")).values("name", *SYNCED)
    }
    report = SyncReport()
    for declaration in declared.valid:
        row = rows.get(declaration.name)
        if row is not None and _same(row, declaration.fields):
            continue
        if row is not None and not row["declared"]:
            _refuse(declaration, report)
            continue
        outcome = _apply(declaration, now)
        if outcome == "refused":
            _refuse(declaration, report)
        elif outcome:
            getattr(report, outcome).append(declaration.name)
    if declared.setting_unreadable:
        _log_once(SETTING, f"{SETTING} is not a dict: the schedules it declared are kept as they are until it is one")
    gone = sorted(
        name
        for name, row in rows.items()
        if row["declared"]
        and name not in declared.names
        and not (declared.setting_unreadable and row["declared"] == Declared.SETTING)
    )
    if gone:
        # `declared` in the filter: a dynamic schedule made under a removed declaration's name meanwhile stays.
        removed = Schedule.objects.filter(name__in=gone).exclude(declared="")
        if declared.setting_unreadable:
            removed = removed.exclude(declared=Declared.SETTING)
        report.removed.extend(removed.values_list("name", flat=True))
        removed.delete()
        logger.info("declared schedules removed (no declaration names them any more): %s", ", ".join(gone))
    return report


def _same(row: Mapping[str, Any], fields: Mapping[str, Any]) -> bool:
    return all(row[key] == fields[key] for key in SYNCED)


def _apply(declaration: Declaration, now: datetime | None) -> str:
    """Create or update one declared row under its lock: "created", "updated", "refused", or "" (nothing to do)."""
    fields = declaration.fields
    with transaction.atomic():
        schedule = Schedule.objects.select_for_update().filter(name=declaration.name).first()
        moment = now if now is not None else clock.now()
        if schedule is None:
            try:
                with transaction.atomic():
                    Schedule.objects.create(
                        name=declaration.name,
                        next_slot=slot_after(fields["cron"], fields["timezone"], moment),
                        **fields,
                    )
                return "created"
            except IntegrityError:
                # Another sweep's insert won the unique name: compare against its row, under the lock.
                schedule = Schedule.objects.select_for_update().get(name=declaration.name)
        if not schedule.declared:
            return "refused"
        if all(getattr(schedule, key) == fields[key] for key in SYNCED):
            return ""
        retimed = schedule.cron != fields["cron"] or schedule.timezone != fields["timezone"]
        changes: dict[str, Any] = {key: fields[key] for key in SYNCED}
        if retimed:
            # From the first slot after now: the old cron's owed slot is not started under the new one.
            changes["next_slot"] = slot_after(fields["cron"], fields["timezone"], moment)
        Schedule.objects.filter(pk=schedule.pk).update(**changes, updated_at=clock.DbNow())
    return "updated"


def _refuse(declaration: Declaration, report: SyncReport) -> None:
    report.refused.append(declaration.name)
    _log_once(
        declaration.name,
        f"declared schedule {declaration.name!r} ({declaration.where}) is not applied: a schedule made with "
        "api.schedule holds that name. Rename the declaration, or delete the other one "
        f"(durable_schedules delete {declaration.name}) to let the next sweep create it.",
    )


def _log_once(name: str, message: str) -> None:
    # Every sweep pass meets the same problem: said once per process, and by the system checks at start-up.
    if (name, message) not in _logged:
        _logged.add((name, message))
        logger.warning("%s", message)


def colliding(names: Iterable[str]) -> list[str]:
    """The names among `names` that a dynamic (api.schedule) schedule holds (for the system check E019)."""
    return sorted(Schedule.objects.filter(name__in=list(names), declared="").values_list("name", flat=True))

"""Retention: how long finished runs are kept, by workflow and status, and the pass that prunes the older ones.

The policy is DURABLE_AGENTS["RETENTION"]: per workflow name (or "default", for every other workflow), per
finished status, an age as `durable_runs --older-than` writes one ("30d", "12h", "26w"), or None to keep
for ever. A workflow's entry overrides the default status by status. A workflow may also declare its own,
`workflow(..., retention={"completed": "30d"})`: the settings' entry for it wins over that, status by status,
and that over the settings' default. Nothing in the settings or the workflows (the default): nothing is
pruned. Pending, running and waiting runs are never pruned, whatever the policy says.

Example::

    DURABLE_AGENTS = {
        "RETENTION": {
            "default": {"completed": "30d", "failed": "180d", "cancelled": "30d"},
            "refund-agent": {"completed": "104w", "failed": None},   # failed refunds are kept
        },
        "RETENTION_ARCHIVE": "durable_archive",          # a STORAGES alias; None: no archive
    }

A run's age is measured from its last change (`updated_at`, and `finished_at`), on the database's clock: a run
an operator touched last week is a week old, whenever it finished. The pass (`prune`) runs from celery beat
(task `durable_agents.prune`) and from `manage.py durable_prune`; see engine/prune.py for what it never deletes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.db.models import Q

from durable_agents import clock
from durable_agents.conf import settings
from durable_agents.durations import MAX_DURATION, parse_duration
from durable_agents.engine import prune as engine_prune
from durable_agents.engine.archive import record_lines
from durable_agents.engine.prune import PruneReport
from durable_agents.engine.records import get_run
from durable_agents.errors import InvalidInputError
from durable_agents.operations import resolve_run_id
from durable_agents.states import FINISHED_RUN_STATUSES
from durable_agents.storable import check_text, shown, whole_number
from durable_agents.workflows import RETENTION_DEFAULT, registry

DEFAULT = RETENTION_DEFAULT
# The longest rest between batches (--pause, RETENTION_PAUSE_SECONDS): the pass holds the prune's lease as it rests.
MOST_PAUSE = 3600.0
FROM_SETTINGS: Any = object()
STATUSES: tuple[str, ...] = tuple(str(status) for status in FINISHED_RUN_STATUSES)


@dataclass(frozen=True)
class Policy:
    """Ages by workflow ("default" for the rest) and finished status; None keeps runs of that status for ever.

    `ages` comes from the settings, `declared` from the workflows' own `retention=`: for each status, the
    settings' entry for the workflow wins, then the workflow's own, then the settings' default.
    """

    ages: dict[str, dict[str, timedelta | None]]
    declared: dict[str, dict[str, timedelta | None]] = field(default_factory=dict)

    def age(self, workflow: str, status: str) -> timedelta | None:
        """How long a `status` run of `workflow` is kept (its own entry, else the default; None: for ever)."""
        for entry in (self.ages.get(workflow, {}), self.declared.get(workflow, {})):
            if status in entry:
                return entry[status]
        return self.ages.get(DEFAULT, {}).get(status)

    def named(self) -> list[str]:
        """The workflows with an age of their own (in the settings or declared), the default aside."""
        return sorted((set(self.ages) | set(self.declared)) - {DEFAULT})


def load_policy(config: Any = FROM_SETTINGS) -> Policy:
    """The policy from DURABLE_AGENTS["RETENTION"] (or `config`) and the registered workflows' own `retention=`;
    a bad settings entry is an InvalidInputError saying which."""
    config = settings.RETENTION if config is FROM_SETTINGS else config
    own = _declared()
    if config is None:
        return Policy({}, own)
    if not isinstance(config, dict):
        raise InvalidInputError(f"RETENTION must be a dict of workflow names, got {shown(config)}")
    ages: dict[str, dict[str, timedelta | None]] = {}
    for workflow, by_status in config.items():
        if not isinstance(workflow, str) or not isinstance(by_status, dict):
            raise InvalidInputError(
                f"RETENTION[{shown(workflow)}] must map statuses to ages, e.g. {{'completed': '30d'}}"
            )
        ages[workflow] = {}
        for status, age in by_status.items():
            if status not in STATUSES:
                raise InvalidInputError(
                    f"RETENTION[{workflow!r}] names status {shown(status)}; only finished runs are pruned: "
                    f"use {', '.join(STATUSES)}"
                )
            try:
                ages[workflow][status] = None if age is None else parse_duration(age)
            except InvalidInputError as exc:
                raise InvalidInputError(f"RETENTION[{workflow!r}][{status!r}]: {exc}") from None
    return Policy(ages, own)


def _declared() -> dict[str, dict[str, timedelta | None]]:
    """Each registered workflow's own `retention=` (its newest version's), checked when it was defined."""
    found = {}
    for name in registry.names():
        ages = registry.get(name).retention
        if ages is not None:
            found[name] = dict(ages)
    return found


def eligible(policy: Policy, now: datetime, *, workflow: str | None = None, older_than: timedelta | None = None) -> Q:
    """The runs old enough to go under `policy` at `now` (the database's time); an empty Q() matches none.

    `older_than` replaces the policy's ages (every finished status); `workflow` narrows to one workflow.
    """
    if older_than is not None:
        chosen = [_older(STATUSES, now - older_than)]
    else:
        named = policy.named()
        chosen = []
        for name in [*named, DEFAULT]:
            for status in STATUSES:
                age = policy.age(name, status)
                if age is None:
                    continue
                which = Q(workflow=name) if name != DEFAULT else ~Q(workflow__in=named)
                chosen.append(which & _older([status], now - age))
    if not chosen:
        return Q(pk__in=[])
    matched = Q()
    for part in chosen:
        matched |= part
    return matched if workflow is None else matched & Q(workflow=workflow)


def _older(statuses: Any, before: datetime) -> Q:
    # updated_at is indexed with status (durable_run_status_updated): the candidate scan uses that index.
    return Q(status__in=list(statuses), updated_at__lt=before) & (
        Q(finished_at__isnull=True) | Q(finished_at__lt=before)
    )


def prune(
    *,
    dry_run: bool = False,
    batch_size: int | str | None = None,
    workflow: str | None = None,
    older_than: str | timedelta | None = None,
    pause_seconds: float | str | None = None,
    duty_cycle: float | str | None = None,
    stop_after: str | timedelta | None = None,
) -> PruneReport:
    """Prune the finished runs the policy (or `older_than`) lets go, archiving each batch first if
    RETENTION_ARCHIVE names a storage. `dry_run` only counts them (report.counts by workflow and status).
    The pace: at most `duty_cycle` (RETENTION_DUTY_CYCLE) of the wall clock at work, and at least
    `pause_seconds` (RETENTION_PAUSE_SECONDS) of rest between batches. `stop_after` ("2h") ends the pass
    once that long has passed, before its next batch (a maintenance window); such a pass begins at a random
    point of the id order and goes round, so the windows of successive passes cover the whole table.

    Example: `prune(dry_run=True, workflow="refund-agent", older_than="90d").selected`
    """
    size = whole_number(
        settings.RETENTION_BATCH if batch_size is None else batch_size,
        "--batch-size (runs per batch)",
        low=1,
        high=100_000,
    )
    if workflow is not None and not check_text(workflow, "--workflow").strip():
        # `--workflow "$WF"` with WF unset must not widen the pass to every workflow (with --older-than: every run).
        raise InvalidInputError("--workflow is empty; name the workflow whose runs to prune, or leave it out")
    age = _duration(older_than, "older_than")
    limit = _duration(stop_after, "stop_after", positive=True)
    which = eligible(load_policy(), clock.now(), workflow=workflow, older_than=age)
    report = engine_prune.prune(
        which,
        batch_size=size,
        archive=settings.RETENTION_ARCHIVE,
        dry_run=dry_run,
        pause_seconds=0.0 if dry_run else _pause(pause_seconds),
        duty_cycle=_duty_cycle(duty_cycle),
        stop_after=None if limit is None else limit.total_seconds(),
        start_at=None if limit is None else engine_prune.window_start(),
    )
    return report


def _duration(value: str | timedelta | None, what: str, *, positive: bool = False) -> timedelta | None:
    """A duration given as text ("2h", as on the command line) or a timedelta, from 0 (above 0 if `positive`) to
    100 years; None stays None. A number is refused (seconds? days?), and so is an age past 100 years (`now - age`
    would overflow)."""
    if value is None:
        return None
    if not isinstance(value, str | timedelta):
        raise InvalidInputError(f"{what} is a duration, e.g. '2h' or a timedelta; got {shown(value)}")
    duration = parse_duration(value) if isinstance(value, str) else value
    option = "--" + what.replace("_", "-")
    if duration > MAX_DURATION:
        raise InvalidInputError(f"{option} {shown(value)} is longer than 100 years; give a shorter one, e.g. 52w")
    if duration < timedelta(0) or (positive and not duration):
        # A window of 0 would stop every pass before its first batch: nothing would ever be pruned.
        least = "longer than 0" if positive else "0 or longer"
        raise InvalidInputError(f"{option} must be {least}, e.g. 2h; got {shown(value)}")
    return duration


def _number(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return float("nan")  # fails every bound below


def _pause(value: float | str | None) -> float:
    """The rest between batches: `--pause`, else RETENTION_PAUSE_SECONDS (seconds, 0 to 3600).

    The setting is checked here too: a Celery worker runs no system checks, and a bad value would crash the pass
    after its first batch or rest it for years holding the prune's lease."""
    name = "--pause" if value is not None else "DURABLE_AGENTS['RETENTION_PAUSE_SECONDS']"
    given = settings.RETENTION_PAUSE_SECONDS if value is None else value
    pause = _number(given)
    if not 0 <= pause <= MOST_PAUSE:
        raise InvalidInputError(f"{name} is seconds from 0 to 3600 between batches, e.g. 0.2; got {shown(given)}")
    return pause


def _duty_cycle(value: float | str | None) -> float:
    """The share of the wall clock a pass may work: `--duty-cycle`, else RETENTION_DUTY_CYCLE (0.01 to 1), checked
    as `_pause` checks its setting (0 divided the first batch's time by zero)."""
    name = "--duty-cycle" if value is not None else "DURABLE_AGENTS['RETENTION_DUTY_CYCLE']"
    given = settings.RETENTION_DUTY_CYCLE if value is None else value
    share = _number(given)
    if not 0.01 <= share <= 1:
        raise InvalidInputError(
            f"{name} is the share of the time the prune may work, from 0.01 to 1 (flat out), e.g. 0.1; "
            f"got {shown(given)}"
        )
    return share


def export_run(run_id: str) -> bytes:
    """One run's full record as JSON lines (the archive's format): what `durable_export RUN_ID` prints.

    `run_id` may be a unique prefix, as everywhere; no such run is a RunNotFoundError.
    """
    run = get_run(resolve_run_id(run_id))
    return record_lines([run.id])

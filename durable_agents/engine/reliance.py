"""Who relies on an effect, and so which effects a saga may undo.

An effect is owned by the run that applied it (`Effect.run_id`). Other runs may rely on it too: a fork built
on a checkpoint that recorded it, or a run that found it already applied under a shared key (a fork and its
source share keys when they share an input). Those are `Reliance` rows. A saga undoes an
effect only once no other run that relies on it still stands (a run stands unless it was compensated or is
compensating): the last run to let go of it undoes it. An effect a saga keeps for another run is recorded
in the saga's history, never dropped silently.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.db.models import F, Q

from durable_agents.errors import UnknownToolError
from durable_agents.models import Effect, EffectKind, EffectStatus, Reliance, Run, RunStatus
from durable_agents.tools import tools

UNDONE_RUNS = (RunStatus.CANCELLED, RunStatus.FAILED)


@dataclass(frozen=True)
class SagaPlan:
    """What a saga of one run undoes (newest first), and what it keeps because other runs rely on it."""

    undo: list[str]
    kept: dict[str, list[str]]  # effect key -> the runs that still stand on it


def plan_saga(run_id: Any) -> SagaPlan:
    """The effects run `run_id` must undo: applied ones and external ones invoked with no recorded outcome
    (the compensation step learns the outcome first), which it owns or relies on — unless another run that
    still stands relies on them. An effect whose tool is no longer registered is listed too: its compensation
    step then stops the saga visibly instead of leaving the effect silently in place."""
    relied_on = Reliance.objects.filter(run_id=run_id).values("effect_id")
    effects = (
        Effect.objects.filter(kind=EffectKind.EFFECT)
        .filter(Q(run_id=run_id) | Q(pk__in=relied_on))
        .filter(Q(status=EffectStatus.APPLIED) | Q(status=EffectStatus.PENDING, attempts__gt=0))
        .order_by(F("applied_at").desc(nulls_first=True), "-id")
    )
    others: dict[int, set[str]] = {}
    for effect_id, other in Reliance.objects.filter(effect__in=effects).values_list("effect_id", "run_id"):
        others.setdefault(effect_id, set()).add(str(other))
    undo, kept = [], {}
    for effect in effects:
        if not is_compensable(effect.tool):
            continue
        standing = _standing(({str(effect.run_id)} | others.get(effect.pk, set())) - {str(run_id)})
        if standing:
            kept[effect.idempotency_key] = standing
        else:
            undo.append(effect.idempotency_key)
    return SagaPlan(undo, kept)


def _standing(run_ids: set[str]) -> list[str]:
    """The runs among `run_ids` that still stand on their effects: not compensated, not compensating."""
    if not run_ids:
        return []
    undone = Q(finish_as__in=UNDONE_RUNS)
    return sorted(str(pk) for pk in Run.objects.filter(pk__in=run_ids).exclude(undone).values_list("pk", flat=True))


def is_compensable(tool_name: str) -> bool:
    """True if the tool has a compensating tool — or is no longer registered, so nobody can tell (its
    compensation step stops the saga and says so)."""
    try:
        return tools.get(tool_name).compensate is not None
    except UnknownToolError:
        return True


def rely_on(effects: list[Effect], run_id: Any) -> None:
    """Record that run `run_id` relies on `effects`, applied by other runs (idempotent)."""
    Reliance.objects.bulk_create(
        (Reliance(effect_id=e.pk, run_id=run_id) for e in effects if str(e.run_id) != str(run_id)),
        ignore_conflicts=True,
    )


__all__ = ["SagaPlan", "is_compensable", "plan_saga", "rely_on"]

"""Who relies on an effect, and so which effects a saga may undo.

An effect is owned by the run that applied it (`Effect.run_id`). Other runs may rely on it too: a fork
whose copied checkpoint recorded it, or a run that found it applied (or in flight) under a key it shares
(a fork and its source share keys when they share an input). Those are `Reliance` rows, each tied to the
plan row that relies; a re-run that supersedes that row lets go. A run stands on its effects unless it
compensated or is compensating (`finish_as`). A saga undoes an effect only once no other run that relies
on it still stands — the last run to let go undoes it — and checks again right before undoing, as others
may have come to rely on it since the saga was planned. An effect a saga keeps for another run is recorded
in the saga's history, never dropped silently.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.db.models import F, Q

from durable_agents.errors import UnknownToolError
from durable_agents.models import Effect, EffectKind, EffectStatus, Reliance, Run, StepStatus
from durable_agents.states import SAGA_ENDINGS
from durable_agents.tools import tools


@dataclass(frozen=True)
class SagaPlan:
    """What a saga of one run undoes (newest first), and what it keeps because other runs rely on it."""

    undo: list[str]
    kept: dict[str, list[str]]  # effect key -> the runs that still stand on it


def _live(reliances: Any) -> Any:
    return reliances.exclude(step__status=StepStatus.SUPERSEDED)


def plan_saga(run_id: Any) -> SagaPlan:
    """The effects run `run_id` must undo: applied ones and external ones invoked with no recorded outcome
    (the compensation step learns the outcome first), which it owns or relies on — unless another run that
    still stands relies on them. An effect whose tool is no longer registered is listed too: its compensation
    step then stops the saga visibly instead of leaving the effect silently in place.

    Runs inside the saga's transaction: the effect rows are locked (in id order), so two sagas over a shared
    effect take turns, and the second sees that the first let go.
    """
    relied_on = _live(Reliance.objects.filter(run_id=run_id)).values("effect_id")
    candidates = (
        Effect.objects.filter(kind=EffectKind.EFFECT)
        .filter(Q(run_id=run_id) | Q(pk__in=relied_on))
        .filter(Q(status=EffectStatus.APPLIED) | Q(status=EffectStatus.PENDING, attempts__gt=0))
    )
    list(candidates.select_for_update().order_by("id").values_list("id", flat=True))
    undo, kept = [], {}
    for effect in candidates.order_by(F("applied_at").desc(nulls_first=True), "-id"):
        if not is_compensable(effect.tool):
            continue
        standing = standing_on(effect, but=run_id)
        if standing:
            kept[effect.idempotency_key] = standing
        else:
            undo.append(effect.idempotency_key)
    return SagaPlan(undo, kept)


def standing_on(effect: Effect, *, but: Any) -> list[str]:
    """The runs other than `but` that still stand on `effect`: its owner and the runs relying on it, unless
    they compensated or are compensating."""
    others = {str(effect.run_id)}
    others |= {str(r) for r in _live(Reliance.objects.filter(effect=effect)).values_list("run_id", flat=True)}
    others.discard(str(but))
    if not others:
        return []
    let_go = Q(finish_as__in=SAGA_ENDINGS)
    return sorted(str(pk) for pk in Run.objects.filter(pk__in=others).exclude(let_go).values_list("pk", flat=True))


def is_compensable(tool_name: str) -> bool:
    """True if the tool has a compensating tool — or is no longer registered, so nobody can tell (its
    compensation step stops the saga and says so)."""
    try:
        return tools.get(tool_name).compensate is not None
    except UnknownToolError:
        return True


def rely_on(effects: list[Effect], run_id: Any, step_pks: list[int]) -> None:
    """Record that run `run_id`'s plan rows `step_pks` rely on `effects` (pairwise; idempotent). An effect
    the run owns needs no row: the run stands on it anyway."""
    Reliance.objects.bulk_create(
        (
            Reliance(effect_id=effect.pk, run_id=run_id, step_id=step_pk)
            for effect, step_pk in zip(effects, step_pks, strict=True)
            if str(effect.run_id) != str(run_id)
        ),
        ignore_conflicts=True,
    )


__all__ = ["SagaPlan", "is_compensable", "plan_saga", "rely_on", "standing_on"]

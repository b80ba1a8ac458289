"""The transition tables: what no operation may ever do, whatever the engine's code says."""

from __future__ import annotations

from durable_agents.states import (
    EFFECT_RULES,
    FINISHED_RUN_STATUSES,
    RUN_RULES,
    STEP_RULES,
    WAIT_RULES,
    EffectOp,
    EffectStatus,
    RunOp,
    RunStatus,
    StepStatus,
    WaitStatus,
)


def _moves(rules):  # type: ignore[no-untyped-def]
    """Every (operation, from, to) a table allows; `to` is the source itself when the status is kept."""
    return {
        (op, source, target)
        for op, rule in rules.items()
        for source in rule.sources
        for target in (rule.targets or {source})
    }


def test_states__every_status_named_is_a_real_one():
    for rules, statuses in (
        (RUN_RULES, RunStatus),
        (STEP_RULES, StepStatus),
        (WAIT_RULES, WaitStatus),
        (EFFECT_RULES, EffectStatus),
    ):
        for op, source, target in _moves(rules):
            assert source in statuses.values and target in statuses.values, f"{op}: {source} -> {target}"


def test_states__a_finished_run_moves_only_when_an_operator_resumes_or_reruns_it_or_its_family_compensates():
    leaving = {op for op, source, target in _moves(RUN_RULES) if source in FINISHED_RUN_STATUSES and target != source}
    assert leaving == {RunOp.RESUME, RunOp.RERUN, RunOp.UNDO}, (
        f"finished runs may be left only by resume, rerun or their family's saga (undo), not {leaving}"
    )
    assert RUN_RULES[RunOp.UNDO].targets == {RunStatus.PENDING}, "a family's saga reopens a finished run to undo it"


def test_states__a_saga_never_ends_completed_and_only_a_commit_completes_a_run():
    assert RUN_RULES[RunOp.FINISH].targets == {RunStatus.CANCELLED, RunStatus.FAILED}
    completing = {op for op, source, target in _moves(RUN_RULES) if target == RunStatus.COMPLETED != source}
    assert completing == {RunOp.COMPLETE}, completing


def test_states__a_closed_wait_never_reopens():
    reopening = {(op, s, t) for op, s, t in _moves(WAIT_RULES) if t == WaitStatus.OPEN or s != WaitStatus.OPEN}
    assert not reopening, f"only open waits close, and nothing reopens one: {reopening}"


def test_states__an_applied_effect_is_only_ever_compensated():
    leaving = {(op, t) for op, s, t in _moves(EFFECT_RULES) if s == EffectStatus.APPLIED and t != s}
    assert leaving == {(EffectOp.COMPENSATE, EffectStatus.COMPENSATED)}, leaving
    assert not {op for op, s, _t in _moves(EFFECT_RULES) if s == EffectStatus.COMPENSATED}, "compensated is final"


def test_states__only_claims_make_a_run_running_and_only_running_runs_commit():
    into_running = {op for op, s, t in _moves(RUN_RULES) if t == RunStatus.RUNNING and s != RunStatus.RUNNING}
    assert into_running == {RunOp.CLAIM}, into_running
    for op in (RunOp.CHECKPOINT, RunOp.COMPLETE, RunOp.FINISH, RunOp.PARK):
        assert RUN_RULES[op].sources == {RunStatus.RUNNING}, f"{op} must be fenced on a running run"

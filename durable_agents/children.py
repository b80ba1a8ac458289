"""Child runs as a step: start one child run, or one per item of a list, and wait for all, any or the first k.

Example::

    workflow("review_all", steps=[
        call("load", load_documents),
        children("reviews", workflow="review_one", each=lambda ctx: ctx.result("load")["documents"],
                 join="all", on_failure="collect"),
        call("summarise", summarise),   # ctx.result("reviews")["children"]: one entry per child, in order
    ])

The step holds no worker while its children run (the run is `waiting`); each child's key is (parent, step,
index), so a step re-executed after a crash never starts a child twice. Its result, in index order::

    {"children": [{"index": 0, "run": "…", "status": "completed", "output": {...}},
                  {"index": 1, "run": "…", "status": "failed", "error": {...}}, ...],
     "completed": 1, "failed": 1, "cancelled": 0, "joined": True}

`join`: "all", "any", or a whole number k (the first k to complete). Once it is met, children still running
are cancelled. `on_failure`: "fail_fast" — the first child that fails (or is cancelled) before the join is met
cancels the others and fails the step with ChildRunFailedError; "collect" — wait, and report every outcome
(`joined` False if the join could not be met). Cancelling the parent cancels its children (with compensation
if asked).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from durable_agents.engine.control import Park, WaitSpec
from durable_agents.engine.family import Join, cancel_children, gather, is_ready, spawn, tally
from durable_agents.errors import ChildRunFailedError, DefinitionError
from durable_agents.models import RunStatus, StepKind, WaitKind
from durable_agents.workflows import NAME_RE, RetryPolicy, StepDef

FAILURE_POLICIES = ("fail_fast", "collect")


def children(
    name: str,
    *,
    workflow: str,
    each: Callable[[Any], Sequence[Any]] | None = None,
    input: Callable[[Any], Any] | None = None,  # noqa: A002 - the child's input, as in api.start
    join: str | int = "all",
    on_failure: str = "fail_fast",
    retry: RetryPolicy | None = None,
) -> StepDef:
    """A step that starts child runs of `workflow` and waits for them, holding no worker.

    `each(ctx)` returns a list: one child per item (the item is its input). `input(ctx)` returns the input of
    a single child. Neither: one child with an empty input.

    Example: ``children("fan", workflow="score", each=lambda ctx: ctx.input["ids"], join=3, on_failure="collect")``
    """
    if not isinstance(workflow, str) or not NAME_RE.match(workflow):
        raise DefinitionError(f"children step {name!r}: workflow must be a workflow name, got {workflow!r}")
    if each is not None and input is not None:
        raise DefinitionError(f"children step {name!r}: give each (one child per item) or input (one child), not both")
    for given, what in ((each, "each"), (input, "input")):
        if given is not None and not callable(given):
            raise DefinitionError(f"children step {name!r}: {what} must be a function of the step context")
    if on_failure not in FAILURE_POLICIES:
        raise DefinitionError(
            f"children step {name!r}: on_failure must be one of {FAILURE_POLICIES}, got {on_failure!r}"
        )
    need = _need(name, join)
    policy = Join(need=need, fail_fast=on_failure == "fail_fast")

    def run(ctx: Any) -> dict[str, Any]:
        if each is not None:
            items = each(ctx)
            if isinstance(items, str | bytes | dict) or not isinstance(items, Sequence):
                raise DefinitionError(f"children step {name!r}: each must return a list, got {type(items).__name__}")
            items = list(items)
        else:
            items = [input(ctx) if input is not None else {}]
        # A zombie must not start children for a run another worker (or a cancel) now holds.
        ctx.ensure_lease()
        spawn(ctx.run, ctx.step, workflow, items, lease_token=ctx.lease_token)
        counted = tally(ctx.run_id, ctx.step_id)
        if not is_ready(policy, counted):
            wanted = "all" if need is None else f"{policy.needed(counted.total)} of"
            raise Park(
                WaitSpec(
                    kind=WaitKind.CHILDREN,
                    name=ctx.step_id,
                    question=f"waiting for {wanted} {counted.total} child runs of {workflow}",
                )
            )
        joined = counted.completed >= policy.needed(counted.total)
        # Met, or failed fast: the children still running are no longer waited for.
        why = f"step {ctx.step_id!r} of its parent run {ctx.run_id} no longer needs it"
        cancel_children(ctx.run_id, compensate=False, why=why, step_id=ctx.step_id)
        gathered = gather(ctx.run_id, ctx.step_id)
        if not joined and policy.fail_fast:
            # The child that failed, not a sibling this step just cancelled for it.
            first = next((c for c in gathered if c["status"] == RunStatus.FAILED), None) or next(
                (c for c in gathered if c["status"] == RunStatus.CANCELLED), None
            )
            ended = "failed" if first and first["status"] == RunStatus.FAILED else "was cancelled"
            detail = f"child {first['index']} (run {first['run']}) {ended}" if first else "children failed"
            message = ((first or {}).get("error") or {}).get("message", "")
            raise ChildRunFailedError(f"{detail}{': ' + message if message else ''}")
        return {
            "children": gathered,
            "completed": sum(c["status"] == RunStatus.COMPLETED for c in gathered),
            "failed": sum(c["status"] == RunStatus.FAILED for c in gathered),
            "cancelled": sum(c["status"] in (RunStatus.CANCELLED, "cancelling") for c in gathered),
            "joined": joined,
        }

    options = {"workflow": workflow, "join": need, "fail_fast": policy.fail_fast}
    return StepDef(name=name, kind=StepKind.CHILDREN, fn=run, retry=retry, options=options)


def _need(name: str, join: str | int) -> int | None:
    if join == "all":
        return None
    if join == "any":
        return 1
    if isinstance(join, int) and not isinstance(join, bool) and join >= 1:
        return join
    raise DefinitionError(f"children step {name!r}: join must be 'all', 'any' or a whole number >= 1, got {join!r}")

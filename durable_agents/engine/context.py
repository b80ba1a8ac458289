"""What a step's code sees: the run input, its own args and attempt, earlier results (read lazily)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from durable_agents import clock
from durable_agents.engine import replaying, turnpath
from durable_agents.engine.approvals import require_approval
from durable_agents.engine.effects import effect_key, invoke_tool
from durable_agents.engine.lease import Spent, prove_lease
from durable_agents.engine.payloads import load_result
from durable_agents.errors import LeaseLostError, StepNotFoundError, ToolFailedError
from durable_agents.models import Run, Step, StepKind, StepStatus, Turn
from durable_agents.tools import Tool, tools


@dataclass(frozen=True)
class ToolCall:
    """A tool call of an agent: its arguments and the tool_result content the model read (None: not answered)."""

    name: str
    input: dict[str, Any]
    result: Any
    is_error: bool


class StepContext:
    """Passed to every step function. Earlier results are fetched one at a time, never the whole history.

    Example::

        def notify(ctx):
            order = ctx.result("fetch")          # one indexed read
            key = ctx.idempotency_key("email")    # stable across retries and resumes
    """

    def __init__(self, run: Run, step: Step, attempt: int, heartbeat: Any = None) -> None:
        self.run = run
        self.step = step
        self.attempt = attempt
        self._heartbeat = heartbeat
        self._tool_calls = 0

    @property
    def run_id(self) -> uuid.UUID:
        return self.run.id

    @property
    def step_id(self) -> str:
        return self.step.step_id

    @property
    def input(self) -> Any:
        return self.run.input

    @property
    def args(self) -> dict[str, Any]:
        return self.step.args

    @property
    def lease_token(self) -> int | None:
        """The fencing token this execution holds; writes made mid-step (journals) must present it."""
        return self._heartbeat.claim.token if self._heartbeat else None

    def ensure_lease(self) -> None:
        """Before an expensive outside call (a model request): prove this execution still holds the run,
        and extend its lease. A zombie stops here instead of asking the model for a turn already answered.
        """
        self._prove_lease()

    def _prove_lease(self) -> Spent | None:
        # What the run has spent comes back from the same statement (None: no lease to prove, nothing read).
        if self._heartbeat is None:
            return None
        spent = prove_lease(self._heartbeat.claim)
        if spent is None:
            raise LeaseLostError(f"run {self.run.id} was taken over; this worker stops before the model call")
        self._lease_proven()
        return spent

    def _lease_proven(self) -> None:
        # One of this execution's statements just proved and extended its lease: the renewer need not yet.
        if self._heartbeat is not None:
            self._heartbeat.renewed_at = time.monotonic()

    @property
    def lease_lost(self) -> bool:
        """True once another worker took this run over; long steps may check it and stop early."""
        return bool(self._heartbeat and self._heartbeat.lost)

    def now(self) -> datetime:
        return clock.now()

    def idempotency_key(self, *parts: str) -> str:
        """A key stable across retries and resumes of this step: run id, step id and your parts.

        A fork with its source's input shares the source's effect scope, so it gets the same keys.
        """
        return ":".join([self.run.effect_scope or str(self.run.id), self.step.step_id, *parts])

    def feedback(self) -> str:
        """The reasons of the last reviewer (judge) that sent this run back to redo a step; "" if none."""
        verdict = (
            Step.objects.filter(run_id=self.run.id, kind=StepKind.JUDGE, status=StepStatus.SUPERSEDED)
            .exclude(result=None)
            .order_by("-id")
            .values_list("result", flat=True)
            .first()
        )
        return verdict.get("reasons", "") if verdict and not verdict.get("passed") else ""

    def call_tool(
        self, tool: Tool[..., Any] | str, args: Mapping[str, Any], *, key: str | None = None, call_id: str = ""
    ) -> Any:
        """Invoke a tool from this step. Effectful tools get an outbox row and a key that is the same
        every time this step re-executes (n-th call of this step), so an applied effect is never repeated.
        `call_id`: the model's tool_use id when the model asked for the call (the trace shows it).

        Example: ``ctx.call_tool(issue_refund, {"order_id": "A1", "amount": "10.00"})``
        """
        resolved = tools.get(tool) if isinstance(tool, str) else tool
        self._tool_calls += 1
        key = effect_key(key or self.idempotency_key(resolved.name, str(self._tool_calls)))
        if replaying.is_replay(self.run):
            # A replay executes no tool: the recording answers, as the tool answered then.
            answer = replaying.answer_tool_call(self, resolved.name, dict(args), key)
            if answer["is_error"]:
                raise ToolFailedError(answer["content"])
            return json.loads(answer["content"])
        if resolved.effectful and resolved.needs_approval:
            require_approval(self, resolved, args, key)
        return invoke_tool(
            resolved,
            args,
            key=key,
            run_id=self.run.id,
            step_pk=self.step.pk,
            ctx=self,
            lease_token=self.lease_token,
            call_id=call_id,
            claim=self._heartbeat.claim if self._heartbeat else None,
        )

    @property
    def is_replay(self) -> bool:
        """True in a replay run (replays.py): its tool calls are answered from a recording and nothing is applied."""
        return replaying.is_replay(self.run)

    def tool_calls(self, name: str | None = None) -> list[ToolCall]:
        """The tool calls this run's agents made (of tool `name`, if given), oldest first, each with the result the
        model read — the same in a replay run, where the recording answered them.

        Example: ``sent = [c for c in ctx.tool_calls("email_customer") if not c.is_error]``
        """
        calls = []
        journal = Turn.objects.filter(run_id=self.run.id, purpose="turn").order_by("step_id", "index")
        for content, results in journal.values_list("content", "tool_results"):
            answered = {r.get("tool_use_id"): r for r in results or ()}
            for block in content or ():
                if block.get("type") != "tool_use" or (name is not None and block.get("name") != name):
                    continue
                result = answered.get(block.get("id"))
                calls.append(
                    ToolCall(
                        block.get("name", ""),
                        block.get("input") or {},
                        None if result is None else result.get("content"),
                        bool(result and result.get("is_error")),
                    )
                )
        return calls

    def result(self, step_id: str) -> Any:
        """The committed result of an earlier step of this run."""
        row = (
            Step.objects.live()
            .filter(run_id=self.run.id, step_id=step_id, status=StepStatus.DONE)
            .values_list("result", "result_ref", "result_hash")
            .first()
        )
        if row is None:
            raise StepNotFoundError(f"run {self.run.id} has no completed step {step_id!r}")
        result, ref, sha = row
        return load_result(ref, sha, run_id=self.run.id) if ref else result


def write_tool_results(ctx: StepContext, turn_pk: int, results: list[Any]) -> Spent | None:
    """Store a turn's tool results iff none are stored and `ctx` still holds its run's lease, proving and extending
    that lease in the same statement (Postgres): the run's spend as it read it, which the model call that follows
    may take as its proof when nothing else waited in between; None if nothing was written (the lease was lost, or
    the turn had its results already)."""
    if ctx._heartbeat is None:
        return None
    spent = turnpath.write_tool_results(turn_pk, results, ctx._heartbeat.claim)
    if spent is not None:
        ctx._lease_proven()
    return spent


def prove_lease_reading_spend(ctx: StepContext) -> Spent | None:
    """`ctx.ensure_lease()`, returning what the run has spent as the same statement read it (None: `ctx` holds no
    lease, nothing was proven or read)."""
    return ctx._prove_lease()

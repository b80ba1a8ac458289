"""The tool calls of one model response: every approval they need decided first, then run concurrently.

Claude's parallel tool use puts several `tool_use` blocks in one response, calls the model means as
independent. Each call of an effectful tool is an effect keyed by its tool_use_id (`run:step:tool_use_id`),
so they may run at once: up to TOOL_CONCURRENCY, each on a thread of its own (a greenlet on the gevent model
worker, whose monkey-patching makes the pool's threads greenlets) with its own database connection, closed
(or given back to the pool) when the call ends. The results come back in block order.

* **Approvals first.** Before any call of a response runs, each call that needs a human is looked at in
  block order; the first one undecided parks the run. Nothing of the response happens before the human
  saw the gated call, and none of it half-happens while the run waits. Each wake-up decides the next gated
  call; once all are decided the calls run (a rejected one is an is_error result, the others run).
* **A call's error is its own.** An error the model should see (bad arguments, a ToolFailedError, a
  rejection) is that call's is_error result; the other calls run. An error that stops the step
  (RetryableError, an unknown outcome, LeaseLostError, PermanentError) lets the calls in flight finish, their
  effects recorded, and starts no more; the first such error in block order is raised. The re-executed step
  runs the response's calls again: an applied effect returns its stored result by its key, a pending one
  (outcome unknown) is called again under its key (the receiver dedupes), the others run for the first time.
* **`parallel_safe=False` runs alone.** The calls before it in the response finish first; the calls after
  it start once it finished.
* Transactional tools prove the lease under the run's row lock, so they apply one at a time; the overlap
  pays for read-only tools and calls to outside systems.
* Inside a transaction (a test wrapped in one), the calls run one after the other in this thread: another
  connection would not see its writes.
"""

from __future__ import annotations

import contextvars
import json
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from django.core.serializers.json import DjangoJSONEncoder
from django.db import connection, connections

from durable_agents.conf import settings
from durable_agents.connections import release_connection
from durable_agents.engine.approvals import require_approval
from durable_agents.engine.effects import effect_key, recorded_effect
from durable_agents.engine.replaying import answer_tool_call, is_replay
from durable_agents.errors import (
    ApprovalRejectedError,
    LeaseLostError,
    PermanentError,
    RetryableError,
    ToolArgumentsError,
    ToolFailedError,
)
from durable_agents.models import EffectStatus
from durable_agents.tools import Tool

Block = dict[str, Any]
Result = dict[str, Any]
Tools = dict[str, Tool[..., Any]]


def run_calls(ctx: Any, blocks: Sequence[Block], tools: Tools) -> list[Result]:
    """The tool_result blocks of `blocks` (the response's tool_use blocks), in their order."""
    if is_replay(getattr(ctx, "run", None)):
        # Answered from the recording, one after the other (each takes the first unused recorded call that
        # matches), asking no one: the recording holds each approval's outcome in its call's result.
        return [replayed_call(ctx, block, tools) for block in blocks]
    decide_approvals(ctx, blocks, tools)
    results: list[Result] = []
    for batch in _batches(blocks, tools):
        results.extend(_run_batch(ctx, batch, tools))
    return results


def decide_approvals(ctx: Any, blocks: Sequence[Block], tools: Tools) -> None:
    """Park the run (raise Park) on the first call that still waits for a human; return once none does."""
    for block in blocks:
        tool = tools.get(block["name"])
        if tool is None or not (tool.effectful and tool.needs_approval):
            continue
        try:
            require_approval(ctx, tool, block.get("input") or {}, effect_key(ctx.idempotency_key(block["id"])))
        except (ToolArgumentsError, ApprovalRejectedError):
            continue  # the call itself meets it again and tells the model
        except Exception:  # noqa: BLE001 - a failing needs_approval predicate: the call reports it as it would alone
            continue


def run_call(ctx: Any, block: Block, tools: Tools) -> Result:
    """One call's tool_result; errors the model should see become an is_error result, the others are raised."""
    use_id, name = block["id"], block["name"]
    tool = tools.get(name)
    if tool is None:
        return _not_deployed(ctx, use_id, name, tools)
    try:
        result = ctx.call_tool(tool, block.get("input") or {}, key=ctx.idempotency_key(use_id), call_id=use_id)
    except (ToolArgumentsError, ToolFailedError, ApprovalRejectedError) as exc:
        return _error(use_id, str(exc))
    except (RetryableError, LeaseLostError, PermanentError):
        raise
    except Exception as exc:  # noqa: BLE001 - a tool's own failure is news for the model, not a crash
        if tool.effectful and not tool.transactional:
            # The call may have landed: shown to the model, it would be re-asked under a new tool_use_id
            # (a new key). Retry this same call instead; the receiver dedupes on its key.
            raise RetryableError(f"{name} failed with an unknown outcome: {type(exc).__name__}: {exc}") from exc
        return _error(use_id, f"{name} failed: {type(exc).__name__}: {exc}")
    return {"type": "tool_result", "tool_use_id": use_id, "content": json.dumps(result, cls=DjangoJSONEncoder)}


def replayed_call(ctx: Any, block: Block, tools: Tools) -> Result:
    """A replay run's tool call: the recorded tool_result (or a stub), never the tool. Arguments the tool's signature
    refuses get the error a live call gets (checking them runs nothing), as the model would have read it."""
    tool = tools.get(block["name"])
    if tool is not None:
        try:
            tool.validate(block.get("input") or {})
        except ToolArgumentsError as exc:
            return _error(block["id"], str(exc))
    key = effect_key(ctx.idempotency_key(block["id"]))
    answer = answer_tool_call(ctx, block["name"], block.get("input") or {}, key)
    result = {"type": "tool_result", "tool_use_id": block["id"], "content": answer["content"]}
    return {**result, "is_error": True} if answer["is_error"] else result


def _not_deployed(ctx: Any, use_id: str, name: str, tools: Tools) -> Result:
    """A call of a tool the code deployed now lacks. If the call already landed (a deploy removed the tool between
    its effect and the turn's results), the model is told what it did, never that it failed: told "unknown tool",
    it would try the refund again by another road."""
    effect = recorded_effect(ctx.idempotency_key(use_id))
    if effect is None:
        return _error(use_id, f"unknown tool {name!r}; the tools you may call are: {', '.join(tools) or 'none'}")
    if effect.status == EffectStatus.APPLIED:
        return {
            "type": "tool_result",
            "tool_use_id": use_id,
            "content": json.dumps(effect.result, cls=DjangoJSONEncoder),
        }
    raise PermanentError(
        f"the call of {name!r} ({effect.idempotency_key}) is {effect.status} and {name!r} is no longer deployed: "
        "its outcome cannot be settled here; deploy the tool again and resume, or resolve the effect "
        "(durable_effect KEY --applied or --failed)"
    )


def _error(use_id: str, message: str) -> Result:
    return {"type": "tool_result", "tool_use_id": use_id, "content": message, "is_error": True}


def _batches(blocks: Sequence[Block], tools: Tools) -> list[list[Block]]:
    """The calls split around each call of a tool that is not parallel_safe, which makes a batch of its own."""
    batches: list[list[Block]] = [[]]
    for block in blocks:
        tool = tools.get(block["name"])
        if tool is not None and not tool.parallel_safe:
            batches += [[block], []]
        else:
            batches[-1].append(block)
    return [batch for batch in batches if batch]


def _run_batch(ctx: Any, batch: list[Block], tools: Tools) -> list[Result]:
    limit = min(int(settings.TOOL_CONCURRENCY), len(batch))
    if limit <= 1 or connection.in_atomic_block:
        return [run_call(ctx, block, tools) for block in batch]
    stop = threading.Event()
    # This thread only waits now: a pooled connection goes back for the calls to use.
    release_connection(pooled_only=True)
    with ThreadPoolExecutor(max_workers=limit, thread_name_prefix="durable-tool") as pool:
        # Each call runs in a copy of this thread's context, so its span is a child of the step attempt's.
        futures = [
            pool.submit(contextvars.copy_context().run, _on_own_connection, stop, run_call, ctx, block, tools)
            for block in batch
        ]
    return _outcomes(futures)


def _on_own_connection(stop: threading.Event, call: Callable[..., Result], *args: Any) -> Result | None:
    """Run `call` unless a call before it stopped the step (None: not started); close this thread's connection."""
    if stop.is_set():
        return None
    try:
        return call(*args)
    except BaseException:
        stop.set()
        raise
    finally:
        connections.close_all()


def _outcomes(futures: list[Future[Result | None]]) -> list[Result]:
    """The calls' results; or the first error in block order that stopped the step (calls skipped after it)."""
    error = next((e for e in (future.exception() for future in futures) if e is not None), None)
    if error is not None:
        raise error
    # No call failed, so none was skipped.
    return [result for result in (future.result() for future in futures) if result is not None]

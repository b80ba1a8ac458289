"""Workflows for the model worker tests (tests/integration/test_model_worker_gevent_pool.py and
test_model_worker_billed_answers.py), imported by the test process and by its workers
(`--include tests.model_worker_flows`).

* GATED_CONVERSATION: one agent step with a read-only tool, `wait_at_gate`, which waits (I/O-bound, as the
  workers how-to allows on the model worker: it polls Redis) until the test opens the gate. The fake model asks
  for the tool when the prompt says "slow", and answers in text otherwise.
* AGENT_THEN_CRUNCH: an agent step, then a plain `call` step (the kind docs/howto/workers.md sends to prefork: "make
  CPU-heavy work a step of its own, which runs on prefork") that records which pool ran it.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import redis

from durable_agents.api import agent, call, tool, workflow
from durable_agents.testing.fake_anthropic import RecordedRequest, Reply
from durable_agents.tools import ToolRegistry

GATED_CONVERSATION = "gated_conversation"
AGENT_THEN_CRUNCH = "agent_then_crunch"
GATE = "model_worker_flows:gate"
AT_GATE = "model_worker_flows:at_gate"


def _redis() -> redis.Redis:
    return redis.Redis.from_url(os.environ["CELERY_BROKER_URL"])


@tool(registry=ToolRegistry())
def wait_at_gate(order_id: str) -> dict[str, Any]:
    """Look the order up in a slow outside system (waits until the test opens the gate)."""
    r = _redis()
    r.incr(AT_GATE)
    while not r.get(GATE):
        time.sleep(0.05)  # gevent-patched in the model worker: other greenlets run meanwhile
    return {"order_id": order_id, "status": "delivered"}


def pool_of_this_process() -> str:
    monkey = sys.modules.get("gevent.monkey")
    if monkey is not None and monkey.is_module_patched("threading"):
        return "gevent"
    return "prefork-or-solo"


def crunch(ctx: Any) -> dict[str, Any]:
    """Stands for CPU-heavy work: records where it ran."""
    return {"pool": pool_of_this_process(), "pid": os.getpid()}


workflow(
    GATED_CONVERSATION,
    steps=[
        agent(
            "support",
            instructions="You answer customers about their orders.",
            tools=[wait_at_gate],
            prompt=lambda ctx: f"{ctx.input['mode']} {ctx.input['tag']}: where is order {ctx.input['order_id']}?",
            max_tokens=64,
            max_turns=4,
        )
    ],
    replace=True,
)

workflow(
    AGENT_THEN_CRUNCH,
    steps=[
        agent(
            "ask",
            instructions="Answer briefly.",
            prompt=lambda ctx: f"crunch {ctx.input['tag']}",
            max_tokens=64,
            max_turns=2,
        ),
        call("crunch", crunch),
    ],
    replace=True,
)


def first_user_text(request: RecordedRequest) -> str:
    messages = request.messages
    if not messages:
        return ""
    content = messages[0].get("content")
    if isinstance(content, str):
        return content
    return " ".join(block.get("text", "") for block in content if isinstance(block, dict))


def answer(request: RecordedRequest) -> Reply:
    """The fake model: 'slow' conversations look the order up first; everything else is answered in text."""
    if first_user_text(request).startswith("slow") and not request.tool_results:
        return Reply.tool_use("wait_at_gate", {"order_id": "A-1"})
    return Reply.text("Your order was delivered.")


def asked_after_journaled(requests: list[RecordedRequest], run_ids: list[str]) -> list[str]:
    """The turns of `run_ids` asked of the fake after they were journaled ("<run>:<step> turn N, k time(s)"): what a
    journal must never allow. A turn asked twice before its answer was journaled (a lease that lapsed on a busy
    machine while the call was in flight) is allowed: at most the unjournaled turn is asked again."""
    from durable_agents.models import Turn

    asked: dict[tuple[str, int], list[float]] = {}
    for request in requests:
        asked.setdefault((request.conversation, request.turn), []).append(request.time)
    late = []
    for turn in Turn.objects.filter(run_id__in=run_ids, purpose="turn").select_related("step"):
        key = (f"{turn.run_id}:{turn.step.step_id}", turn.index)
        after = [t for t in asked.get(key, []) if t > turn.created_at.timestamp()]
        if after:
            late.append(f"{key[0]} turn {key[1]}, {len(after)} time(s)")
    return late

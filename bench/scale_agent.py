"""The conversation bench/agent_scale.py and the scale tests run by the thousand: two model calls, one effect.

Imported by the process that starts runs (after Django is set up) and by its workers (`--include
bench.scale_agent`). The fake model's side, `answer`, lives here too so both sides agree on the script:
turn 0 asks for `look_up_order`, turn 1 answers in text. BATCHED_WORKFLOW is the same conversation with
`delivery="batch"` (bench/batches.py): each of its two calls goes in a Message Batch at half price.

`look_up_order` is an effect (it marks the order as looked at): every execution of its body is counted in the
broker's Redis (`applied(key)`), outside Postgres, so a test can tell an effect applied twice.
"""

from __future__ import annotations

import os
from typing import Any

import redis

from durable_agents.api import agent, tool, workflow
from durable_agents.testing.fake_anthropic import RecordedRequest, Reply
from durable_agents.tools import ToolRegistry

WORKFLOW = "bench_scale_conversation"
BATCHED_WORKFLOW = "bench_scale_conversation_batched"  # the same conversation, its calls in Message Batches


# A registry of its own: the bench's tool never collides with an application's tool names.
APPLIED = "bench_scale:applied"


def _redis() -> redis.Redis:
    """The broker's Redis, or (with RabbitMQ as the broker) SCALE_REDIS_URL's."""
    broker = os.environ["CELERY_BROKER_URL"]
    return redis.Redis.from_url(broker if broker.startswith("redis") else os.environ["SCALE_REDIS_URL"])


@tool(registry=ToolRegistry(), effectful=True)
def look_up_order(order_id: str, *, idempotency_key: str) -> dict[str, Any]:
    """Look up an order by its id: its status and amount (the order is marked as looked at)."""
    _redis().hincrby(APPLIED, idempotency_key, 1)
    return {"order_id": order_id, "status": "delivered", "amount": "42.00"}


def applied() -> dict[str, int]:
    """How many times each effect's body ran, by idempotency key."""
    return {key.decode(): int(count) for key, count in _redis().hgetall(APPLIED).items()}


def _support(**options: Any) -> Any:
    return agent(
        "support",
        instructions="You answer customers about their orders. Look the order up before you answer.",
        tools=[look_up_order],
        prompt=lambda ctx: f"Where is my order {ctx.input['order_id']}?",
        max_tokens=256,
        max_turns=4,
        **options,
    )


workflow(WORKFLOW, steps=[_support()], replace=True)
workflow(BATCHED_WORKFLOW, steps=[_support(delivery="batch")], replace=True)


def answer(request: RecordedRequest) -> Reply:
    """The fake model: look the order up, then say where it is."""
    if not request.tool_results:
        order_id = request.last_user_text.rsplit(" ", 1)[-1].rstrip("?")
        return Reply.tool_use("look_up_order", {"order_id": order_id})
    return Reply.text("Your order was delivered.")

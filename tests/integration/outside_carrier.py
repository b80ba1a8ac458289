"""An outside carrier in this process, shared by the saga tests that ship orders through it: it dedupes on the
idempotency key, may refuse, may lose its answer, and its call-back desk may be down.

Its tools (`carrier_send`, compensated by `carrier_unsend`) and the `carrier_send_hold` workflow are registered
once, here, so that every test module drives the same CARRIER.
"""

from __future__ import annotations

from typing import Any

from durable_agents.api import StepContext, call, tool, workflow
from durable_agents.errors import ToolFailedError
from tests.testapp.trust import hook

# key -> what the carrier did ("shipped" / "unshipped"); "mode:<order>" -> how it answers the next call.
CARRIER: dict[str, Any] = {}


@tool(effectful=True, compensate="carrier_unsend", name="carrier_send")
def send(order_id: str, *, idempotency_key: str, ctx: StepContext | None = None) -> dict[str, Any]:
    """Ship an order through an outside carrier that dedupes on the key."""
    mode = CARRIER.get(f"mode:{order_id}", "ok")
    if mode == "refuse":
        raise ToolFailedError(f"the carrier refused order {order_id}")
    CARRIER.setdefault(idempotency_key, "shipped")
    hook(ctx, f"carrier:sent:{order_id}")
    if mode == "lost":
        raise ConnectionResetError("the connection broke after the carrier accepted the shipment")
    return {"shipped": order_id}


@tool(effectful=True, name="carrier_unsend")
def unsend(order_id: str, *, idempotency_key: str, ctx: StepContext | None = None) -> dict[str, Any]:
    """Call a shipment back."""
    if CARRIER.get("unsend") == "broken":
        raise ToolFailedError("the carrier's call-back desk is down")
    CARRIER[idempotency_key] = "unshipped"
    return {"unshipped": order_id}


def _send(ctx: StepContext) -> dict[str, Any]:
    hook(ctx, f"carrier:{ctx.step_id}")
    return ctx.call_tool(send, {"order_id": ctx.args.get("order", ctx.input["order_id"])})


def _plain(ctx: StepContext) -> dict[str, Any]:
    hook(ctx, f"carrier:{ctx.step_id}")
    if ctx.args.get("fail"):
        raise ValueError("the order data is malformed")
    return {"step": ctx.step_id}


workflow("carrier_send_hold", steps=[call("send", _send), call("hold", _plain)], replace=True)

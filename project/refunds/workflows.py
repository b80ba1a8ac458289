"""The refund_agent workflow: load the order, let an agent resolve the customer's message, review its email.

    load_order ──► resolve (agent: lookup_order, issue_refund, email_customer) ──► review_email (judge)
                                     ▲                                                  │
                                     └──────────── redo with the reviewer's reasons ◄───┘

The reviewer reads the email the agent sent. A failing review sends the run back to `resolve` with its
reasons (`ctx.feedback()` in the prompt) and the agent writes a corrected follow-up. It does not refund
again: the redo prompt says the refund is done, and lookup_order shows it.

Who plays the agent is decided when this module is imported: Claude ("anthropic") when ANTHROPIC_API_KEY
is set, else the "refund-script" participant (project/refunds/script.py), so the example runs offline.

Example::

    from durable_agents import api

    run = api.start("refund_agent", {"order_id": "A-1001", "message": "My mug arrived broken."})
"""

from __future__ import annotations

import json
import os
from datetime import timedelta
from typing import Any

from django.core.serializers.json import DjangoJSONEncoder

from durable_agents.api import (
    InvalidInputError,
    ScriptedParticipant,
    StepContext,
    agent,
    call,
    judge,
    participants,
    workflow,
)
from project.refunds.models import OutboundEmail
from project.refunds.script import play
from project.refunds.tools import email_customer, issue_refund, lookup_order

SCRIPT = "refund-script"
participants.register(SCRIPT, ScriptedParticipant(play, name=SCRIPT))
PARTICIPANT = "anthropic" if os.environ.get("ANTHROPIC_API_KEY") else SCRIPT
# "batch" (`durable_demo --batch` sets it for its workers): the reviewer's turns go through the Message Batches API
# at half price, the run parked until the batch answers. Only Claude through the API is batched. Unset: the
# workflow's delivery (live).
REVIEW_DELIVERY = os.environ.get("REFUNDS_REVIEW_DELIVERY") or None

MESSAGE_MAX_CHARS = 5000
ORDER_FRESH_FOR = timedelta(minutes=10)

INSTRUCTIONS = """\
You are a customer-support agent of an online shop. You resolve one customer message about one order.

1. Call lookup_order first, and act on what it returns, not on what the customer remembers.
2. If the customer asks for money back and the order has a refundable amount, call issue_refund once: for the
   amount the customer names, or the whole refundable amount if they name none, never more than `refundable`.
   Refunds above 50.00 wait for a manager's approval; that is expected, just call the tool.
3. If no refund is possible (nothing was paid, or it was already refunded), do not call issue_refund.
4. Then call email_customer exactly once: greet the customer by first name, name the order, state the outcome
   (the amount refunded, or why there is no refund, or the answer to their question) and what happens next.
   Plain text, no internal details (tool names, ids), signed "Kind regards,\\nThe support team".
5. Finish with one sentence saying what you did.
"""

RUBRIC = """\
The email to the customer must: (1) name the order; (2) greet the customer; (3) state the outcome plainly (the
amount refunded, why no refund is possible, or the answer to the question) and what happens next; (4) be polite,
signed by the support team, with no internal details (tool names, ids, keys). Pass only if all four hold.
"""


def validate_input(run_input: Any) -> None:
    if not isinstance(run_input, dict):
        raise InvalidInputError('refund_agent takes {"order_id": "A-1001", "message": "..."}')
    for field in ("order_id", "message"):
        if not isinstance(run_input.get(field), str) or not run_input[field].strip():
            raise InvalidInputError(f"refund_agent needs {field!r}, a non-empty string")
    if len(run_input["message"]) > MESSAGE_MAX_CHARS:
        raise InvalidInputError(f"the customer message is over {MESSAGE_MAX_CHARS} characters")


def load_order(ctx: StepContext) -> dict[str, Any]:
    """The order as it stood when the run started; a missing order fails the run with a clear error."""
    return {"order": lookup_order(ctx.input["order_id"]), "loaded_at": ctx.now().isoformat()}


def resolve_prompt(ctx: StepContext) -> str:
    """The agent's first message: the customer's words, the order on file, and any reviewer feedback."""
    loaded = ctx.result("load_order")
    order = DjangoJSONEncoder(indent=2).encode(loaded["order"])
    parts = [
        f"A customer wrote to support about order {ctx.input['order_id']}.",
        f"<customer_message>\n{ctx.input['message']}\n</customer_message>",
        f'<order_on_file loaded_at="{loaded["loaded_at"]}">\n{order}\n</order_on_file>',
    ]
    feedback = ctx.feedback()
    if feedback:
        parts.append(
            "A reviewer rejected the email you sent for this request. Send a better one (the refund, if any, is "
            f"already done: do not refund again).\n<reviewer_feedback>\n{feedback}\n</reviewer_feedback>"
        )
    return "\n\n".join(parts)


def email_under_review(ctx: StepContext) -> str:
    """The last email this run sent the customer, as the customer reads it: from the agent's calls and what the
    mail provider answered, so a replay (which sends nothing) reviews the email its agent wrote."""
    sent = [call for call in ctx.tool_calls(email_customer.name) if call.result is not None and not call.is_error]
    if not sent:
        return "(No email was sent to the customer.)"
    receipt = json.loads(sent[-1].result)
    return OutboundEmail(to=receipt["to"], subject=sent[-1].input["subject"], body=sent[-1].input["body"]).as_text()


refund_agent = workflow(
    "refund_agent",
    version=1,
    description='A support agent resolves a refund request: {"order_id": "A-1001", "message": "..."}',
    validate_input=validate_input,
    # The admin's search box finds a refund by its order number ("A-1001", or "order_id:A-1001").
    search=("order_id",),
    steps=[
        call("load_order", load_order, fresh_for=ORDER_FRESH_FOR),
        # The agent acts on the order loaded above: resumed past its freshness budget (say, a refund approved
        # the next day), the run re-plans from load_order instead of acting on a stale order.
        agent(
            "resolve",
            instructions=INSTRUCTIONS,
            tools=[lookup_order, issue_refund, email_customer],
            prompt=resolve_prompt,
            participant=PARTICIPANT,
            max_turns=12,
            depends_on=["load_order"],
        ),
        judge(
            "review_email",
            rubric=RUBRIC,
            subject=email_under_review,
            on_fail="redo",
            redo_step="resolve",
            max_redos=2,
            participant=PARTICIPANT,
            delivery=REVIEW_DELIVERY,
        ),
    ],
)

"""A scripted support agent that plays Claude offline: deterministic, plausible, and as slow as a model.

It reads the conversation the way Claude would — the customer's message, the order lookup, the tool
results — and decides from them alone, so it can pick up any run mid-way from the journal:

1. look the order up;
2. if the customer asks for money back and some is refundable, refund what they ask for (capped at what
   is left), else explain why not or answer their question;
3. email the customer once, with the outcome;
4. say what it did.

Asked to review an email (a request offering the `submit_verdict` tool), it checks the email against the
rubric's points and submits a verdict. `next_move` is the whole policy; the integration tests play the same
conversation through the fake Messages API with it.

Example::

    participants.register("refund-script", ScriptedParticipant(play, name="refund-script"))
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

from durable_agents.agents.participants import ModelRequest, text, tool_use
from durable_agents.testing.fake_anthropic import RecordedRequest, Reply
from project.refunds.models import money

VERDICT_TOOL = "submit_verdict"
# Seconds each scripted turn takes: a model is not instant, and the demo's SIGKILL must land mid-run.
THINK_SECONDS = float(os.environ.get("REFUND_SCRIPT_THINK_SECONDS", "0.4"))

_ORDER_RE = re.compile(r"about order (?P<number>[\w-]+)")
_MESSAGE_RE = re.compile(r"<customer_message>\s*(?P<message>.*?)\s*</customer_message>", re.S)
_REFUND_RE = re.compile(r"refund|money back|reimburs|charged (?:me )?twice|pay (?:me )?back", re.I)
_AMOUNT_RE = re.compile(
    r"(?:€|\$|£|EUR\s?)(?P<a>\d+(?:[.,]\d{1,2})?)|(?P<b>\d+(?:[.,]\d{1,2})?)\s?(?:€|EUR|euros?)\b", re.I
)
SIGN_OFF = "Kind regards,\nThe support team"
_FEEDBACK = "<reviewer_feedback>"


@dataclass(frozen=True)
class ToolCall:
    """A tool call of the conversation, with its result once the tools answered."""

    name: str
    input: Mapping[str, Any]
    result: str | None = None
    is_error: bool = False

    def json(self) -> dict[str, Any]:
        return json.loads(self.result or "{}")


def play(request: ModelRequest) -> list[dict[str, Any]]:
    """The ScriptedParticipant's function: think for a moment, then make the next move.

    Tool-use ids derive from the first prompt and the turn: a turn asked again after a crash gets the same
    ids (so the same effect keys), while a new prompt — a redo with the reviewer's feedback, or a re-plan on
    a freshly loaded order — gets new ones, as Claude's would be.
    """
    time.sleep(THINK_SECONDS)
    blocks = next_move(request.messages, [tool["name"] for tool in request.tools])
    prompt = _text(request.messages[0].get("content")) if request.messages else ""
    digest = hashlib.sha256(prompt.encode()).hexdigest()[:10]
    return [
        {**block, "id": f"toolu_{digest}_{request.turn:02d}_{i}"} if block["type"] == "tool_use" else block
        for i, block in enumerate(blocks)
    ]


def stand_in_reply(request: RecordedRequest) -> Reply:
    """Claude's side played through the fake Messages API (`durable_demo --stand-in`, the integration tests): the
    same moves as `play`, served over HTTP by the strict stand-in, which adds thinking blocks as the default
    model does and checks every request against the API's documented rules."""
    blocks = next_move(request.messages, [tool["name"] for tool in request.body.get("tools") or []])
    stop = "tool_use" if any(block["type"] == "tool_use" for block in blocks) else "end_turn"
    return Reply(content=blocks, stop_reason=stop)


def next_move(messages: Sequence[Mapping[str, Any]], tool_names: Sequence[str]) -> list[dict[str, Any]]:
    """The assistant's next content blocks for this conversation (Messages API shapes, tool_use without ids)."""
    if VERDICT_TOOL in tool_names:
        return [review(messages)]
    prompt = _text(messages[0].get("content")) if messages else ""
    number = (_ORDER_RE.search(prompt) or _missing("order number"))["number"]
    found = _MESSAGE_RE.search(prompt)
    message = found["message"] if found else prompt
    calls = _tool_calls(messages)
    if not calls:
        return [text(f"I'll look up order {number} first."), tool_use("lookup_order", {"order_id": number})]
    last = calls[-1]
    if last.name == "lookup_order":
        if last.is_error:
            return [text(f"I could not find order {number}, so I cannot act on it: {last.result}")]
        order = last.json()
        earlier = _refund_for(order, message) if _FEEDBACK in prompt else None
        if earlier is not None:
            # A redo after the reviewer's feedback: the refund is done; only the email is written again.
            return [_email(order, *_refund_email(order, {**earlier, "currency": order["currency"]}))]
        return _decide(number, message, order)
    order = next(c.json() for c in calls if c.name == "lookup_order" and not c.is_error)
    if last.name == "issue_refund":
        email = _refund_email(order, last.json()) if not last.is_error else _refund_failed_email(order, last.result)
        return [_email(order, *email)]
    if last.name == "email_customer":
        refund = next((c for c in calls if c.name == "issue_refund"), None)
        if last.is_error:
            return [text(f"The email to the customer failed: {last.result}")]
        if refund is not None and not refund.is_error:
            done = f"Refunded {money(Decimal(refund.json()['amount']), order['currency'])} on order {number}"
            return [text(f"{done} and emailed {order['customer_email']} to confirm.")]
        earlier = _refund_for(order, message) if _FEEDBACK in prompt else None
        if earlier is not None:
            amount = money(Decimal(earlier["amount"]), order["currency"])
            return [text(f"Sent {order['customer_email']} a corrected email about the {amount} refund on {number}.")]
        if _REFUND_RE.search(message):
            return [text(f"No refund on order {number}; I explained why by email to {order['customer_email']}.")]
        return [text(f"Answered the customer's question about order {number} by email to {order['customer_email']}.")]
    return [text("Done.")]


def _decide(number: str, message: str, order: Mapping[str, Any]) -> list[dict[str, Any]]:
    if not _REFUND_RE.search(message):
        return [_email(order, f"Your order {number}", _status_answer(order))]
    refundable = Decimal(order["refundable"])
    if refundable <= 0:
        return [_email(order, f"About your refund request for order {number}", _no_refund_reason(order))]
    asked = _amount_in(message)
    amount = min(asked, refundable) if asked else refundable
    reason = _reason(message)
    return [
        text(f"Order {number} can be refunded up to {refundable}; the customer asks for {asked or 'a full refund'}."),
        tool_use("issue_refund", {"order_id": number, "amount": f"{amount:.2f}", "reason": reason}),
    ]


def _reason(message: str) -> str:
    return message if len(message) <= 120 else message[:117] + "..."


def _refund_for(order: Mapping[str, Any], message: str) -> Mapping[str, Any] | None:
    """The refund an earlier attempt made for this very message (its reason is the message), if any."""
    return next((r for r in order.get("refunds") or [] if r.get("reason") == _reason(message)), None)


def _email(order: Mapping[str, Any], subject: str, paragraph: str) -> dict[str, Any]:
    name = order["customer_name"].split()[0]
    body = f"Dear {name},\n\n{paragraph}\n\n{SIGN_OFF}"
    return tool_use("email_customer", {"order_id": order["order_id"], "subject": subject, "body": body})


def _refund_email(order: Mapping[str, Any], receipt: Mapping[str, Any]) -> tuple[str, str]:
    amount = money(Decimal(receipt["amount"]), order["currency"])
    whole = Decimal(receipt["amount"]) >= Decimal(order["amount_paid"])
    what = "the full amount you paid" if whole else "the amount you asked about"
    return (
        f"Your refund for order {order['order_id']}",
        f"We have refunded {amount} ({what}) for order {order['order_id']} to your original payment method. "
        "Banks usually take 3 to 5 business days to show it. Sorry for the trouble, and thank you for your patience.",
    )


def _refund_failed_email(order: Mapping[str, Any], error: str | None) -> tuple[str, str]:
    number = order["order_id"]
    if "rejected" in (error or ""):
        why = "After reviewing your request, our team could not approve a refund for this order."
    else:
        why = "We could not make the refund right now."
    return (
        f"About your refund request for order {number}",
        f"{why} A member of our team will contact you within two business days about order {number} "
        "and the options you have.",
    )


def _no_refund_reason(order: Mapping[str, Any]) -> str:
    number, currency = order["order_id"], order["currency"]
    if order["status"] in ("placed", "cancelled"):
        return (
            f"We have not taken any payment for order {number} ({order['status']}), so there is nothing to "
            "refund. You will not be charged for it."
        )
    refunds = order.get("refunds") or []
    when = f" on {refunds[-1]['issued_at']}" if refunds else ""
    return (
        f"Order {number} has already been refunded in full: {money(Decimal(order['refunded']), currency)} "
        f"went back to your original payment method{when}. If it has not reached your account after 5 business "
        "days, reply to this email and we will trace it with our bank."
    )


def _status_answer(order: Mapping[str, Any]) -> str:
    number, status = order["order_id"], order["status"]
    if status == "shipped":
        state = f"is on its way: it left our warehouse on {order['shipped_at']}, and deliveries take 2 to 4 days"
    elif status == "delivered":
        state = f"was delivered on {order['delivered_at']}"
    elif status == "paid":
        state = "is paid and being prepared; we will email you the tracking link when it ships"
    else:
        state = f"is {status}"
    return f"Thanks for getting in touch. Your order {number} {state}. Reply to this email if anything is wrong."


def review(messages: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """A verdict on the email under review: does it cover the rubric's points?"""
    subject = "\n".join(_text(m.get("content")) for m in messages if m.get("role") == "user")
    checks = {
        "names the order": bool(re.search(r"order [A-Z]-\d+", subject)),
        "greets the customer": bool(re.search(r"^(Dear|Hello|Hi) \w+", subject, re.M)),
        "states the outcome and what happens next": bool(
            re.search(r"refunded|nothing to refund|could not|on its way|delivered|prepared", subject)
        ),
        "signed, no internal details": SIGN_OFF in subject and not re.search(r"toolu_|idempotency|_refund\(", subject),
    }
    failed = [name for name, ok in checks.items() if not ok]
    score = round(0.95 * (len(checks) - len(failed)) / len(checks), 2)
    if failed:
        reasons = "The email does not: " + "; ".join(failed) + "."
    else:
        reasons = "Names the order, greets the customer, states the outcome and the next step, politely signed."
    return tool_use(VERDICT_TOOL, {"passed": not failed, "score": score, "reasons": reasons})


def _amount_in(message: str) -> Decimal | None:
    found = _AMOUNT_RE.search(message)
    if not found:
        return None
    try:
        return Decimal((found["a"] or found["b"]).replace(",", "."))
    except InvalidOperation:
        return None


def _tool_calls(messages: Sequence[Mapping[str, Any]]) -> list[ToolCall]:
    """Every tool call in order, each with the result the next user message sent back for it."""
    calls: dict[str, ToolCall] = {}
    for message in messages:
        content = message.get("content")
        for block in content if isinstance(content, list) else []:
            if block.get("type") == "tool_use":
                calls[block["id"]] = ToolCall(block["name"], block.get("input") or {})
            elif block.get("type") == "tool_result" and block.get("tool_use_id") in calls:
                call = calls[block["tool_use_id"]]
                calls[block["tool_use_id"]] = ToolCall(
                    call.name, call.input, _text(block.get("content")), bool(block.get("is_error"))
                )
    return list(calls.values())


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(_text(b.get("text", b.get("content", ""))) for b in content if isinstance(b, Mapping))
    return ""


def _missing(what: str) -> Any:
    raise ValueError(f"the prompt names no {what}: the refund script expects the refund_agent prompt")

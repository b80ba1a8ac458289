"""What a wait asks, in a form an approver can read: a tool approval as the tool and a table of its arguments.

A tool approval stores the tool's name and the hash of the exact arguments it authorises, not the arguments
themselves; its question reads `Allow issue_refund({...})?`, cut at 200 characters. The arguments shown are
the ones that hash to the wait's `args_hash` — from the question when it is whole, else from the planned
step's arguments or the agent turn that asked for the call — so the table is exactly the call a "yes"
authorises. When none of those is whole, the approver reads the question and the brief as they are.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from django.core.serializers.json import DjangoJSONEncoder

from durable_agents.models import Turn, Wait, WaitKind
from durable_agents.tools import args_digest

# `Allow <tool>(<json>)?`: the question engine/approvals.py asks for a tool call.
TOOL_QUESTION = re.compile(r"\AAllow (?P<tool>[\w.-]+)\((?P<args>.*)\)\?\Z", re.S)
# A value longer than this shows its start, with the whole of it one click away.
SHORT_VALUE = 160
# Agent turns searched for the call, newest first.
RECENT_TURNS = 5


@dataclass(frozen=True)
class Argument:
    name: str
    text: str

    @property
    def short(self) -> str:
        return self.text if len(self.text) <= SHORT_VALUE else self.text[: SHORT_VALUE - 1] + "…"

    @property
    def is_long(self) -> bool:
        return len(self.text) > SHORT_VALUE


@dataclass(frozen=True)
class Asks:
    """A wait's question, readable: the tool and its arguments for a tool approval, else its question."""

    question: str
    tool: str = ""
    arguments: tuple[Argument, ...] | None = None

    @property
    def is_tool_call(self) -> bool:
        return bool(self.tool)


def asks(wait: Wait, *, look_further: bool = True) -> Asks:
    """What `wait` asks; a tool approval whose arguments can be recovered whole comes with its arguments.

    `look_further=False` reads the question only (no query): for lists, where a row must cost nothing.
    """
    question = wait.question or wait.name or wait.kind
    if wait.kind != WaitKind.APPROVAL or not wait.args_hash or not wait.name:
        return Asks(question=question)
    args = _recovered_args(wait, look_further)
    if args is None:
        return Asks(question=question, tool=wait.name)
    return Asks(question=question, tool=wait.name, arguments=tuple(_argument(k, v) for k, v in sorted(args.items())))


def _argument(name: str, value: Any) -> Argument:
    text = value if isinstance(value, str) else json.dumps(value, cls=DjangoJSONEncoder, ensure_ascii=False)
    return Argument(name=str(name), text=text)


def _recovered_args(wait: Wait, look_further: bool) -> dict[str, Any] | None:
    for candidate in _candidates(wait, look_further):
        if isinstance(candidate, dict) and args_digest(candidate) == wait.args_hash:
            return candidate
    return None


def _json_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:  # cut short at 200 characters
        return None


def _candidates(wait: Wait, look_further: bool) -> Any:
    """Where the call's arguments may be found, cheapest first (the question costs no query)."""
    found = TOOL_QUESTION.match(wait.question)
    if found and found.group("tool") == wait.name:
        yield _json_or_none(found.group("args"))
    if wait.step_id is None or not look_further:
        return
    step_args = wait.step.args if wait.step is not None else {}
    if isinstance(step_args, dict):
        yield step_args.get("args")
        yield step_args
    turns = Turn.objects.filter(step_id=wait.step_id).order_by("-index").values_list("content", flat=True)
    for content in turns[:RECENT_TURNS]:
        for block in content if isinstance(content, list) else []:
            if isinstance(block, dict) and block.get("type") == "tool_use" and block.get("name") == wait.name:
                yield block.get("input")

"""The conversations of one replay case, side by side: the recording's (observed) and each replay run's.

A conversation is read as a list of entries (the model's text, a tool call with its arguments, the tool's answer),
from the recording's `turns` or a replay run's Turn rows — the same fields either way. The n-th tool call is marked
where the lane's calls first differ from the observed ones (the report's `first_divergence`).

Example::

    entries = observed_conversation(recording.data, first_divergence=1)
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from django.core.serializers.json import DjangoJSONEncoder

from durable_agents.models import Turn

# A block or a tool result is shown up to this many characters; the rest is said to exist.
SHOWN_CHARS = 6000


@dataclass(frozen=True)
class Entry:
    """One thing said in a conversation: `kind` is text, tool_use, tool_result, thinking or other."""

    kind: str
    step: str
    title: str
    body: str
    is_error: bool = False
    diverges: bool = False


def _shown(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, indent=2, cls=DjangoJSONEncoder, ensure_ascii=False)
    return text if len(text) <= SHOWN_CHARS else f"{text[:SHOWN_CHARS]}… ({len(text) - SHOWN_CHARS:,} more characters)"


def _result_text(content: Any) -> str:
    """A tool_result's content as the model read it: a string, or its text blocks."""
    if isinstance(content, list):
        parts = [b.get("text", "") if isinstance(b, dict) and b.get("type") == "text" else _shown(b) for b in content]
        return "\n".join(parts)
    return content if isinstance(content, str) else _shown(content)


def _entries(turns: Iterable[dict[str, Any]], first_divergence: int | None) -> list[Entry]:
    entries: list[Entry] = []
    calls = 0
    for turn in turns:
        step = str(turn.get("step") or "")
        for block in turn.get("content") or ():
            if not isinstance(block, dict):
                continue
            kind = block.get("type")
            if kind == "text":
                entries.append(Entry("text", step, "model", _shown(block.get("text", ""))))
            elif kind == "tool_use":
                entries.append(
                    Entry(
                        "tool_use",
                        step,
                        f"calls {block.get('name')}",
                        _shown(block.get("input") or {}),
                        diverges=calls == first_divergence,
                    )
                )
                calls += 1
            elif kind in ("thinking", "redacted_thinking"):
                size = len(str(block.get("thinking") or block.get("data") or ""))
                entries.append(Entry("thinking", step, "thinking", f"({size:,} characters of thinking, not shown)"))
            else:
                entries.append(Entry("other", step, str(kind), _shown(block)))
        for result in turn.get("tool_results") or ():
            if isinstance(result, dict):
                error = bool(result.get("is_error"))
                title = "tool error" if error else "tool answered"
                entries.append(Entry("tool_result", step, title, _shown(_result_text(result.get("content"))), error))
    return entries


def _from_calls(calls: Iterable[dict[str, Any]], first_divergence: int | None) -> list[Entry]:
    """An imported case with tool calls but no turns: its calls and their answers."""
    entries = []
    for i, call in enumerate(calls):
        step, error = str(call.get("step") or ""), bool(call.get("is_error"))
        arguments, answer = _shown(call.get("input") or {}), _shown(_result_text(call.get("result")))
        entries.append(Entry("tool_use", step, f"calls {call.get('name')}", arguments, diverges=i == first_divergence))
        entries.append(Entry("tool_result", step, "tool error" if error else "tool answered", answer, error))
    return entries


def observed_conversation(data: dict[str, Any], first_divergence: int | None = None) -> list[Entry]:
    """The recording's conversation (its agent turns), the call at `first_divergence` marked."""
    turns = [t for t in data.get("turns") or () if t.get("purpose", "turn") == "turn"]
    if turns:
        return _entries(turns, first_divergence)
    return _from_calls(data.get("tool_calls") or (), first_divergence)


def run_conversation(run_id: Any, first_divergence: int | None = None) -> list[Entry]:
    """A replay run's conversation from its Turn rows (one query), the call at `first_divergence` marked."""
    rows = (
        Turn.objects.filter(run_id=run_id, purpose="turn")
        .order_by("step_id", "index")
        .values("step__name", "content", "tool_results")
    )
    return _entries(
        ({"step": r["step__name"], "content": r["content"], "tool_results": r["tool_results"]} for r in rows),
        first_divergence,
    )

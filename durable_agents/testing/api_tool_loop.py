"""The tool loop's rules for the fake Anthropic API: how tool_use, tool_result and server tool blocks may follow one
another in `messages`, each broken rule a 400 with the API's words.

https://platform.claude.com/docs/en/agents-and-tools/tool-use/handle-tool-calls: every tool_use gets one
tool_result, in the user message right after it, tool_result blocks first; a request holding either block
defines `tools`; https://platform.claude.com/docs/en/build-with-claude/handling-stop-reasons: a server tool
deferred behind a client tool call runs when the results come back, so that message holds results only;
https://platform.claude.com/docs/en/build-with-claude/extended-thinking: with extended thinking (`enabled`) the
assistant turn being answered starts with its thinking block.

Example::

    problem = check_tool_loop(body["messages"], tools_defined=bool(body.get("tools")), extended_thinking=False)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["THINKING_KINDS", "check_tool_loop", "content_blocks", "merged_turns"]

THINKING_KINDS = frozenset({"thinking", "redacted_thinking"})
DUPLICATE_TOOL_USE = "messages: `tool_use` ids must be unique"  # observed wording
TOOLS_REQUIRED = "Requests which include `tool_use` or `tool_result` blocks must define tools."  # observed wording


def content_blocks(message: Mapping[str, Any]) -> list[Any]:
    """A message's content as blocks (a string is one text block); anything else holds none."""
    content = message.get("content")
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return content if isinstance(content, list) else []


def merged_turns(messages: list[dict[str, Any]]) -> list[tuple[int, str, list[dict[str, Any]]]]:
    """(index of the first message, role, blocks): consecutive same-role messages combined, as the API does."""
    merged: list[tuple[int, str, list[dict[str, Any]]]] = []
    for i, message in enumerate(messages):
        blocks = [b for b in content_blocks(message) if isinstance(b, dict)]
        if merged and merged[-1][1] == message["role"]:
            merged[-1][2].extend(blocks)
        else:
            merged.append((i, message["role"], list(blocks)))
    return merged


def check_tool_loop(messages: list[dict[str, Any]], *, tools_defined: bool, extended_thinking: bool) -> str | None:
    """The first tool-loop rule these (well-formed) messages break, as the 400 message; None if none is.

    `extended_thinking`: the request's thinking type is `enabled`.
    """
    turns = merged_turns(messages)
    kinds = {block["type"] for _index, _role, blocks in turns for block in blocks}
    if kinds & {"tool_use", "tool_result"} and not tools_defined:
        return TOOLS_REQUIRED
    return _pairing(turns) or _deferred_server_tools(turns) or (_thinking_first(turns) if extended_thinking else None)


def _pairing(turns: list[tuple[int, str, list[dict[str, Any]]]]) -> str | None:
    seen: set[str] = set()
    for _index, role, blocks in turns:
        if role != "assistant":
            continue
        for block in blocks:
            if block["type"] in ("tool_use", "server_tool_use"):
                if block["id"] in seen:
                    return DUPLICATE_TOOL_USE
                seen.add(block["id"])
    for position, (index, role, blocks) in enumerate(turns):
        if role == "assistant":
            calls = [b["id"] for b in blocks if b["type"] == "tool_use"]
            following = turns[position + 1] if position + 1 < len(turns) else None
            answered = (
                {b.get("tool_use_id") for b in following[2] if b["type"] == "tool_result"} if following else set()
            )
            if missing := [c for c in calls if c not in answered]:
                where = following[0] if following else index
                return (
                    f"messages.{where}: tool_use ids were found without tool_result blocks immediately after: "
                    f"{', '.join(missing)}. Each tool_use block must have a corresponding tool_result block in the "
                    "next message."
                )
            continue
        results = [(j, b) for j, b in enumerate(blocks) if b["type"] == "tool_result"]
        if not results:
            continue
        if results[-1][0] != len(results) - 1:
            # The fake's words for the documented rule "tool_result blocks must come FIRST".
            return (
                f"messages.{index}: `tool_result` blocks must come first in the message content, before any other block"
            )
        previous = turns[position - 1][2] if position > 0 else []
        calls = {b["id"] for b in previous if b["type"] == "tool_use"}
        answered: set[str] = set()
        for j, block in results:
            tool_use_id = block.get("tool_use_id")
            if tool_use_id not in calls:
                return (
                    f"messages.{index}.content.{j}: unexpected `tool_use_id` found in `tool_result` blocks: "
                    f"{tool_use_id}. Each `tool_result` block must have a corresponding `tool_use` block in the "
                    "previous message."
                )
            if tool_use_id in answered:
                return (
                    f"messages.{index}: each tool_use must have a single result. Found multiple `tool_result` "
                    f"blocks with id: {tool_use_id}"
                )
            answered.add(tool_use_id)
    return None


def _deferred_server_tools(turns: list[tuple[int, str, list[dict[str, Any]]]]) -> str | None:
    # handling-stop-reasons: a server_tool_use left without its result beside a client tool call (stop_reason
    # "tool_use") runs when the user message after it comes back, which must then hold ONLY tool_result blocks;
    # anything else is a 400 in the API's words "`web_search` tool use with id `srvtoolu_…` was found without a
    # corresponding `web_search_tool_result` block". A paused turn (pause_turn, no client call) is continued by
    # sending it back as is, and the docs say nothing of a user message after it: not judged here.
    for position, (_index, role, blocks) in enumerate(turns[:-1]):
        if role != "assistant" or not any(b["type"] == "tool_use" for b in blocks):
            continue
        resolved = {b.get("tool_use_id") for b in blocks if b["type"].endswith("_tool_result")}
        pending = [b for b in blocks if b["type"] == "server_tool_use" and b["id"] not in resolved]
        following = turns[position + 1]
        if pending and any(b["type"] != "tool_result" for b in following[2]):
            name, tool_use_id = pending[0]["name"], pending[0]["id"]
            return (
                f"messages.{following[0]}: `{name}` tool use with id `{tool_use_id}` was found without a "
                f"corresponding `{name}_tool_result` block"
            )
    return None


def _thinking_first(turns: list[tuple[int, str, list[dict[str, Any]]]]) -> str | None:
    # extended-thinking: "During tool use, you must pass thinking blocks back to the API for the last assistant
    # message"; the API's 400 (observed) starts "Expected `thinking` or `redacted_thinking`, but found `tool_use`".
    # Models with the prefix check refuse an altered latest turn in `thinking_binding`; this is the rule for the
    # models before them, where `enabled` is still taken.
    last = next(((index, blocks) for index, role, blocks in reversed(turns) if role == "assistant"), None)
    if last is None or not any(b["type"] == "tool_use" for b in last[1]):
        return None
    index, blocks = last
    if blocks[0]["type"] in THINKING_KINDS:
        return None
    return (
        f"messages.{index}.content.0.type: Expected `thinking` or `redacted_thinking`, but found "
        f"`{blocks[0]['type']}`. When `thinking` is enabled, a final `assistant` message must start with a thinking "
        "block (preceding the lastmost set of `tool_use` and `tool_result` blocks). We recommend you include "
        "thinking blocks from previous turns. To avoid this requirement, disable `thinking`."
    )

"""What the model is sent: the conversation an agent step rebuilds, its compaction, and its cache breakpoints.

Compaction happens at a checkpoint boundary (a turn whose tool results are in) once the last prompt
passed `COMPACT_AT_PROMPT_TOKENS`: every turn but the last `KEEP_RECENT_TURNS` is folded, with its tool
results and the earlier summary, into a structured summary written by the step's own participant (a
journaled model call, Turn.purpose "compaction"). The summary is stored with the checkpoint in
`Step.context` (`Compacted`); from then on, and on every resume, the model is sent

    tools + system + [user: prompt, summary] + the turns from `covers_until` on

and a resume reads Step.context and those recent turns only, never the whole journal.

Where the summary goes: a second block of the first user message, after the prompt. Not the system
prompt, because (1) the summary quotes tool output, which must not gain the authority of instructions;
(2) the system prompt stays byte-identical for every run of the agent, so its cache entry is shared
across runs and survives every compaction; (3) no filler assistant/user pair is needed to keep turns
alternating — the first kept turn is an assistant message, right after it.

Cache breakpoints (the API allows four): the last tool definition, the system prompt, the summary block,
and the last block of the last user message. The first three are the stable prefix; the last one makes
each request write what the next one reads, so a turn, a compaction call (which sends a prefix of the
last request plus an instruction) and a resumed step's first request all pay cache-read prices for
everything up to the newest tool results. The last *user* message, not a trailing assistant prefill:
a continuation after `max_tokens` is sent exactly as journaled.

Thinking blocks (preserved thinking): the API checks that everything before a thinking block it is sent back —
system, tools, every earlier message — is byte-identical to when the block was produced, and refuses (400) or
ignores the block otherwise; dropping blocks oldest-first, or all of them, is allowed. A fold replaces the
turns before the kept ones by a summary, so the prefix of every kept turn's thinking block changes: kept turns
lose their thinking blocks (the model still sees their text, tool calls and results) on models that run that
check (preserved thinking: the 5.x models of the table); older models, which ignore earlier turns' blocks but want
the last tool-use turn's block back unchanged under extended thinking, keep them. Turns after the fold keep
theirs: their prefix is the new opening, which stays as it is until the next fold. A turn answered by another
model (a fallback, an operator's swap) keeps no thinking blocks the model now asked cannot read: they are dropped
on purpose, and the agent loop records it. The compaction call itself sends a prefix of the last
request unchanged, thinking blocks included.

Continuing after `max_tokens`: where the model takes an assistant prefill (and is not thinking), the cut answer
is sent back as the last message and the model goes on from it; elsewhere (every 4.6+ model refuses prefill) a
user message asks the model to continue from where it stopped, as the migration guides advise.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

from durable_agents.agents.messages import ModelRequest, ModelResponse, text
from durable_agents.conf import settings

SUMMARY_OPEN = "<conversation_summary>"
SUMMARY_CLOSE = "</conversation_summary>"
SUMMARY_PREFACE = (
    "The earlier turns of this conversation, with their tool calls and results, were condensed into the summary "
    "below. Continue the task from it; never repeat an action it records as done."
)
COMPACTION_INSTRUCTION = (
    "[compaction] Pause the task: write a summary of the conversation so far, which will replace it. Do not call "
    "tools; answer with the summary only, in these sections:\n"
    "## Task - the goal and constraints, as the user gave them.\n"
    "## Done - every action that changed something (charges, refunds, messages sent, records written), with its "
    "arguments and the ids or results it returned. These must never be repeated.\n"
    "## Facts - what the tools returned that is still needed: ids, amounts, statuses, decisions.\n"
    "## Open - what remains to be done, and the next step.\n"
    "Fold any earlier summary in: drop nothing still needed, keep identifiers exact, be concise."
)
# Blocks the API accepts a cache_control on; thinking blocks and empty text take none.
CACHEABLE_BLOCKS = frozenset({"text", "tool_result", "tool_use", "image", "document"})
THINKING_BLOCKS = frozenset({"thinking", "redacted_thinking"})
CONTINUE_PROMPT = (
    "Your previous response was cut off by the output limit. Continue exactly from where it stopped, without "
    "repeating anything."
)
# What a kept turn says in place of an answer that was all thinking (an assistant message may not be empty).
THOUGHT_PLACEHOLDER = "(thinking omitted)"
RECENT_CALLS = 5
_SNAPSHOT_DATE = re.compile(r"-\d{8}$")
CLIP_CHARS = 200


@dataclass(frozen=True)
class Compacted:
    """An agent step's compacted context, as stored in Step.context."""

    summary: str
    # The first journal index the summary does not cover: turns from here on are sent verbatim.
    covers_until: int
    # The journal index of the compaction call that wrote this summary.
    turn: int
    # Compaction calls made by the step so far: they take journal indices too, but are not agent turns.
    compactions: int
    # The prompt that triggered this compaction, and the invalid tool calls made in the turns it covers.
    prompt_tokens_before: int = 0
    tool_errors: int = 0

    def as_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | None) -> Compacted | None:
        if not data or "summary" not in data:
            return None
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})


@dataclass(frozen=True)
class FoldPoint:
    """Where to cut: `messages[position]` is the assistant message of turn `covers_until`, the first one kept."""

    position: int
    covers_until: int


@dataclass(frozen=True)
class _TurnMark:
    index: int
    position: int
    stop_reason: str


class Conversation:
    """The messages an agent step sends: the opening user message (prompt, then any summary) and recent turns.

    Example::

        conversation = Conversation("Charge order A-1", Compacted.from_json(step.context), prefill=False)
        conversation.add_turn(turn.index, turn.content, turn.stop_reason, model=turn.model)
        conversation.add_results(turn.tool_results)
        request_messages = conversation.sendable("claude-sonnet-5-5")
    """

    def __init__(
        self, prompt: Any, compacted: Compacted | None = None, *, prefill: bool = True, strip_on_fold: bool = True
    ) -> None:
        self.prompt = prompt
        self.compacted = compacted
        self.prefill = prefill
        # A fold drops the kept turns' thinking blocks for a model that checks their prefix (preserved thinking).
        self.strip_on_fold = strip_on_fold
        self.messages: list[dict[str, Any]] = [{"role": "user", "content": self._opening()}]
        # The model that produced each assistant message (by position), for the thinking blocks it may carry.
        self._models: dict[int, str] = {}
        self._turns: list[_TurnMark] = []
        # Where the answer being written began: a continuation adds to it.
        self._answer_from = 1
        self.dropped_models: set[str] = set()

    def _opening(self) -> list[dict[str, Any]]:
        # Always blocks: a string prompt sent as a string on one turn and as a block with a cache breakpoint on the
        # next (when it was the last user message) would change the prefix of every thinking block after it.
        blocks = [text(self.prompt)] if isinstance(self.prompt, str) else [dict(b) for b in self.prompt]
        return blocks if self.compacted is None else [*blocks, summary_block(self.compacted.summary)]

    @property
    def final_text(self) -> str:
        return "".join(text_of(m["content"]) for m in self.messages[self._answer_from :] if m["role"] == "assistant")

    def add_turn(
        self,
        index: int,
        content: Sequence[Mapping[str, Any]],
        stop_reason: str,
        *,
        model: str = "",
        strip_thinking: bool = False,
    ) -> None:
        """Add a response; a continuation (after max_tokens or pause_turn) extends the previous assistant message
        (as a prefill), or follows a user message asking to continue where prefill is refused."""
        blocks = [dict(b) for b in content]
        if strip_thinking:
            blocks = [b for b in blocks if b.get("type") not in THINKING_BLOCKS] or [text(THOUGHT_PLACEHOLDER)]
        last = self.messages[-1]
        if last["role"] != "assistant":
            if not _is_continue(last):
                self._answer_from = len(self.messages)
            self.messages.append({"role": "assistant", "content": blocks})
            self._models[len(self.messages) - 1] = model
        else:
            merged = last["content"]
            for block in blocks:
                if merged and merged[-1].get("type") == "text" and block.get("type") == "text":
                    merged[-1] = {**merged[-1], "text": merged[-1]["text"] + block["text"]}
                else:
                    merged.append(block)
        self._turns.append(_TurnMark(index, len(self.messages) - 1, stop_reason))
        if stop_reason == "max_tokens" and not self.prefill:
            self.messages.append({"role": "user", "content": [text(CONTINUE_PROMPT)]})

    def add_results(self, results: list[dict[str, Any]]) -> None:
        self.messages.append({"role": "user", "content": results})

    def sendable(self, model: str = "") -> list[dict[str, Any]]:
        """A copy fit to send to `model`: breakpoints added, thinking blocks of other models left out, and no final
        assistant text ending in whitespace (the API refuses that prefill)."""
        out = [dict(m) for m in self.messages]
        for position, producer in self._models.items():
            if model and producer and not _same_model(producer, model) and position < len(out):
                content = out[position]["content"]
                kept = [b for b in content if b.get("type") not in THINKING_BLOCKS]
                if len(kept) != len(content):
                    self.dropped_models.add(producer)
                    out[position] = {**out[position], "content": kept or [text(THOUGHT_PLACEHOLDER)]}
        last = out[-1]
        if last["role"] == "assistant" and last["content"] and last["content"][-1].get("type") == "text":
            last["content"] = [
                *last["content"][:-1],
                {**last["content"][-1], "text": last["content"][-1]["text"].rstrip()},
            ]
        return cacheable_messages(out)

    def fold_point(self, keep: int) -> FoldPoint | None:
        """The newest cut that keeps at least `keep` turns verbatim and folds at least one; None if there is none.

        A cut lies only after a turn whose tool results are in, so the kept part starts with a fresh assistant
        message and every tool_use keeps its tool_result.
        """
        for j in range(len(self._turns) - max(keep, 1), 0, -1):
            before, first_kept = self._turns[j - 1], self._turns[j]
            if before.stop_reason == "tool_use" and first_kept.position > before.position:
                return FoldPoint(first_kept.position, first_kept.index)
        return None

    def fold(self, compacted: Compacted, point: FoldPoint) -> None:
        """Replace everything before the cut by the opening message carrying the new summary."""
        self.compacted = compacted
        shift = point.position - 1
        kept = self.messages[point.position :]
        kept = [_without_thinking(m) for m in kept] if self.strip_on_fold else kept
        self.messages = [{"role": "user", "content": self._opening()}, *kept]
        self._models = {p - shift: m for p, m in self._models.items() if p >= point.position}
        self._answer_from = max(1, self._answer_from - shift)
        self._turns = [
            _TurnMark(m.index, m.position - shift, m.stop_reason) for m in self._turns if m.index >= point.covers_until
        ]

    def compaction_request(self, base: ModelRequest, point: FoldPoint, *, turn_number: int) -> ModelRequest:
        """Ask for a summary of everything before the cut: a prefix of the last request (a cache read), plus the
        instruction. Tools, thinking and effort stay as they were: changing tools would miss the cache, and effort
        may not change mid-conversation under between_tools thinking."""
        messages = cacheable_messages(self.sendable(base.model)[: point.position])
        last = messages[-1]
        content = [text(last["content"])] if isinstance(last["content"], str) else list(last["content"])
        messages[-1] = {**last, "content": [*content, text(COMPACTION_INSTRUCTION)]}
        return ModelRequest(
            model=base.model,
            max_tokens=int(settings.COMPACTION_MAX_TOKENS),
            system=base.system,
            tools=base.tools,
            messages=messages,
            metadata=base.metadata,
            thinking=base.thinking,
            output_config=base.output_config,
            purpose="compaction",
            turn_number=turn_number,
            step_key=base.step_key,
        )


def _is_continue(message: Mapping[str, Any]) -> bool:
    content = message.get("content")
    return isinstance(content, list) and len(content) == 1 and content[0].get("text") == CONTINUE_PROMPT


def _same_model(a: str, b: str) -> bool:
    """One model under two names (an id and its dated snapshot) reads its own thinking blocks."""
    return _SNAPSHOT_DATE.sub("", a) == _SNAPSHOT_DATE.sub("", b)


def _without_thinking(message: dict[str, Any]) -> dict[str, Any]:
    if message.get("role") != "assistant":
        return message
    kept = [b for b in message["content"] if b.get("type") not in THINKING_BLOCKS]
    return {**message, "content": kept or [text(THOUGHT_PLACEHOLDER)]}


def summary_block(summary: str) -> dict[str, Any]:
    return text(f"{SUMMARY_PREFACE}\n{SUMMARY_OPEN}\n{summary}\n{SUMMARY_CLOSE}")


def summary_of(messages: Sequence[Mapping[str, Any]]) -> str | None:
    """The summary carried by a conversation's opening message, if it has one."""
    content = messages[0].get("content") if messages else None
    for block in content if isinstance(content, list) else []:
        value = block.get("text", "") if block.get("type") == "text" else ""
        if SUMMARY_OPEN in value and SUMMARY_CLOSE in value:
            return value.split(SUMMARY_OPEN, 1)[1].rsplit(SUMMARY_CLOSE, 1)[0].strip()
    return None


def summary_text(response: ModelResponse, request: ModelRequest) -> str:
    """The summary a compaction call produced; if the model answered with no text, a deterministic one,
    so a run never fails (or compacts again at once) over a summary."""
    return text_of(list(response.content)).strip() or deterministic_summary(request)


def deterministic_summary(request: ModelRequest) -> str:
    """A bounded summary computed from the request alone: turns, tool calls by name and the last few calls
    with their (clipped) results, folded into the previous summary. Scripted participants answer with it."""
    try:
        previous = json.loads(summary_of(request.messages) or "{}")
    except ValueError:
        previous = {"earlier": _clip(summary_of(request.messages) or "")}
    turns = int(previous.get("turns", 0))
    calls: Counter[str] = Counter(previous.get("calls", {}))
    recent: list[dict[str, Any]] = list(previous.get("recent", []))
    pending: dict[str, dict[str, Any]] = {}
    for message in request.messages[1:]:
        content = message.get("content")
        blocks = [text(content)] if isinstance(content, str) else list(content or [])
        for block in blocks:
            if block.get("type") == "tool_use":
                calls[block["name"]] += 1
                entry = {"tool": block["name"], "input": _clip(json.dumps(block.get("input"), sort_keys=True))}
                recent.append(entry)
                pending[block.get("id", "")] = entry
            elif block.get("type") == "tool_result" and block.get("tool_use_id") in pending:
                pending[block["tool_use_id"]]["result"] = _clip(text_of(block.get("content", "")))
        turns += message.get("role") == "assistant"
    summary = {**previous, "turns": turns, "calls": dict(sorted(calls.items())), "recent": recent[-RECENT_CALLS:]}
    return json.dumps(summary, sort_keys=True)


def cache_control() -> dict[str, str] | None:
    """The breakpoint marker for DURABLE_AGENTS['PROMPT_CACHE_TTL'] ("5m", "1h"), or None when caching is off."""
    ttl = settings.PROMPT_CACHE_TTL
    if not ttl:
        return None
    return {"type": "ephemeral"} if ttl == "5m" else {"type": "ephemeral", "ttl": ttl}


def cacheable_tools(tools: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The tools with a breakpoint on the last one, at the TTL configured now (markers on them before are dropped:
    a frozen head sent after PROMPT_CACHE_TTL changed must not put a 5 min breakpoint before a 1 h one)."""
    unmarked = [{k: v for k, v in tool.items() if k != "cache_control"} for tool in tools]
    control = cache_control()
    if control is None or not unmarked:
        return unmarked
    return [*unmarked[:-1], {**unmarked[-1], "cache_control": control}]


def cacheable_system(system: str | Sequence[Mapping[str, Any]]) -> Any:
    """The system prompt with a breakpoint, at the TTL configured now; a list of blocks stays a list."""
    control = cache_control()
    if isinstance(system, str):
        return [{"type": "text", "text": system, "cache_control": control}] if control and system else system
    blocks = [{k: v for k, v in block.items() if k != "cache_control"} for block in system]
    if control is None or not blocks:
        return blocks
    return [*blocks[:-1], {**blocks[-1], "cache_control": control}]


def cacheable_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Breakpoints on the summary block and on the last block of the last user message (a shallow copy)."""
    control = cache_control()
    if control is None:
        return messages
    out = list(messages)
    last_user = max((i for i, m in enumerate(out) if m.get("role") == "user"), default=None)
    if last_user is not None:
        out[last_user] = _mark(out[last_user], control, last=True)
    if out and out[0].get("role") == "user" and summary_of(out) is not None:
        out[0] = _mark(out[0], control, last=False)
    return out


def _mark(message: dict[str, Any], control: dict[str, str], *, last: bool) -> dict[str, Any]:
    content = message.get("content")
    blocks = [text(content)] if isinstance(content, str) else [dict(b) for b in content or []]
    targets = range(len(blocks) - 1, -1, -1) if last else range(len(blocks))
    for i in targets:
        block = blocks[i]
        if block.get("type") not in CACHEABLE_BLOCKS or (block.get("type") == "text" and not block.get("text")):
            continue
        if last or SUMMARY_OPEN in block.get("text", ""):
            blocks[i] = {**block, "cache_control": control}
            break
    return {**message, "content": blocks}


def text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(block.get("text", "") for block in content if block.get("type") == "text")


def _clip(value: str) -> str:
    return value if len(value) <= CLIP_CHARS else value[: CLIP_CHARS - 1] + "…"

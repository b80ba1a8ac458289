"""What the fake Anthropic API refuses: the Messages API's documented request rules, each a 400 with the API's words.

Every rule cites the page it comes from. Where the docs quote the error, the message is theirs word for word;
where they only say "400", the words are the fake's own and the comment says so. `check_request` runs the rules
in a fixed order and returns the first problem; the model lookup (404) and the thinking-block signatures
(`thinking_binding`) are checked by the fake around it.

Consecutive messages of one role: the API reference says they "will be combined into a single turn"; the fake
refuses them by default (``strict_roles=True``) because our client never means to send them, and a merge hides
a bug. ``strict_roles=False`` combines them, as the API does.

Example::

    problem = check_request(body, path="/v1/messages", rules=MODELS["claude-opus-5-5"])
    if problem: answer 400 invalid_request_error with `problem` as the message
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from durable_agents.testing.api_models import ModelRules

__all__ = ["BINDING_BETA", "THINKING_KINDS", "check_request", "effort_of", "thinking_on", "thinking_type"]

COUNT_TOKENS_PATH = "/v1/messages/count_tokens"
BINDING_BETA = "thinking-binding-controls-2026-08-01"
DISPLAY_UPDATES_BETA = "thinking-display-updates-2026-08-18"
STRUCTURED_OUTPUTS_BETA = "structured-outputs-2025-11-13"
THINKING_KINDS = frozenset({"thinking", "redacted_thinking"})
THINKING_TYPES = ("adaptive", "between_tools", "disabled", "enabled")
_TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
_USER_BLOCKS = frozenset({"text", "image", "document", "search_result", "tool_result", "container_upload"})
_ASSISTANT_BLOCKS = frozenset({"text", "thinking", "redacted_thinking", "tool_use", "server_tool_use"})

# https://platform.claude.com/docs/en/models/sonnet-5-5/migration-guide (also opus-5-5, fable-5-1 pages)
FORCED_TOOL_REFUSED = 'tool_choice: type "tool" and "any" are not supported for this model.'
# https://platform.claude.com/docs/en/models/sonnet-5-5/migration-guide ("errors#prefill-not-supported")
PREFILL_REFUSED = (
    "This model does not support assistant message prefill. The conversation must end with a user message."
)
FIRST_USER = 'messages: first message must use the "user" role'
EMPTY_TEXT = "messages: text content blocks must be non-empty"
BLANK_TEXT = "messages: text content blocks must contain non-whitespace text"
DUPLICATE_TOOL_USE = "messages: `tool_use` ids must be unique"


@dataclass(frozen=True)
class _Request:
    body: dict[str, Any]
    rules: ModelRules
    count_only: bool
    strict_roles: bool
    betas: frozenset[str]
    continuation: bool = False


def thinking_type(body: Mapping[str, Any], rules: ModelRules) -> str:
    """The thinking type in effect: the request's, else the model's default ("adaptive" or "disabled")."""
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and isinstance(thinking.get("type"), str):
        return thinking["type"]
    return "adaptive" if rules.thinking_default else "disabled"


def thinking_on(body: Mapping[str, Any], rules: ModelRules) -> bool:
    """Whether this request thinks, so may be answered with thinking blocks."""
    return thinking_type(body, rules) != "disabled"


def effort_of(body: Mapping[str, Any], rules: ModelRules) -> str:
    config = body.get("output_config")
    effort = config.get("effort") if isinstance(config, dict) else None
    return effort if isinstance(effort, str) else rules.default_effort


def check_request(
    body: dict[str, Any],
    *,
    path: str,
    rules: ModelRules,
    strict_roles: bool = True,
    betas: frozenset[str] = frozenset(),
    continuation: bool = False,
) -> str | None:
    """The first rule this request breaks, as the 400 message; None if the API would accept it.

    `continuation`: the final assistant message is a paused turn sent back to go on, not a prefill.
    """
    request = _Request(body, rules, path == COUNT_TOKENS_PATH, strict_roles, betas, continuation)
    for check in (
        _max_tokens,
        _thinking,
        _output_config,
        _sampling,
        _tools,
        _tool_choice,
        _messages,
        _pairing,
        _cache_control,
    ):
        if problem := check(request):
            return problem
    return None


def _forced(body: Mapping[str, Any]) -> bool:
    choice = body.get("tool_choice")
    return isinstance(choice, dict) and choice.get("type") in ("tool", "any")


def _max_tokens(request: _Request) -> str | None:
    # https://platform.claude.com/docs/en/api/messages: max_tokens is required; "Different models have different
    # maximum values". 0 pre-warms the cache and then excludes streaming, forced tool_choice, structured outputs
    # and extended thinking (https://platform.claude.com/docs/en/build-with-claude/prompt-caching).
    if request.count_only:
        return None
    body, rules = request.body, request.rules
    value = body.get("max_tokens")
    if type(value) is not int:
        return "max_tokens: Input should be a valid integer"
    if value < 0:
        return "max_tokens: Input should be greater than or equal to 0"
    if value == 0:
        config = body.get("output_config")
        thinking = body.get("thinking")
        if (
            body.get("stream")
            or _forced(body)
            or (isinstance(config, dict) and config.get("format"))
            or (isinstance(thinking, dict) and thinking.get("type") == "enabled")
        ):
            # The fake's words: the docs list the exclusions but not the error text.
            return "max_tokens: 0 cannot be combined with stream, forced tool_choice, structured outputs or thinking"
    if value > rules.max_output:
        # Observed wording (the docs only say the maximum differs per model).
        return (
            f"max_tokens: {value} > {rules.max_output}, which is the maximum allowed number of output tokens "
            f"for {rules.model}"
        )
    return None


def _thinking(request: _Request) -> str | None:
    # https://platform.claude.com/docs/en/build-with-claude/thinking-troubleshooting: the types each model takes.
    body, rules = request.body, request.rules
    thinking = body.get("thinking")
    if thinking is None:
        return None
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind not in THINKING_TYPES:
        return "thinking.type: Input should be 'adaptive', 'between_tools', 'disabled' or 'enabled'"
    assert isinstance(thinking, dict)
    allowed = {
        "adaptive": {"type", "display", "block_binding"},
        "enabled": {"type", "budget_tokens", "display", "block_binding"},
        "disabled": {"type"},
        # https://platform.claude.com/docs/en/models/sonnet-5-5/migration-guide: between_tools "takes no other
        # field": display, budget_tokens, block_binding → 400 (wording not documented).
        "between_tools": {"type"},
    }[kind]
    # https://platform.claude.com/docs/en/build-with-claude/preserved-thinking: block_binding without the beta
    # header is refused with "... block_binding: Extra inputs are not permitted".
    if "block_binding" in thinking and BINDING_BETA not in request.betas and "block_binding" in allowed:
        return f"thinking.{kind}.block_binding: Extra inputs are not permitted"
    if extra := sorted(set(thinking) - allowed):
        return f"thinking.{kind}.{extra[0]}: Extra inputs are not permitted"
    if kind not in rules.thinking_types:
        return rules.refusal(kind)
    effort = effort_of(body, rules)
    if kind == "disabled" and rules.disabled_efforts is not None and effort not in rules.disabled_efforts:
        # thinking-troubleshooting / prompting-claude-haiku-5-5: disabled only up to "high"; wording is the fake's.
        return f'"thinking.type.disabled" is not supported with output_config.effort "{effort}" on this model.'
    if kind == "between_tools" and effort not in ("low", "medium", "high"):
        # migration-guide (Sonnet 5.5): between_tools at xhigh/max → 400; wording is the fake's.
        return f'"thinking.type.between_tools" is not supported with output_config.effort "{effort}".'
    if kind == "enabled":
        # https://platform.claude.com/docs/en/api/messages: budget_tokens ≥ 1024 and less than max_tokens.
        budget = thinking.get("budget_tokens")
        if type(budget) is not int:
            return "thinking.enabled.budget_tokens: Field required"
        if budget < 1024:
            return "thinking.enabled.budget_tokens: Input should be greater than or equal to 1024"
        if not request.count_only and isinstance(body.get("max_tokens"), int) and budget >= body["max_tokens"]:
            return "`max_tokens` must be greater than `thinking.budget_tokens`"
    display = thinking.get("display")
    updates = display == "updates" and DISPLAY_UPDATES_BETA in request.betas
    if display is not None and display not in ("summarized", "omitted") and not updates:
        return f"thinking.{kind}.display: Input should be 'summarized' or 'omitted'"
    binding = thinking.get("block_binding")
    if binding is not None:
        behavior = binding.get("prefix_mismatch_behavior") if isinstance(binding, dict) else None
        if behavior not in ("error", "drop_block"):
            return f"thinking.{kind}.block_binding.prefix_mismatch_behavior: Input should be 'error' or 'drop_block'"
    return None


def _output_config(request: _Request) -> str | None:
    # https://platform.claude.com/docs/en/build-with-claude/effort: effort levels per model;
    # https://platform.claude.com/docs/en/build-with-claude/structured-outputs: format json_schema.
    body, rules = request.body, request.rules
    if "output_format" in body and STRUCTURED_OUTPUTS_BETA not in request.betas:
        # migration-guide: the deprecated `output_format` needs its beta header, else 400.
        return "output_format: Extra inputs are not permitted"
    config = body.get("output_config")
    if config is None:
        return None
    if not isinstance(config, dict):
        return "output_config: Input should be a valid dictionary"
    effort = config.get("effort")
    if effort is not None:
        if not rules.efforts:
            return "output_config.effort: effort is not supported on this model"  # the fake's words
        if effort not in rules.efforts:
            levels = ", ".join(f"'{e}'" for e in ("low", "medium", "high", "xhigh", "max") if e in rules.efforts)
            return f"output_config.effort: Input should be {levels}"
    fmt = config.get("format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
            return "output_config.format.type: Input should be 'json_schema'"
        if not isinstance(fmt.get("schema"), dict):
            return "output_config.format.schema: Field required"
    return None


def _sampling(request: _Request) -> str | None:
    # https://platform.claude.com/docs/en/models/sonnet-5-5/migration-guide: non-default temperature / top_p /
    # top_k → 400 on Opus 4.7+ and every 5.x model (observed wording "`temperature` is deprecated for this
    # model."); Haiku 4.5 takes temperature or top_p, not both. Only temperature has a documented default (1.0).
    body, rules = request.body, request.rules
    present = [name for name in ("temperature", "top_p", "top_k") if body.get(name) is not None]
    for name in present:
        value = body[name]
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return f"{name}: Input should be a valid number"
        if name != "top_k" and not 0 <= value <= 1:
            return f"{name}: Input should be less than or equal to 1" if value > 1 else f"{name}: Input should be >= 0"
    if rules.sampling == "none":
        for name in present:
            if not (name == "temperature" and body[name] == 1):
                return f"`{name}` is deprecated for this model."
    if rules.sampling == "one" and "temperature" in present and "top_p" in present:
        return "`temperature` and `top_p` cannot both be specified for this model. Please use only one."
    return None


def _tools(request: _Request) -> str | None:
    # https://platform.claude.com/docs/en/agents-and-tools/tool-use/implement-tool-use: name matches
    # ^[a-zA-Z0-9_-]{1,64}$; input_schema is a JSON Schema object ("type": "object").
    tools = request.body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        return "tools: Input should be a valid list"
    names: set[str] = set()
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            return f"tools.{i}: Input should be a valid dictionary"
        name = tool.get("name")
        custom = tool.get("type") in (None, "custom")
        if not isinstance(name, str) or (custom and not _TOOL_NAME.match(name)):
            return f"tools.{i}.custom.name: String should match pattern '^[a-zA-Z0-9_-]{{1,64}}$'"
        if custom:
            schema = tool.get("input_schema")
            if not isinstance(schema, dict):
                return f"tools.{i}.custom.input_schema: Field required"
            if schema.get("type") != "object":
                return f"tools.{i}.custom.input_schema.type: Input should be 'object'"
        if name in names:
            return "tools: Tool names must be unique."
        names.add(name)
    return None


def _tool_choice(request: _Request) -> str | None:
    body, rules = request.body, request.rules
    choice = body.get("tool_choice")
    if choice is None:
        return None
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in ("auto", "any", "tool", "none"):
        return "tool_choice.type: Input should be 'auto', 'any', 'tool' or 'none'"
    if kind in ("auto", "none"):
        return None
    # migration-guide (Sonnet 5.5), whats-new-opus-5-5, whats-new-fable-5-1; also enforced on count_tokens.
    if not rules.forced_tool_choice:
        return FORCED_TOOL_REFUSED
    # https://platform.claude.com/docs/en/build-with-claude/extended-thinking: forced tool use is incompatible
    # with thinking ("tool_choice: any/tool" not supported while thinking); wording observed from the API.
    if thinking_on(body, rules):
        return "Thinking may not be enabled when tool_choice forces tool use."
    names = {t.get("name") for t in body.get("tools") or [] if isinstance(t, dict)}
    if not names:
        return "tool_choice may only be specified while providing tools."
    if kind == "tool" and choice.get("name") not in names:
        return f"tool_choice.name: no tool named {choice.get('name')!r} is defined in tools"  # the fake's words
    return None


def _content(message: Mapping[str, Any]) -> list[Any]:
    content = message.get("content")
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return content if isinstance(content, list) else []


def _messages(request: _Request) -> str | None:
    body, rules = request.body, request.rules
    messages = body["messages"]
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            return f"messages.{i}.role: Input should be 'user' or 'assistant'"
    # Observed 400s (not in the current reference, which is silent on them); see the module docstring on roles.
    if messages[0]["role"] != "user":
        return FIRST_USER
    if request.strict_roles:
        for previous, message in zip(messages, messages[1:], strict=False):
            if message["role"] == previous["role"]:
                role = message["role"]
                return (
                    'messages: roles must alternate between "user" and "assistant", '
                    f'but found multiple "{role}" roles in a row'
                )
    for i, message in enumerate(messages):
        content = message.get("content")
        if content in (None, "", []) or not isinstance(content, (str, list)):
            return (
                f"messages.{i}: all messages must have non-empty content except for the optional final "
                "assistant message"
            )
        allowed = _USER_BLOCKS if message["role"] == "user" else _ASSISTANT_BLOCKS
        for j, block in enumerate(_content(message)):
            if not isinstance(block, dict) or not isinstance(block.get("type"), str):
                return f"messages.{i}.content.{j}: Input should be a valid content block"
            kind = block["type"]
            if kind not in allowed and not (message["role"] == "assistant" and kind.endswith("_tool_result")):
                return f"messages.{i}.content.{j}: `{kind}` blocks are not allowed in `{message['role']}` messages"
            if problem := _block(block, f"messages.{i}.content.{j}"):
                return problem
    # https://platform.claude.com/docs/en/models/sonnet-5-5/migration-guide: a final assistant message is a
    # prefill; 4.6+ and every 5.x model refuse it. Older models refuse it while thinking (extended thinking docs).
    # https://platform.claude.com/docs/en/build-with-claude/handling-stop-reasons: after pause_turn the paused
    # assistant content (a server_tool_use without its result) goes back as-is to continue: not a prefill.
    paused = any(b.get("type") == "server_tool_use" for b in _content(messages[-1]) if isinstance(b, dict))
    if messages[-1]["role"] == "assistant" and not (paused or request.continuation):
        if not rules.prefill:
            return PREFILL_REFUSED
        if thinking_on(body, rules):
            return "Assistant message prefill is not supported when thinking is enabled."  # the fake's words
    return None


def _block(block: Mapping[str, Any], path: str) -> str | None:
    kind = block["type"]
    if kind == "text":
        text = block.get("text")
        if not isinstance(text, str):
            return f"{path}.text.text: Field required"
        if text == "":
            return EMPTY_TEXT
        if not text.strip():
            return BLANK_TEXT
    elif kind == "thinking":
        # The SDK's ThinkingBlockParam requires signature, thinking and type.
        for name in ("signature", "thinking"):
            if not isinstance(block.get(name), str):
                return f"{path}.thinking.{name}: Field required"
    elif kind == "redacted_thinking":
        if not isinstance(block.get("data"), str):
            return f"{path}.redacted_thinking.data: Field required"
    elif kind in ("tool_use", "server_tool_use"):
        if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
            return f"{path}.{kind}.id: Field required"
        if not isinstance(block.get("input"), dict):
            return f"{path}.{kind}.input: Input should be a valid dictionary"
    elif kind == "tool_result" and not isinstance(block.get("tool_use_id"), str):
        return f"{path}.tool_result.tool_use_id: Field required"
    return None


def _merged(messages: list[dict[str, Any]]) -> list[tuple[int, str, list[dict[str, Any]]]]:
    """(index of the first message, role, blocks): consecutive same-role messages combined, as the API does."""
    merged: list[tuple[int, str, list[dict[str, Any]]]] = []
    for i, message in enumerate(messages):
        blocks = [b for b in _content(message) if isinstance(b, dict)]
        if merged and merged[-1][1] == message["role"]:
            merged[-1][2].extend(blocks)
        else:
            merged.append((i, message["role"], list(blocks)))
    return merged


def _pairing(request: _Request) -> str | None:
    # https://platform.claude.com/docs/en/agents-and-tools/tool-use/handle-tool-calls: every tool_use gets one
    # tool_result in the user message right after it, tool_result blocks first in that message; matched by id.
    turns = _merged(request.body["messages"])
    seen: set[str] = set()
    for _index, role, blocks in turns:
        if role != "assistant":
            continue
        for block in blocks:
            if block["type"] in ("tool_use", "server_tool_use"):
                if block["id"] in seen:
                    return DUPLICATE_TOOL_USE  # observed wording
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


def _cache_control(request: _Request) -> str | None:
    # https://platform.claude.com/docs/en/build-with-claude/prompt-caching: at most 4 breakpoints (the automatic
    # top-level one takes a slot), type "ephemeral", ttl "5m" | "1h"; thinking blocks "cannot be cached directly
    # with cache_control"; "Empty text blocks cannot be cached".
    body = request.body
    marked: list[tuple[str, Mapping[str, Any]]] = []
    for i, tool in enumerate(body.get("tools") or []):
        if isinstance(tool, dict):
            marked.append((f"tools.{i}", tool))
    system = body.get("system")
    for j, block in enumerate(system if isinstance(system, list) else []):
        if isinstance(block, dict):
            marked.append((f"system.{j}", block))
    for i, message in enumerate(body["messages"]):
        for j, block in enumerate(_content(message) if isinstance(message.get("content"), list) else []):
            marked.append((f"messages.{i}.content.{j}", block))
            nested = block.get("content") if block.get("type") == "tool_result" else None
            for k, inner in enumerate(nested if isinstance(nested, list) else []):
                if isinstance(inner, dict):
                    marked.append((f"messages.{i}.content.{j}.content.{k}", inner))
    found = 1 if body.get("cache_control") is not None else 0
    for where, block in [("", body), *marked]:
        control = block.get("cache_control")
        if control is None:
            continue
        if where:
            found += 1
        prefix = f"{where}." if where else ""
        if not isinstance(control, dict) or control.get("type") != "ephemeral":
            return f"{prefix}cache_control.type: Input should be 'ephemeral'"
        if control.get("ttl", "5m") not in ("5m", "1h"):
            return f"{prefix}cache_control.ttl: Input should be '5m' or '1h'"
        if block.get("type") in THINKING_KINDS:
            return f"{where}: thinking blocks cannot be cached directly with cache_control"
        if block.get("type") == "text" and not str(block.get("text") or "").strip():
            return f"{where}: cache_control cannot be set for empty text blocks"
    if found > 4:
        return f"A maximum of 4 blocks with cache_control may be provided. Found {found}."
    return None

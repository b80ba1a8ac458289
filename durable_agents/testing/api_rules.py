"""What the fake Anthropic API refuses: the Messages API's documented request rules, each a 400 with the API's words.

Every rule cites the page it comes from. Where the docs quote the error, the message is theirs word for word;
where they only say "400", the words are the fake's own and the comment says so. `check_request` runs the rules
in a fixed order and returns the first problem; the request's shape (`api_shapes.check_shape`), the model lookup
(404) and the thinking-block signatures (`thinking_binding`) are checked by the fake around it. The tool list is
checked in `api_shapes`, the tool loop in `api_tool_loop`.

A rule never raises on a body it did not expect: each runs guarded, and what it trips on is a 400 naming its
field, so a malformed request is answered like the API answers it, never with a dropped connection.

Consecutive messages of one role: the API reference says they "will be combined into a single turn"; the fake
refuses them by default (``strict_roles=True``) because our client never means to send them, and a merge hides
a bug. ``strict_roles=False`` combines them, as the API does.

Example::

    problem = check_request(body, path="/v1/messages", rules=MODELS["claude-opus-5-5"])
    if problem: answer 400 invalid_request_error with `problem` as the message
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from durable_agents.testing.api_models import ModelRules
from durable_agents.testing.api_shapes import check_format_schema, check_tools, text_problem
from durable_agents.testing.api_tool_loop import THINKING_KINDS, check_tool_loop
from durable_agents.testing.api_tool_loop import content_blocks as _content
from durable_agents.testing.fake_cache import prompt_tokens

__all__ = ["BINDING_BETA", "THINKING_KINDS", "check_request", "effort_of", "thinking_on", "thinking_type"]

COUNT_TOKENS_PATH = "/v1/messages/count_tokens"
BINDING_BETA = "thinking-binding-controls-2026-08-01"
DISPLAY_UPDATES_BETA = "thinking-display-updates-2026-08-18"
THINKING_TYPES = ("adaptive", "between_tools", "disabled", "enabled")
_USER_BLOCKS = frozenset({"text", "image", "document", "search_result", "tool_result", "container_upload"})
_ASSISTANT_BLOCKS = frozenset({"text", "thinking", "redacted_thinking", "tool_use", "server_tool_use"})
_RESULT_BLOCKS = frozenset({"text", "image", "document", "search_result", "tool_reference"})

# https://platform.claude.com/docs/en/models/sonnet-5-5/migration-guide (also opus-5-5, fable-5-1 pages)
FORCED_TOOL_REFUSED = 'tool_choice: type "tool" and "any" are not supported for this model.'
# https://platform.claude.com/docs/en/models/sonnet-5-5/migration-guide ("errors#prefill-not-supported")
PREFILL_REFUSED = (
    "This model does not support assistant message prefill. The conversation must end with a user message."
)
FIRST_USER = 'messages: first message must use the "user" role'
# https://platform.claude.com/docs/en/build-with-claude/extended-thinking#important-considerations-when-using-extended-thinking
# (observed wording; the link it ends with is the API's)
TEMPERATURE_WHILE_THINKING = (
    "`temperature` may only be set to 1 when thinking is enabled. Please consult our documentation at "
    "https://docs.claude.com/en/docs/build-with-claude/extended-thinking#important-considerations-when-using-extended-thinking"
)


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
    for name, check in _CHECKS:
        try:
            problem = check(request)
        except (TypeError, ValueError, LookupError, AttributeError, RecursionError) as exc:
            # A rule tripped on a value of a shape it did not expect: the API's schema refuses such a body.
            return f"{name}: Input could not be validated ({type(exc).__name__}: {exc})"
        if problem:
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
        return check_format_schema(fmt["schema"])
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
    if thinking_on(body, rules):
        # https://platform.claude.com/docs/en/build-with-claude/extended-thinking (feature compatibility): thinking
        # "isn't compatible with temperature or top_k modifications"; top_p only between 0.95 and 1. The top_k and
        # top_p wordings are the fake's.
        if "temperature" in present and body["temperature"] != 1:
            return TEMPERATURE_WHILE_THINKING
        if "top_k" in present:
            return "`top_k` must be unset when thinking is enabled."
        if "top_p" in present and not 0.95 <= body["top_p"] <= 1:
            return "`top_p` must be between 0.95 and 1 when thinking is enabled."
    return None


def _tools(request: _Request) -> str | None:
    return check_tools(request.body.get("tools"), request.rules)


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


def _messages(request: _Request) -> str | None:
    body, rules = request.body, request.rules
    messages = body["messages"]
    for i, message in enumerate(messages):
        # `role: "system"` mid-conversation: the preserved-thinking page says models that support mid-conversation
        # system messages take it (Sonnet 5.5 among them), but no page lists which models do nor what such a
        # message may hold, so the fake refuses it on every model, as the models before it do: a request it accepts
        # is one every model accepts. Put such instructions in the top-level `system` (or a user message).
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
        config = body.get("output_config")
        if isinstance(config, dict) and config.get("format") is not None:
            # https://platform.claude.com/docs/en/build-with-claude/structured-outputs: JSON outputs are
            # incompatible with a prefill; the words are the fake's.
            return "output_config.format: structured outputs cannot be combined with an assistant message prefill"
    return None


def _block(block: Mapping[str, Any], path: str) -> str | None:
    kind = block["type"]
    if kind == "text":
        return text_problem(block, path, "messages")
    if kind == "thinking":
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
    elif kind == "tool_result":
        if not isinstance(block.get("tool_use_id"), str):
            return f"{path}.tool_result.tool_use_id: Field required"
        # https://platform.claude.com/docs/en/agents-and-tools/tool-use/handle-tool-calls: content is a string or
        # a list of content blocks (text, image, document, search result).
        content = block.get("content")
        if content is not None and not isinstance(content, (str, list)):
            return f"{path}.tool_result.content: Input should be a valid string or a list of content blocks"
        for k, inner in enumerate(content if isinstance(content, list) else []):
            if not isinstance(inner, dict) or inner.get("type") not in _RESULT_BLOCKS:
                return f"{path}.tool_result.content.{k}: Input should be a valid content block"
            if inner["type"] == "text" and not isinstance(inner.get("text"), str):
                return f"{path}.tool_result.content.{k}.text: Field required"
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
    found = 0
    short = False  # a 5m breakpoint came before: a 1h one may not follow it
    # The automatic top-level breakpoint marks the last cacheable block, so it comes last in the order.
    for where, block in [*marked, ("", body)]:
        control = block.get("cache_control")
        if control is None:
            continue
        found += 1
        prefix = f"{where}." if where else ""
        if not isinstance(control, dict) or control.get("type") != "ephemeral":
            return f"{prefix}cache_control.type: Input should be 'ephemeral'"
        ttl = control.get("ttl", "5m")
        if ttl not in ("5m", "1h"):
            return f"{prefix}cache_control.ttl: Input should be '5m' or '1h'"
        if block.get("type") in THINKING_KINDS:
            return f"{where}: thinking blocks cannot be cached directly with cache_control"
        if block.get("type") == "text" and not str(block.get("text") or "").strip():
            return f"{where}: cache_control cannot be set for empty text blocks"
        if ttl == "1h" and short:
            # prompt-caching (mixing TTLs): longer TTLs come before shorter ones; observed wording.
            return (
                f"{prefix}cache_control.ttl: a ttl='1h' cache_control block must not come after a ttl='5m' "
                "cache_control block. Note that blocks are processed in the following order: `tools`, `system`, "
                "`messages`."
            )
        short = short or ttl == "5m"
    if found > 4:
        return f"A maximum of 4 blocks with cache_control may be provided. Found {found}."
    return None


def _tool_loop(request: _Request) -> str | None:
    body = request.body
    return check_tool_loop(
        body["messages"],
        tools_defined=bool(body.get("tools")),
        extended_thinking=thinking_type(body, request.rules) == "enabled",
    )


def _context_window(request: _Request) -> str | None:
    # https://platform.claude.com/docs/en/build-with-claude/context-windows: a prompt over the model's window is a
    # 400 "prompt is too long: N tokens > M maximum" (observed wording), measured with the fake's own estimate.
    # count_tokens is how a client learns a prompt's size, so it answers whatever the size.
    if request.count_only:
        return None
    tokens = prompt_tokens(request.body)
    if tokens > request.rules.context_window:
        return f"prompt is too long: {tokens} tokens > {request.rules.context_window} maximum"
    return None


# Each rule with the field it reads, named when it trips on a value of an unexpected shape.
_CHECKS: tuple[tuple[str, Callable[[_Request], str | None]], ...] = (
    ("max_tokens", _max_tokens),
    ("thinking", _thinking),
    ("output_config", _output_config),
    ("temperature", _sampling),
    ("tools", _tools),
    ("tool_choice", _tool_choice),
    ("messages", _messages),
    ("messages", _tool_loop),
    ("cache_control", _cache_control),
    ("messages", _context_window),
)

"""The request's shape for the fake Anthropic API: the top-level fields each endpoint takes, `system`, the tool list
and its types, and the JSON schemas of structured outputs and strict tools. Each problem is a 400 message.

The API validates a request against its schema before any rule runs, and answers what fails with the field's path
("tools.0.custom.name: ...", "temprature: Extra inputs are not permitted"). The fake does the same here, so what
the later rules (`api_rules`, `api_tool_loop`) and the cache accounting (`fake_cache`) read has the right types.

Example::

    problem = check_shape(body, path="/v1/messages", betas=frozenset())
    problem or check_tools(body.get("tools"), rules)
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from durable_agents.testing.api_models import ModelRules

__all__ = ["BLANK_TEXT", "EMPTY_TEXT", "check_format_schema", "check_shape", "check_tools", "text_problem"]

COUNT_TOKENS_PATH = "/v1/messages/count_tokens"
STRUCTURED_OUTPUTS_BETA = "structured-outputs-2025-11-13"
# Observed wordings (the reference is silent on them), for `messages` and, the same way, for `system`.
EMPTY_TEXT = "text content blocks must be non-empty"
BLANK_TEXT = "text content blocks must contain non-whitespace text"

# The fields of the installed SDK's `messages.create` / `messages.stream` (2.16) and `messages.count_tokens` sends,
# https://platform.claude.com/docs/en/api/messages: the API refuses any other with "<field>: Extra inputs are not
# permitted" (the wording https://platform.claude.com/docs/en/build-with-claude/preserved-thinking quotes).
# temperature / top_p / top_k are still API fields (`api_rules` refuses them per model), though SDK 2.16 no longer
# has them as arguments; `output_format` is the deprecated structured-outputs field, taken only with its beta
# header. count_tokens takes the prompt and what shapes it, no generation parameter
# (https://platform.claude.com/docs/en/build-with-claude/token-counting). The beta namespace's extra fields
# (context_management, mcp_servers, ...) are not modelled: they are refused like any unknown field.
_PROMPT_FIELDS = frozenset(
    {"model", "messages", "system", "tools", "tool_choice", "thinking", "output_config", "cache_control", "speed"}
)
_MESSAGES_FIELDS = _PROMPT_FIELDS | {
    "max_tokens",
    "container",
    "diagnostics",
    "inference_geo",
    "metadata",
    "service_tier",
    "stop_sequences",
    "stream",
    "temperature",
    "top_p",
    "top_k",
}
# Expected types of the fields later rules read without checking (None: the field is sent as null, allowed).
_TYPES: dict[str, tuple[type, ...]] = {
    "metadata": (dict,),
    "stop_sequences": (list,),
    "stream": (bool,),
    "tool_choice": (dict,),
    "thinking": (dict,),
    "output_config": (dict,),
    "cache_control": (dict,),
    "tools": (list,),
}
_TYPE_NAMES = {dict: "a valid dictionary", list: "a valid list", bool: "a valid boolean"}

_TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
# The tool union of https://platform.claude.com/docs/en/api/messages as the SDK types it (`ToolUnionParam`, plus the
# beta union's computer, advisor and MCP types, whose beta headers the fake does not ask for).
BUILT_IN_TOOL_TYPES = frozenset(
    {
        "bash_20241022",
        "bash_20250124",
        "browser_toolset_20260801",
        "code_execution_20250522",
        "code_execution_20250825",
        "code_execution_20260120",
        "code_execution_20260521",
        "computer_20251124",
        "computer_toolset_20260801",
        "memory_20250818",
        "text_editor_20241022",
        "text_editor_20250124",
        "text_editor_20250429",
        "text_editor_20250728",
        "tool_search_tool_bm25",
        "tool_search_tool_bm25_20251119",
        "tool_search_tool_regex",
        "tool_search_tool_regex_20251119",
        "web_fetch_20250910",
        "web_fetch_20260209",
        "web_fetch_20260309",
        "web_fetch_20260318",
        "web_search_20250305",
        "web_search_20260209",
        "web_search_20260318",
        "advisor_20260301",
        "mcp_toolset",
    }
)
# https://platform.claude.com/docs/en/models/sonnet-5-5/migration-guide: computer_20250124 → 400 on every model
# (computer_20241022 is older still); the models that refuse computer_20251124 say so in `ModelRules.refused_tools`.
RETIRED_TOOL_TYPES = frozenset({"computer_20241022", "computer_20250124"})
# https://platform.claude.com/docs/en/build-with-claude/structured-outputs: at most 20 strict tools a request.
MAX_STRICT_TOOLS = 20


def check_shape(body: Any, *, path: str, betas: frozenset[str]) -> str | None:
    """The first thing wrong with the request's top-level shape (required and unknown fields, their types,
    `system`), as the 400 message; None if it is well formed."""
    if not isinstance(body, dict):
        return "request body must be a JSON object"
    count_only = path == COUNT_TOKENS_PATH
    for name in ("model", "messages") if count_only else ("model", "max_tokens", "messages"):
        if name not in body:
            return f"{name}: Field required"
    allowed = _PROMPT_FIELDS if count_only else _MESSAGES_FIELDS
    if STRUCTURED_OUTPUTS_BETA in betas:
        # migration-guide: the deprecated `output_format` needs its beta header, else 400.
        allowed = allowed | {"output_format"}
    if extra := sorted(set(body) - allowed):
        return f"{extra[0]}: Extra inputs are not permitted"
    if not isinstance(body["messages"], list) or not body["messages"]:
        return "messages: at least one message is required"
    for name, types in _TYPES.items():
        value = body.get(name)
        if value is not None and not isinstance(value, types):
            return f"{name}: Input should be {_TYPE_NAMES[types[0]]}"
    for i, item in enumerate(body.get("stop_sequences") or []):
        if not isinstance(item, str):
            return f"stop_sequences.{i}: Input should be a valid string"
    return _system(body.get("system"))


def text_problem(block: Mapping[str, Any], path: str, where: str) -> str | None:
    """What is wrong with a text block at `path` (in `where`: "messages" or "system"), if anything."""
    text = block.get("text")
    if not isinstance(text, str):
        return f"{path}.text.text: Field required"
    if text == "":
        return f"{where}: {EMPTY_TEXT}"
    if not text.strip():
        return f"{where}: {BLANK_TEXT}"
    return None


def _system(system: Any) -> str | None:
    # https://platform.claude.com/docs/en/api/messages: `system` is a string or a list of text blocks; its blocks
    # are held to what message text blocks are (non-empty, not only whitespace).
    if system is None or isinstance(system, str):
        return None
    if not isinstance(system, list):
        return "system: Input should be a valid string or a list of text blocks"
    for j, block in enumerate(system):
        if not isinstance(block, dict):
            return f"system.{j}: Input should be a valid dictionary"
        if block.get("type") != "text":
            return f"system.{j}.type: Input should be 'text'"
        if problem := text_problem(block, f"system.{j}", "system"):
            return problem
    return None


def check_tools(tools: Any, rules: ModelRules) -> str | None:
    """The first thing wrong with `tools` for this model, as the 400 message; None if nothing is.

    https://platform.claude.com/docs/en/agents-and-tools/tool-use/implement-tool-use: a custom tool's name matches
    ^[a-zA-Z0-9_-]{1,64}$ and its input_schema is a JSON Schema object ("type": "object"); names are unique.
    """
    if tools is None:
        return None
    if not isinstance(tools, list):
        return "tools: Input should be a valid list"
    names: set[str] = set()
    strict = 0
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            return f"tools.{i}: Input should be a valid dictionary"
        kind = tool.get("type")
        custom = kind in (None, "custom")
        if not custom and (problem := _built_in(kind, i, rules)):
            return problem
        name = tool.get("name")
        if not isinstance(name, str) or (custom and not _TOOL_NAME.match(name)):
            return f"tools.{i}.custom.name: String should match pattern '^[a-zA-Z0-9_-]{{1,64}}$'"
        if custom:
            schema = tool.get("input_schema")
            if not isinstance(schema, dict):
                return f"tools.{i}.custom.input_schema: Field required"
            if schema.get("type") != "object":
                return f"tools.{i}.custom.input_schema.type: Input should be 'object'"
            if tool.get("strict") is True:
                # https://platform.claude.com/docs/en/agents-and-tools/tool-use/strict-tool-use: a strict tool's
                # schema is held to the structured-outputs subset, `additionalProperties: false` on every object.
                strict += 1
                if where := _open_object(schema, f"tools.{i}.custom.input_schema"):
                    return _open_message(where)
        if name in names:
            return "tools: Tool names must be unique."
        names.add(name)
    if strict > MAX_STRICT_TOOLS:
        return f"tools: at most {MAX_STRICT_TOOLS} strict tools may be given in one request; found {strict}."
    return None


def _built_in(kind: Any, i: int, rules: ModelRules) -> str | None:
    # Not documented word for word: the fake's words for the refusals the migration guide describes.
    if kind in RETIRED_TOOL_TYPES or kind in rules.refused_tools:
        return f"tools.{i}.type: '{kind}' is not supported for this model. Use 'computer_toolset_20260801'."
    if not isinstance(kind, str) or kind not in BUILT_IN_TOOL_TYPES:
        # Pydantic's words for a discriminated union's unknown tag, as the API's schema validation answers.
        return f"tools.{i}: Input tag '{kind}' found using 'type' does not match any of the expected tags"
    return None


def check_format_schema(schema: Mapping[str, Any]) -> str | None:
    """https://platform.claude.com/docs/en/build-with-claude/structured-outputs: `output_config.format`'s schema
    sets `additionalProperties: false` on every object, nested ones too."""
    where = _open_object(schema, "output_config.format.schema")
    return _open_message(where) if where else None


def _open_message(where: str) -> str:
    return f"{where}: For 'object' type, 'additionalProperties' must be explicitly set to false"  # the fake's words


def _open_object(schema: Any, path: str) -> str | None:
    """The path of the first object schema that does not close `additionalProperties`, or None."""
    if not isinstance(schema, dict):
        return None
    kind = schema.get("type")
    is_object = kind == "object" or (isinstance(kind, list) and "object" in kind) or "properties" in schema
    if is_object and schema.get("additionalProperties") is not False:
        return path
    for key in ("properties", "$defs", "definitions", "patternProperties"):
        children = schema.get(key)
        for name, child in children.items() if isinstance(children, dict) else ():
            if where := _open_object(child, f"{path}.{key}.{name}"):
                return where
    for key in ("items", "additionalProperties", "not", "contains", "if", "then", "else"):
        if where := _open_object(schema.get(key), f"{path}.{key}"):
            return where
    for key in ("anyOf", "allOf", "oneOf", "prefixItems"):
        children = schema.get(key)
        for k, child in enumerate(children if isinstance(children, list) else ()):
            if where := _open_object(child, f"{path}.{key}.{k}"):
                return where
    return None

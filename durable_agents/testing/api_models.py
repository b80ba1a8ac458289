"""The fake Anthropic API's own table of models: what each one accepts, written from the Claude docs, not from ours.

The fake must stay independent of the library's capability table (`durable_agents.agents.capabilities`): if both
were one table, a wrong row would be wrong on both sides and every test would still pass. So this module imports
nothing from the library and its rows are transcribed from the documentation (state of December 2026):

    https://platform.claude.com/docs/en/build-with-claude/thinking-troubleshooting   thinking types per model, errors
    https://platform.claude.com/docs/en/models/sonnet-5-5/migration-guide            prefill, forced tool choice
    https://platform.claude.com/docs/en/models/opus-5-5/whats-new-opus-5-5           Opus 5.5 (disabled refused)
    https://platform.claude.com/docs/en/models/fable-5-1/whats-new-fable-5-1         Fable 5.1 breaking changes
    https://platform.claude.com/docs/en/models/fable-5-2/whats-new-fable-5-2         Fable 5.2 (prefix check always)
    https://platform.claude.com/docs/en/models/haiku-5-5/overview                    Haiku 5.5
    https://platform.claude.com/docs/en/build-with-claude/preserved-thinking         which model reads whose blocks
    https://platform.claude.com/docs/en/about-claude/model-deprecations              retired ids (404)

Ids are exact, as the API matches them: `claude-haiku-4-5-20251001` is a row of its own, a made-up dated id is not.
A model the table does not know is served with `CONSERVATIVE` (the newest models' rules: thinking on when
omitted, adaptive only, no prefill, no forced tool choice, no sampling parameters, prefix check) unless the fake
is built with ``strict_models=True``, when it is a 404 like a retired one.

Example::

    rules = MODELS["claude-sonnet-5-5"]
    rules.prefill, rules.forced_tool_choice, "between_tools" in rules.thinking_types   # False, False, True
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Literal

__all__ = ["CONSERVATIVE", "MODELS", "RETIRED_MODELS", "ModelRules", "rules_for"]

EFFORTS = ("low", "medium", "high", "xhigh", "max")
ALL_EFFORTS = frozenset(EFFORTS)
NO_XHIGH = frozenset({"low", "medium", "high", "max"})
UP_TO_HIGH = frozenset({"low", "medium", "high"})

# The documented 400 texts for a refused `thinking.type` (thinking-troubleshooting; the model pages).
ENABLED_REFUSED = (
    '"thinking.type.enabled" is not supported for this model. Use "thinking.type.adaptive" and '
    '"output_config.effort" to control thinking behavior.'
)
DISABLED_REFUSED = (
    '"thinking.type.disabled" is not supported for this model. Use "thinking.type.adaptive" and '
    '"output_config.effort" to control thinking behavior.'
)
DISABLED_REFUSED_SONNET_5_5 = (
    '"thinking.type.disabled" is not supported for this model. Use "thinking.type.between_tools" for the lowest '
    'thinking setting, or "thinking.type.adaptive" and "output_config.effort" to control thinking behavior.'
)
DISABLED_REFUSED_ALWAYS_ON = (
    '"thinking.type.disabled" is not supported for this model. Thinking defaults to adaptive mode when not '
    'specified; use "thinking.type.enabled" with "budget_tokens" for extended thinking.'
)
ADAPTIVE_REFUSED = "adaptive thinking is not supported on this model"
# Not documented: the fake's own words for between_tools on a model other than Sonnet 5.5.
BETWEEN_TOOLS_REFUSED = '"thinking.type.between_tools" is not supported for this model.'
_DEFAULT_REFUSALS = {
    "enabled": ENABLED_REFUSED,
    "disabled": DISABLED_REFUSED,
    "adaptive": ADAPTIVE_REFUSED,
    "between_tools": BETWEEN_TOOLS_REFUSED,
}


@dataclass(frozen=True)
class ModelRules:
    """What one model id accepts. `signer` names whose thinking blocks these are (a dated id and its alias share
    one); `reads` lists the other signers whose blocks it can read (the rest are dropped silently)."""

    model: str
    max_output: int = 128_000
    context_window: int = 1_000_000
    thinking_default: bool = True  # thinks when the request has no `thinking` field
    thinking_types: frozenset[str] = frozenset({"adaptive"})
    disabled_efforts: frozenset[str] | None = None  # effort levels "disabled" is accepted at; None: any
    display: Literal["omitted", "summarized"] = "omitted"
    prefill: bool = False
    forced_tool_choice: bool = False
    sampling: Literal["any", "one", "none"] = "none"  # "one": temperature or top_p, not both (Haiku 4.5)
    efforts: frozenset[str] = ALL_EFFORTS
    default_effort: str = "high"
    prefix_check: Literal["never", "account", "always"] = "account"
    signer: str = ""
    reads: frozenset[str] = frozenset()
    refusals: Mapping[str, str] = field(default_factory=dict)
    refused_tools: frozenset[str] = frozenset()  # built-in tool types this model answers 400 (computer use)

    def refusal(self, thinking_type: str) -> str:
        """The 400 text for a `thinking.type` this model refuses."""
        return self.refusals.get(thinking_type) or _DEFAULT_REFUSALS[thinking_type]

    def can_read(self, signer: str) -> bool:
        return signer == (self.signer or self.model) or signer in self.reads


# Signers of the models before Fable 5.1, which the 5.x readers below read (preserved-thinking "model check").
_OLDER = frozenset(
    {
        "claude-opus-4-5",
        "claude-sonnet-4-5",
        "claude-haiku-4-5",
        "claude-opus-4-6",
        "claude-sonnet-4-6",
        "claude-opus-4-7",
        "claude-opus-4-8",
    }
)
_FIVE = frozenset({"claude-opus-5", "claude-sonnet-5", "claude-fable-5", "claude-mythos-5"})
# https://platform.claude.com/docs/en/models/sonnet-5-5/migration-guide: on the Claude API, Sonnet 5.5 and Opus 5.5
# refuse the computer_20251124 tool (computer_20250124 is refused everywhere: `api_shapes`).
_OLD_COMPUTER = frozenset({"computer_20251124"})


def _rows() -> dict[str, ModelRules]:
    rows: list[ModelRules] = []
    # The 5.x generation: thinking on when omitted, no prefill, no sampling parameters, 1M / 128K.
    for model, twin in (("claude-fable-5-2", "claude-mythos-5-2"), ("claude-mythos-5-2", "claude-fable-5-2")):
        # Fable 5.2 runs the prefix check on every account, whatever its age (whats-new-fable-5-2).
        rows.append(
            ModelRules(
                model,
                prefix_check="always",
                reads=_OLDER | _FIVE | {twin, "claude-fable-5-1", "claude-mythos-5-1", "claude-opus-5-5"},
                refusals={"disabled": DISABLED_REFUSED_ALWAYS_ON},
            )
        )
    for model, twin, check in (
        ("claude-fable-5-1", "claude-mythos-5-1", "account"),
        ("claude-mythos-5-1", "claude-fable-5-1", "never"),  # "Mythos 5.1 ... don't run the prefix check"
    ):
        rows.append(
            ModelRules(
                model,
                prefix_check=check,  # type: ignore[arg-type]
                reads=_OLDER | _FIVE | {twin, "claude-opus-5-5"},
                refusals={"disabled": DISABLED_REFUSED_ALWAYS_ON},
            )
        )
    rows += [
        ModelRules(
            "claude-opus-5-5",
            default_effort="medium",
            reads=_OLDER | {"claude-opus-5", "claude-sonnet-5"},
            refused_tools=_OLD_COMPUTER,
        ),
        ModelRules(
            "claude-sonnet-5-5",
            thinking_types=frozenset({"adaptive", "between_tools"}),
            reads=_OLDER | {"claude-sonnet-5"},
            refusals={"disabled": DISABLED_REFUSED_SONNET_5_5},
            refused_tools=_OLD_COMPUTER,
        ),
        ModelRules(
            "claude-haiku-5-5",
            thinking_types=frozenset({"adaptive", "disabled"}),
            disabled_efforts=UP_TO_HIGH,
            forced_tool_choice=True,
            default_effort="medium",
            reads=frozenset({"claude-haiku-4-5"}),
        ),
        # Legacy 5.x: no prefix check (it starts with Fable 5.1), forced tool choice still accepted.
        ModelRules(
            "claude-opus-5",
            thinking_types=frozenset({"adaptive", "disabled"}),
            disabled_efforts=UP_TO_HIGH,
            forced_tool_choice=True,
            prefix_check="never",
        ),
        ModelRules(
            "claude-sonnet-5",
            thinking_types=frozenset({"adaptive", "disabled"}),
            forced_tool_choice=True,
            prefix_check="never",
        ),
    ]
    for model in ("claude-fable-5", "claude-mythos-5"):
        rows.append(
            ModelRules(
                model, forced_tool_choice=True, prefix_check="never", refusals={"disabled": DISABLED_REFUSED_ALWAYS_ON}
            )
        )
    # Claude 4.x: thinking off when omitted; forced tool choice accepted, but never while thinking.
    older = {"thinking_default": False, "forced_tool_choice": True, "prefix_check": "never"}
    for model in ("claude-opus-4-8", "claude-opus-4-7"):
        rows.append(ModelRules(model, thinking_types=frozenset({"adaptive", "disabled"}), **older))  # type: ignore[arg-type]
    for model, max_output in (("claude-opus-4-6", 128_000), ("claude-sonnet-4-6", 64_000)):
        rows.append(
            ModelRules(
                model,
                max_output=max_output,
                thinking_types=frozenset({"adaptive", "disabled", "enabled"}),
                display="summarized",
                sampling="any",
                efforts=NO_XHIGH,
                **older,  # type: ignore[arg-type]
            )
        )
    legacy = {
        **older,
        "max_output": 64_000,
        "context_window": 200_000,
        "thinking_types": frozenset({"enabled", "disabled"}),
        "display": "summarized",
        "prefill": True,
    }
    for model, signer in (("claude-opus-4-5", ""), ("claude-opus-4-5-20251101", "claude-opus-4-5")):
        rows.append(ModelRules(model, signer=signer, sampling="any", efforts=UP_TO_HIGH, **legacy))  # type: ignore[arg-type]
    for model, signer in (("claude-sonnet-4-5", ""), ("claude-sonnet-4-5-20250929", "claude-sonnet-4-5")):
        rows.append(ModelRules(model, signer=signer, sampling="any", efforts=frozenset(), **legacy))  # type: ignore[arg-type]
    for model, signer in (("claude-haiku-4-5", ""), ("claude-haiku-4-5-20251001", "claude-haiku-4-5")):
        rows.append(ModelRules(model, signer=signer, sampling="one", efforts=frozenset(), **legacy))  # type: ignore[arg-type]
    return {row.model: row for row in rows}


MODELS: dict[str, ModelRules] = _rows()

# Retired on the Claude API: a request "will fail" with 404 not_found_error "model: <id>" (model-deprecations).
RETIRED_MODELS = frozenset(
    {
        "claude-sonnet-4-20250514",
        "claude-opus-4-20250514",
        "claude-opus-4-1-20250805",
        "claude-3-haiku-20240307",
        "claude-3-5-haiku-20241022",
        "claude-3-7-sonnet-20250219",
        "claude-3-7-sonnet-latest",
        "claude-3-5-sonnet-20240620",
        "claude-3-5-sonnet-20241022",
        "claude-mythos-preview",
    }
)

# The rules of the newest models, for ids the table does not know: a request the fake accepts under this profile
# is one Fable 5.2 / Opus 5.5 accept too. Refusing "disabled" uses Opus 5.5's words (Fable's point at "enabled",
# which is refused as well).
CONSERVATIVE = ModelRules("", prefix_check="account", refused_tools=_OLD_COMPUTER)


def rules_for(model: str, table: Mapping[str, ModelRules], *, strict: bool) -> ModelRules | None:
    """The rules for `model`; None when the API would answer 404 (retired, or unknown under `strict`)."""
    if model in table:
        return table[model]
    if model in RETIRED_MODELS or strict:
        return None
    return replace(CONSERVATIVE, model=model)

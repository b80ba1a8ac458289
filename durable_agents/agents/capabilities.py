"""What each Claude model accepts: one table every model request is built from, never `if model == ...`.

A profile says, for one model id, the limits (context window, max output), how thinking behaves (on when the
`thinking` field is omitted? which `thinking.type` values it accepts?), whether it takes an assistant prefill,
a forced `tool_choice`, non-default sampling parameters and which `output_config.effort` levels, whether it
checks the prefix of a thinking block it is sent back ("preserved thinking"), and its prices. The rows come
from the model pages, migration guides and the pricing page of the Claude docs (December 2026):

    https://platform.claude.com/docs/en/build-with-claude/thinking-troubleshooting   (thinking per model)
    https://platform.claude.com/docs/en/models/sonnet-5-5/migration-guide            (prefill, forced tool choice)
    https://platform.claude.com/docs/en/build-with-claude/preserved-thinking         (prefix checks)
    https://platform.claude.com/docs/en/about-claude/pricing                         (prices, cache reads)

`DURABLE_AGENTS["MODELS"]` extends or overrides the table (a dict of field values by model id); a model the
table does not know gets the CONSERVATIVE profile: thinking assumed on, no prefill, no forced tool choice, no
sampling parameters, its blocks' prefix checked — the rules of the newest models, so a request built for it is
one the newest model accepts. Lookup: the exact id, else the longest id that prefixes it (a dated snapshot such
as `claude-haiku-4-5-20251001` finds `claude-haiku-4-5`).

Example::

    profile = model_profile("claude-sonnet-5-5")
    profile.prefill, profile.forced_tool_choice, profile.thinking_on(None)   # False, False, True
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from decimal import Decimal
from typing import Any

from durable_agents.conf import settings
from durable_agents.errors import DefinitionError

EFFORTS = ("low", "medium", "high", "xhigh", "max")
THINKING_TYPES = ("adaptive", "between_tools", "enabled", "disabled")
ALL_EFFORTS = frozenset(EFFORTS)
NO_XHIGH = frozenset({"low", "medium", "high", "max"})
# between_tools is the lowest thinking setting of Sonnet 5.5 and is refused above "high" effort.
BETWEEN_TOOLS_EFFORTS = frozenset({"low", "medium", "high"})
MILLION = 1_000_000
logger = logging.getLogger("durable_agents.engine")


@dataclass(frozen=True)
class ModelProfile:
    """What one model accepts and costs. Prices are USD per million tokens."""

    model: str
    context_window: int
    max_output: int
    # Thinking when the request has no `thinking` field, and the `thinking.type` values the model accepts.
    thinking_default: bool
    thinking_types: frozenset[str]
    efforts: frozenset[str]
    prefill: bool
    forced_tool_choice: bool
    sampling: bool
    # The API checks that nothing before a returned thinking block changed (400 on accounts made on or after
    # 2026-08-31, and always on some models): compaction and swaps must not change that prefix.
    prefix_check: bool
    prices: tuple[float, float, float, float, float] | None  # input, output, 5 min write, cache read, 1 h write
    known: bool = True

    def thinking_on(self, thinking: Mapping[str, Any] | None) -> bool:
        """Whether a request with this `thinking` field (None: omitted) thinks, so may return thinking blocks."""
        if thinking is None:
            return self.thinking_default
        return thinking.get("type") != "disabled"

    def accepts_forced_tool(self, thinking: Mapping[str, Any] | None) -> bool:
        """Forced tool use (`tool_choice` "tool" or "any"): refused by some models, and by all while thinking."""
        return self.forced_tool_choice and not self.thinking_on(thinking)

    def accepts_prefill(self, thinking: Mapping[str, Any] | None) -> bool:
        """A conversation ending with an assistant message: refused by 4.6+ models, and by all while thinking."""
        return self.prefill and not self.thinking_on(thinking)


def _profile(
    model: str,
    *,
    context: int = MILLION,
    output: int = 128_000,
    default: bool = True,
    types: tuple[str, ...] = ("adaptive",),
    efforts: frozenset[str] = ALL_EFFORTS,
    prefill: bool = False,
    forced: bool = False,
    sampling: bool = False,
    prefix_check: bool = True,
    prices: tuple[float, float, float, float, float] | None = None,
) -> ModelProfile:
    return ModelProfile(
        model, context, output, default, frozenset(types), efforts, prefill, forced, sampling, prefix_check, prices
    )


# (input, output, 5 min cache write, cache read, 1 h cache write) per million tokens, from the pricing page.
PROFILES: dict[str, ModelProfile] = {
    p.model: p
    for p in (
        _profile("claude-fable-5-2", prices=(8.0, 40.0, 10.0, 0.20, 16.0)),
        _profile("claude-mythos-5-2", prices=(8.0, 40.0, 10.0, 0.20, 16.0)),
        _profile("claude-fable-5-1", prices=(10.0, 50.0, 12.5, 0.25, 20.0)),
        _profile("claude-mythos-5-1", prefix_check=False, prices=(10.0, 50.0, 12.5, 0.25, 20.0)),
        _profile("claude-opus-5-5", prices=(4.0, 20.0, 5.0, 0.20, 8.0)),
        _profile("claude-sonnet-5-5", types=("adaptive", "between_tools"), prices=(2.0, 10.0, 2.5, 0.20, 4.0)),
        # Haiku 5.5 is priced in two steps (prompts over 100K tokens cost 5x): the table keeps the first.
        _profile(
            "claude-haiku-5-5", types=("adaptive", "disabled"), forced=True, prices=(0.10, 0.50, 0.125, 0.01, 0.20)
        ),
        _profile("claude-fable-5", forced=True, prefix_check=False, prices=(10.0, 50.0, 12.5, 1.0, 20.0)),
        _profile("claude-mythos-5", forced=True, prefix_check=False, prices=(10.0, 50.0, 12.5, 1.0, 20.0)),
        _profile(
            "claude-opus-5",
            types=("adaptive", "disabled"),
            forced=True,
            prefix_check=False,
            prices=(5.0, 25.0, 6.25, 0.50, 10.0),
        ),
        _profile(
            "claude-sonnet-5",
            types=("adaptive", "disabled"),
            forced=True,
            prefix_check=False,
            prices=(2.0, 10.0, 2.5, 0.20, 4.0),
        ),
        _profile(
            "claude-opus-4-8",
            default=False,
            types=("adaptive", "disabled"),
            forced=True,
            prefix_check=False,
            prices=(5.0, 25.0, 6.25, 0.50, 10.0),
        ),
        _profile(
            "claude-opus-4-7",
            default=False,
            types=("adaptive", "disabled"),
            forced=True,
            prefix_check=False,
            prices=(5.0, 25.0, 6.25, 0.50, 10.0),
        ),
        _profile(
            "claude-opus-4-6",
            default=False,
            types=("adaptive", "disabled", "enabled"),
            efforts=NO_XHIGH,
            forced=True,
            sampling=True,
            prefix_check=False,
            prices=(5.0, 25.0, 6.25, 0.50, 10.0),
        ),
        _profile(
            "claude-sonnet-4-6",
            output=64_000,
            default=False,
            types=("adaptive", "disabled", "enabled"),
            efforts=NO_XHIGH,
            forced=True,
            sampling=True,
            prefix_check=False,
            prices=(3.0, 15.0, 3.75, 0.30, 6.0),
        ),
        _profile(
            "claude-opus-4-5",
            context=200_000,
            output=64_000,
            default=False,
            types=("enabled", "disabled"),
            efforts=NO_XHIGH,
            prefill=True,
            forced=True,
            sampling=True,
            prefix_check=False,
            prices=(5.0, 25.0, 6.25, 0.50, 10.0),
        ),
        _profile(
            "claude-haiku-4-5",
            context=200_000,
            output=64_000,
            default=False,
            types=("enabled", "disabled"),
            efforts=frozenset(),
            prefill=True,
            forced=True,
            sampling=True,
            prefix_check=False,
            prices=(1.0, 5.0, 1.25, 0.10, 2.0),
        ),
    )
}

# A model the table does not know: the newest models' rules, so whatever is built for it they accept.
CONSERVATIVE = _profile("", types=("adaptive",))


def model_profile(model: str) -> ModelProfile:
    """The profile of `model`: DURABLE_AGENTS["MODELS"] over the built-in table; the conservative one if unknown."""
    table = profiles()
    match = table.get(model) or table.get(max((m for m in table if model.startswith(m)), key=len, default=""))
    if match is None:
        return replace(CONSERVATIVE, model=model, known=False)
    return match


def profiles() -> dict[str, ModelProfile]:
    """The built-in table with DURABLE_AGENTS["MODELS"] applied (a new id starts from the conservative profile).

    A row that is not a profile is left out and logged: a worker runs no system checks (E013 reports it where they
    run), and a step must neither fail over a price nor lose a billed answer to one.
    """
    table = dict(PROFILES)
    configured = settings.MODELS
    for model, overrides in configured.items() if isinstance(configured, dict) else ():
        found = problems(overrides) if isinstance(overrides, Mapping) else ["must be a dict of profile fields"]
        if found:
            _warn_once(model, found)
            continue
        base = table.get(model) or replace(CONSERVATIVE, model=model)
        table[model] = replace(base, **coerce(overrides))
    return table


_warned: set[str] = set()


def _warn_once(model: str, found: list[str]) -> None:
    key = f"{model}:{found}"
    if key not in _warned:
        _warned.add(key)
        logger.error("DURABLE_AGENTS['MODELS'][%r] is left out of the model table: %s", model, "; ".join(found))


FIELDS = {f.name for f in fields(ModelProfile)} - {"model", "known"}


def coerce(overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Settings values as profile fields: lists become frozensets, prices a 5-tuple (a 4-tuple gets the 1 h write
    at twice the input price, as the API bills it). Raises ValueError naming a key that is not a field."""
    unknown = sorted(set(overrides) - FIELDS)
    if unknown:
        raise ValueError(f"unknown field(s) {', '.join(unknown)}; fields are {', '.join(sorted(FIELDS))}")
    out = dict(overrides)
    for name in ("thinking_types", "efforts"):
        if name in out:
            out[name] = frozenset(out[name])
    if out.get("prices") is not None:
        prices = tuple(float(p) for p in out["prices"])
        out["prices"] = (*prices, prices[0] * 2) if len(prices) == 4 else prices
    return out


def problems(overrides: Mapping[str, Any]) -> list[str]:
    """Why a DURABLE_AGENTS["MODELS"] entry cannot be a profile (empty if it can): for the system check."""
    try:
        values = coerce(overrides)
    except (ValueError, TypeError) as exc:
        return [str(exc)]
    except Exception as exc:  # noqa: BLE001 - a hostile value (an iterable that raises): reported, not raised
        return [f"{type(exc).__name__}: {exc}"]
    found = []
    for name in ("context_window", "max_output"):
        if name in values and (not isinstance(values[name], int) or isinstance(values[name], bool) or values[name] < 1):
            found.append(f"{name} must be a positive whole number")
    for name in ("thinking_default", "prefill", "forced_tool_choice", "sampling", "prefix_check"):
        if name in values and not isinstance(values[name], bool):
            found.append(f"{name} must be true or false")
    if set(values.get("thinking_types", ())) - set(THINKING_TYPES):
        found.append(f"thinking_types must be among {', '.join(THINKING_TYPES)}")
    if set(values.get("efforts", ())) - ALL_EFFORTS:
        found.append(f"efforts must be among {', '.join(EFFORTS)}")
    prices = values.get("prices")
    if prices is not None and (len(prices) != 5 or any(not p >= 0 for p in prices)):
        found.append("prices must be 4 or 5 numbers >= 0: input, output, cache write, cache read[, 1 h cache write]")
    return found


def thinking_param(thinking: str | Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The `thinking` request field for an agent's `thinking=`: None (the model's default), a type name
    ("adaptive", "between_tools", "disabled") or the whole field ({"type": "enabled", "budget_tokens": 4096})."""
    if thinking is None:
        return None
    if isinstance(thinking, str):
        return {"type": thinking}
    if not isinstance(thinking, Mapping):
        raise DefinitionError(f"thinking must be None, a type name or a dict, got {thinking!r}")
    return dict(thinking)


def shape_problem(thinking: Mapping[str, Any] | None, effort: str | None, max_tokens: int) -> str | None:
    """Why no model would take these choices (None if some model may): a typo is an error at definition, whatever
    model the step ends up asking."""
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        return f"max_tokens must be a positive whole number, got {max_tokens!r}"
    if effort is not None and effort not in EFFORTS:
        return f"effort must be one of {', '.join(EFFORTS)}, got {effort!r}"
    if thinking is None:
        return None
    kind = thinking.get("type")
    if kind not in THINKING_TYPES:
        return f"thinking type must be one of {', '.join(THINKING_TYPES)}, got {kind!r}"
    if kind == "between_tools" and (set(thinking) - {"type"} or (effort or "high") not in BETWEEN_TOOLS_EFFORTS):
        return "thinking 'between_tools' takes no other field and only effort low, medium or high"
    budget = thinking.get("budget_tokens")
    if kind == "enabled" and not (isinstance(budget, int) and budget >= 1024 and budget < max_tokens):
        return "thinking 'enabled' needs budget_tokens, a whole number of at least 1024 and below max_tokens"
    return None


def thinking_problem(profile: ModelProfile, thinking: Mapping[str, Any] | None, effort: str | None) -> str | None:
    """Why `model` would refuse this thinking/effort pair (None if it accepts it), in words that say what to do."""
    name = profile.model or "this model"
    if effort is not None and effort not in EFFORTS:
        return f"effort must be one of {', '.join(EFFORTS)}, got {effort!r}"
    if effort is not None and profile.known and effort not in profile.efforts:
        allowed = ", ".join(e for e in EFFORTS if e in profile.efforts) or "none (leave effort out)"
        return f"{name} does not take effort {effort!r}; it takes: {allowed}"
    if thinking is None:
        return None
    kind = thinking.get("type")
    if kind not in THINKING_TYPES:
        return f"thinking type must be one of {', '.join(THINKING_TYPES)}, got {kind!r}"
    if kind not in profile.thinking_types:
        allowed = ", ".join(t for t in THINKING_TYPES if t in profile.thinking_types)
        return f"{name} does not take thinking {kind!r}; it takes: {allowed} (or leave thinking out for its default)"
    return None


def price_per_million(profile: ModelProfile) -> tuple[Decimal, ...] | None:
    return tuple(Decimal(str(p)) for p in profile.prices) if profile.prices is not None else None


@dataclass(frozen=True)
class ModelChoice:
    """A model step's own choices (agent, judge, planner): model (None: DEFAULT_MODEL), thinking, effort, the
    output limit, and a fallback model asked on the next attempt after a refusal."""

    model: str | None = None
    thinking: Mapping[str, Any] | None = None
    effort: str | None = None
    max_tokens: int = 1024
    fallback_model: str | None = None

    @property
    def resolved_model(self) -> str:
        return self.model or settings.DEFAULT_MODEL

    def problem(self, model: str | None = None) -> str | None:
        """Why the model would refuse these choices (None if it takes them), checked against the model table."""
        shape = shape_problem(self.thinking, self.effort, self.max_tokens)
        if shape is not None:
            return shape
        asked = [(model or self.resolved_model, "")]
        if self.fallback_model:
            asked.append((self.fallback_model, f"fallback_model {self.fallback_model}: "))
        for name, what in asked:
            profile = model_profile(name)
            found = thinking_problem(profile, self.thinking, self.effort)
            if found is None and profile.known and self.max_tokens > profile.max_output:
                found = f"max_tokens {self.max_tokens} is over {name}'s limit of {profile.max_output}"
            if found is not None:
                return what + found
        return None

    def output_config(self) -> dict[str, Any] | None:
        return {"effort": self.effort} if self.effort else None


def check_choice(what: str, choice: ModelChoice) -> None:
    """A step naming its model is checked against the model table at definition; one using DEFAULT_MODEL is
    checked by the system check (E014), since settings may not be loaded when workflows are imported."""
    problem = shape_problem(choice.thinking, choice.effort, choice.max_tokens)
    if problem is None and choice.model:
        problem = choice.problem(choice.model)
    if problem is None and choice.fallback_model:
        problem = choice.problem(choice.fallback_model)
    if problem is not None:
        raise DefinitionError(f"{what}: {problem}")


def model_table() -> str:
    """The built-in table as Markdown, for docs/explanation/claude-today.md (tests/unit/test_model_table.py keeps the
    two in step)."""

    def yes(value: bool) -> str:
        return "yes" if value else "no"

    def price(value: float) -> str:
        return f"{value:g}"

    def tokens(value: int) -> str:
        return f"{value // MILLION}M" if value % MILLION == 0 else f"{value // 1000}K"

    rows = [
        "| model | context / max output | thinking when omitted | thinking types | effort | prefill | forced tool "
        "choice | prefix check | $ / M tokens: in, out, cache write 5 min, cache read |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for p in PROFILES.values():
        efforts = ", ".join(e for e in EFFORTS if e in p.efforts) or "—"
        types = ", ".join(t for t in THINKING_TYPES if t in p.thinking_types)
        prices = " / ".join(price(v) for v in p.prices[:4]) if p.prices else "—"
        limits = f"{tokens(p.context_window)} / {tokens(p.max_output)}"
        thinks = "on" if p.thinking_default else "off"
        accepts = f"{yes(p.prefill)} | {yes(p.forced_tool_choice)} | {yes(p.prefix_check)}"
        rows.append(f"| `{p.model}` | {limits} | {thinks} | {types} | {efforts} | {accepts} | {prices} |")
    return "\n".join(rows)

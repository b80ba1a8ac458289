"""The conversation head a replay run's model step sends: the recorded one (baseline), or the candidate's.

A model step of a real run freezes its head (model, system, tools, first prompt, thinking, effort) from the code
deployed at its first call. A replay run's step starts from the same head, then:

* baseline lane: the model, system prompt, tools, first prompt, thinking and effort the recording's step sent: the
  recorded model asked again, which measures its own run-to-run noise (a step the recording never ran, a redo it
  never made, builds its prompt with the workflow's code);
* candidate lane: the baseline head with the candidate's changes — `model`, `instructions` (the system prompt of
  every agent step, or {step name: prompt}), `tool_descriptions` ({tool name: text}), `thinking`, `effort`.

A replay's conversation is its own from the first turn: it never sends a recorded assistant turn, so a recorded
thinking block (account-bound, or unreadable by the candidate model) is never sent, and never needs to be accepted.
"""

from __future__ import annotations

from typing import Any

from durable_agents.agents.capabilities import thinking_param
from durable_agents.engine.replaying import case_of, is_replay, occurrence, recorded_step

RECORDED_KEYS = ("model", "system", "tools", "prompt", "thinking", "output_config")


def recorded_prompt(ctx: Any) -> tuple[bool, Any]:
    """(True, the first prompt the recording's step sent) in a replay run whose recording has one, else (False, None):
    the prompt is then not built again, so prompt code that calls a tool uses no recorded answer."""
    if not is_replay(getattr(ctx, "run", None)):
        return False, None
    head = (recorded_step(case_of(ctx), ctx.step.name, occurrence(ctx), with_result=False) or {}).get("head") or {}
    return ("prompt" in head), head.get("prompt")


def replay_head(ctx: Any, head: dict[str, Any], *, agent: bool) -> dict[str, Any]:
    """`head` (built from the code deployed now) as this replay run's lane sends it; unchanged for a real run."""
    if not is_replay(getattr(ctx, "run", None)):
        return head
    case = case_of(ctx)
    recorded = recorded_step(case, ctx.step.name, occurrence(ctx), with_result=False) or {}
    out = dict(head)
    for key in RECORDED_KEYS:
        if key in (recorded.get("head") or {}):
            out[key] = recorded["head"][key]
    return apply_candidate(out, case.candidate, step=ctx.step.name, agent=agent) if case.lane == "candidate" else out


def apply_candidate(head: dict[str, Any], candidate: dict[str, Any], *, step: str, agent: bool) -> dict[str, Any]:
    """The candidate's changes to one step's head."""
    out = dict(head)
    if candidate.get("model"):
        out["model"] = candidate["model"]
    instructions = candidate.get("instructions")
    if isinstance(instructions, dict):
        if step in instructions:
            out["system"] = instructions[step]
    elif instructions and agent:
        out["system"] = instructions
    descriptions = candidate.get("tool_descriptions") or {}
    if descriptions and out.get("tools"):
        out["tools"] = [
            {**tool, "description": descriptions[tool["name"]]} if tool.get("name") in descriptions else tool
            for tool in out["tools"]
        ]
    if "thinking" in candidate:
        out["thinking"] = thinking_param(candidate["thinking"])
    if candidate.get("effort"):
        out["output_config"] = {**(out.get("output_config") or {}), "effort": candidate["effort"]}
    return out

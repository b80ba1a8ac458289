"""The agent bench/tokens.py measures: a ticker that calls `tick(n)` once a turn, with and without compaction.

Imported by the bench process (after Django is set up) and by its workers (`--include bench.agent_ticks`).
The fake model's side, `Ticker`, lives here too so both sides agree on the prompt.
"""

from __future__ import annotations

import json
import re
from typing import Any

from durable_agents.agents.compaction import COMPACTION_INSTRUCTION
from durable_agents.api import StepContext, agent, tool, workflow
from durable_agents.testing.fake_anthropic import Fault, RecordedRequest, Reply
from durable_agents.tools import ToolRegistry

NOTE = (
    "Tick recorded. The ticker keeps a durable count: each call stores one tick with its number, the time it was "
    "seen and the worker that saw it, so a replay can tell a repeated tick from a new one. Nothing else changes."
)
COMPACT_AT = 4000


# A registry of its own: the bench's tools never collide with an application's tool names.
@tool(registry=ToolRegistry())
def tick(n: int) -> dict[str, Any]:
    """Record tick number `n` (1, 2, 3, ...); returns the number with a note."""
    return {"n": n, "note": NOTE}


def _prompt(ctx: StepContext) -> str:
    return f"Call the tick tool {ctx.input['ticks']} times, with n = 1, 2, 3 and so on, one call a turn. Then say done."


def _ticker(compact_at: int) -> Any:
    return agent(
        "ticker",
        instructions="You are a patient ticker. Call the tick tool exactly as asked, one call per turn.",
        tools=[tick],
        prompt=_prompt,
        max_tokens=256,
        max_turns=1000,
        compact_at_prompt_tokens=compact_at,
        keep_recent_turns=4,
    )


workflow("bench_ticks", steps=[_ticker(COMPACT_AT)], replace=True)
# The same agent that never compacts (its threshold is beyond any prompt here): the counterfactual.
workflow("bench_ticks_uncompacted", steps=[_ticker(10**9)], replace=True)


class Ticker:
    """The fake model: tick(n) with the next n, then "done"; a short summary when asked to compact.

    `stall_at` holds ticks whose first request is answered only after `stall_seconds`, to a worker the
    bench has SIGKILLed by then: the server still bills it, as the API would. `stalled` is called with the tick.
    """

    def __init__(self, stall_seconds: float = 1.5) -> None:
        self.stall_at: set[int] = set()
        self.stall_seconds = stall_seconds
        self.on_stall: Any = None

    def __call__(self, request: RecordedRequest) -> Reply | Fault:
        done = max((json.loads(r["content"])["n"] for r in request.tool_results if not r.get("is_error")), default=0)
        if COMPACTION_INSTRUCTION in request.last_user_text:
            return Reply.text(f"## Task\nTick as asked.\n## Done\ntick 1 to {done}.\n## Open\nContinue at {done + 1}.")
        match = re.search(r"tick tool (\d+) times", json.dumps(request.messages[0]["content"]))
        if match is None or done >= int(match.group(1)):
            return Reply.text("done")
        reply = Reply.tool_use("tick", {"n": done + 1})
        if done + 1 in self.stall_at:
            self.stall_at.discard(done + 1)
            if self.on_stall is not None:
                self.on_stall(done + 1)
            return Fault.delay(self.stall_seconds, then=reply)
        return reply

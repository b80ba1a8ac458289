"""Spending limits of a run, checked before every model call: tokens and USD spent so far, across resumes.

The spend is the run row's counters (every journaled model call adds to them in the transaction that
journals it), so retries, resumes and participant swaps all count, and the check is one primary-key read.
A run's own budget (`Run.token_budget`, `Run.cost_budget_usd`, set by `durable_budget`) overrides the
workflow's; None means unlimited. Tokens are everything billed: input, output, cache writes and reads.

The check stops a run *before* the call that would cross the limit: it adds an estimate of that call
(prompt tokens + `max_tokens`, the most it can produce) to what is spent. The prompt is estimated, not
counted with `messages.count_tokens` on every turn: that is a round trip per turn (free, but limited by a
requests-per-minute limit of its own), while the previous turn's reported prompt size plus ~4 characters
a token for what was added since is close enough for a guard — it errs high, by up to the previous
message. Only the first turn has nothing measured; a caller may pass `count` (e.g.
`AnthropicParticipant.count_tokens`) to ask the API for that one, and keeps the estimate when it cannot
say. The run fails with BudgetExceededError, whose message says how to raise the budget and resume.

Example::

    budget = Budget.of(ctx.run)
    budget.check(model="claude-sonnet-5-5", prompt_tokens=12_000, max_tokens=1024, purpose="turn 7")
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from django.db.models import F

from durable_agents.agents.messages import Usage, estimate_tokens
from durable_agents.agents.pricing import cost_usd
from durable_agents.engine.lease import Spent
from durable_agents.errors import BudgetExceededError
from durable_agents.models import Run
from durable_agents.workflows import registry


@dataclass(frozen=True)
class Spend:
    """What a run has spent and may spend, as read from its row (budgets already fall back to the workflow's)."""

    tokens: int
    cost_usd: Decimal
    token_budget: int | None
    cost_budget_usd: Decimal | None


@dataclass(frozen=True)
class Budget:
    """The limits of one run: the workflow's defaults here, the run's overrides read fresh on every check."""

    run_id: uuid.UUID
    workflow_tokens: int | None
    workflow_cost_usd: Decimal | None

    @classmethod
    def of(cls, run: Run) -> Budget:
        definition = registry.get(run.workflow, run.workflow_version)
        return cls(run.id, definition.token_budget, definition.cost_budget_usd)

    def spend(self, spent: Spent | None = None) -> Spend:
        """One indexed read: the run's counters and budgets as committed now (an operator may have raised them);
        or, given `spent`, as the lease's proof read them (StepContext.ensure_lease)."""
        row = spent or (
            Run.objects.filter(pk=self.run_id)
            .annotate(spent=F("input_tokens") + F("output_tokens") + F("cache_write_tokens") + F("cache_read_tokens"))
            .values_list("spent", "cost_usd", "token_budget", "cost_budget_usd")
            .get()
        )
        spent, cost, tokens_limit, cost_limit = row
        return Spend(
            tokens=int(spent),
            cost_usd=Decimal(cost),
            token_budget=tokens_limit if tokens_limit is not None else self.workflow_tokens,
            cost_budget_usd=cost_limit if cost_limit is not None else self.workflow_cost_usd,
        )

    def check(
        self,
        *,
        model: str,
        prompt_tokens: int,
        max_tokens: int,
        purpose: str,
        batch: bool = False,
        spent: Spent | None = None,
    ) -> Spend:
        """Raise BudgetExceededError if the next call (`purpose`, for the message) could cross a limit (`batch`: sent
        in a Message Batch, at batch prices; `spent`: the run's spend as the lease's proof just read it)."""
        spend = self.spend(spent)
        needed = prompt_tokens + max_tokens
        if spend.token_budget is not None and spend.tokens + needed > spend.token_budget:
            suggested = _round_up(max(spend.token_budget * 2, spend.tokens + needed * 4))
            raise BudgetExceededError(
                f"token budget reached: run {self.run_id} spent {spend.tokens} of its {spend.token_budget} tokens "
                f"and the next model call ({purpose}) may take up to {needed} more; raise it with "
                f"`manage.py durable_budget {self.run_id} --tokens {suggested}` "
                f"then `manage.py durable_resume {self.run_id}`"
            )
        if spend.cost_budget_usd is not None:
            cost = cost_usd(model, Usage(input_tokens=prompt_tokens, output_tokens=max_tokens), batch=batch)
            if spend.cost_usd + cost > spend.cost_budget_usd:
                suggested_usd = max(spend.cost_budget_usd * 2, spend.cost_usd + cost * 4).quantize(Decimal("0.01"))
                raise BudgetExceededError(
                    f"cost budget reached: run {self.run_id} spent ${spend.cost_usd} of its ${spend.cost_budget_usd} "
                    f"and the next model call ({purpose}) may cost up to ${cost} more; raise it with "
                    f"`manage.py durable_budget {self.run_id} --cost {suggested_usd}` "
                    f"then `manage.py durable_resume {self.run_id}`"
                )
        return spend


@dataclass(frozen=True)
class PromptSize:
    """A measured prompt: the tokens the API reported for a request that held `messages` messages."""

    tokens: int
    messages: int


def estimate_prompt(
    request_kwargs: dict[str, Any],
    messages: Sequence[Any],
    measured: PromptSize | None,
    count: Callable[[], int | None] | None = None,
) -> int:
    """Prompt tokens of the next request: the last measured prompt plus what was added since; with nothing measured,
    `count()` (the API's count, None if it could not say), else ~4 chars a token.

    What was added is counted from the last message the measured request already held, because a
    continuation (after `max_tokens`) grows that message instead of adding one.

    Example::

        estimate_prompt(kwargs, messages, measured, count=lambda: participant.count_tokens(request))
    """
    if measured is None or measured.messages > len(messages) or measured.messages < 1:
        counted = count() if count is not None else None
        return counted if counted else estimate_tokens(request_kwargs)
    return measured.tokens + estimate_tokens(list(messages[measured.messages - 1 :]))


def _round_up(tokens: int) -> int:
    step = 10 ** max(len(str(tokens)) - 2, 0)
    return -(-tokens // step) * step

"""What a model turn costs: a price table by model-name prefix (DURABLE_AGENTS['MODEL_PRICES'])."""

from __future__ import annotations

from decimal import Decimal

from durable_agents.agents.participants import Usage
from durable_agents.conf import settings

MILLION = Decimal(1_000_000)


def cost_usd(model: str, usage: Usage) -> Decimal:
    """USD for one turn; models without a price (scripted participants) cost nothing."""
    prices = settings.MODEL_PRICES
    match = max((prefix for prefix in prices if model.startswith(prefix)), key=len, default=None)
    if match is None:
        return Decimal(0)
    input_price, output_price, write_price, read_price = (Decimal(str(p)) for p in prices[match])
    total = (
        usage.input_tokens * input_price
        + usage.output_tokens * output_price
        + usage.cache_write_tokens * write_price
        + usage.cache_read_tokens * read_price
    )
    return (total / MILLION).quantize(Decimal("0.000001"))

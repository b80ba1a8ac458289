"""What a model call costs: a price table by model-name prefix (DURABLE_AGENTS['MODEL_PRICES']).

Each entry is USD per million tokens: (input, output, cache write, cache read), optionally followed by
the price of a 1 h cache write (default: twice the input price, as the API bills it). The longest matching
prefix wins, so `"claude-opus-4-1": (...)` can sit beside a general `"claude-opus": (...)`.

Example::

    DURABLE_AGENTS = {"MODEL_PRICES": {"claude-sonnet": (3.0, 15.0, 3.75, 0.3), "claude-opus": (5.0, 25.0, 6.25, 0.5)}}
    cost_usd("claude-sonnet-5-5", Usage(input_tokens=1200, output_tokens=300))   # Decimal("0.008100")
"""

from __future__ import annotations

from collections.abc import Sequence
from decimal import Decimal

from durable_agents.agents.messages import Usage
from durable_agents.conf import settings

MILLION = Decimal(1_000_000)
ONE_HOUR_WRITE_FACTOR = Decimal(2)


def price_of(model: str) -> tuple[Decimal, ...] | None:
    """(input, output, cache write 5 min, cache read, cache write 1 h) per million tokens; None if unpriced."""
    prices: dict[str, Sequence[float]] = settings.MODEL_PRICES
    match = max((prefix for prefix in prices if model.startswith(prefix)), key=len, default=None)
    if match is None:
        return None
    entry = [Decimal(str(p)) for p in prices[match]]
    if len(entry) == 4:
        entry.append(entry[0] * ONE_HOUR_WRITE_FACTOR)
    return tuple(entry)


def cost_usd(model: str, usage: Usage) -> Decimal:
    """USD for one model call; models without a price (scripted participants) cost nothing."""
    price = price_of(model)
    if price is None:
        return Decimal(0)
    input_price, output_price, write_price, read_price, write_1h_price = price
    writes_1h = min(usage.cache_write_1h_tokens, usage.cache_write_tokens)
    total = (
        usage.input_tokens * input_price
        + usage.output_tokens * output_price
        + (usage.cache_write_tokens - writes_1h) * write_price
        + writes_1h * write_1h_price
        + usage.cache_read_tokens * read_price
    )
    return (total / MILLION).quantize(Decimal("0.000001"))

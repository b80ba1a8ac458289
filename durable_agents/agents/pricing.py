"""What a model call costs: the model table's prices (capabilities.py), or DURABLE_AGENTS['MODEL_PRICES'] over them.

Each price is USD per million tokens: (input, output, cache write, cache read), optionally followed by the
price of a 1 h cache write (default: twice the input price, as the API bills it). `MODEL_PRICES` entries match
by model-name prefix, the longest winning, so `"claude-opus-4-1": (...)` can sit beside a general
`"claude-opus": (...)`; a model they do not match is priced by its row of the model table, and a model neither
knows (a scripted participant's "scripted:claude-...") costs nothing.

Example::

    cost_usd("claude-sonnet-5-5", Usage(input_tokens=1200, output_tokens=300))   # Decimal("0.005400")
    DURABLE_AGENTS = {"MODEL_PRICES": {"claude-sonnet": (3.0, 15.0, 3.75, 0.3)}}  # a negotiated price
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from decimal import Decimal

from durable_agents.agents.capabilities import model_profile, price_per_million
from durable_agents.agents.messages import Usage
from durable_agents.conf import settings

MILLION = Decimal(1_000_000)
# https://platform.claude.com/docs/en/build-with-claude/batch-processing#pricing: batches cost 50% of standard prices.
BATCH_PRICE_FACTOR = Decimal("0.5")
logger = logging.getLogger("durable_agents.engine")
ONE_HOUR_WRITE_FACTOR = Decimal(2)


def price_of(model: str) -> tuple[Decimal, ...] | None:
    """(input, output, cache write 5 min, cache read, cache write 1 h) per million tokens; None if unpriced."""
    prices: dict[str, Sequence[float]] = settings.MODEL_PRICES
    match = max((prefix for prefix in prices if model.startswith(prefix)), key=len, default=None)
    if match is None:
        profile = model_profile(model)
        return price_per_million(profile) if profile.known else None
    entry = [Decimal(str(p)) for p in prices[match]]
    if len(entry) == 4:
        entry.append(entry[0] * ONE_HOUR_WRITE_FACTOR)
    return tuple(entry)


def cost_usd(model: str, usage: Usage, *, batch: bool = False) -> Decimal:
    """USD for one model call (`batch`: answered in a Message Batch, at half price); models without a price
    (scripted participants) cost nothing.

    A price that is not one (MODEL_PRICES written wrong: a worker runs no system checks) costs nothing and is
    logged: the answer it prices was billed, and journaling it matters more than its price.
    """
    try:
        price = price_of(model)
        if price is None:
            return Decimal(0)
        cost = _cost(price, usage)
        return (cost * BATCH_PRICE_FACTOR).quantize(Decimal("0.000001")) if batch else cost
    except (TypeError, ValueError, ArithmeticError) as exc:
        logger.error(
            "no price for %s (%s: %s): counted at 0; check DURABLE_AGENTS['MODEL_PRICES']",
            model,
            type(exc).__name__,
            exc,
        )
        return Decimal(0)


def _cost(price: tuple[Decimal, ...], usage: Usage) -> Decimal:
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

"""Durations as operators and settings write them: "90s", "30m", "2h", "3d", "1w".

Example::

    parse_duration("30d")   # timedelta(days=30)
    parse_duration("soon")  # InvalidInputError: invalid duration 'soon': use a number and a unit, e.g. 90s, ...
"""

from __future__ import annotations

import re
from datetime import timedelta

from durable_agents.errors import InvalidInputError
from durable_agents.storable import shown

DURATION_RE = re.compile(r"^\s*(\d{1,12}(?:\.\d{1,9})?)\s*([smhdw])\s*$")
DURATION_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days", "w": "weeks"}
# Longer ago than this is before any run; it also keeps `now - duration` inside datetime's range.
MAX_DURATION = timedelta(days=100 * 365)


def parse_duration(text: str) -> timedelta:
    """'90s', '30m', '2h', '3d', '1w' → timedelta; anything else is a clear InvalidInputError."""
    match = DURATION_RE.match(text or "") if isinstance(text, str) else None
    if not match:
        raise InvalidInputError(f"invalid duration {shown(text)}: use a number and a unit, e.g. 90s, 30m, 2h, 3d, 1w")
    amount, unit = float(match.group(1)), DURATION_UNITS[match.group(2)]
    if amount > MAX_DURATION / timedelta(**{unit: 1}):
        raise InvalidInputError(f"duration {text.strip()!r} is longer than 100 years; give a shorter one, e.g. 52w")
    return timedelta(**{unit: amount})

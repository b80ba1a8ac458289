"""What Postgres can store: one check for every JSON value, text and number the app writes to a column.

Postgres refuses what a Python value can easily hold: the character U+0000 (in text and in jsonb), lone
UTF-16 surrogates (not valid UTF-8: e.g. `os.fsdecode` of bad bytes), NaN and Infinity (not JSON), and
numbers wider than their column. Each fails late, as a DataError or an encoding error in the middle of a
write — for a step result, inside the commit transaction. They are refused here first, with a message
that names where the bad value is and what to do about it.

Pure rules: no Django, no models. Callers choose the error class (InvalidInputError for what users send,
PermanentError for what a step returns).

Example::

    problem = json_problem({"items": [{"name": "a\\x00"}]}, "result")
    # 'result["items"][0]["name"] contains \\u0000, which Postgres cannot store; remove it or encode the text'
"""

from __future__ import annotations

import json
import math
import re
from decimal import Decimal, InvalidOperation
from typing import Any

from durable_agents.errors import DurableAgentsError, InvalidInputError

# Bounds of Postgres columns the app writes from user input.
BIGINT_MAX = 2**63 - 1
# The actor, name and step id columns (Event.actor, Wait.decided_by, Wait.name, Step.step_id) hold this many.
NAME_MAX_CHARS = 200

NUL_HINT = "which Postgres cannot store; remove it or encode the text"
SURROGATE_HINT = "which is not valid Unicode and Postgres cannot store; decode the bytes properly or encode the text"


def text_problem(text: str, where: str) -> str | None:
    """Why Postgres cannot store this string (NUL, a lone surrogate), or None."""
    if "\x00" in text:
        return f"{where} contains \\u0000, {NUL_HINT}"
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = text[exc.start]
        return f"{where} contains a lone surrogate ({bad.encode('unicode_escape').decode()}), {SURROGATE_HINT}"
    return None


def storable_text(text: str) -> str:
    """`text` with what Postgres cannot store escaped (\\u0000, \\udcxx): for messages the app writes itself,
    such as an exception's, which must be recorded whatever they contain."""
    if "\x00" in text:
        text = text.replace("\x00", "\\u0000")
    if text.isascii():
        return text
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def json_problem(value: Any, root: str) -> str | None:
    """Why Postgres jsonb cannot store `value` (the first bad spot, named by its path from `root`), or None.

    `value` is what json.loads gives back (dicts, lists, str, int, float, bool, None); tuples count as lists.
    Other objects are not looked into: serialise first, and check what the encoder produced.
    """
    try:
        path = _find(value)
    except RecursionError:
        return f"{root} is nested too deeply to store as JSON; flatten it"
    if path is None:
        return None
    steps, problem = path
    return problem.format(where=root + "".join(reversed(steps)))


def _find(value: Any) -> tuple[list[str], str] | None:
    """The path (innermost step first) and problem template of the first unstorable spot in `value`."""
    if isinstance(value, str):
        problem = text_problem(value, "{where}")
        return ([], problem) if problem else None
    if isinstance(value, float):
        if math.isfinite(value):
            return None
        name = "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
        return [], f"{{where}} is {name}, which JSON and Postgres cannot store; use null or a string"
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str):
                problem = text_problem(key, "a key of {where} (" + _quoted(key) + ")")
                if problem:
                    return [], problem
            found = _find(item)
            if found is not None:
                found[0].append(f"[{_quoted(key)}]")
                return found
        return None
    if isinstance(value, list | tuple):
        for index, item in enumerate(value):
            found = _find(item)
            if found is not None:
                found[0].append(f"[{index}]")
                return found
    return None


def _quoted(key: Any) -> str:
    # ASCII-escaped like JSON, so the message itself stores and prints anywhere; braces doubled for format().
    text = json.dumps(key if isinstance(key, str) else str(key))
    return text.replace("{", "{{").replace("}", "}}")


# What an unstorable value leaves in json.dumps output (ensure_ascii): NaN/Infinity tokens, the NUL escape,
# surrogate escapes (\\udXXX, also the pairs of valid characters such as emoji, and Hangul: the walk decides).
SUSPECT_TOKENS = (b"NaN", b"Infinity", b"\\u0000", b"\\ud")


def check_json(
    value: Any, root: str, error: type[DurableAgentsError] = InvalidInputError, *, raw: bytes | None = None
) -> None:
    """Raise `error` naming the first spot of `value` that Postgres jsonb cannot store.

    With `raw` (`value` as json.dumps wrote it, ASCII-escaped), clean values skip the walk: a byte scan is
    cheaper than visiting every leaf of a large result.
    """
    if raw is not None and not any(token in raw for token in SUSPECT_TOKENS):
        return
    problem = json_problem(value, root)
    if problem:
        raise error(problem)


def check_text(
    value: Any,
    what: str,
    *,
    max_chars: int = NAME_MAX_CHARS,
    error: type[DurableAgentsError] = InvalidInputError,
) -> str:
    """`value` if it is a string a text column of `max_chars` can store; otherwise `error` saying why.

    Example: ``actor = check_text(actor, "the actor (--as)")``
    """
    if not isinstance(value, str):
        raise error(f"{what} must be a string, got {type(value).__name__}")
    problem = text_problem(value, what)
    if problem:
        raise error(problem)
    if len(value) > max_chars:
        raise error(f"{what} is {len(value)} characters long; at most {max_chars} fit, shorten it")
    return value


def whole_number(value: Any, what: str, *, low: int = 0, high: int = BIGINT_MAX) -> int:
    """`value` as an int within [low, high] (a bigint column by default), else InvalidInputError.

    Strings of digits are accepted (command-line options); bools, floats and other strings are not.
    """
    # 30 digits are past any bigint, and int() refuses strings of thousands of digits by itself.
    digits = isinstance(value, str) and re.fullmatch(r"[+-]?[0-9]{1,30}", value.strip())
    number = int(value) if digits else value
    if isinstance(number, bool) or not isinstance(number, int) or not low <= number <= high:
        raise InvalidInputError(f"{what} is a whole number >= {low}, at most {high}; got {shown(value)}")
    return number


def decimal_amount(
    value: Any, what: str, *, max_digits: int, decimal_places: int, unit: str = "", low: Decimal = Decimal(0)
) -> Decimal:
    """`value` as a finite Decimal >= `low` that a numeric(max_digits, decimal_places) column holds exactly.

    Example: ``decimal_amount("2.50", "a cost budget", max_digits=14, decimal_places=6, unit="USD")``
    """
    kind = f"a decimal amount in {unit}" if unit else "a decimal amount"
    try:
        amount = value if isinstance(value, Decimal) else Decimal(str(value).strip())
    except (InvalidOperation, ValueError):
        raise InvalidInputError(f"{what} is {kind}, e.g. 2.50; got {shown(value)}") from None
    if isinstance(value, bool) or not amount.is_finite():
        raise InvalidInputError(f"{what} is {kind} and finite, e.g. 2.50; got {shown(value)}")
    if amount < low:
        raise InvalidInputError(f"{what} is >= {low}, got {amount}")
    exponent = amount.normalize().as_tuple().exponent
    if isinstance(exponent, int) and -exponent > decimal_places:
        raise InvalidInputError(f"{what} has at most {decimal_places} decimal places, got {amount}")
    limit = Decimal(10) ** (max_digits - decimal_places)
    if amount >= limit:
        biggest = limit - Decimal(1).scaleb(-decimal_places)
        raise InvalidInputError(f"{what} is at most {biggest} (the column holds {max_digits} digits), got {amount}")
    return amount


def shown(value: Any, limit: int = 60) -> str:
    """repr() for messages, clipped: an error line should stay one readable line whatever was sent."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 5]}...{text[-2:]}"

"""What is stored of a failure: which errors keep a traceback, its bound, and the secrets taken out of it."""

from __future__ import annotations

import pytest

from durable_agents.engine.retry import TRACEBACK_MAX_CHARS, classify, has_traceback, traceback_of
from durable_agents.errors import PermanentError, RetryableError, ToolFailedError
from durable_agents.workflows import RetryPolicy

ANTHROPIC_KEY = "sk-ant-api03-Unit7estKeyAbcdefghijklmnopqrstuvwxyz0123456789-_AA"
ENV_SECRET = "env-secret-value-4f1c2e"


def raised(exc: BaseException) -> BaseException:
    try:
        raise exc
    except BaseException as caught:  # noqa: BLE001 - the test wants the exception with its traceback
        return caught


def test_has_traceback__only_for_surprises_and_what_is_raised_from_them():
    assert has_traceback(raised(ZeroDivisionError("division by zero")))
    assert has_traceback(raised(ConnectionResetError("reset")))
    for deliberate in (RetryableError("flaky"), PermanentError("bad order"), ToolFailedError("no stock")):
        assert not has_traceback(raised(deliberate)), f"{type(deliberate).__name__} is raised on purpose"
    try:
        try:
            {}["missing"]
        except KeyError as exc:
            raise RetryableError("the lookup failed") from exc
    except RetryableError as wrapped:
        assert has_traceback(wrapped), "a library error raised from a surprise keeps the surprise's traceback"


def test_classify__a_surprise_is_stored_with_its_traceback_and_no_secret(monkeypatch):
    monkeypatch.setenv("PAYMENTS_API_TOKEN", ENV_SECRET)
    exc = raised(ValueError(f"refused {ANTHROPIC_KEY} with token={ENV_SECRET}"))

    error = classify(exc, RetryPolicy(), "charge").as_error()

    assert error["type"] == "ValueError" and error["step"] == "charge"
    assert "test_failure_records.py" in error["traceback"] and "in raised" in error["traceback"]
    stored = f"{error['message']} {error['traceback']}"
    assert ANTHROPIC_KEY[10:30] not in stored and ENV_SECRET not in stored, f"a secret was stored: {stored}"
    assert "[redacted]" in error["message"], "the secret is replaced, not the message dropped"
    assert "traceback" not in classify(raised(PermanentError("bad order")), RetryPolicy(), "charge").as_error()


def test_traceback_of__a_recursion_error_stays_within_the_bound():
    def dive(depth: int) -> int:
        return dive(depth + 1)

    with pytest.raises(RecursionError) as caught:
        dive(0)
    text = traceback_of(caught.value)

    assert len(text) <= TRACEBACK_MAX_CHARS, f"the traceback is {len(text)} characters, over the bound"
    assert "in dive" in text and text.rstrip().endswith("RecursionError: maximum recursion depth exceeded")
    assert text.count("in dive") <= 30, "only the innermost frames are kept"


def test_traceback_of__long_lines_and_chains_are_cut_with_a_marker():
    def nested(level: int) -> None:
        if level == 0:
            raise ValueError("x" * 50_000)
        try:
            nested(level - 1)
        except Exception as exc:  # noqa: BLE001 - each level wraps the one below: a chain 40 deep
            raise RuntimeError(f"level {level}") from exc

    with pytest.raises(RuntimeError) as caught:
        nested(40)
    text = traceback_of(caught.value)

    assert len(text) <= TRACEBACK_MAX_CHARS, f"the traceback is {len(text)} characters, over the bound"
    assert "lines of the traceback cut …]" in text, "the cut is said, not silent"
    assert "ValueError: xxxx" in text and "characters cut]" in text, "the root cause is kept, its long line clipped"
    assert text.rstrip().endswith("RuntimeError: level 40"), "the newest part (the exception raised) is kept"

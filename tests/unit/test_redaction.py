"""Secrets out of stored and logged text: their shapes, their known values, and ordinary text left alone."""

from __future__ import annotations

from django.conf import settings

from durable_agents.redaction import REDACTED, redact

ANTHROPIC_KEY = "sk-ant-api03-Unit7estKeyAbcdefghijklmnopqrstuvwxyz0123456789-_AA"
ENV_SECRET = "env-secret-value-4f1c2e"


def test_redact__secret_shapes_are_replaced_and_their_names_kept():
    cases = {
        f"401: invalid x-api-key: {ANTHROPIC_KEY}": "401: invalid x-api-key: [redacted]",
        f"the key {ANTHROPIC_KEY}!": "the key [redacted]!",
        "Authorization: Bearer eyJhbGciOiJIUzI1NiJ9.e30.sig\nnext": "Authorization: [redacted]\nnext",
        "{'Authorization': 'Basic dXNlcjpwYXNz', 'Accept': '*/*'}": "{'Authorization': '[redacted]', 'Accept': '*/*'}",
        "curl -H 'X: Bearer abcdef123456'": "curl -H 'X: Bearer [redacted]'",
        "login password=s3cret!! user=bob": "login password=[redacted] user=bob",
        '{"api_key": "two words", "n": 1}': '{"api_key": [redacted], "n": 1}',
        "postgres://bob:pw123@db:5432/orders": "postgres://bob:[redacted]@db:5432/orders",
    }
    for text, expected in cases.items():
        assert redact(text) == expected, f"redact({text!r}) should hide the secret and keep the rest"
        assert redact(expected) == expected, "redacting twice changes nothing: '[redacted]' stays whole"


def test_redact__ordinary_text_is_left_alone():
    for text in (
        "if password == expected:",
        "max_tokens=1024 input_tokens=5",
        "a basic example of a task-abcdefghijklmnopqrstuvwxyz",
        'File "/srv/app/orders.py", line 12, in share_of',
    ):
        assert redact(text) == text, f"{text!r} holds no secret and must read as it was"


def test_redact__known_values_wherever_they_appear(monkeypatch):
    monkeypatch.setenv("PAYMENTS_API_TOKEN", ENV_SECRET)
    monkeypatch.setenv("SHORT_SECRET", "1")
    text = f"called with {ENV_SECRET}; django key {settings.SECRET_KEY}; count 1"
    assert redact(text) == f"called with {REDACTED}; django key {REDACTED}; count 1", (
        "env vars named *TOKEN*/*SECRET* and SECRET_KEY are hidden; values too short to matter ('1') are not"
    )

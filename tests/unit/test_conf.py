"""The settings declarations: one source for defaults, types and docs, and the settings reference rendered from it."""

from __future__ import annotations

import pytest
from django.test import override_settings

from durable_agents import conf
from durable_agents.conf import DEFAULTS, SETTINGS, settings


def test_settings_reference__lists_every_setting_as_declared(built_docs):
    missing = sorted(set(SETTINGS) - built_docs.headings("reference/settings", 3))
    assert not missing, (
        f"docs/reference/settings.md does not list {missing}: its sections are rendered from conf.py's SETTINGS "
        "(by the durable-settings directive of docs/_ext/durable_docs.py)"
    )


def test_settings__every_default_satisfies_its_own_declaration():
    wrong = {name: setting.problem(setting.default) for name, setting in SETTINGS.items()}
    assert not {name: why for name, why in wrong.items() if why}, "a default breaks its own type or bounds"


def test_settings__defaults_and_attribute_access_come_from_the_declarations():
    assert {name: setting.default for name, setting in SETTINGS.items()} == DEFAULTS
    assert settings.QUEUE == ""
    with override_settings(DURABLE_AGENTS={"LEASE_SECONDS": 3}):
        assert settings.LEASE_SECONDS == 3
    with pytest.raises(AttributeError, match="unknown durable_agents setting 'LEASE_SECOND'"):
        settings.LEASE_SECOND  # noqa: B018


@pytest.mark.parametrize(
    ("name", "value", "reason"),
    [
        ("LEASE_SECONDS", "15", "must be float, got '15' (str)"),
        ("LEASE_SECONDS", True, "must be float, got True (bool)"),
        ("LEASE_SECONDS", 0, "must be greater than 0"),
        ("LEASE_SECONDS", float("nan"), "must be a finite number"),
        ("LEASE_SECONDS", 10**400, "must be a finite number"),
        ("SWEEP_BATCH", 2.5, "must be int"),
        ("APPROVERS", "ops@example.com", "must be list[str]"),
        ("APPROVERS", ["ops@example.com", None], "must be list[str]"),
        ("MODEL_PRICES", {"claude-x": (1.0, 2.0)}, "must be dict[str, tuple[float, float, float, float] | "),
        ("MODEL_PRICES", {"claude-x": (1.0, 2.0, 3.0, -0.1)}, "must be at least 0"),
        ("PROMPT_CACHE_TTL", "5 minutes", "must be '5m' | '1h' | None"),
        ("COMPACT_AT_PROMPT_TOKENS", 0, "must be at least 1"),
    ],
)
def test_setting__problem_says_what_is_wrong(name, value, reason):
    assert reason in (SETTINGS[name].problem(value) or ""), SETTINGS[name].problem(value)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("LEASE_SECONDS", 15),
        ("APPROVERS", ("ops@example.com",)),
        ("MODEL_PRICES", {"claude-x": [1, 2, 3, 4, 5]}),
        ("COMPACT_AT_PROMPT_TOKENS", None),
        ("RETRY_BACKOFF_SECONDS", 0.0),
    ],
)
def test_setting__accepts_equivalent_forms(name, value):
    assert SETTINGS[name].problem(value) is None


def test_settings__each_access_reads_what_django_holds_however_it_was_changed(settings, monkeypatch):
    # Django's settings change without its setting_changed signal under pytest-django's `del settings.X`
    # (SettingsWrapper.__delattr__), an assignment and monkeypatch: each access still reads the change.
    from django.conf import settings as django_settings

    durable = conf.settings
    declared = dict(django_settings.DURABLE_AGENTS)
    assert declared.get("QUEUE", "") == durable.QUEUE
    monkeypatch.setattr(django_settings, "DURABLE_AGENTS", {**declared, "QUEUE": "patched"})
    assert durable.QUEUE == "patched"
    django_settings.DURABLE_AGENTS = {**declared, "QUEUE": "assigned"}
    assert durable.QUEUE == "assigned"
    del settings.DURABLE_AGENTS
    assert durable.QUEUE == ""
    assert DEFAULTS["LEASE_SECONDS"] == durable.LEASE_SECONDS
    settings.DURABLE_AGENTS = {"QUEUE": "fixture"}
    assert durable.QUEUE == "fixture"

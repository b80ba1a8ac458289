"""The documentation builds with no warning, and its reference pages list everything the code declares."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from durable_agents import checks

BUILD = "python -m sphinx -W -n --keep-going -b html docs /tmp/html"


def test_docs__build_without_warnings(built_docs):
    assert built_docs.result.returncode == 0, (
        f"the documentation does not build cleanly ({BUILD}); fix each warning, or add a genuinely external "
        f"reference to nitpick_ignore_regex in docs/conf.py:\n{built_docs.result.stderr}"
    )


def test_checks_reference__lists_every_check_id(built_docs):
    source = Path(checks.__file__).read_text()
    ids = {node.value for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Constant)}
    ids = {value for value in ids if isinstance(value, str) and re.fullmatch(r"durable_agents\.[EW]\d{3}", value)}
    assert len(ids) > 20, (
        f"found only {sorted(ids)} in durable_agents/checks.py: has the way checks are declared changed?"
    )
    missing = sorted(ids - built_docs.headings("reference/checks", 3))
    assert not missing, f"docs/reference/checks.md (rendered by docs/_ext/durable_docs.py) misses: {missing}"


def test_commands_reference__lists_every_command(built_docs):
    commands = Path(checks.__file__).parent / "management" / "commands"
    names = sorted(path.stem for path in commands.glob("durable_*.py"))
    missing = sorted(set(names) - built_docs.headings("reference/commands", 2))
    assert not missing, f"docs/reference/commands.md (rendered by docs/_ext/durable_docs.py) misses: {missing}"


def test_metrics_reference__lists_every_gauge(built_docs):
    source = (Path(checks.__file__).parent / "metrics.py").read_text()
    names = set(re.findall(r'(?:GaugeMetricFamily|_per_workflow)\(\s*"(durable_\w+)"', source))
    assert len(names) > 10, f"found only {sorted(names)} in durable_agents/metrics.py: have the gauges moved?"
    page = built_docs.page("reference/metrics")
    missing = sorted(name for name in names if f'<span class="pre">{name}' not in page)
    assert not missing, f"docs/reference/metrics.md (rendered by docs/_ext/durable_docs.py) misses: {missing}"


def test_signals_reference__documents_every_signal(built_docs):
    from django.dispatch import Signal

    from durable_agents import signals

    names = {f"durable_agents.signals.{name}" for name, value in vars(signals).items() if isinstance(value, Signal)}
    missing = sorted(names - built_docs.objects())
    assert not missing, f"docs/reference/signals.md (rendered by docs/_ext/durable_docs.py) misses: {missing}"


def test_models_reference__lists_every_built_in_model(built_docs):
    from durable_agents.agents.capabilities import PROFILES

    page = built_docs.page("reference/models")
    missing = sorted(model for model in PROFILES if f'<span class="pre">{model}</span>' not in page)
    assert not missing, f"docs/reference/models.md (rendered by docs/_ext/durable_docs.py) misses: {missing}"

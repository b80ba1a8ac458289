"""Sphinx directives that render the reference from the code at build time, so the documentation cannot drift.

    {durable-settings}     every DURABLE_AGENTS setting, from the declarations in durable_agents/conf.py
    {durable-model-table}  the built-in table of what each Claude model accepts (agents/capabilities.py)
    {durable-commands}     every durable_* management command, from its argument parser
    {durable-checks}       every system check id, with its message and hint, read from durable_agents/checks.py
    {durable-metrics}      every Prometheus gauge, with its labels and help, read from durable_agents/metrics.py
    {durable-errors}       the exception tree of durable_agents/errors.py, each class with its default message
    {durable-signals}      every Django signal of durable_agents/signals.py, with the keyword arguments it sends
    {durable-api-errors}   autodoc entries for the exceptions durable_agents.api exports, in the tree's order

Each directive renders Markdown (the functions below) and parses it in place. The build also warns (an error
under -W) when a name of `durable_agents.api.__all__` has no entry in the reference.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import inspect
import pkgutil
import re
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import import_module
from pathlib import Path
from typing import Any

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.application import Sphinx
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective

logger = logging.getLogger(__name__)

API_MODULE = "durable_agents.api"


# Settings ------------------------------------------------------------------------------------------------------


def settings_markdown() -> str:
    """A section per DURABLE_AGENTS key, as declared in durable_agents/conf.py: its meaning, default and type.

    Sections, not conf.py's one table (`settings_table()`): a key gets an anchor to link to
    (`settings.md#lease_seconds`), and the page does not scroll sideways.
    """
    from durable_agents.conf import SETTINGS

    sections = []
    for name, setting in SETTINGS.items():
        default, kind = _code(repr(setting.default)), _code(setting.describe())
        sections.append(f"### {name}\n\nDefault: {default} (type: {kind})\n\n{_sentence(setting.doc)}\n")
    return "\n".join(sections)


def _sentence(text: str) -> str:
    """A declaration's doc as a sentence: "a step's lease" -> "A step's lease."."""
    text = text.strip()
    return text[:1].upper() + text[1:] + ("" if text.endswith(".") else ".")


def model_table_markdown() -> str:
    """The built-in model table of durable_agents/agents/capabilities.py (what each Claude model accepts)."""
    from durable_agents.agents.capabilities import model_table

    return model_table()


# Management commands -------------------------------------------------------------------------------------------


def command_names() -> list[str]:
    """The durable_* management commands, by name."""
    from durable_agents.management import commands

    return sorted(m.name for m in pkgutil.iter_modules(commands.__path__) if m.name.startswith("durable_"))


def _parser(name: str) -> argparse.ArgumentParser:
    command = import_module(f"durable_agents.management.commands.{name}").Command()
    return command.create_parser("manage.py", name)


def _django_option_dests() -> set[str]:
    """The options every Django command takes (--settings, --verbosity, ...): listed once, not per command."""
    from django.core.management.base import BaseCommand

    return {action.dest for action in BaseCommand().create_parser("manage.py", "command")._actions}


def _argument_term(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{action.metavar or action.dest}`"
    takes_value = action.nargs != 0
    metavar = action.metavar or action.dest.upper()
    spelled = (f"{option} {metavar}" if takes_value else option for option in action.option_strings)
    return ", ".join(f"`{spelling}`" for spelling in spelled)


def _argument_help(action: argparse.Action, parser: argparse.ArgumentParser) -> str:
    text = _escape_markdown((action.help or "").replace("%%", "%"))
    if action.choices:
        text += " (one of " + ", ".join(f"`{choice}`" for choice in action.choices) + ")"
    default = action.default
    if action.option_strings and action.nargs != 0 and default not in (None, "", [], argparse.SUPPRESS):
        text += f" (default: `{default}`)"
    for group in parser._mutually_exclusive_groups:
        if action in group._group_actions:
            others = ", ".join(f"`{other.option_strings[0]}`" for other in group._group_actions)
            text += f" ({'exactly' if group.required else 'at most'} one of {others})"
    return text.strip() or "(required)"


def _escape_markdown(text: str) -> str:
    # Help texts are plain text: a `*` or `<` in them must not become emphasis or HTML.
    return re.sub(r"([*_<>\[\]])", r"\\\1", text) if "`" not in text else text


def _usage(parser: argparse.ArgumentParser, skip: set[str]) -> str:
    """The usage line without Django's common options, wrapped at 90 columns (the page's code width)."""
    actions = [action for action in parser._actions if action.dest not in skip]
    formatter = parser.formatter_class(prog=parser.prog, width=90)
    formatter.add_usage(parser.usage, actions, parser._mutually_exclusive_groups, prefix="")
    return formatter.format_help().strip()


def _arguments(parser: argparse.ArgumentParser, skip: set[str]) -> Iterator[str]:
    positionals_first = sorted(parser._actions, key=lambda action: bool(action.option_strings))
    for action in positionals_first:
        if action.dest in skip or action.help == argparse.SUPPRESS:
            continue
        yield f"{_argument_term(action)}\n: {_argument_help(action, parser)}"


def commands_markdown() -> str:
    """A section per durable_* command: what it does, its usage, and each argument and option with its help."""
    django_options = _django_option_dests()
    sections = []
    for name in command_names():
        parser = _parser(name)
        usage = _usage(parser, django_options)
        lines = [f"## `{name}`", "", _escape_markdown(parser.description or ""), "", "```text", usage, "```", ""]
        lines += [f"{item}\n" for item in _arguments(parser, django_options)]
        sections.append("\n".join(lines))
    return "\n".join(sections)


# System checks -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Check:
    id: str
    level: str  # "Error" or "Warning"
    messages: tuple[str, ...]  # as the source writes them, `{expression}` where a value is put in
    hints: tuple[str, ...]
    summary: str  # from the module docstring's table


def _source(module: str) -> ast.Module:
    """A module's syntax tree, read without importing it (its optional dependencies need not be installed)."""
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin, f"{module} is not importable from here"
    return ast.parse(Path(spec.origin).read_text())


def _template(node: ast.expr | None) -> str:
    """A message as its source writes it: literal text, and `{expression}` where a value is put in."""
    if node is None:
        return ""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(_template(part) for part in node.values)
    if isinstance(node, ast.FormattedValue):
        return "{" + ast.unparse(node.value) + "}"
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _template(node.left) + _template(node.right)
    return "{" + ast.unparse(node) + "}"


def _summaries(docstring: str) -> dict[str, str]:
    """The module docstring's table: `    E001  DURABLE_AGENTS is not a dict` (continuation lines indented more)."""
    summaries: dict[str, str] = {}
    last = None
    for line in docstring.splitlines():
        if match := re.match(r"^ {4}([EW]\d{3})  (.*)$", line):
            last = match[1]
            summaries[last] = match[2].strip()
        elif last and re.match(r"^ {5,}\S", line):
            summaries[last] += " " + line.strip()
        else:
            last = None
    return summaries


def checks() -> list[Check]:
    """Every check message durable_agents/checks.py can report, read from its source: a new one appears by itself."""
    tree = _source("durable_agents.checks")
    summaries = _summaries(ast.get_docstring(tree) or "")
    found: dict[str, Check] = {}
    for call in ast.walk(tree):
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)):
            continue
        keywords = {keyword.arg: keyword.value for keyword in call.keywords}
        ident = keywords.get("id")
        if not (isinstance(ident, ast.Constant) and str(ident.value).startswith("durable_agents.")):
            continue
        messages = [_template(call.args[0] if call.args else keywords.get("msg"))]
        hints = [_template(keywords.get("hint"))]
        if ident.value in found:  # one id, several wordings: list each once
            messages = list(dict.fromkeys([*found[ident.value].messages, *messages]))
            hints = list(dict.fromkeys([*found[ident.value].hints, *hints]))
        summary = summaries.get(ident.value.removeprefix("durable_agents."), "")
        found[ident.value] = Check(ident.value, call.func.id, tuple(messages), tuple(hints), summary)
    return sorted(found.values(), key=lambda check: (check.level != "Error", check.id))


def _code(text: str) -> str:
    """Inline code that may itself hold backticks."""
    fence = "``" if "`" in text else "`"
    return f"{fence} {text} {fence}" if fence == "``" else f"{fence}{text}{fence}"


def checks_markdown() -> str:
    """A section per check id: its level, what it means, its message and its hint (`{...}`: filled in)."""
    sections = []
    found = checks()
    for number, check in enumerate(found):
        if number == 0 or check.level != found[number - 1].level:
            sections.append(f"## {check.level}s (`durable_agents.{check.level[0]}…`)\n")
        deploy = check.summary.startswith("(deploy)")
        lines = [f"### {check.id}", ""]
        lines += [
            f"**{check.level}**{' (only under `check --deploy`)' if deploy else ''}: "
            f"{_escape_markdown(check.summary.removeprefix('(deploy)').strip())}",
            "",
        ]
        for label, texts in (("Message", check.messages), ("Hint", check.hints)):
            # A lone `{hint}` says nothing: the summary above does.
            shown = [_code(text.replace("\n", " ")) for text in texts if text and not re.fullmatch(r"\{[^{}]*\}", text)]
            if shown:
                lines += [f"{label}\n: " + "\n\n  or ".join(shown), ""]
        sections.append("\n".join(lines))
    return "\n".join(sections)


# Metrics -------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Metric:
    name: str
    labels: tuple[str, ...]
    help: str  # as the source writes it, `{expression}` where a value is put in


def _labels(call: ast.Call) -> tuple[str, ...]:
    for keyword in call.keywords:
        if keyword.arg == "labels" and isinstance(keyword.value, ast.List | ast.Tuple):
            return tuple(str(ast.literal_eval(element)) for element in keyword.value.elts)
    return ()


def metrics() -> list[Metric]:
    """Every gauge durable_agents/metrics.py exports, read from its source (`GaugeMetricFamily("durable_...", help)`,
    directly or through a helper function of the module that makes one with fixed labels)."""
    tree = _source("durable_agents.metrics")
    makers = {"GaugeMetricFamily": ()}
    for function in tree.body:  # helpers such as _per_workflow(name, help, ...): the labels of the family they make
        if isinstance(function, ast.FunctionDef):
            for call in ast.walk(function):
                makes = isinstance(call, ast.Call) and getattr(call.func, "id", "") == "GaugeMetricFamily"
                if makes and call.args and isinstance(call.args[0], ast.Name):
                    makers[function.name] = _labels(call)
    found = []
    for call in ast.walk(tree):
        if not (isinstance(call, ast.Call) and getattr(call.func, "id", None) in makers and len(call.args) >= 2):
            continue
        name = call.args[0]
        if isinstance(name, ast.Constant) and str(name.value).startswith("durable_"):
            labels = _labels(call) or makers[call.func.id]
            found.append(Metric(name.value, labels, _template(call.args[1])))
    return sorted(found, key=lambda metric: metric.name)


def metrics_markdown() -> str:
    """A definition per gauge: its name and labels as Prometheus shows them, and its help text."""
    entries = []
    for metric in metrics():
        labels = "{" + ", ".join(metric.labels) + "}" if metric.labels else ""
        entries.append(f"`{metric.name}{labels}`\n: {_escape_markdown(metric.help)}\n")
    return "\n".join(entries)


# Errors --------------------------------------------------------------------------------------------------------


def error_classes() -> list[type[Exception]]:
    """The exception classes of durable_agents/errors.py, in source order."""
    errors = import_module("durable_agents.errors")
    return [
        value
        for value in vars(errors).values()
        if inspect.isclass(value)
        and issubclass(value, errors.DurableAgentsError)
        and value.__module__ == errors.__name__
    ]


def errors_markdown() -> str:
    """The tree, each class under its base, with its default message; exported ones link to the API reference."""
    api = import_module(API_MODULE)
    classes = error_classes()
    lines = []

    def walk(base: type[Exception], depth: int) -> None:
        name = base.__name__
        exported = name in api.__all__
        title = f"{{py:class}}`~{API_MODULE}.{name}`" if exported else f"`{name}`"
        where = "" if exported else " (internal: raised and handled inside, or caught as its base)"
        message = _escape_markdown(" ".join((base.__doc__ or "").split()))
        lines.append(f"{'  ' * depth}* {title}{where}: {message}")
        for child in classes:
            if child.__bases__[0] is base:
                walk(child, depth + 1)

    walk(classes[0], 0)
    return "\n".join(lines)


def api_errors_markdown() -> str:
    """autodoc entries for the exceptions `durable_agents.api` exports, in the order of the tree."""
    api = import_module(API_MODULE)
    exported = [cls.__name__ for cls in error_classes() if cls.__name__ in api.__all__]
    entries = "\n".join(f".. autoexception:: {API_MODULE}.{name}\n   :show-inheritance:" for name in exported)
    return f"```{{eval-rst}}\n{entries}\n```"


def signals_markdown() -> str:
    """The module's docstring, then an autodoc entry (its `#:` comment) for each Signal of durable_agents.signals."""
    from django.dispatch import Signal

    signals = import_module("durable_agents.signals")
    names = [name for name, value in vars(signals).items() if isinstance(value, Signal)]
    entries = "\n".join(f".. autodata:: durable_agents.signals.{name}\n   :no-value:" for name in names)
    return f"```{{eval-rst}}\n.. automodule:: durable_agents.signals\n   :no-members:\n\n{entries}\n```"


# Directives ----------------------------------------------------------------------------------------------------


class _MarkdownDirective(SphinxDirective):
    """Parses the Markdown `render()` returns where the directive stands (headings allowed)."""

    has_content = False
    required_arguments = 0

    def render(self) -> str:
        raise NotImplementedError

    def run(self) -> list[nodes.Node]:
        container = nodes.container()
        self.state.nested_parse(StringList(self.render().splitlines(), source="<generated>"), 0, container, True)
        return container.children


class SettingsDirective(_MarkdownDirective):
    def render(self) -> str:
        return settings_markdown()


class CommandsDirective(_MarkdownDirective):
    def render(self) -> str:
        return commands_markdown()


class ChecksDirective(_MarkdownDirective):
    def render(self) -> str:
        return checks_markdown()


class MetricsDirective(_MarkdownDirective):
    def render(self) -> str:
        return metrics_markdown()


class SignalsDirective(_MarkdownDirective):
    def render(self) -> str:
        return signals_markdown()


class ModelTableDirective(_MarkdownDirective):
    def render(self) -> str:
        return model_table_markdown()


class ErrorsDirective(_MarkdownDirective):
    def render(self) -> str:
        return errors_markdown()


class ApiErrorsDirective(_MarkdownDirective):
    def render(self) -> str:
        return api_errors_markdown()


def _check_api_documented(app: Sphinx, env: Any) -> None:
    """Warn (an error under -W) for each public name the API reference has no entry for."""
    api = import_module(API_MODULE)
    documented = set(env.get_domain("py").objects)
    for name in api.__all__:
        if f"{API_MODULE}.{name}" not in documented:
            logger.warning(
                "%s.%s is public (in __all__) but has no entry in the API reference: add it to docs/reference/api.md",
                API_MODULE,
                name,
            )


def _model_signature(app: Sphinx, what: str, name: str, obj: Any, *rest: Any) -> tuple[str, str | None] | None:
    """A model's entry without Django's `(*args, **kwargs)`: runs and schedules are made by the API, not by hand."""
    from django.db import models

    if what == "class" and inspect.isclass(obj) and issubclass(obj, models.Model):
        return "", None
    return None


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_directive("durable-settings", SettingsDirective)
    app.add_directive("durable-commands", CommandsDirective)
    app.add_directive("durable-checks", ChecksDirective)
    app.add_directive("durable-errors", ErrorsDirective)
    app.add_directive("durable-metrics", MetricsDirective)
    app.add_directive("durable-signals", SignalsDirective)
    app.add_directive("durable-model-table", ModelTableDirective)
    app.add_directive("durable-api-errors", ApiErrorsDirective)
    app.connect("env-check-consistency", _check_api_documented)
    app.connect("autodoc-process-signature", _model_signature)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}

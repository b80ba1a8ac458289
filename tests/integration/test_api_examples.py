"""The `Example::` blocks of the public API's docstrings (the API reference shows them) run as written.

Each block runs against the test app, in a database test, with the registries isolated: the names of
`durable_agents.api` are in scope, as `from durable_agents.api import *` would give, plus what the block's prose
assumes (SETUP). A block that cannot run on its own is in CANNOT_RUN, with the reason.
"""

from __future__ import annotations

import inspect
import re
import textwrap
import uuid
from collections.abc import Callable, Iterator
from decimal import Decimal
from types import SimpleNamespace
from typing import Annotated, Any

import pytest

from durable_agents import api
from durable_agents.testing import drive, isolated_registries
from durable_agents.tools import tools
from tests.testapp.workflows import lookup_order

CANNOT_RUN = {
    "replay": "replays a cohort of 50 finished refund_agent runs on the example project's workers "
    "(tests/integration/test_replay_lab.py runs replays)",
}


def examples() -> Iterator[tuple[str, str]]:
    """(owner, code) for each `Example::` block of durable_agents.api's docstring and its public names'."""
    owners = [("api", api)] + [(name, getattr(api, name)) for name in api.__all__]
    for owner, value in owners:
        for number, part in enumerate((inspect.getdoc(value) or "").split("Example::")[1:]):
            block = []
            for line in part.splitlines()[1:]:
                if line.strip() and not line.startswith(" "):
                    break
                block.append(line)
            yield (owner if number == 0 else f"{owner}-{number + 1}"), textwrap.dedent("\n".join(block)).strip()


def _refund_tools() -> dict[str, Any]:
    @api.tool(effectful=True)
    def issue_refund(order_id: str, amount: Decimal, *, idempotency_key: str) -> dict[str, Any]:
        """Refund part of an order."""
        return {"order_id": order_id, "refunded": str(amount), "key": idempotency_key}

    return {"lookup_order": lookup_order, "issue_refund": issue_refund}  # lookup_order: the test app's


def _report_workflow() -> dict[str, Any]:
    api.workflow("report", steps=[api.call("render", lambda ctx: {"days": ctx.input["days"]})])
    return {}


def _tool_objects() -> dict[str, Any]:
    # The block's `registry` is the tool registry (durable_agents.tools.tools), `key` and `step_ctx` its prose's.
    return {**_refund_tools(), "registry": tools, "key": "refund-A1", "step_ctx": None}


def _scheduled_report() -> dict[str, Any]:
    _report_workflow()
    api.schedule("nightly-report", "report", cron="0 3 * * *", input={"days": 1})
    return {}


def _schedule_steps() -> dict[str, Any]:
    return {"send_digest": lambda ctx: {"days": ctx.input["days"]}, "render_report": lambda ctx: {}}


def _workflow_steps() -> dict[str, Any]:
    return {"tick": lambda ctx: {}, "lookup": lambda ctx: {"order_id": ctx.input["order_id"]}}


SETUP: dict[str, Callable[[], dict[str, Any]]] = {
    "workflow": _workflow_steps,
    "cron": _schedule_steps,
    "Tool": _tool_objects,
    "agent": _refund_tools,
    "tool_step": _refund_tools,
    "schedule": _report_workflow,
    "trigger_schedule": _scheduled_report,
    "pause_schedule": _scheduled_report,
}


@pytest.mark.django_db
@pytest.mark.parametrize(("owner", "code"), list(examples()), ids=[owner for owner, _ in examples()])
def test_api_example__runs_as_written(owner, code):
    if owner in CANNOT_RUN:  # it cannot run here (the reason is in CANNOT_RUN), but it must still be Python
        compile(code, f"<Example:: of {owner}>", "exec")
        return
    scope: dict[str, Any] = {name: getattr(api, name) for name in api.__all__}
    scope.update(api=api, uuid=uuid, Decimal=Decimal, Annotated=Annotated)
    with isolated_registries():
        scope.update(SETUP.get(owner, dict)())
        exec(compile(code, f"<Example:: of {owner}>", "exec"), scope)  # noqa: S102 - the docstring's own code


def test_api_examples__the_allowlist_names_only_blocks_that_exist():
    owners = {owner for owner, _ in examples()}
    assert set(CANNOT_RUN) <= owners, f"CANNOT_RUN names blocks that are gone: {sorted(set(CANNOT_RUN) - owners)}"
    assert set(SETUP) <= owners, f"SETUP names blocks that are gone: {sorted(set(SETUP) - owners)}"


def module_example(module: Any) -> str:
    """The `Example::` block of a module's docstring (the reference pages render module docstrings too)."""
    part = (inspect.getdoc(module) or "").split("Example::")[1]
    block = []
    for line in part.splitlines()[1:]:
        if line.strip() and not line.startswith(" "):
            break
        block.append(line)
    return textwrap.dedent("\n".join(block)).strip()


@pytest.mark.django_db
def test_signals_example__its_receiver_pages_a_failed_run(django_capture_on_commit_callbacks):
    """docs/reference/signals.md shows durable_agents.signals' example: its receiver, as written, gets a real
    failed run's arguments from the engine (signals are sent on commit, hence the captured callbacks)."""
    from durable_agents import signals  # noqa: PLC0415

    alerts: list[str] = []
    scope: dict[str, Any] = {"pager": SimpleNamespace(alert=alerts.append)}
    exec(compile(module_example(signals), "<Example:: of durable_agents.signals>", "exec"), scope)  # noqa: S102
    try:
        with django_capture_on_commit_callbacks(execute=True):
            run = api.start("broken")
        with django_capture_on_commit_callbacks(execute=True):
            run = drive(run.id)
    finally:
        signals.run_finished.disconnect(scope["page_on_failure"])
    assert run.status == "failed"
    assert len(alerts) == 1 and alerts[0].startswith(f"run {run.id} failed: "), alerts


INLINE = re.compile(r"Example: ``(.+?)``", re.S)


def inline_examples() -> Iterator[tuple[str, str]]:
    """(owner, code) for each one-line `Example: ``...``` of the public names and their classes' methods."""
    for name in api.__all__:
        value = getattr(api, name)
        docs = [(name, inspect.getdoc(value) or "")]
        if inspect.isclass(value):
            docs += [
                (f"{name}.{attribute}", inspect.getdoc(member) or "")
                for attribute, member in vars(value).items()
                if not attribute.startswith("_") and callable(member)
            ]
        for owner, doc in docs:
            for code in INLINE.findall(doc):
                yield owner, " ".join(code.split())  # a wrapped line of the docstring is one line of code


@pytest.mark.django_db
@pytest.mark.parametrize(("owner", "code"), list(inline_examples()), ids=[owner for owner, _ in inline_examples()])
def test_api_inline_example__runs_as_written(owner, code):
    scope: dict[str, Any] = {name: getattr(api, name) for name in api.__all__}
    scope.update(api=api, Annotated=Annotated, charge_card=lambda ctx: {})
    with isolated_registries():
        scope.update(_refund_tools())
        if not owner.startswith("StepContext."):
            exec(compile(code, f"<Example: of {owner}>", "exec"), scope)  # noqa: S102 - the docstring's own code
            return

        def in_a_step(ctx):  # a StepContext method's example needs a step's context: it runs in one
            exec(compile(code, f"<Example: of {owner}>", "exec"), {**scope, "ctx": ctx})  # noqa: S102
            return {}

        api.workflow("inline_example", steps=[api.call("try", in_a_step)])
        run = drive(api.start("inline_example").id)
    assert run.status == "completed", (run.status, run.error)

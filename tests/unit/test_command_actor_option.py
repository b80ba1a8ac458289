"""`--as USER` on the command line: every command that changes state and records who acted takes it, from the one
helper (`add_actor_argument`), with one help text and one default; the read-only commands do not."""

from __future__ import annotations

import argparse

import pytest
from django.core.management import get_commands, load_command_class

from durable_agents.management.commands._base import ACTOR_HELP, DEFAULT_ACTOR

# Each durable_* command, by what it does. A new command fails test_commands__each_is_classified until it is added.
RECORDS_AN_ACTOR = {
    "durable_budget",
    "durable_cancel",
    "durable_decide",
    "durable_effect",
    "durable_fork",
    "durable_migrate",
    "durable_replay",
    "durable_resume",
    "durable_schedules",  # pause, resume and trigger record who acted; list changes nothing
    "durable_signal",
    "durable_swap",
}
READ_ONLY = {"durable_export", "durable_runs", "durable_show", "durable_status"}
# They change state but no history names a person: a run's start, the sweep's pass, retention's deletes.
RECORDS_NO_ACTOR = {"durable_start", "durable_sweep", "durable_prune"}


def durable_commands() -> dict[str, str]:
    return {name: app for name, app in get_commands().items() if name.startswith("durable_")}


def actor_action(name: str) -> argparse.Action | None:
    parser = load_command_class(durable_commands()[name], name).create_parser("manage.py", name)
    return next((action for action in parser._actions if "--as" in action.option_strings), None)


def test_commands__each_is_classified():
    found = set(durable_commands())
    classified = RECORDS_AN_ACTOR | READ_ONLY | RECORDS_NO_ACTOR
    assert found == classified, (
        f"unclassified commands {sorted(found - classified)} (or gone: {sorted(classified - found)}): a command that "
        "changes state and records who acted takes --as through add_actor_argument; list it in this test"
    )


@pytest.mark.parametrize("name", sorted(RECORDS_AN_ACTOR))
def test_actor_option__each_acting_command_takes_it_with_one_help_and_default(name):
    action = actor_action(name)
    assert action is not None, f"{name} records who acted but takes no --as: call add_actor_argument(parser)"
    assert action.dest == "actor" and action.metavar == "USER", f"{name}: --as must be add_actor_argument's"
    assert action.help == ACTOR_HELP, f"{name}'s --as help differs: use add_actor_argument, not its own"
    assert action.default == DEFAULT_ACTOR, f"{name}'s --as defaults to {action.default!r}, not {DEFAULT_ACTOR!r}"


@pytest.mark.parametrize("name", sorted(READ_ONLY | RECORDS_NO_ACTOR))
def test_actor_option__commands_recording_no_actor_do_not_take_it(name):
    assert actor_action(name) is None, f"{name} records no actor: an --as there would be silently ignored"


def test_actor_option__is_given_as_the_history_records_it():
    parser = load_command_class(durable_commands()["durable_cancel"], "durable_cancel").create_parser(
        "manage.py", "durable_cancel"
    )
    assert parser.parse_args(["abcdef", "--as", "alice"]).actor == "alice"
    assert parser.parse_args(["abcdef"]).actor == DEFAULT_ACTOR

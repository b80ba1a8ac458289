"""The README's API reference covers the public API, and the API exports every error a user may catch."""

import inspect
import re
from pathlib import Path

from durable_agents import api, errors

README = Path(__file__).resolve().parents[2] / "README.md"


def _reference() -> str:
    text = README.read_text()
    start = text.index("## API reference")
    return text[start : text.index("\n## ", start + 1)]


def test_every_public_name_is_in_the_api_reference():
    reference = _reference()
    missing = [name for name in api.__all__ if f"`{name}`" not in reference and f"`{name}(" not in reference]
    assert not missing, f"README's API reference does not describe: {', '.join(missing)}"


def test_the_api_reference_names_only_what_the_api_exports():
    named = set(re.findall(r"^\| `(\w+)`", _reference(), flags=re.MULTILINE))
    assert named, "no table rows found in README's API reference"
    assert named <= set(api.__all__), f"README names what the API does not export: {sorted(named - set(api.__all__))}"


def test_every_error_a_user_may_catch_is_exported():
    internal = {"BatchRefusedError", "ToolDefinitionError"}  # raised as their exported bases' kinds
    # Raised and caught inside: a notification is failed for it (visibly), a wake-up is left to the sweep.
    internal |= {"DecisionLinkError", "BrokerUnavailableError"}
    public = {
        name
        for name, value in vars(errors).items()
        if inspect.isclass(value)
        and issubclass(value, errors.DurableAgentsError)
        and value.__module__ == errors.__name__
    }
    unexported = public - internal - set(api.__all__)
    assert not unexported, f"not exported by durable_agents.api: {sorted(unexported)}"

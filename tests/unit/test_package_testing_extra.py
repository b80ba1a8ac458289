"""The package's `testing` extra is what the documentation says it is, and installs everything its testing code and
the testing guide's example import."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import textwrap
import tomllib
from pathlib import Path

from tests.integration import user_project

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# The pages that sell the extra: the install guide lists it, the testing guide is about it.
PAGES = (ROOT / "docs" / "howto" / "install.md", ROOT / "docs" / "howto" / "testing.md")
TESTING_GUIDE = ROOT / "docs" / "howto" / "testing.md"
TESTING_EXAMPLE = ROOT / "docs" / "examples" / "testing"  # the guide's literalinclude'd project
PROJECT = PYPROJECT["project"]["name"]

# The testing guide example's own packages (the user's project), not something to install.
EXAMPLE_PACKAGES = {"shop", "shopsite", "yourproject"}


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name(requirement: str) -> tuple[str, list[str]]:
    """(distribution, extras) of a PEP 508 requirement such as "durable-agents[anthropic]" or "redis>=5"."""
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[([^\]]*)\])?", requirement)
    assert match, f"unreadable requirement {requirement!r} in pyproject.toml"
    extras = [extra.strip() for extra in (match.group(2) or "").split(",") if extra.strip()]
    return _normalized(match.group(1)), extras


def installed_by(extra: str) -> set[str]:
    """The distributions `pip install durable-agents[extra]` brings: the core dependencies, the extra's, and
    those of the package's own extras it names (e.g. "durable-agents[anthropic]")."""
    extras = PYPROJECT["project"]["optional-dependencies"]
    names = {_requirement_name(r)[0] for r in PYPROJECT["project"]["dependencies"]}
    pending, seen = [extra], set()
    while pending:
        current = pending.pop()
        seen.add(current)
        for requirement in extras[current]:
            name, named_extras = _requirement_name(requirement)
            if name == _normalized(PROJECT):
                pending += [e for e in named_extras if e not in seen]
            else:
                names.add(name)
                # celery[redis] brings redis: an extra of another package counts as its import name too.
                names.update(f"{name}[{e}]" for e in named_extras)
    return names


def top_level_imports(source: str) -> set[str]:
    """Every absolute import's top-level module, function-level and TYPE_CHECKING ones included."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


def third_party(modules: set[str]) -> set[str]:
    return {m for m in modules if m not in sys.stdlib_module_names and m != "durable_agents"} - EXAMPLE_PACKAGES


def imports_of_the_testing_guide() -> dict[str, set[str]]:
    """Imports of the testing guide's example (its Python blocks and the project files it includes), and of the
    test settings it describes (read DATABASE_URL with dj-database-url), as tests/integration/user_project.py
    writes them for a user."""
    found = re.findall(r"```(?:python|\{code-block\} python)\n(.*?)```", TESTING_GUIDE.read_text(), re.S)
    # A block in a list item is indented; a MyST directive's options (":class: settings") open it.
    blocks = [re.sub(r"\A(?::\w+:.*\n)+", "", textwrap.dedent(block)) for block in found]
    sources = {f"{TESTING_GUIDE.name} example #{i + 1}": block for i, block in enumerate(blocks)}
    files = sorted(TESTING_EXAMPLE.rglob("*.py"))
    assert files, f"{TESTING_EXAMPLE.relative_to(ROOT)} lost its example project: fix imports_of_the_testing_guide()"
    sources.update({str(path.relative_to(ROOT)): path.read_text() for path in files})
    sources["the test settings (tests/integration/user_project.py SETTINGS)"] = user_project.SETTINGS
    sources["the Celery app (tests/integration/user_project.py CELERY)"] = user_project.CELERY
    return {where: top_level_imports(source) for where, source in sources.items()}


def distributions_of(module: str) -> set[str]:
    return {_normalized(d) for d in importlib.metadata.packages_distributions().get(module, [])}


def uncovered(imports: dict[str, set[str]], extra: str = "testing") -> list[str]:
    installed = installed_by(extra)
    missing = []
    for where, modules in sorted(imports.items()):
        for module in sorted(third_party(modules)):
            dists = distributions_of(module)
            assert dists, f"{where} imports {module!r}, which is not installed here: install it, or list it"
            if not dists & installed:
                missing.append(f"{where} imports {module!r} (distribution {', '.join(sorted(dists))})")
    return missing


def test_package__the_testing_extra_is_what_the_docs_say_it_is():
    """The docs sell `durable-agents[testing]` as "the pytest plugin": the wheel must declare its pytest11 entry
    point, or no page may promise one."""
    plugins = PYPROJECT["project"].get("entry-points", {}).get("pytest11", {})
    for page in PAGES:
        text = page.read_text()
        if plugins:
            assert "pytest plugin" in text, f"{page.relative_to(ROOT)} no longer says what the testing extra is for"
        else:
            assert "pytest plugin" not in text, f"{page.relative_to(ROOT)} promises a pytest plugin the package lacks"


def test_testing_extra__installs_every_third_party_import_of_durable_agents_testing():
    imports = {
        str(path.relative_to(ROOT)): top_level_imports(path.read_text())
        for path in sorted((ROOT / "durable_agents" / "testing").glob("*.py"))
    }
    missing = uncovered(imports)
    assert not missing, (
        "the `testing` extra in pyproject.toml does not install what durable_agents.testing imports; add it "
        "(with version bounds):\n" + "\n".join(missing)
    )


def test_testing_extra__installs_every_third_party_import_of_the_testing_guides_example():
    missing = uncovered(imports_of_the_testing_guide())
    assert not missing, (
        "the testing guide's example (docs/howto/testing.md) needs packages the `testing` extra does not install; add "
        "them to it in pyproject.toml:\n" + "\n".join(missing)
    )


def _is_distribution(name: str) -> bool:
    try:
        importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def test_testing_extra__installs_the_packages_the_testing_guide_names():
    named = {
        _normalized(name)
        for name in re.findall(r"`([A-Za-z][A-Za-z0-9._-]*)`", TESTING_GUIDE.read_text())
        if _is_distribution(name) and _normalized(name) != _normalized(PROJECT)
    }
    assert {"pytest-django", "dj-database-url"} <= named, "the testing guide no longer names them"
    missing = sorted(named - installed_by("testing"))
    assert not missing, f"the testing guide names {missing}; the `testing` extra must install them"


def test_testing_extra__the_fake_messages_api_gets_the_anthropic_sdk():
    """The fake Messages API is driven through the real SDK: the extra brings it, with the anthropic extra's bounds."""
    testing = PYPROJECT["project"]["optional-dependencies"]["testing"]
    assert f"{PROJECT}[anthropic]" in testing, "the testing extra must reuse the anthropic extra (one version bound)"
    assert "anthropic" in installed_by("testing")


def test_uncovered__sees_an_import_the_extra_does_not_install():
    assert uncovered({"example": {"anthropic", "django", "os", "shop"}}, extra="metrics") == [
        "example imports 'anthropic' (distribution anthropic)"
    ], "the check must flag a third-party import no extra provides and pass the stdlib, core deps and the example"

"""Every Python and shell example in README.md, docs/howto, docs/explanation and the hand-written parts of
docs/reference runs here, so none can drift (the tutorial's run in tests/e2e/test_tutorial.py, the API
docstrings' in tests/integration/test_api_examples.py).

Each fenced block is checked by its kind, which its fence declares with MyST's ``{code-block}`` directive and its
``:class:`` option (README.md, read on GitHub, puts ``<!-- example: settings -->`` on the line before a plain fence
instead):

* ``:class: settings`` — a settings fragment: exec'd after tests/settings.py in a settings module of its own
  (with durable_agents taken out of INSTALLED_APPS first, so a fragment adding it is not a duplicate), then
  Django's system checks run on it in a fresh process and must find no error;
* ``:class: run`` — Python a reader runs: a page's run blocks are exec'd in order in one namespace, in this
  process, on the test database, with the registries isolated (a block that starts a run drives it itself);
* ``console`` — shell lines with ``$`` prompts: ``python manage.py <command>`` lines of SAFE_COMMANDS run with
  call_command on the test database and must succeed; every other line must match ALLOWED_COMMANDS, which
  says why it does not run here (it installs software, starts a long-lived process, runs the whole suite);
* whole modules are not fenced at all: pages ``literalinclude`` them from docs/examples/ (or from the example
  project), and the tests here (and tests/integration/test_docs_testing_example.py) run those projects; the
  install example's Celery app is the one every user-project test starts, and its URLs are loaded.

A Python or shell block that is none of these, and not in ALLOWED_BLOCKS with a reason, fails
test_docs__every_python_and_shell_block_is_checked, which lists each by file and line.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from django.core.management import call_command

from durable_agents.tools import tools
from durable_agents.workflows import registry
from tests.conftest import ROOT
from tests.integration.user_project import run_user_tests, write_user_project

pytest_plugins = ["pytester"]

PAGES = sorted(
    [
        ROOT / "README.md",
        *(ROOT / "docs" / "howto").glob("*.md"),
        *(ROOT / "docs" / "explanation").glob("*.md"),
        *(ROOT / "docs" / "reference").glob("*.md"),
    ]
)
EXAMPLES = ROOT / "docs" / "examples"
PYTHON = {"python", "py", "python3"}
SHELL = {"console", "bash", "sh", "shell", "shell-session"}

# `python manage.py <name> ...` lines that run here, against the test database.
SAFE_COMMANDS = {
    "check",
    "migrate",
    "sqlmigrate",
    "durable_start",
    "durable_runs",
    "durable_sweep",
    "durable_schedules",
    "durable_prune",
}

# Shell lines that do not run here, each with the reason (a regular expression matched from the line's start).
ALLOWED_COMMANDS: list[tuple[str, str]] = [
    (r"scripts/demo\b", "the demo: tests/e2e/test_demo.py runs it"),
    (r"DATABASE_URL=\S+ CELERY_BROKER_URL=\S+ scripts/demo", "the demo on Postgres: tests/e2e/test_demo.py"),
    (r"OTEL_TRACES_EXPORTER=otlp \S+ scripts/demo", "the demo sending spans: tests/e2e/test_otlp_export.py"),
    (r"scripts/test\b", "the whole suite: this test is part of it"),
    (r"pip install\b", "installs software"),
    (r"celery -A \S+ (worker|beat)\b", "a long-lived process: tests start real workers with start_worker"),
    (r"OTEL_TRACES_EXPORTER=\S+ celery -A", "a long-lived worker exporting spans: tests/e2e/test_otlp_export.py"),
    (r"phoenix serve", "a trace viewer, installed apart"),
    (r"export ", "sets a production environment"),
    (r"python -m sphinx\b", "the documentation build: CI builds the site with -W"),
    (r"PGOPTIONS=.* python manage.py migrate\b", "the same migrate with a lock timeout: test_upgrades.py migrates"),
    (r"python manage.py durable_replay\b", "needs recorded runs: tests/integration/test_durable_replay_command.py"),
    (
        r"python manage.py (durable_status|durable_show|durable_resume|durable_cancel|durable_decide|durable_effect)\b",
        "needs a live system or a run id: tests/integration/test_commands.py runs each",
    ),
]

# Python or shell blocks that are neither run nor fenced as a kind above: (page, first line) -> why. Keep it empty:
# an example that cannot run here should say so in a reason, and a test elsewhere should run what it shows.
ALLOWED_BLOCKS: dict[tuple[str, str], str] = {}


@dataclass
class Block:
    page: str
    line: int
    lang: str
    options: dict[str, str] = field(default_factory=dict)
    text: str = ""

    @property
    def kind(self) -> str:
        return self.options.get("class", "")

    @property
    def first_line(self) -> str:
        return next((line.strip() for line in self.text.splitlines() if line.strip()), "")

    def __str__(self) -> str:
        return f"{self.page}:{self.line} ({self.lang}{', ' + self.kind if self.kind else ''})"


FENCE = re.compile(r"^(?P<fence>`{3,}|~{3,})(?P<info>.*)$")


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of a Markdown page, with a {code-block}'s language and options."""
    found: list[Block] = []
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        fence, info = match["fence"], match["info"].strip()
        directive = re.match(r"\{(code-block|code|sourcecode)\}\s*(\S*)", info)
        lang = directive[2] if directive else (info.split()[0] if info else "")
        if info.startswith("{") and not directive:
            lang = "directive"
        block = Block(str(path.relative_to(ROOT)), i + 1, lang.lower())
        # README.md is read on GitHub, which shows a {code-block}'s options as code: there a comment names the kind.
        marker = re.match(r"^<!-- example: (\w+) -->$", lines[i - 1]) if i else None
        if marker:
            block.options["class"] = marker[1]
        i += 1
        while directive and i < len(lines) and (m := re.match(r"^:(\w[\w-]*):\s*(.*)$", lines[i])):
            block.options[m[1]] = m[2].strip()
            i += 1
        body = []
        while i < len(lines) and not lines[i].startswith(fence):
            body.append(lines[i])
            i += 1
        block.text = "\n".join(body).strip("\n") + "\n"
        found.append(block)
        i += 1
    return found


ALL = [block for page in PAGES for block in blocks(page)]


def commands(block: Block) -> list[str]:
    """The `$ ` lines of a console block, continuation lines joined."""
    found, current = [], None
    for line in block.text.splitlines():
        if line.startswith("$ "):
            current = line[2:]
            found.append(current)
        elif current is not None and found[-1].endswith("\\"):
            found[-1] = found[-1][:-1] + " " + line.strip()
    return found


def without_comment(command: str) -> str:
    return shlex.join(shlex.split(command, comments=True))


def allowed_reason(command: str) -> str | None:
    return next((why for pattern, why in ALLOWED_COMMANDS if re.match(pattern, command)), None)


def is_safe(command: str) -> bool:
    words = shlex.split(command, comments=True)
    return words[:2] == ["python", "manage.py"] and len(words) > 2 and words[2] in SAFE_COMMANDS


def problems(block: Block) -> list[str]:
    if block.lang in PYTHON:
        if block.kind in ("settings", "run") or (block.page, block.first_line) in ALLOWED_BLOCKS:
            return []
        return [
            f"{block}: a Python block must be a {{code-block}} with `:class: settings` or `:class: run`, "
            "a literalinclude of a file a test runs, or be in ALLOWED_BLOCKS with a reason"
        ]
    if block.lang in SHELL:
        if block.lang != "console":
            return [f"{block}: write shell as a `console` block with `$ ` prompts, so each line can be checked"]
        lines = commands(block)
        if not lines:
            return [f"{block}: a console block with no `$ ` command"]
        return [
            f"{block}: `{line}` neither runs here (SAFE_COMMANDS) nor is in ALLOWED_COMMANDS with a reason"
            for line in lines
            if not is_safe(line) and allowed_reason(line) is None
        ]
    return []


def test_docs__every_python_and_shell_block_is_checked():
    assert ALL, "no fenced block found: has the documentation moved?"
    found = [problem for block in ALL for problem in problems(block)]
    assert not found, "examples no test checks:\n" + "\n".join(found)


def test_docs__the_allow_lists_name_only_what_the_pages_still_show():
    unclassified = {(b.page, b.first_line) for b in ALL if b.lang in PYTHON and b.kind not in ("settings", "run")}
    stale_blocks = [key for key in ALLOWED_BLOCKS if key not in unclassified]
    shown = [line for block in ALL if block.lang == "console" for line in commands(block) if not is_safe(line)]
    stale_commands = [pattern for pattern, _ in ALLOWED_COMMANDS if not any(re.match(pattern, line) for line in shown)]
    assert not stale_blocks, f"ALLOWED_BLOCKS names blocks no page shows unchecked any more: {stale_blocks}"
    assert not stale_commands, f"ALLOWED_COMMANDS has patterns no page's command needs any more: {stale_commands}"


SETTINGS_BLOCKS = [block for block in ALL if block.lang in PYTHON and block.kind == "settings"]


# One process imports what every settings module needs, then forks a child per fragment: each child starts Django
# afresh on its fragment's settings (as `manage.py check` would) without paying for the imports again.
CHECK_EACH = """
import os, sys
import anthropic, celery, dj_database_url, django, kombu, psycopg  # noqa: F401 - imported once, before the forks
for name in sys.argv[1:]:
    pid = os.fork()
    if pid == 0:
        with open(name + ".log", "w") as log:
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
            os.environ["DJANGO_SETTINGS_MODULE"] = name
            try:
                django.setup()
                from django.core.management import call_command
                call_command("check", "--fail-level", "ERROR")
            except BaseException as exc:
                import traceback
                traceback.print_exc()
                os._exit(exc.code if isinstance(exc, SystemExit) and isinstance(exc.code, int) and exc.code else 1)
            sys.stdout.flush()
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    open(name + ".status", "w").write(str(os.waitstatus_to_exitcode(status)))
"""


@pytest.fixture(scope="module")
def settings_checks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[int, str]]:
    """`manage.py check` on each fragment's settings: by fragment, its exit code and output."""
    folder = tmp_path_factory.mktemp("fragments")
    names = {}
    for index, block in enumerate(SETTINGS_BLOCKS):
        names[str(block)] = name = f"fragment_{index}"
        (folder / f"{name}.py").write_text(
            "from tests.settings import *  # noqa\n"
            "import copy\n"
            "DURABLE_AGENTS = copy.deepcopy(DURABLE_AGENTS)\n"
            "DATABASES = copy.deepcopy(DATABASES)\n"
            'INSTALLED_APPS = [app for app in INSTALLED_APPS if app != "durable_agents"]\n'
            f"# {block}\n{block.text}"
            'if "durable_agents" not in INSTALLED_APPS:\n    INSTALLED_APPS = [*INSTALLED_APPS, "durable_agents"]\n'
        )
    subprocess.run(
        [sys.executable, "-c", CHECK_EACH, *names.values()],
        cwd=folder,
        env={**_environ(), "PYTHONPATH": f"{folder}:{ROOT}"},
        timeout=600,
        check=False,
    )
    return {
        block: (int((folder / f"{name}.status").read_text() or 1), (folder / f"{name}.log").read_text())
        for block, name in names.items()
    }


@pytest.mark.parametrize("block", SETTINGS_BLOCKS, ids=str)
def test_docs__a_settings_fragment_passes_the_system_checks(block: Block, settings_checks):
    code, output = settings_checks[str(block)]
    assert code == 0, f"{block}: the system checks refuse this fragment (exit {code}):\n{output[-3000:]}"


def _environ() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}


RUN_PAGES = sorted({block.page for block in ALL if block.lang in PYTHON and block.kind == "run"})


@pytest.mark.django_db(transaction=True)  # as workers see it: family hooks run on commit
@pytest.mark.parametrize("page", RUN_PAGES)
def test_docs__a_pages_python_runs_in_order(page: str, isolated_registries):
    # A page's examples run as in a fresh project: none of the test app's workflows and tools (isolated_registries
    # puts them back after).
    registry._workflows = {}
    tools._tools = {}
    namespace: dict[str, object] = {"__name__": f"docs_{Path(page).stem.replace('-', '_')}"}
    for block in (b for b in ALL if b.page == page and b.lang in PYTHON and b.kind == "run"):
        # Named after the page and line, so a failing example's traceback says where it is printed.
        code = compile(textwrap.dedent(block.text), str(block), "exec")
        exec(code, namespace)  # noqa: S102 - the documentation's own examples


SAFE_LINES = [(block, line) for block in ALL if block.lang == "console" for line in commands(block) if is_safe(line)]


@pytest.mark.django_db
@pytest.mark.parametrize(("block", "line"), SAFE_LINES, ids=[f"{b}: {line}" for b, line in SAFE_LINES])
def test_docs__a_management_command_shown_runs(block: Block, line: str, capsys):
    words = shlex.split(line, comments=True)[2:]
    try:
        call_command(*words)
    except SystemExit as exc:
        assert exc.code in (0, None), f"{block}: `{line}` exited {exc.code}: {capsys.readouterr().err}"


def test_docs_compensation_example__the_compensating_tool_receives_what_the_page_says(
    pytester: pytest.Pytester, monkeypatch
):
    example = EXAMPLES / "compensation"
    write_user_project(
        pytester,
        models=(example / "shop" / "models.py").read_text(),
        workflows=(example / "shop" / "workflows.py").read_text(),
        tests={"test_compensation.py": (example / "tests" / "test_compensation.py").read_text()},
    )

    result = run_user_tests(pytester, monkeypatch)

    result.assert_outcomes(passed=1)


def test_docs_install_example__the_celery_app_is_the_one_every_user_project_test_runs():
    # tests/integration/user_project.py's CELERY starts the workers of every user-project test (the testing and
    # compensation examples here): the install guide shows the same module, named for the reader's project.
    from tests.integration import user_project

    shown = (EXAMPLES / "install" / "yourproject" / "celery.py").read_text()
    assert shown.strip() == user_project.CELERY.replace("shopsite", "yourproject").strip(), (
        "docs/examples/install/yourproject/celery.py differs from the Celery app the user-project tests run"
    )
    package = (EXAMPLES / "install" / "yourproject" / "__init__.py").read_text()
    assert "from yourproject.celery import app as celery_app" in package


def test_docs_install_example__the_urls_include_the_admin_and_the_decision_links():
    namespace: dict[str, object] = {}
    exec((EXAMPLES / "install" / "yourproject" / "urls.py").read_text(), namespace)  # noqa: S102

    included = [getattr(pattern, "urlconf_module", None) for pattern in namespace["urlpatterns"]]
    assert any(getattr(module, "__name__", "") == "durable_agents.urls" for module in included), included
    assert any(str(pattern.pattern) == "admin/" for pattern in namespace["urlpatterns"])

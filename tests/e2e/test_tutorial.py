"""The tutorial (docs/tutorial/), performed as written, so it cannot drift from the product.

What is read from the Markdown, page by page in the order of the tutorial's toctree:

* a fenced ```` ```{code-block} LANG ```` with ``:caption: PATH`` is a file: written at PATH (relative to the
  directory the commands are in at that point), or appended to it with ``:class: append``;
* a ```` ```console ```` fence is the reader's first terminal: each ``$ `` line is a command, run in order with
  ``bash -c``; it must exit 0, and the lines under it (the expected output, ``…`` for what is left out or differs)
  must appear in its output, in order. A read-only command (``durable_show``, ``durable_runs``, ``shell -c``) is
  repeated until they do, for at most ``POLL_SECONDS``: that is how the test waits for a run, never by sleeping;
* a ```` ```{code-block} console ```` with ``:caption: Terminal: NAME`` is another terminal: ``cd``, ``export``
  and ``source`` set its state, any other command starts a long-running process there (a worker, beat, the
  stand-in of Claude), and the test waits until the expected output lines appear in that process's log;
* every other fence (``text``, uncaptioned ``python``) is an illustration and is not run;
* a command is run unless ALLOWLIST names it, with the reason it cannot run here; an unknown caption, a
  captioned block that is neither a file nor a terminal, or a second process in a busy terminal fails the test.

The reader installs ``durable-agents`` from the package index; this test has no network. It makes a fresh
``python -m venv --without-pip`` and gives it what ``pip install --no-deps -e <checkout>`` would write — a
``.pth`` line putting the checkout's ``durable_agents`` package on the path and a ``durable_agents-*.dist-info``
with the ``pytest11`` entry point from pyproject.toml, so pytest loads the plugin as an installed package's —
plus a ``.pth`` line to this test's own site-packages for the dependencies (Django, Celery, anthropic, pytest,
pytest-django), and console scripts ``django-admin``, ``celery`` and ``pytest`` in the venv's ``bin``, as pip
would make them. (Building a wheel needs setuptools >= 77, which pip fetches from the index.) The commands run
with that ``bin`` first on a clean PATH and nothing else of this process's environment: the tutorial's project
uses its own SQLite file and file-system broker, in a temporary directory, never this suite's database.

The agent step talks to Claude through the real ``anthropic`` SDK, pointed by ``ANTHROPIC_BASE_URL`` at the
tutorial's own stand-in (``fake_claude.py``, built on ``durable_agents.testing.fake_anthropic``): the path the
tutorial documents for a reader without an API key, on a free port in place of the tutorial's 8765.

It takes about 2.5 minutes on two busy cores, most of it the tutorial's own waits: the receipt step's 15 s (three
times), a lease running out after the kill, and the Python start-up of some twenty `manage.py` commands. It needs
no Postgres or Redis; run it alone with `pytest tests/e2e/test_tutorial.py`.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import durable_agents

ROOT = Path(__file__).resolve().parents[2]
TUTORIAL = ROOT / "docs" / "tutorial"
POLL_SECONDS = 150.0  # the longest a read-only command is repeated, or a process's log is waited on
COMMAND_TIMEOUT = 180.0
LOG_TAIL_CHARS = 4000

# Commands the reader runs that this test cannot, each with the reason. Any other command is run.
ALLOWLIST = {
    "python3 -m venv .venv": "the test makes its own venv (see the module docstring): there is no package index",
    "source .venv/bin/activate": "the test puts its venv's bin first on every process's PATH",
    'pip install "durable-agents[anthropic,testing]"': "needs the package index; the test installs this checkout",
    "export ANTHROPIC_API_KEY=sk-ant-...": "needs a real key and the internet; the test takes the stand-in path",
    "python manage.py runserver": "the admin in a browser (tests/e2e/test_admin_browser.py decides a wait there)",
}
# Commands that change nothing: repeated until their expected output appears (a run reaching a state).
READ_ONLY = re.compile(r"^python manage\.py (durable_show|durable_runs|durable_status|shell -c) ")
FILE_CAPTION = re.compile(r"[\w./-]+\.(py|ini|toml|cfg|txt)")
CODE_DIRECTIVES = {"code-block", "code", "sourcecode"}
ILLUSTRATIONS = {"text"}  # expected output shown outside a console block, e.g. the approval email
UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


@dataclass
class Block:
    page: str
    line: int
    lang: str
    caption: str = ""
    classes: tuple[str, ...] = ()
    body: list[str] = field(default_factory=list)

    @property
    def where(self) -> str:
        return f"docs/tutorial/{self.page}:{self.line}"


@dataclass
class Command:
    text: str
    expected: list[str]
    block: Block


def pages() -> list[str]:
    """The tutorial's pages in reading order: index.md, then its toctree's entries."""
    index = (TUTORIAL / "index.md").read_text()
    toctree = re.search(r"```\{toctree\}\n(.*?)```", index, re.S)
    assert toctree, "docs/tutorial/index.md has no toctree: the test reads the pages' order from it"
    entries = [line.strip() for line in toctree[1].splitlines() if line.strip() and not line.startswith(":")]
    return ["index.md", *(f"{entry}.md" for entry in entries)]


def blocks(page: str) -> Iterator[Block]:
    """The fenced code blocks of a page, indented ones too (``:::`` admonitions hold prose: their text is read on).

    A fence names a language (```` ```console ````) or a directive: ``{code-block} LANG`` (or its aliases) is code
    with options; ``{toctree}`` is not code; any other directive fails the test, which would not know what to do.
    """
    lines = (TUTORIAL / page).read_text().splitlines()
    number = 0
    while number < len(lines):
        opening = re.match(r"^(\s*)(`{3,})\s*(.*?)\s*$", lines[number])
        number += 1
        if not opening or not opening[3]:
            continue
        indent, fence, info = opening.groups()
        directive = re.match(r"^\{([\w-]+)\}\s*(.*)$", info)
        if directive and directive[1] not in CODE_DIRECTIVES | {"toctree"}:
            pytest.fail(f"docs/tutorial/{page}:{number}: a `{{{directive[1]}}}` block this test does not know")
        block = Block(page, number, directive[2] if directive else info)
        body: list[str] = []
        while number < len(lines) and lines[number].strip() != fence:
            body.append(lines[number].removeprefix(indent))
            number += 1
        number += 1
        if directive and directive[1] == "toctree":
            continue
        if directive:
            while body and (option := re.match(r"^:(\w+):\s*(.*)$", body[0])):
                if option[1] == "caption":
                    block.caption = option[2].strip()
                elif option[1] == "class":
                    block.classes = tuple(option[2].split())
                body.pop(0)
            if body and not body[0].strip():
                body.pop(0)
        assert block.lang, f"{block.where}: a code block without a language"
        block.body = body
        yield block


def classify(block: Block) -> str:
    """Whether a block is a "terminal", a "file" or an "illustration"; any other block fails the test, saying what
    to write instead."""
    if block.lang == "console":
        if block.caption and not block.caption.startswith("Terminal: "):
            pytest.fail(f"{block.where}: a console block's caption is `Terminal: NAME`, not {block.caption!r}")
        return "terminal"
    if block.caption:
        if not FILE_CAPTION.fullmatch(block.caption):
            pytest.fail(f"{block.where}: a captioned block is a file, captioned with its path; not {block.caption!r}")
        return "file"
    if block.lang in ILLUSTRATIONS or "illustration" in block.classes:
        return "illustration"
    pytest.fail(
        f"{block.where}: a `{block.lang}` block this test would not run: caption it with a file's path, make it a "
        "`console` block with `$ ` commands, or mark it `:class: illustration`"
    )


def commands(block: Block) -> list[Command]:
    found: list[Command] = []
    for line in block.body:
        if line.startswith("$ "):
            found.append(Command(line[2:].strip(), [], block))
        elif line.strip():
            assert found, f"{block.where}: output before any `$ ` command"
            found[-1].expected.append(line)
    return found


def line_pattern(expected: str) -> re.Pattern[str]:
    """An expected output line as a pattern: `…` matches anything, any run of spaces matches any run of spaces."""
    parts = [r"\s+".join(re.escape(word) for word in part.split()) for part in expected.strip().split("…")]
    return re.compile(r"\s*" + ".*".join(parts) + r"\s*")


def missing_lines(expected: list[str], output: str) -> list[str]:
    """The expected lines not found, in order, among the output's lines (a line of only `…` matches nothing)."""
    wanted = [line for line in expected if line.strip() not in ("…", "...")]
    actual = output.splitlines()
    position = 0
    for index, line in enumerate(wanted):
        pattern = line_pattern(line)
        while position < len(actual) and not pattern.fullmatch(actual[position]):
            position += 1
        if position == len(actual):
            return wanted[index:]
        position += 1
    return []


@dataclass
class Terminal:
    name: str
    cwd: Path
    env: dict[str, str]
    process: subprocess.Popen[bytes] | None = None
    log: Path | None = None


TUTORIAL_PORT = 8765  # the port the pages give Claude's stand-in


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Reader:
    """Performs the tutorial's blocks in order, in `base` (the reader's empty directory)."""

    def __init__(self, base: Path, venv: Path, logs: Path) -> None:
        self.base = base
        self.logs = logs
        self.env = {
            "PATH": f"{venv / 'bin'}:/usr/bin:/bin",
            "HOME": os.environ.get("HOME", str(base)),
            "LANG": "C.UTF-8",
            "VIRTUAL_ENV": str(venv),
            "PYTHONUNBUFFERED": "1",
        }
        self.terminals: dict[str, Terminal] = {"": Terminal("", base, dict(self.env))}
        # What the pages show → what this test uses: a run id → the id of the run it started; the stand-in's port
        # 8765 → a port free on this machine (a second suite beside this one must not collide on it).
        self.ids: dict[str, str] = {f"127.0.0.1:{TUTORIAL_PORT}": f"127.0.0.1:{free_port()}"}
        self.ids[f"port={TUTORIAL_PORT}"] = "port=" + self.ids[f"127.0.0.1:{TUTORIAL_PORT}"].rpartition(":")[2]
        self.run_ids: list[str] = []
        self.allowed: list[str] = []
        self.started: list[subprocess.Popen[bytes]] = []
        self.clock = time.monotonic()

    def perform(self, block: Block) -> None:
        kind = classify(block)
        if kind == "terminal":
            name = block.caption.removeprefix("Terminal: ")
            terminal = self.terminals.setdefault(name, Terminal(name, self.base, dict(self.env)))
            for command in commands(block):
                self.command(terminal, command)
        elif kind == "file":
            self.write(block)

    def write(self, block: Block) -> None:
        path = self.terminals[""].cwd / block.caption
        assert path.resolve().is_relative_to(self.base), f"{block.where}: {block.caption} is outside the project"
        text = "\n".join(block.body) + "\n"
        for shown, actual in self.ids.items():
            text = text.replace(shown, actual)
        if "append" in block.classes:
            assert path.exists(), f"{block.where}: appends to {block.caption}, which does not exist yet"
            with path.open("a") as handle:
                handle.write("\n" + text)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)

    def command(self, terminal: Terminal, command: Command) -> None:
        text = command.text
        if text in ALLOWLIST:
            self.allowed.append(text)
            return
        for shown, actual in self.ids.items():
            text = text.replace(shown, actual)
        words = shlex.split(text)
        if words[0] == "cd" and len(words) == 2:
            terminal.cwd = (terminal.cwd / words[1]).resolve()
        elif words[0] == "export":
            for word in words[1:]:
                key, _, value = word.partition("=")
                terminal.env[key] = value
        elif terminal.name:
            self.start(terminal, command, text)
        else:
            self.run(terminal, command, text)

    def run(self, terminal: Terminal, command: Command, text: str) -> None:
        if text.startswith("kill "):
            self.kill(terminal, text, command)
            return
        deadline = time.monotonic() + POLL_SECONDS
        while True:
            done = subprocess.run(
                ["bash", "-c", text],
                cwd=terminal.cwd,
                env=terminal.env,
                capture_output=True,
                text=True,
                timeout=COMMAND_TIMEOUT,
            )
            output = done.stdout + done.stderr
            assert done.returncode == 0, f"{command.block.where}: `{text}` exited {done.returncode}:\n{output}"
            if text.startswith("python manage.py durable_start "):
                self.started_run(command, done.stdout)
            missing = missing_lines(self.shown(command.expected), output)
            if not missing:
                break
            if not READ_ONLY.match(text) or time.monotonic() > deadline:
                pytest.fail(
                    f"{command.block.where}: `{text}` printed no line like {missing[0]!r}\n"
                    f"(the pages show:)\n" + "\n".join(command.expected) + f"\n(it printed:)\n{output}"
                )
            time.sleep(1.0)
        print(f"{time.monotonic() - self.clock:6.1f} s  {command.block.where}  {text[:90]}")

    def started_run(self, command: Command, stdout: str) -> None:
        """Map the run id the pages show to the id of the run this test started, for the commands after it."""
        actual = stdout.strip().splitlines()[-1] if stdout.strip() else ""
        shown = command.expected[0].strip() if command.expected else ""
        assert UUID.match(actual) and UUID.match(shown), f"{command.block.where}: shows {shown!r}, printed {actual!r}"
        self.ids[shown] = actual
        self.ids[shown[:8]] = actual[:8]
        self.run_ids.append(actual)

    def shown(self, expected: list[str]) -> list[str]:
        lines = []
        for line in expected:
            for shown, actual in self.ids.items():
                line = line.replace(shown, actual)
            lines.append(line)
        return lines

    def start(self, terminal: Terminal, command: Command, text: str) -> None:
        if terminal.process is not None and terminal.process.poll() is None:
            pytest.fail(f"{command.block.where}: terminal {terminal.name!r} still runs pid {terminal.process.pid}")
        terminal.log = self.logs / f"{terminal.name}-{len(self.started)}.log"
        with terminal.log.open("wb") as log:
            terminal.process = subprocess.Popen(
                ["bash", "-c", f"exec {text}"],
                cwd=terminal.cwd,
                env=terminal.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.started.append(terminal.process)
        deadline = time.monotonic() + POLL_SECONDS
        while missing := missing_lines(self.shown(command.expected), terminal.log.read_text(errors="replace")):
            assert terminal.process.poll() is None, (
                f"{command.block.where}: `{text}` exited {terminal.process.returncode}:\n{terminal.log.read_text()}"
            )
            assert time.monotonic() < deadline, (
                f"{command.block.where}: `{text}` has not printed a line like {missing[0]!r} "
                f"in {POLL_SECONDS:.0f} s:\n{terminal.log.read_text()[-6000:]}"
            )
            time.sleep(0.5)
        print(f"{time.monotonic() - self.clock:6.1f} s  {command.block.where}  {text[:90]} (started)")

    def kill(self, terminal: Terminal, text: str, command: Command) -> None:
        """`kill -9 $(cat worker.pid)`: run as written, once the pid file is known to name the worker started here."""
        pidfile = re.search(r"\$\(cat (\S+)\)", text)
        assert pidfile, f"{command.block.where}: the test runs `kill` only on a pid file's process, not `{text}`"
        pid = int((terminal.cwd / pidfile[1]).read_text().strip())
        (owner,) = [t for t in self.terminals.values() if t.process is not None and t.process.pid == pid] or [None]
        assert owner is not None, f"{command.block.where}: {pidfile[1]} names pid {pid}, no process this test started"
        done = subprocess.run(["bash", "-c", text], cwd=terminal.cwd, env=terminal.env, timeout=COMMAND_TIMEOUT)
        assert done.returncode == 0, f"{command.block.where}: `{text}` exited {done.returncode}"
        assert owner.process is not None
        assert owner.process.wait(timeout=30) == -signal.SIGKILL, "the worker was not killed by SIGKILL"
        print(f"{time.monotonic() - self.clock:6.1f} s  {command.block.where}  {text} (pid {pid})")

    def stop(self) -> None:
        """SIGKILL what this test started (each in a session of its own), then print the ends of their logs: pytest
        shows them when the test failed."""
        for process in self.started:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=30)
        for log in sorted(self.logs.glob("*.log")):
            print(f"--- {log.name} (end) ---\n{log.read_text(errors='replace')[-LOG_TAIL_CHARS:]}")

    def manage_json(self, *args: str) -> dict:
        project = self.terminals[""].cwd
        done = subprocess.run(
            ["python", "manage.py", *args, "--json"], cwd=project, env=self.env, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stdout + done.stderr
        return json.loads(done.stdout)


def make_venv(venv: Path, tmp_path: Path) -> None:
    """A fresh venv with this checkout installed the way `pip install --no-deps -e` would (see the docstring)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    (site,) = venv.glob("lib/python3*/site-packages")
    source = tmp_path / "src"
    source.mkdir()
    (source / "durable_agents").symlink_to(ROOT / "durable_agents")
    ours = sysconfig.get_paths()["purelib"]
    (site / "durable_agents_tutorial.pth").write_text(f"{source}\n{ours}\n")
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    info = site / f"durable_agents-{durable_agents.__version__}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {pyproject['project']['name']}\nVersion: {durable_agents.__version__}\n"
    )
    groups = pyproject["project"]["entry-points"]
    (info / "entry_points.txt").write_text(
        "".join(
            f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in entries.items()) for group, entries in groups.items()
        )
    )
    (info / "top_level.txt").write_text("durable_agents\n")
    (info / "RECORD").write_text("")
    scripts = {
        "django-admin": "from django.core.management import execute_from_command_line as main",
        "celery": "from celery.__main__ import main",
        "pytest": "from pytest import console_main as main",
    }
    for name, line in scripts.items():
        script = venv / "bin" / name
        script.write_text(f"#!{venv / 'bin' / 'python'}\nimport sys\n{line}\nsys.exit(main())\n")
        script.chmod(0o755)


def test_tutorial__every_block_is_a_file_a_terminal_or_an_illustration() -> None:
    kinds: dict[str, int] = {}
    shown: set[str] = set()
    for page in pages():
        for block in blocks(page):
            kind = classify(block)
            kinds[kind] = kinds.get(kind, 0) + 1
            if kind == "terminal":
                shown.update(command.text for command in commands(block))
    assert kinds.get("file", 0) >= 8 and kinds.get("terminal", 0) >= 15, f"pages or blocks went missing: {kinds}"
    unused = set(ALLOWLIST) - shown
    assert not unused, f"ALLOWLIST names commands the tutorial no longer has: remove {sorted(unused)}"


def test_tutorial__an_expected_line_matches_its_own_words_in_order_and_no_others() -> None:
    printed = "steps:\n     2  send_receipt             done       attempts 2  15062.829 ms\nevents:\n"
    assert missing_lines(["steps:", "…", "     2  send_receipt  done  attempts 2  …"], printed) == []
    assert missing_lines(["     2  send_receipt  done  attempts 1  …"], printed), "attempts 1 matched attempts 2"
    assert missing_lines(["events:", "steps:"], printed) == ["steps:"], "lines matched out of order"
    assert missing_lines(["send_receipt"], printed), "a word matched a line: a line matches a whole line"


@pytest.mark.timeout(600)
def test_tutorial__performed_as_written_reaches_a_refund_made_once_after_a_kill(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    make_venv(venv, tmp_path)
    base = tmp_path / "reader"
    base.mkdir()
    logs = (
        Path(os.environ["DURABLE_TEST_ARTIFACTS"]) / "tutorial"
        if os.environ.get("DURABLE_TEST_ARTIFACTS")
        else tmp_path
    )
    logs.mkdir(parents=True, exist_ok=True)
    reader = Reader(base, venv, logs)
    try:
        for page in pages():
            for block in blocks(page):
                reader.perform(block)
        unused = set(ALLOWLIST) - set(reader.allowed)
        assert not unused, f"ALLOWLIST names commands the tutorial no longer has: remove {sorted(unused)}"
        # What the tutorial promises, checked apart from the words it shows.
        assert len(reader.run_ids) == 2, f"the tutorial starts two runs, this test saw {reader.run_ids}"
        runs = [reader.manage_json("durable_show", run_id) for run_id in reader.run_ids]
    finally:
        reader.stop()
    for shown in runs:
        assert shown["status"] == "completed", shown
        refunds = [effect for effect in shown["effects"] if effect["tool"] == "issue_refund"]
        assert [(e["status"], e["attempts"]) for e in refunds] == [("applied", 1)], refunds
    approved, killed = runs
    assert [w["status"] for w in approved["waits"]] == ["approved"], approved["waits"]
    attempts = {step["step_id"]: step["attempts"] for step in killed["step_rows"]}
    assert attempts == {"resolve": 1, "send_receipt": 2}, f"the killed step ran again, nothing else did: {attempts}"
    assert any(event["kind"] == "lease_takeover" for event in killed["events"]), killed["events"]

"""The shape of the house, checked by machine: the layers, imports at module level, one writer of statuses."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "durable_agents"

# engine/transitions.py is the only writer of statuses; engine/hotpath.py holds three of its operations as SQL
# and only transitions may import it (an import-linter "protected" contract).
STATUS_WRITERS = {"engine/transitions.py", "engine/hotpath.py"}
WRITE_METHODS = {"update", "create", "get_or_create", "update_or_create", "bulk_update"}
STATEFUL_MODELS = {"Run", "Step", "Wait", "Effect"}
SQL_STATUS_WRITE = re.compile(r"\bSET\b[\s\S]*\bstatus\s*=", re.IGNORECASE)
# Django calls AppConfig.ready() once the app registry is loaded: the one place an import must wait.
FUNCTION_LEVEL_IMPORTS_ALLOWED = {("apps.py", "durable_agents")}


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "migrations" not in p.parts)


def _name(node: ast.AST) -> str:
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ""


def _has_status_key(node: ast.AST | None) -> bool:
    return isinstance(node, ast.Dict) and any(
        isinstance(key, ast.Constant) and key.value == "status" for key in node.keys
    )


def status_writes(source: str) -> list[int]:
    """Line numbers where `source` writes a `status` field: an update/create with `status=` (or a defaults
    or ** dict carrying it), a model constructed with one, an assignment to `.status`, or SQL `SET status =`."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and (_name(node.func) in WRITE_METHODS or _name(node.func) in STATEFUL_MODELS):
            for keyword in node.keywords:
                if keyword.arg == "status" or (keyword.arg in ("defaults", None) and _has_status_key(keyword.value)):
                    lines.append(node.lineno)
        elif isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            # `self.status` is an exception's HTTP status, never a row's.
            lines += [
                node.lineno
                for t in targets
                if isinstance(t, ast.Attribute) and t.attr == "status" and _name(t.value) != "self"
            ]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and SQL_STATUS_WRITE.search(node.value):
            lines.append(node.lineno)
    return sorted(lines)


def test_transitions__the_scanner_sees_every_kind_of_status_write():
    source = """
Run.objects.filter(pk=1).update(status="failed")
Wait.objects.create(run_id=1, status="approved")
Effect.objects.get_or_create(idempotency_key="k", defaults={"status": "applied"})
Step.objects.filter(pk=1).update(**{"status": "done"})
step = Step(run_id=1, status="done")
run.status = "completed"
cursor.execute("UPDATE durable_agents_run SET cursor = 1, status = 'failed' WHERE id = %s")
Run.objects.filter(status="failed").values("status")
"""
    assert status_writes(source) == [2, 3, 4, 5, 6, 7, 8], "the scanner must see each write and no read"
    transitions = (PACKAGE / "engine" / "transitions.py").read_text()
    assert status_writes(transitions), "the scanner finds no write in transitions.py: it is broken"


def test_transitions__only_the_transitions_module_writes_a_status():
    offenders = {
        str(path.relative_to(PACKAGE)): status_writes(path.read_text())
        for path in _modules()
        if str(path.relative_to(PACKAGE)) not in STATUS_WRITERS
    }
    offenders = {path: lines for path, lines in offenders.items() if lines}
    assert not offenders, (
        f"statuses are written outside engine/transitions.py: {offenders}; add an operation to "
        "durable_agents/states.py and write it in engine/transitions.py instead"
    )


def test_layers__the_import_contracts_hold():
    result = subprocess.run(
        [str(Path(sys.executable).with_name("lint-imports")), "--no-cache"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, f"an import breaks the layers in pyproject.toml:\n{result.stdout[-4000:]}"
    assert "BROKEN" not in result.stdout and "KEPT" in result.stdout, result.stdout[-2000:]


def test_layers__no_module_imports_the_package_inside_a_function():
    """A function-level import dodges an import cycle: a sign the layers are wrong, not a fix."""
    found = []
    for path in _modules():
        tree = ast.parse(path.read_text())
        for func in ast.walk(tree):
            if not isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(func):
                module = node.module if isinstance(node, ast.ImportFrom) else None
                names = [module] if module else [a.name for a in node.names] if isinstance(node, ast.Import) else []
                for name in names:
                    where = (str(path.relative_to(PACKAGE)), name)
                    if name and name.startswith("durable_agents") and where not in FUNCTION_LEVEL_IMPORTS_ALLOWED:
                        found.append(f"{where[0]}:{node.lineno} imports {name}")
    assert not found, "imports inside functions (move them to the top, or fix the layering):\n" + "\n".join(found)

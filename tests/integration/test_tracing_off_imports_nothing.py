"""With `DURABLE_AGENTS["TRACING"]` off, a process that starts a run and drives it to completion asks for nothing of
OpenTelemetry: tracing off costs durable_agents no import, and works where opentelemetry-api is not installed.

Other libraries import it on their own: the Anthropic SDK (2.x depends on opentelemetry-api and imports it with
`import anthropic`) and redis-py (its observability module, when the SDK is installed). So the fresh interpreter
records who asks: every `import` statement and `importlib.import_module` call naming an `opentelemetry` module, with
the file of the code that asked; none may be in durable_agents. The same script with TRACING on asks from
durable_agents/tracing.py, so the check can fail.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.django_db(transaction=True)

SCRIPT = """
import builtins
import importlib
import sys

asked = set()
real_import, real_import_module = builtins.__import__, importlib.import_module


def record(name):
    if name == "opentelemetry" or name.startswith("opentelemetry."):
        asked.add(sys._getframe(2).f_code.co_filename)


def traced_import(name, *args, **kwargs):
    record(name)
    return real_import(name, *args, **kwargs)


def traced_import_module(name, package=None):
    record(name)
    return real_import_module(name, package)


builtins.__import__, importlib.import_module = traced_import, traced_import_module

import django

django.setup()

from durable_agents import api
from durable_agents.conf import settings
from durable_agents.testing import drive

run = drive(api.start("noop", {"steps": 3}).id)
assert run.status == "completed", run.status
print("TRACING", settings.TRACING)
print("ASKED", ",".join(sorted(asked)))
"""


def _drive_in_a_fresh_process(worker_env: dict[str, str], durable: dict[str, object]) -> dict[str, str]:
    # OTEL_* variables could make a settings module configure an SDK: this process decides nothing of the kind.
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(worker_env, DURABLE_TEST_SETTINGS=json.dumps(durable))
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, f"the run did not complete in the subprocess:\n{result.stdout}\n{result.stderr}"
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines() if line.startswith(("TRACING", "ASKED")))
    return {"TRACING": lines["TRACING"].strip(), "ASKED": [f for f in lines["ASKED"].strip().split(",") if f]}


def _in_durable_agents(files: list[str]) -> list[str]:
    return [f for f in files if f"{os.sep}durable_agents{os.sep}" in f]


def test_tracing_off__driving_a_run_imports_no_opentelemetry_module(worker_env):
    seen = _drive_in_a_fresh_process(worker_env, {})
    assert seen["TRACING"] == "False"
    assert not _in_durable_agents(seen["ASKED"]), (
        f"tracing is off, yet durable_agents imported OpenTelemetry from {_in_durable_agents(seen['ASKED'])}: "
        "import it inside tracing.py's _api(), reached only with TRACING on"
    )


def test_tracing_on__the_same_run_imports_the_opentelemetry_api_from_durable_agents(worker_env):
    seen = _drive_in_a_fresh_process(worker_env, {"TRACING": True})
    assert seen["TRACING"] == "True"
    assert any(f.endswith(f"durable_agents{os.sep}tracing.py") for f in seen["ASKED"]), seen

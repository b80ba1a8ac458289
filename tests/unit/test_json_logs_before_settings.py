"""A log line formatted by JsonFormatter before Django's settings exist (a script, an import-time warning) is written
as it always was: asking whether tracing is on must not raise ImproperlyConfigured inside logging."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import io, logging
from durable_agents.logs import JsonFormatter
stream = io.StringIO()
handler = logging.StreamHandler(stream)
handler.setFormatter(JsonFormatter())
logger = logging.getLogger("early")
logger.addHandler(handler)
logger.warning("before settings")
print(stream.getvalue(), end="")
"""


def test_json_logs__a_line_before_settings_are_configured_has_no_trace_ids_and_no_error():
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}  # no DJANGO_SETTINGS_MODULE
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "Logging error" not in done.stderr, done.stderr
    line = json.loads(done.stdout)
    assert line["message"] == "before settings" and "trace_id" not in line

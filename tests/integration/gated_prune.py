"""A prune pass in a process of its own that rests after each batch until the test lets it go.

    python -m tests.integration.gated_prune GATE

Prunes finished runs older than a day, one per batch. At each rest it creates GATE.resting and waits for the file
GATE (at most two minutes): a pass certainly still running, holding the prune, while the test acts — however busy
the machine. Prints its report as JSON at the end. Its database and settings come from the environment, as a
worker's (DATABASE_URL may be a pooler).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import django

GATE_SECONDS = 120.0


def main(gate: Path) -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    django.setup()
    from durable_agents import retention
    from durable_agents.engine import prune as engine_prune

    def rest_until_let_go(seconds: float) -> None:
        gate.with_suffix(".resting").touch()
        deadline = time.monotonic() + GATE_SECONDS
        while not gate.exists() and time.monotonic() < deadline:
            time.sleep(0.05)

    engine_prune._sleep = rest_until_let_go
    report = retention.prune(batch_size=1, older_than="1d", pause_seconds=1)
    print(json.dumps(report.as_dict()), flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))

"""Start runs in a subprocess against another database: `python -m tests.chaos.remote < inputs.json`.

The Postgres restart test runs on a cluster of its own while pytest's connection stays on the test
database, so runs are started where DATABASE_URL points (the public API commits them and sends the wake-ups).
Reads a JSON list of refund_agent inputs on stdin, prints the run ids as a JSON list.
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    import django

    django.setup()
    from durable_agents import api
    from tests.chaos.workload import WORKFLOW

    inputs = json.load(sys.stdin)
    print(json.dumps([str(api.start(WORKFLOW, run_input).id) for run_input in inputs]))


if __name__ == "__main__":
    main()

"""Settings of the worker subprocesses the chaos tests start: the test settings plus the chaos instrumentation app.

The pytest process keeps `tests.example_settings`; only workers load this module (DJANGO_SETTINGS_MODULE), so the
instrumentation (tests/chaos/apps.py) runs where the steps run. Knobs come from the environment:

DURABLE_CHAOS_MODEL_TIMEOUT  seconds the Anthropic client waits for an answer (the fault matrix times out)
DURABLE_CHAOS_STREAM         "1": the "anthropic" participant streams (mid-stream errors reach the SSE parser)
DURABLE_CHAOS_BATCH          "1": model calls go in Message Batches (apps.py, batch_points.py), on a fast clock:
                             a batch goes out once DURABLE_CHAOS_BATCH_SIZE turns wait (or the oldest waited 1 s),
                             is polled every 0.05-0.2 s, and a create left without an answer is looked for after 1 s
"""

import os

from tests.example_settings import *  # noqa: F403
from tests.example_settings import DURABLE_AGENTS, INSTALLED_APPS

INSTALLED_APPS = [*INSTALLED_APPS, "tests.chaos"]

DURABLE_AGENTS = {
    **DURABLE_AGENTS,
    "MODEL_TIMEOUT_SECONDS": float(os.environ.get("DURABLE_CHAOS_MODEL_TIMEOUT", "120")),
}
if os.environ.get("DURABLE_CHAOS_BATCH") == "1":
    DURABLE_AGENTS = {
        **DURABLE_AGENTS,
        "BATCH_WINDOW_SECONDS": 1.0,
        "BATCH_MAX_REQUESTS": int(os.environ.get("DURABLE_CHAOS_BATCH_SIZE", "10000")),
        "BATCH_POLL_SECONDS": 0.05,
        "BATCH_POLL_MAX_SECONDS": 0.2,
        "BATCH_SUBMIT_GRACE_SECONDS": 1.0,
    }

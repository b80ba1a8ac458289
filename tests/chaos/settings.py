"""Settings of the worker subprocesses the chaos tests start: the test settings plus the chaos instrumentation app.

The pytest process keeps `tests.example_settings`; only workers load this module (DJANGO_SETTINGS_MODULE), so the
instrumentation (tests/chaos/apps.py) runs where the steps run. Knobs come from the environment:

DURABLE_CHAOS_MODEL_TIMEOUT  seconds the Anthropic client waits for an answer (the fault matrix times out)
DURABLE_CHAOS_STREAM         "1": the "anthropic" participant streams (mid-stream errors reach the SSE parser)
"""

import os

from tests.example_settings import *  # noqa: F403
from tests.example_settings import DURABLE_AGENTS, INSTALLED_APPS

INSTALLED_APPS = [*INSTALLED_APPS, "tests.chaos"]

DURABLE_AGENTS = {
    **DURABLE_AGENTS,
    "MODEL_TIMEOUT_SECONDS": float(os.environ.get("DURABLE_CHAOS_MODEL_TIMEOUT", "120")),
}

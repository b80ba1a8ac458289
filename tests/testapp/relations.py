"""Workflows of the relations state-machine test (tests/integration/test_state_machine_relations.py).

`relations_nan_args`: a workflow whose plan gives its step arguments Postgres refuses (a NaN is no JSON it
stores): a schedule of it can never start a slot, and must say so without stopping the other schedules.
"""

from __future__ import annotations

from durable_agents.api import PlannedStep, call, workflow
from tests.testapp.workflows import _record_step

workflow(
    "relations_nan_args",
    steps=[call("s", _record_step)],
    plan=lambda inp: [PlannedStep("s", "s", {"ratio": float("nan")})],
)

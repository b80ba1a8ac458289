"""A run whose wake-up message was lost, recovered by the sweep on another process, goes on in its own trace: the
trace context comes from the run's row, not from the Celery message (which the sweep replaced with one of its own).

The rules checked are OpenTelemetry's parent/link model (Tracing API specification): a span's parent is in its own
trace; a span started under a context of another trace (here the sweep's Celery task, delivered with the sweep's
traceparent by opentelemetry-instrumentation-celery) links to it instead of joining it.
"""

from __future__ import annotations

import pytest
import redis
from opentelemetry import trace

from durable_agents import api, tracing
from durable_agents.testing import wait_for_run
from project.refunds.seed import CASES, seed_shop
from tests.chaos.traces import Tree, exported, traced_env, worker
from tests.chaos.workload import timeout

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, timeout()]

QUESTION = next(case for case in CASES if case.refund is None and "arrive" in case.message)  # A-1005: no refund


def test_trace_after_lost_wakeup__the_sweeps_recovery_continues_the_runs_trace(
    chaos_env, chaos_logs, fake, spans, broker_url
):
    seed_shop()
    with trace.get_tracer("the shop's web process").start_as_current_span("POST /support/refunds"):
        run = api.start("refund_agent", QUESTION.run_input)
    broker = redis.Redis.from_url(broker_url)
    assert broker.dbsize() > 0, "the run's wake-up should be waiting in the broker"
    broker.flushdb()  # the wake-up is lost: only the sweep can start the run now

    traces = chaos_logs / "spans"
    recovering = worker(traced_env(chaos_env, traces), chaos_logs / "worker.log", beat=True)
    try:
        run = wait_for_run(run.id, "completed", timeout=120)
    finally:
        recovering.stop()

    tree = Tree(exported(spans, traces))
    trace_id = f"0x{tracing.trace_id(run.trace_context)}"
    run_span = tree.one("run refund_agent")
    attempts = tree.named("step ")
    assert {s["name"] for s in attempts} == {"step load_order", "step resolve", "step review_email"}
    for attempt in attempts:
        assert attempt["context"]["trace_id"] == trace_id, f"{attempt['name']} left the run's trace"
        assert tree.parent(attempt) is run_span, f"{attempt['name']} is not a child of the run's span (from its row)"

    first = tree.one("step load_order")
    (link,) = first["links"]
    delivered = tree.by_id.get(link["context"]["span_id"])
    assert delivered is not None and delivered["name"] == "run/durable_agents.advance", "linked to Celery's task span"
    assert delivered["context"]["trace_id"] != trace_id, "the sweep's message carried the sweep's trace, not the run's"
    sweeps = {s["context"]["trace_id"] for s in tree.spans if s["name"] == "run/durable_agents.sweep"}
    assert delivered["context"]["trace_id"] in sweeps, "the first attempt was delivered by a sweep's wake-up"
    # The run's tree is whole. (Not asserted of the sweep's own traces: beat's passes go on until the stop, and a pool
    # child SIGTERMed in a pass — "Worker exited prematurely: signal 15" — never ends Celery's task span around it.)
    assert tree.orphans(trace_id) == [], "spans of the run's trace whose parent was never exported"

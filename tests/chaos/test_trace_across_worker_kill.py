"""One trace across a SIGKILL: a refund started by a traced Django request, its worker killed mid-step, another
worker taking over, a manager approving the refund, the run completing — and every span of it in one tree.

The test process is the web process: Django and Celery instrumented (opentelemetry-instrumentation-django and
-celery) on an in-memory SDK; a view starts the refund run. The workers are the example project's (`celery -A
project`, project/tracing.py), each pool process writing every span it ends to a file as it ends
(tests/chaos/apps.py), so a SIGKILL takes only the spans that had not ended. The model's first answer to the
agent is held until the worker that asked is SIGKILLed: a kill in the middle of the `resolve` step, before the
step ended any span of its own.

The rules checked are OpenTelemetry's trace model (the Tracing API specification: a span has at most one parent,
in its own trace; a trace is the tree of spans sharing its trace id; links join spans across traces) and the shape
this library promises (durable_agents/tracing.py): request → `run refund_agent` → `step <name>` per attempt (the
killed attempt drawn by the takeover as `worker_lost`, the takeover's attempt numbered one more) → `chat <model>`
(GenAI semantic conventions) → `execute_tool <tool>` (`durable_agents.effect.outcome`), and the approval as `wait
approval` under the run; every parent exported (no orphan), one span per attempt; Celery's spans in the trace, but
never the parent of a step, which links to its task's span instead.
"""

from __future__ import annotations

import threading
import uuid
from collections import Counter
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import pytest
from django.http import HttpRequest, JsonResponse
from django.urls import path
from opentelemetry.instrumentation.celery import CeleryInstrumentor
from opentelemetry.instrumentation.django import DjangoInstrumentor

from durable_agents import api, tracing
from durable_agents.models import Event, Wait, WaitStatus
from durable_agents.testing import wait_for, wait_for_run
from durable_agents.testing.fake_anthropic import FakeAnthropic, RecordedRequest, Reply
from project.refunds.models import OutboundEmail, Refund
from project.refunds.script import stand_in_reply
from project.refunds.seed import CASES, seed_shop
from tests.chaos.apps import COMMIT_PREFIX, PID_HEADER
from tests.chaos.traces import Tree, exported, traced_env, worker
from tests.chaos.workload import timeout
from tests.testapp.models import Execution

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.slow,
    pytest.mark.urls(__name__),
    timeout(),
]

ATTEMPT = tracing.ATTEMPT
ORDER = next(case for case in CASES if case.needs_approval)  # A-1002: 129.00, above the manager's threshold


def start_refund(request: HttpRequest) -> JsonResponse:
    """The shop's support form: a customer's message about an order starts a refund run."""
    run = api.start("refund_agent", {"order_id": request.POST["order_id"], "message": request.POST["message"]})
    return JsonResponse({"run": str(run.id)}, status=202)


urlpatterns = [path("support/refunds", start_refund)]


class HeldFirstAnswer:
    """The refund script's answers, except the agent's first turn: held, the first time, until `release`."""

    def __init__(self) -> None:
        self.asked = threading.Event()
        self.release = threading.Event()
        self.asker = 0
        self._held = False
        self._lock = threading.Lock()

    def __call__(self, request: RecordedRequest) -> Reply:
        with self._lock:
            hold = not self._held and request.conversation.endswith(":resolve") and request.turn == 0
            self._held = self._held or hold
        if hold:
            self.asker = int(request.headers.get(PID_HEADER) or 0)
            self.asked.set()
            self.release.wait(timeout=300)
        return stand_in_reply(request)


@pytest.fixture
def held() -> HeldFirstAnswer:
    return HeldFirstAnswer()


@pytest.fixture
def fake(held: HeldFirstAnswer) -> Iterator[FakeAnthropic]:
    with FakeAnthropic(responder=held) as server:
        yield server
        held.release.set()


@pytest.fixture
def web_instrumented(spans: Any) -> Iterator[None]:
    """This process as the example's web process: Django's requests and Celery's publishes traced."""
    DjangoInstrumentor().instrument()
    CeleryInstrumentor().instrument()
    yield
    CeleryInstrumentor().uninstrument()
    DjangoInstrumentor().uninstrument()


def test_trace_across_worker_kill__request_run_steps_calls_tools_and_wait_form_one_tree(
    chaos_env, chaos_logs, fake, held, spans, web_instrumented, client
):
    seed_shop()
    traces = chaos_logs / "spans"
    env = traced_env(chaos_env, traces)
    first = worker(env, chaos_logs / "worker-first.log")
    try:
        answer = client.post("/support/refunds", {"order_id": ORDER.number, "message": ORDER.message})
        assert answer.status_code == 202, answer.content
        run_id = uuid.UUID(answer.json()["run"])
        assert held.asked.wait(timeout=120), "the agent's first model call never came"
        assert held.asker in first.pids(), f"the held call came from pid {held.asker}, not the first worker"
        first.kill()
    finally:
        first.kill()
        held.release.set()
    second = worker(env, chaos_logs / "worker-second.log", beat=True)
    try:
        wait_for(
            lambda: Wait.objects.filter(run_id=run_id, status=WaitStatus.OPEN).first(),
            timeout=120,
            what="the manager's approval to be asked, after the takeover",
        )
        approval = Wait.objects.get(run_id=run_id, status=WaitStatus.OPEN)
        api.decide(approval.pk, True, by="manager@example.com", comment="defective within the warranty")
        run = wait_for_run(run_id, "completed", timeout=120)
    finally:
        second.stop()

    assert [r.amount for r in Refund.objects.filter(order__number=ORDER.number)] == [Decimal("129.00")]
    assert OutboundEmail.objects.filter(order__number=ORDER.number).count() == 1, "one email to the customer"
    commits = Counter(Execution.objects.filter(run_id=run_id, step_id__startswith=COMMIT_PREFIX).values_list("step_id"))
    assert set(commits.values()) == {1}, f"a step committed twice: {commits}"
    takeovers = Event.objects.filter(run_id=run_id, kind="lease_takeover")
    assert takeovers.count() == 1, "the kill was taken over once"

    tree = Tree(exported(spans, traces))
    trace_id = tracing.trace_id(run.trace_context)
    run_span = tree.one("run refund_agent")
    assert run_span["context"]["trace_id"] == f"0x{trace_id}", "the run's row names the run's span"
    request = tree.parent(run_span)
    assert request is not None and request["kind"] == "SpanKind.SERVER", "the run is a child of the request's span"
    assert request["attributes"].get("http.route") == "support/refunds"
    assert request["parent_id"] is None, "the request is the root of the trace"
    ours = tree.of_run(str(run.id))
    assert {s["context"]["trace_id"] for s in ours} == {f"0x{trace_id}"}, "every span of the run in the run's trace"
    assert tree.orphans() == [], "spans whose parent was never exported (a viewer draws the tree broken)"

    attempts = tree.named("step ")
    assert all(tree.parent(s) is run_span for s in attempts), "every attempt is a child of the run's span"
    # An attempt is a claim, fenced by its lease token (the attempt number restarts after a wait is decided).
    claims = Counter(s["attributes"].get(tracing.LEASE_TOKEN) for s in attempts)
    shown = [(s["name"], {k.rsplit(".", 1)[-1]: v for k, v in s["attributes"].items()}) for s in attempts]
    assert claims[None] == 1, f"only the killed attempt, drawn by the takeover, has no lease token: {shown}"
    assert all(n == 1 for n in claims.values()), f"an attempt exported twice: {shown}"
    lost = [s for s in attempts if s["attributes"].get("durable_agents.step.outcome") == "worker_lost"]
    assert len(lost) == 1 and lost[0]["name"] == "step resolve", f"the killed attempt: {[s['name'] for s in lost]}"
    assert lost[0]["status"]["status_code"] == "ERROR"
    killed = f":{held.asker}"  # a worker is named host:pid
    assert lost[0]["attributes"][tracing.WORKER].endswith(killed), "drawn as the killed process's attempt"
    taken = [
        s
        for s in attempts
        if s["name"] == "step resolve" and s["attributes"][ATTEMPT] == lost[0]["attributes"][ATTEMPT] + 1
    ]
    assert len(taken) == 1, "the takeover's attempt is numbered one more than the killed one"
    assert not taken[0]["attributes"][tracing.WORKER].endswith(killed), "taken over by another process"
    assert {"step load_order", "step review_email"} <= {s["name"] for s in attempts}

    celery = [s for s in tree.spans if s["name"].startswith(("run/", "apply_async/"))]
    assert any(s["context"]["trace_id"] == f"0x{trace_id}" for s in celery), "Celery's spans join the request's trace"
    celery_ids = {s["context"]["span_id"] for s in celery}
    for attempt in attempts:
        if attempt is lost[0]:
            continue
        links = {link["context"]["span_id"] for link in attempt["links"]}
        what = f"{attempt['name']} (lease token {attempt['attributes'][tracing.LEASE_TOKEN]})"
        assert len(links) == 1, f"{what} links the one Celery task span that delivered it: {links}"
        if attempt["attributes"][tracing.WORKER].endswith(killed):
            continue  # its task span was still open when SIGKILL came: a span is exported when it ends
        assert links <= celery_ids, f"{what} links a span that is not Celery's task span"

    # Model calls, tools and the wait (their spans: GenAI chat, execute_tool with the effect's outcome, wait).
    chats = tree.named("chat ")
    assert chats and all(tree.parent(s) in attempts for s in chats), "each model call under the attempt that made it"
    assert all(s["kind"] == "SpanKind.CLIENT" for s in chats)
    assert all(s["attributes"]["gen_ai.operation.name"] == "chat" for s in chats)
    tools = tree.named("execute_tool ")
    assert all(tree.parent(s) in attempts for s in tools), "each tool call under the attempt that made it"
    refunds = [s for s in tools if s["name"] == "execute_tool issue_refund"]
    assert [s["attributes"].get("durable_agents.effect.outcome") for s in refunds].count("applied") == 1
    assert any(s["name"] == "execute_tool email_customer" for s in tools)
    waits = tree.named("wait approval")
    assert len(waits) == 1 and tree.parent(waits[0]) is run_span, "the approval drawn under the run, once"

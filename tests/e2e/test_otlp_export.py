"""The example project's worker exports a refund run's spans as its OTEL_* environment says: over OTLP/HTTP to a
receiver, or printed on its stdout.

The receiver is a few lines of http.server that follow the OTLP/HTTP specification
(https://opentelemetry.io/docs/specs/otlp/#otlphttp): a client POSTs an `ExportTraceServiceRequest` protobuf
(`Content-Type: application/x-protobuf`, optionally `Content-Encoding: gzip`) to `/v1/traces` — the path the
exporter appends to OTEL_EXPORTER_OTLP_ENDPOINT ("Endpoint URLs for OTLP/HTTP", OpenTelemetry SDK environment
variables) — and a server that accepted it answers 200 with an `ExportTraceServiceResponse` in the same
Content-Type. The worker's SDK is configured by project/tracing.py from OTEL_TRACES_EXPORTER, OTEL_SERVICE_NAME
and OTEL_EXPORTER_OTLP_ENDPOINT, after the prefork pool's fork; its resource carries `service.name` (Resource
semantic conventions). Model calls follow the GenAI semantic conventions (https://opentelemetry.io/docs/specs/
semconv/gen-ai/gen-ai-spans/): a CLIENT span named "{gen_ai.operation.name} {gen_ai.request.model}" with the
operation, provider, request and response model, finish reasons and token usage.
"""

from __future__ import annotations

import gzip
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from durable_agents import api, tracing
from durable_agents.testing import wait_for, wait_for_run
from durable_agents.testing.fake_anthropic import FakeAnthropic
from project import tracing as project_tracing
from project.refunds.script import stand_in_reply
from project.refunds.seed import CASES, seed_shop
from tests.conftest import ROOT
from tests.integration.tracing_helpers import spans  # noqa: F401 - the test process's SDK (the run's span)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(300), pytest.mark.usefixtures("spans")]

CASE = {case.number: case for case in CASES}
STEPS = ("step load_order", "step resolve", "step review_email")
PROTOBUF = "application/x-protobuf"


class OtlpReceiver:
    """An OTLP/HTTP trace receiver on 127.0.0.1: keeps every span it is sent, with its resource and scope."""

    def __init__(self) -> None:
        self.requests: list[ExportTraceServiceRequest] = []
        self.refused: list[str] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.path != "/v1/traces" or self.headers.get("Content-Type") != PROTOBUF:
                    receiver.refused.append(f"{self.path} {self.headers.get('Content-Type')}")
                    self.send_response(404 if self.path != "/v1/traces" else 415)
                    self.end_headers()
                    return
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                with receiver._lock:
                    receiver.requests.append(request)
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", PROTOBUF)
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def spans(self) -> list[tuple[dict[str, Any], str, Any]]:
        """(resource attributes, instrumentation scope name, span) of every span received."""
        with self._lock:
            requests = list(self.requests)
        found = []
        for request in requests:
            for resource_spans in request.resource_spans:
                resource = attributes(resource_spans.resource.attributes)
                for scope_spans in resource_spans.scope_spans:
                    found += [(resource, scope_spans.scope.name, span) for span in scope_spans.spans]
        return found

    def __enter__(self) -> OtlpReceiver:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def attributes(pairs: Any) -> dict[str, Any]:
    return {pair.key: value_of(pair.value) for pair in pairs}


def value_of(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [value_of(item) for item in value.array_value.values]
    return getattr(value, kind) if kind else None


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as server:
        yield server


@pytest.fixture
def fake(worker_env: dict[str, str]) -> Iterator[FakeAnthropic]:
    """Claude played by the strict stand-in of the Messages API: the worker's "anthropic" participant calls it."""
    with FakeAnthropic(responder=stand_in_reply) as server:
        worker_env.update(server.environ())
        yield server


@pytest.fixture(autouse=True)
def shop(transactional_db: None) -> None:
    seed_shop()


def example_worker(start_worker: Any, pool: str = "prefork", **otel: str) -> Any:
    """The example project's worker as the Procfile starts it (`celery -A project`, prefork), with OTEL_* set."""
    return start_worker(app="project", pool=pool, concurrency=1, env=otel)


def test_otlp_export__a_refund_runs_spans_reach_an_otlp_http_receiver_in_the_runs_trace(start_worker, fake, receiver):
    example_worker(
        start_worker,
        OTEL_TRACES_EXPORTER="otlp",
        OTEL_EXPORTER_OTLP_ENDPOINT=receiver.url,
        OTEL_SERVICE_NAME="refunds-worker",
        OTEL_RESOURCE_ATTRIBUTES="deployment.environment.name=test",
        OTEL_BSP_SCHEDULE_DELAY="100",
    )
    run = wait_for_run(api.start("refund_agent", CASE["A-1001"].run_input).id, "completed", timeout=120)
    trace_id = bytes.fromhex(tracing.trace_id(run.trace_context))
    run_span_id = bytes.fromhex(run.trace_context.split("-")[2])

    def steps_received() -> list[Any]:
        received = [span for _, _, span in receiver.spans() if span.trace_id == trace_id]
        return received if {s.name for s in received} >= set(STEPS) else []

    received = wait_for(steps_received, timeout=60, what="the run's step spans at the OTLP receiver")

    assert not receiver.refused, f"the exporter sent what OTLP/HTTP does not allow: {receiver.refused}"
    resources = [resource for resource, _, span in receiver.spans() if span.trace_id == trace_id]
    assert {r.get("service.name") for r in resources} == {"refunds-worker"}, "OTEL_SERVICE_NAME names the resource"
    assert {r.get("deployment.environment.name") for r in resources} == {"test"}, "OTEL_RESOURCE_ATTRIBUTES"
    steps = [span for span in received if span.name.startswith("step ")]
    assert sorted(span.name for span in steps) == sorted(STEPS), "one attempt per step, nothing killed"
    for step in steps:
        assert step.parent_span_id == run_span_id, f"{step.name} is not a child of the run's span in its row"
        assert attributes(step.attributes)["durable_agents.run.id"] == str(run.id)
    by_id = {span.span_id: span for _, _, span in receiver.spans()}
    orphans = [s.name for s in received if s.parent_span_id not in (b"", run_span_id) and s.parent_span_id not in by_id]
    assert not orphans, f"spans whose parent never arrived (a viewer draws the tree broken): {orphans}"
    celery = [span for _, scope, span in receiver.spans() if scope.startswith("opentelemetry.instrumentation.celery")]
    assert celery, "the example worker instruments Celery (opentelemetry-instrumentation-celery)"
    for step in steps:
        linked = [by_id.get(link.span_id) for link in step.links]
        assert any(span in celery for span in linked if span is not None), f"{step.name} links its Celery task span"

    # The model calls (GenAI semantic conventions): under the step that made them, in the run's trace.
    chats = [span for span in received if span.name.startswith("chat ")]
    assert chats, f"no chat span in the run's trace: {sorted({s.name for s in received})}"
    step_ids = {step.span_id for step in steps}
    for chat in chats:
        found = attributes(chat.attributes)
        assert chat.kind == chat.SPAN_KIND_CLIENT, "a model call is a CLIENT span"
        assert chat.parent_span_id in step_ids, f"{chat.name} is not a child of a step span"
        assert found["gen_ai.operation.name"] == "chat"
        assert found["gen_ai.provider.name"] == "anthropic"
        assert chat.name == f"chat {found['gen_ai.request.model']}"
        assert found["gen_ai.response.model"]
        assert found["gen_ai.usage.input_tokens"] > 0 and found["gen_ai.usage.output_tokens"] > 0
        assert found["gen_ai.response.finish_reasons"] in (["tool_use"], ["end_turn"])


@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_otlp_export__console_prints_the_runs_spans_on_the_workers_stdout(start_worker, fake, pool):
    """Configured after the fork in a prefork pool's child (worker_process_init), in the worker's own process for a
    pool without children (worker_init)."""
    worker = example_worker(start_worker, pool, OTEL_TRACES_EXPORTER="console")
    run = wait_for_run(api.start("refund_agent", CASE["A-1005"].run_input).id, "completed", timeout=120)
    trace_id = tracing.trace_id(run.trace_context)

    def printed() -> str:
        text = worker.log_path.read_text(errors="replace")
        return text if all(f'"name": "{name}"' in text for name in STEPS) else ""

    text = wait_for(printed, timeout=60, what="the step spans printed by the worker's ConsoleSpanExporter")
    assert f'"trace_id": "0x{trace_id}"' in text, "the printed spans are in the run's trace"


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, []),
        ({"OTEL_TRACES_EXPORTER": "none"}, []),
        ({"OTEL_TRACES_EXPORTER": "console"}, ["console"]),
        ({"OTEL_TRACES_EXPORTER": " otlp , console ,otlp"}, ["otlp", "console"]),
        ({"OTEL_TRACES_EXPORTER": "console,none"}, []),
        ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"}, []),
        ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}, ["otlp"]),
    ],
)
def test_otlp_export__the_exporters_are_read_as_the_sdk_environment_specifies(monkeypatch, environ, expected):
    """OTEL_TRACES_EXPORTER is a comma-separated list; "none" means no exporter; OTEL_SDK_DISABLED=true turns the
    SDK off (OpenTelemetry SDK environment variables, "Exporter Selection" and "General SDK Configuration")."""
    for name in ("OTEL_TRACES_EXPORTER", "OTEL_SDK_DISABLED", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    assert project_tracing.exporters() == expected
    assert project_tracing.enabled() is bool(expected)


@pytest.mark.parametrize(
    "environ",
    [{"OTEL_TRACES_EXPORTER": "zipkin"}, {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}],
)
def test_otlp_export__an_exporter_the_project_cannot_make_stops_start_up(monkeypatch, environ):
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ImproperlyConfigured, match="OTEL_"):
        project_tracing.exporters()


@pytest.mark.parametrize(
    ("environ", "service"),
    [
        ({}, "refunds-worker"),
        ({"OTEL_SERVICE_NAME": "support-agents"}, "support-agents"),
        ({"OTEL_RESOURCE_ATTRIBUTES": "service.name=from-attributes"}, "from-attributes"),
    ],
)
def test_otlp_export__the_service_name_defaults_to_the_process_kind_unless_the_environment_names_one(
    worker_env, environ, service
):
    """OTEL_SERVICE_NAME, else service.name in OTEL_RESOURCE_ATTRIBUTES, names the resource (Resource semantic
    conventions, SDK environment variables); the example project's default stands in for "unknown_service"."""
    inherited = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env = {**inherited, **worker_env, "OTEL_TRACES_EXPORTER": "console", **environ}
    code = "from project import tracing; print(tracing.configure(tracing.WORKER).resource.attributes['service.name'])"
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == service

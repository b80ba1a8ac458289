"""Settings for bench/steps.py's tracing figures: the example project's, with `DURABLE_AGENTS["TRACING"]` and an
OpenTelemetry SDK set up in each worker process as BENCH_TRACING says.

    BENCH_TRACING=off      tracing off: the baseline
    BENCH_TRACING=memory   the SDK's InMemorySpanExporter behind a SimpleSpanProcessor (each span exported as it ends)
    BENCH_TRACING=otlp     a BatchSpanProcessor and the OTLP/HTTP exporter, to BENCH_OTLP_ENDPOINT (…/v1/traces)

The provider is set here because the settings module is what a worker imports first; an application would do it
where the example project does (project/tracing.py, from the OTEL_* environment variables).
"""

import os

from project.settings import *  # noqa: F403
from project.settings import DURABLE_AGENTS

BENCH_TRACING = os.environ.get("BENCH_TRACING", "off")
DURABLE_AGENTS = {**DURABLE_AGENTS, "TRACING": BENCH_TRACING != "off"}

if BENCH_TRACING != "off":
    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    _provider = TracerProvider(resource=Resource.create({"service.name": "durable-bench"}))
    if BENCH_TRACING == "memory":
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

        _provider.add_span_processor(SimpleSpanProcessor(InMemorySpanExporter()))
    elif BENCH_TRACING == "otlp":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        _provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=os.environ["BENCH_OTLP_ENDPOINT"])))
    else:
        raise ValueError(f"BENCH_TRACING={BENCH_TRACING!r}: off, memory or otlp")
    trace.set_tracer_provider(_provider)

"""The example project's OpenTelemetry SDK, configured per process from the standard `OTEL_*` environment variables.

The library only speaks the OpenTelemetry API (DURABLE_AGENTS["TRACING"]); which SDK, exporter and resource a
process has is the application's choice, and this module is the example project's. It follows the SDK
environment variables of the OpenTelemetry specification ("Environment Variable Specification"):

OTEL_TRACES_EXPORTER          "console" (each span printed on the process's stdout as it ends), "otlp" (OTLP/HTTP
                              protobuf, opentelemetry-exporter-otlp-proto-http, batched), both ("console,otlp"), or
                              "none". Unset is "none" here (the specification's default is "otlp"): the example runs
                              without a collector, and then no SDK is configured, nothing imported, nothing paid.
OTEL_EXPORTER_OTLP_ENDPOINT   where "otlp" sends, e.g. http://127.0.0.1:4318 (the exporter adds /v1/traces);
                              OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, _HEADERS, _TIMEOUT, _COMPRESSION as the SDK reads them
OTEL_EXPORTER_OTLP_PROTOCOL   "http/protobuf" (the default); "grpc" needs opentelemetry-exporter-otlp-proto-grpc,
                              which the example project does not install, so it stops start-up with a message
OTEL_SERVICE_NAME             the resource's service.name; without it "refunds-web" or "refunds-worker"
OTEL_RESOURCE_ATTRIBUTES      more resource attributes, "deployment.environment.name=staging,team=support"
OTEL_TRACES_SAMPLER(_ARG)     read by the SDK's TracerProvider; OTEL_BSP_* by its BatchSpanProcessor
OTEL_SDK_DISABLED             "true": no SDK, as with "none"

Per process, as opentelemetry-instrumentation-celery asks: a prefork worker configures each pool child after the fork
(`worker_process_init`; a BatchSpanProcessor's thread does not survive a fork) and flushes it before the child exits
(`worker_process_shutdown`: billiard ends children without running atexit); a solo, threads or gevent worker
configures its one process at `worker_init`; the web process and management commands configure themselves on start
(project/wsgi.py, manage.py) and flush at exit (the SDK's atexit hook). With tracing on, Django and Celery are
instrumented too, so a trace reads request → `run refund_agent` (api.start opens it under the request's span) →
`step ...`, with Celery's task spans beside the steps they delivered (each step span links to its task's span).
"""

from __future__ import annotations

import os
from typing import Any

from django.core.exceptions import ImproperlyConfigured

EXPORTERS = ("console", "otlp")
WEB = "refunds-web"
WORKER = "refunds-worker"

_configured: dict[int, Any] = {}


def exporters() -> list[str]:
    """The span exporters OTEL_TRACES_EXPORTER names (comma-separated), [] for none; an unknown one stops start-up."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    names = [name.strip().lower() for name in os.environ.get("OTEL_TRACES_EXPORTER", "").split(",") if name.strip()]
    if "none" in names:
        return []
    unknown = [name for name in names if name not in EXPORTERS]
    if unknown:
        raise ImproperlyConfigured(
            f"OTEL_TRACES_EXPORTER names {', '.join(unknown)}: the example project knows "
            f'"console", "otlp" and "none", e.g. OTEL_TRACES_EXPORTER=console'
        )
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
    if "otlp" in names and protocol and protocol.strip() != "http/protobuf":
        raise ImproperlyConfigured(
            f"OTEL_EXPORTER_OTLP_PROTOCOL is {protocol!r}: the example project sends OTLP over HTTP only "
            "(opentelemetry-exporter-otlp-proto-http); set it to http/protobuf, or unset it"
        )
    return list(dict.fromkeys(names))


def enabled() -> bool:
    """True when this process should trace (DURABLE_AGENTS["TRACING"] follows it: project/settings.py)."""
    return bool(exporters())


def configure(service: str, *, django: bool = False, celery: bool = False) -> Any:
    """Set this process's tracer provider from the environment, once per process (a forked child configures its own);
    returns it, or None when tracing is off. `django`/`celery`: also instrument them.

    Example (a worker's pool child)::

        @worker_process_init.connect(weak=False)
        def _trace_pool_child(**_):
            tracing.configure(tracing.WORKER, celery=True)
    """
    names = exporters()
    if not names:
        return None
    pid = os.getpid()
    if pid in _configured:
        return _configured[pid]
    from opentelemetry import trace
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor

    inherited = trace.get_tracer_provider()
    if isinstance(inherited, TracerProvider):
        # Configured before a fork (gunicorn --preload): the SDK restarts its batching thread in the child.
        _configured[pid] = inherited
        return inherited
    resource = Resource.create()
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: service}))
    provider = TracerProvider(resource=resource)
    if "console" in names:
        # Printed as each span ends: what a developer watching a worker wants, and what a SIGKILL cannot lose.
        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
    if "otlp" in names:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    if django:
        from opentelemetry.instrumentation.django import DjangoInstrumentor

        if not DjangoInstrumentor().is_instrumented_by_opentelemetry:
            DjangoInstrumentor().instrument()
    if celery:
        from opentelemetry.instrumentation.celery import CeleryInstrumentor

        if not CeleryInstrumentor().is_instrumented_by_opentelemetry:
            CeleryInstrumentor().instrument()
    _configured[pid] = provider
    return provider


def flush() -> None:
    """Export what this process still holds and stop its exporters (a pool child about to exit)."""
    provider = _configured.pop(os.getpid(), None)
    if provider is not None:
        provider.shutdown()

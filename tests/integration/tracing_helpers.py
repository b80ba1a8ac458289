"""An OpenTelemetry SDK in this test process: its in-memory exporter keeps every span the engine ends.

The API's global tracer provider can be set once per process; the fixture sets it on first use and empties the
exporter before each test. Spans are read back as the exporter has them (ReadableSpan).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

_EXPORTER = InMemorySpanExporter()


def _provider() -> None:
    current = trace.get_tracer_provider()
    if isinstance(current, TracerProvider):
        return
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(_EXPORTER))
    trace.set_tracer_provider(provider)


class Spans:
    """The spans ended so far, with the questions the tests ask of a trace."""

    def __init__(self, exporter: InMemorySpanExporter) -> None:
        self.exporter = exporter

    @property
    def all(self) -> list[ReadableSpan]:
        return list(self.exporter.get_finished_spans())

    def named(self, prefix: str) -> list[ReadableSpan]:
        return [s for s in self.all if s.name.startswith(prefix)]

    def one(self, prefix: str) -> ReadableSpan:
        found = self.named(prefix)
        assert len(found) == 1, f"expected one span named {prefix!r}, got {[s.name for s in self.all]}"
        return found[0]

    def parent_of(self, span: ReadableSpan) -> ReadableSpan | None:
        if span.parent is None:
            return None
        return next((s for s in self.all if s.context.span_id == span.parent.span_id), None)

    def orphans(self) -> list[ReadableSpan]:
        """Spans whose parent was never exported: a tree a viewer would draw broken."""
        ids = {s.context.span_id for s in self.all}
        return [s for s in self.all if s.parent is not None and s.parent.span_id not in ids]


@pytest.fixture
def spans(settings) -> Iterator[Spans]:
    """Tracing on, an SDK exporting to memory; the spans of this test."""
    _provider()
    _EXPORTER.clear()
    settings.DURABLE_AGENTS = {**getattr(settings, "DURABLE_AGENTS", {}), "TRACING": True}
    yield Spans(_EXPORTER)
    _EXPORTER.clear()

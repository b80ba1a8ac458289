"""Spans the chaos tests read back: the test process's (its in-memory exporter) and each worker process's (the file
DURABLE_CHAOS_TRACES has it write each span to as it ends, tests/chaos/apps.py), in the SDK's JSON form."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from durable_agents.testing import WorkerProcess
from tests.chaos.fleet import ROOT


def traced_env(env: dict[str, str], folder: Path) -> dict[str, str]:
    """A chaos worker's environment as the example project's worker with tracing on, spans written under `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    return {
        **env,
        "DURABLE_CELERY_APP": "project",
        "OTEL_TRACES_EXPORTER": "console",
        "OTEL_SERVICE_NAME": "refunds-worker",
        "DURABLE_CHAOS_TRACES": str(folder),
    }


def worker(env: dict[str, str], log: Path, *, beat: bool = False) -> WorkerProcess:
    return WorkerProcess(env=env, cwd=ROOT, log_path=log, pool="prefork", concurrency=1, beat=beat).start()


def exported(spans: Any, traces: Path) -> list[dict[str, Any]]:
    """Every span ended: this process's (the in-memory exporter) and each worker process's (its file)."""
    found = [json.loads(span.to_json(indent=None)) for span in spans.all]
    for file in sorted(traces.glob("spans-*.jsonl")):
        found += [json.loads(line) for line in file.read_text().splitlines() if line.strip()]
    return found


class Tree:
    """Exported spans (the SDK's JSON form), with the questions asked of a trace."""

    def __init__(self, spans: list[dict[str, Any]]) -> None:
        self.spans = spans
        self.by_id = {s["context"]["span_id"]: s for s in spans}

    def named(self, prefix: str) -> list[dict[str, Any]]:
        return [s for s in self.spans if s["name"].startswith(prefix)]

    def one(self, name: str) -> dict[str, Any]:
        found = [s for s in self.spans if s["name"] == name]
        names = sorted(s["name"] for s in self.spans)
        assert len(found) == 1, f"expected one span {name!r}, got {len(found)} of {names}"
        return found[0]

    def parent(self, span: dict[str, Any]) -> dict[str, Any] | None:
        return self.by_id.get(span["parent_id"]) if span["parent_id"] else None

    def of_run(self, run_id: str) -> list[dict[str, Any]]:
        """The run's own spans and everything under them."""
        roots = [s for s in self.spans if s["attributes"].get("durable_agents.run.id") == run_id]
        found, seen = [], set()
        while roots:
            span = roots.pop()
            if span["context"]["span_id"] in seen:
                continue
            seen.add(span["context"]["span_id"])
            found.append(span)
            roots += [s for s in self.spans if s["parent_id"] == span["context"]["span_id"]]
        return found

    def orphans(self, trace_id: str | None = None) -> list[str]:
        """Spans (of one trace, if given) whose parent was never exported: a tree a viewer would draw broken."""
        return [
            s["name"]
            for s in self.spans
            if s["parent_id"] and s["parent_id"] not in self.by_id and trace_id in (None, s["context"]["trace_id"])
        ]

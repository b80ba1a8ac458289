"""durable_show RUN_ID [--json]: a run, its steps (numbered from 1, as in the admin), its Message Batch turns and its
events."""

from __future__ import annotations

from typing import Any

from durable_agents import operations
from durable_agents.decisions import asked_again
from durable_agents.management.commands._base import RUN_ID_HELP, DurableCommand, step_progress

# The lines of a run error's traceback the text output shows: the innermost frames and the exception.
TRACEBACK_LINES_SHOWN = 20


class Command(DurableCommand):
    help = "Show one run: status, steps and history."

    def add_arguments(self, parser: Any) -> None:
        super().add_arguments(parser)
        parser.add_argument("run_id", help=RUN_ID_HELP)

    def handle(self, *args: Any, **options: Any) -> None:
        data = operations.describe_run(options["run_id"])
        if options["json"]:
            self.emit_json(data)
            return
        write = self.stdout.write
        write(f"run {data['id']}  {data['workflow']}@{data['version']}  {data['status']}")
        if data["replay"]:
            write(f"  {_replay_line(data['replay'])}")
        finished = data["finished_at"] or "-"
        write(f"  {step_progress(data)}  created {data['created_at']}  finished {finished}")
        if data["saga"]:
            write(f"  {data['saga']}")
        if data["trace"]["id"]:
            write(f"  trace {data['trace']['id']}" + (f"  {data['trace']['url']}" if data["trace"]["url"] else ""))
        if data["concurrency"]["note"]:
            write(f"  {data['concurrency']['note']}")
        if data["error"]:
            write(f"  error: {data['error']['type']}: {data['error']['message']} (step {data['error']['step']})")
            for line in _traceback_tail(data["error"]):
                write(f"    {line}")
        if data["parent"]:
            parent = data["parent"]
            write(f"  parent: run {parent['id']} (step {parent['step_id']}, child {parent['index']})")
        family = data["children"]
        if family["count"]:
            counts = ", ".join(f"{status} {n}" for status, n in sorted(family["by_status"].items()))
            write(f"  children: {family['count']} ({counts})")
            for child in family["runs"]:
                write(f"    {child['index']:>4}  {child['id']}  {child['status']:<9}  step {child['step_id']}")
            if family["count"] > len(family["runs"]):
                write(f"    … all of them: durable_runs --parent {data['id']}")
        usage = data["usage"]
        budget = f" of {usage['token_budget']}" if usage["token_budget"] is not None else ""
        write(
            f"  tokens in {usage['input_tokens']} out {usage['output_tokens']}{budget} "
            f"(cache write {usage['cache_write_tokens']}, read {usage['cache_read_tokens']})  cost ${usage['cost_usd']}"
        )
        write("steps:")
        for s in data["step_rows"]:
            took = f"{s['duration_ms']} ms" if s["duration_ms"] is not None else "-"
            tokens = s["tokens"]["input"] + s["tokens"]["output"]
            spent = f"  {tokens} tokens ${s['cost_usd']}" if tokens else ""
            write(f"  {s['number']:>4}  {s['step_id']:<24} {s['status']:<10} attempts {s['attempts']}  {took}{spent}")
        if data["effects"]:
            write("effects:")
        for e in data["effects"]:
            attention = f"  NEEDS ATTENTION: {e['needs_attention']}" if e["needs_attention"] else ""
            skipped = f"  (skipped: {e['skipped']})" if e["skipped"] else ""
            undoing = f"  {e['compensation']['text']}" if e["compensation"] else ""
            undoes = f"  undoes {e['compensates']}" if e["compensates"] else ""
            write(
                f"  {e['tool']:<20} {e['status']:<12} attempts {e['attempts']}  key {e['key']}"
                f"{undoing}{undoes}{skipped}{attention}"
            )
        again = asked_again((), runs=[data["id"]]) if data["waits"] else {}
        for w in data["waits"]:
            who = f" by {w['decided_by']}" if w["decided_by"] else ""
            said = again.get(w["id"])
            why = ""
            if said is not None:
                why = f"  {said.why}" if said.later.pk == w["id"] else f"  {said.replaced}"
            write(f"wait {w['id']}: {w['kind']} {w['name']} {w['status']}{who}  deadline {w['deadline'] or '-'}{why}")
        if data["batch_turns"]:
            write("message batch turns:")
        for b in data["batch_turns"]:
            batch = f"batch {b['batch']} ({b['batch_status']})" if b["batch"] else "no batch yet"
            ended = f"  ended {b['ended_at']}" if b["ended_at"] else ""
            write(
                f"  {b['step_id']:<24} turn {b['index']:<3} {b['purpose']:<10} {b['status']:<10} {batch}"
                f"  since {b['created_at']}{ended}"
            )
        write("events:")
        for e in data["events"]:
            detail = _brief(e["detail"]) or ""
            write(f"  {e['at']}  {e['kind']:<24} {e['step_id'] or '-':<16} {e['actor'] or ''} {detail}")


def _replay_line(replay: dict[str, Any]) -> str:
    """What a replay run is: it answered its tool calls from a recording and changed nothing."""
    if replay["id"] is None:
        where = "of a replay no longer kept"
    elif replay["source_run"]:
        where = f"of replay {replay['id']}, recording of run {replay['source_run']}"
    else:
        where = f"of replay {replay['id']}, recording #{replay['position']} of cohort {replay['cohort']!r} (imported)"
    return f"replay run ({replay['lane']} lane) {where}: tool calls answered from the recording; nothing was applied"


def _traceback_tail(error: dict[str, Any]) -> list[str]:
    """The end of a stored traceback (where it happened, and what): the whole of it is in --json."""
    lines = str(error.get("traceback") or "").splitlines()
    if len(lines) <= TRACEBACK_LINES_SHOWN:
        return lines
    cut = len(lines) - TRACEBACK_LINES_SHOWN
    return [f"[… {cut} earlier lines of the traceback: durable_show --json has them]", *lines[-TRACEBACK_LINES_SHOWN:]]


def _brief(detail: Any) -> Any:
    """An event's detail for one line: an error's traceback is left to --json."""
    error = detail.get("error") if isinstance(detail, dict) else None
    if isinstance(error, dict) and "traceback" in error:
        return {**detail, "error": {k: v for k, v in error.items() if k != "traceback"}}
    return detail

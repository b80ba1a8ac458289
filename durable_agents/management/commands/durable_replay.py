"""durable_replay: replay recorded runs with a candidate model, participant, prompt or tool text; report; cohorts.

Replay (the default mode)::

    durable_replay --cohort NAME | --runs ID [ID ...] | --workflow W [--status S] [--since T] [--until T]
                   [--sample N] [--seed N]
                   [--candidate-model M] [--candidate-participant P] [--instructions TEXT | --instructions-file PATH]
                   [--tool-description NAME=TEXT ...] [--thinking TYPE|JSON] [--effort E]
                   [--lanes baseline,candidate] [--stub TOOL=JSON ...] [--budget-usd USD] [--concurrency N]
                   [--here | --timeout SECONDS] [--fail-under 0.95] [--as USER] [--json]

starts the replay, waits for the workers to finish its runs (progress on stderr unless --json), or advances them in
this process with `--here` (CI without workers), then prints the report. Exit code 0: finished, and the verdict
passed if `--fail-under` asked for one; 1: the verdict failed, or `--timeout` passed first (one line on stderr
says which); 2: a mistake in the options (one line on stderr).

Other modes, one at a time::

    durable_replay --report REPLAY_ID [--fail-under F] [--json]   an existing replay's report (and verdict)
    durable_replay --save-cohort NAME <selection> [--json]         freeze the chosen runs as a cohort
    durable_replay --export COHORT [--output FILE]                  the cohort as JSON lines (stdout by default)
    durable_replay --import FILE|- --cohort NAME [--json]           a cohort from JSON lines
    durable_replay --cohorts [--json] / --replays [--cohort NAME] [--json]
"""

from __future__ import annotations

import math
import sys
import time
from datetime import datetime
from datetime import time as day_start
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

from django.core.management.base import CommandError
from django.utils import timezone
from django.utils.dateparse import parse_date, parse_datetime

from durable_agents import api, operations, replay_status, replays
from durable_agents.management.commands._base import (
    DEFAULT_ACTOR,
    RUN_ID_HELP,
    USER_MISTAKE,
    DurableCommand,
    add_actor_argument,
    parse_json_option,
    usage_errors_on_one_line,
)
from durable_agents.management.commands._replay_text import cohort_lines, replay_lines, report_json, report_lines
from durable_agents.storable import check_text

FAILED = 1
POLL_SECONDS = 2.0
PROGRESS_EVERY_SECONDS = 30.0
STUB_EXAMPLE = '--stub issue_refund=\'{"status": "issued"}\''
THINKING_EXAMPLE = '--thinking \'{"type": "enabled", "budget_tokens": 2048}\''

SELECTION = ("runs", "workflow", "status", "since", "until", "sample", "seed")
CANDIDATE = (
    "candidate_model",
    "candidate_participant",
    "instructions",
    "instructions_file",
    "tool_description",
    "thinking",
    "effort",
)
RUNNING = ("lanes", "stub", "budget_usd", "concurrency", "actor", "here", "timeout", "fail_under", "json")
# Each mode and the options that go with it (dest names); any other option given is refused, never ignored.
MODES: dict[str | None, tuple[str, ...]] = {
    None: (*SELECTION, "cohort", *CANDIDATE, *RUNNING),
    "report": ("fail_under", "json"),
    "save_cohort": (*SELECTION, "description", "json"),
    "export": ("output",),
    "import_file": ("cohort", "description", "json"),
    "cohorts": ("json",),
    "replays": ("cohort", "json"),
}
FLAGS = {"actor": "--as", "import_file": "--import"}


def flag(dest: str) -> str:
    return FLAGS.get(dest, "--" + dest.replace("_", "-"))


class Command(DurableCommand):
    help = (
        "Replay recorded runs with a candidate model, participant, prompt or tool text beside the recorded model "
        "(nothing is applied), and compare the lanes; or show a replay's report, or manage cohorts."
    )

    def create_parser(self, prog_name: str, subcommand: str, **kwargs: Any) -> Any:
        return usage_errors_on_one_line(super().create_parser(prog_name, subcommand, **kwargs))

    def add_arguments(self, parser: Any) -> None:
        super().add_arguments(parser)
        chosen = parser.add_argument_group("which runs (a replay, or --save-cohort)")
        chosen.add_argument("--runs", nargs="+", metavar="RUN_ID", help=RUN_ID_HELP + "; finished runs only")
        chosen.add_argument("--workflow", help="runs of this workflow")
        chosen.add_argument("--status", help="runs that finished so: completed, failed, cancelled")
        chosen.add_argument("--since", help="runs created at or after this ISO time, e.g. 2026-11-01T00:00Z")
        chosen.add_argument("--until", help="runs created before this ISO time")
        chosen.add_argument("--sample", help="at most this many of them, at random (--seed makes it repeatable)")
        chosen.add_argument("--seed", help="the seed of --sample's choice (a whole number)")
        chosen.add_argument("--cohort", help="a saved cohort (replay it, list its replays, or name an --import)")
        candidate = parser.add_argument_group("the candidate (any of these)")
        candidate.add_argument("--candidate-model", help="the model the candidate lane asks, e.g. claude-sonnet-4-5")
        candidate.add_argument("--candidate-participant", help="a registered participant that answers instead")
        candidate.add_argument("--instructions", help="the system prompt of every agent step")
        candidate.add_argument("--instructions-file", help="... read from this file")
        candidate.add_argument(
            "--tool-description", action="append", metavar="NAME=TEXT", help="a tool's new description (repeat)"
        )
        candidate.add_argument("--thinking", help="adaptive, disabled, between_tools, or the field as JSON")
        candidate.add_argument("--effort", help="low, medium, high, xhigh or max")
        running = parser.add_argument_group("the replay")
        running.add_argument("--lanes", help="which lanes to run: baseline,candidate (default both)")
        running.add_argument(
            "--stub",
            action="append",
            metavar="TOOL=JSON",
            help="answers a call of TOOL that the recording never made (else that run's replay ends) (repeat)",
        )
        running.add_argument("--budget-usd", help="what the whole replay may spend on models, in dollars")
        running.add_argument("--concurrency", help="replay runs in flight at once (default 100)")
        add_actor_argument(running)
        running.add_argument("--here", action="store_true", help="advance the runs in this process (no workers)")
        running.add_argument(
            "--batch",
            action="store_true",
            help="every model call through the Message Batches API, at half price (answered within 24 h)",
        )
        running.add_argument("--timeout", help="seconds to wait for the workers (default 3600); exit 1 after")
        running.add_argument(
            "--fail-under", help="exit 1 unless the candidate agrees with the recording at least this often (0-1)"
        )
        modes = parser.add_argument_group("other modes (one at a time)")
        modes.add_argument("--report", metavar="REPLAY_ID", help="print this replay's report")
        modes.add_argument("--save-cohort", metavar="NAME", help="save the chosen runs as a cohort; replay nothing")
        modes.add_argument("--export", metavar="COHORT", help="write the cohort as JSON lines")
        modes.add_argument("--output", metavar="FILE", help="--export writes here instead of stdout")
        modes.add_argument(
            "--import", dest="import_file", metavar="FILE", help="import JSON lines (- reads stdin) as --cohort"
        )
        modes.add_argument("--description", help="a cohort's description (--save-cohort, --import)")
        modes.add_argument("--cohorts", action="store_true", help="list the cohorts")
        modes.add_argument("--replays", action="store_true", help="list the replays (of --cohort, if given)")

    def handle(self, *args: Any, **options: Any) -> None:
        mode = _mode(options)
        if mode is None:
            self.replay(options)
        elif mode == "report":
            self.print_report(api.replay_report(options["report"]), options, fail_under(options))
        elif mode == "save_cohort":
            self.save_cohort(options)
        elif mode == "export":
            self.export(options)
        elif mode == "import_file":
            self.import_cohort(options)
        elif mode == "cohorts":
            cohorts = replay_status.list_cohorts()
            self.emit_json(cohorts) if options["json"] else self.write_lines(cohort_lines(cohorts))
        else:
            replays = replay_status.list_replays(options["cohort"])
            self.emit_json(replays) if options["json"] else self.write_lines(replay_lines(replays))

    # ---- replay ------------------------------------------------------------------------------------------------

    def replay(self, options: dict[str, Any]) -> None:
        threshold = fail_under(options)
        lanes = tuple(lane.strip() for lane in (options["lanes"] or "baseline,candidate").split(",") if lane.strip())
        if threshold is not None and "candidate" not in lanes:
            raise _mistake("--fail-under judges the candidate lane; --lanes has none (add candidate)")
        if options["here"] and options["timeout"] is not None:
            raise _mistake("--timeout is how long to wait for the workers; --here runs the replay to its end itself")
        timeout = _seconds(options["timeout"])
        selection = _selection(options)
        if options["cohort"] is None and not selection:
            raise _mistake(
                "choose the runs to replay: --cohort NAME, --runs ID ..., or --workflow/--status/--since/--until/"
                "--sample (`durable_replay --cohorts` lists the cohorts)"
            )
        made = api.replay(
            cohort=options["cohort"],
            candidate=_candidate(options),
            lanes=lanes,
            stubs=_stubs(options["stub"]),
            budget_usd=_dollars(options["budget_usd"]),
            concurrency=_whole(options["concurrency"], "--concurrency", low=1),
            actor=check_text(options["actor"] or DEFAULT_ACTOR, "--as (who is replaying)"),
            seed=_whole(options["seed"], "--seed"),
            delivery="batch" if options["batch"] else None,
            **selection,
        )
        quiet = options["json"]
        counts = replay_status.progress(made.id)
        self.say(quiet, f"replay {made.id}: {counts['runs']} replay runs of cohort {made.cohort.name!r}")
        timed_out = None
        if options["here"]:
            self.say(quiet, "advancing them in this process (--here)")
            if not replays.run_here(made.id):
                timed_out = (
                    f"its runs had not finished after the rounds --here runs; `durable_replay --report {made.id}`"
                )
        else:
            timed_out = self.wait(made.id, timeout, quiet)
        report = api.replay_report(made.id)
        self.print_report(report, options, threshold, timed_out=timed_out)

    def wait(self, replay_id: Any, timeout: float, quiet: bool) -> str | None:
        """Poll until the replay's runs have finished; a one-line reason if `timeout` passed first."""
        started = time.monotonic()
        said, said_at = None, started
        while True:
            counts = replay_status.progress(replay_id)
            now = time.monotonic()
            if counts["finished"] >= counts["runs"]:
                return None
            if (counts["finished"], counts["runs"]) != said or now - said_at >= PROGRESS_EVERY_SECONDS:
                lanes = ", ".join(f"{lane} {c['finished']}/{c['runs']}" for lane, c in counts["lanes"].items())
                self.say(quiet, f"{counts['finished']}/{counts['runs']} replay runs finished ({lanes})")
                said, said_at = (counts["finished"], counts["runs"]), now
            if now - started >= timeout:
                return (
                    f"timed out after {timeout:g} s with {counts['finished']} of {counts['runs']} replay runs "
                    f"finished (are the workers up?); they go on: `durable_replay --report {replay_id}` later"
                )
            time.sleep(min(POLL_SECONDS, max(0.0, timeout - (now - started))))

    def say(self, quiet: bool, line: str) -> None:
        if not quiet:
            self.stderr.write(line)

    # ---- the report --------------------------------------------------------------------------------------------

    def print_report(
        self, report: Any, options: dict[str, Any], threshold: float | None, timed_out: str | None = None
    ) -> None:
        if options["json"]:
            self.emit_json(report_json(report, threshold))
        else:
            self.write_lines(report_lines(report, threshold))
        if timed_out:
            raise CommandError(timed_out, returncode=FAILED)
        if threshold is not None:
            passed, why = report.verdict(threshold)
            if not passed:
                # stderr and exit code 1: CI sees it without parsing the report.
                raise CommandError(f"verdict failed: {why}", returncode=FAILED)

    def write_lines(self, lines: list[str]) -> None:
        for line in lines:
            self.stdout.write(line)

    # ---- cohorts -----------------------------------------------------------------------------------------------

    def save_cohort(self, options: dict[str, Any]) -> None:
        selection = _selection(options)
        if not selection:
            raise _mistake("--save-cohort needs the runs to save: --runs, --workflow, --status, --since, --until")
        cohort = api.save_cohort(
            options["save_cohort"],
            description=options["description"] or "",
            seed=_whole(options["seed"], "--seed"),
            **selection,
        )
        count = cohort.recordings.count()
        if options["json"]:
            self.emit_json({"cohort": cohort.name, "recordings": count})
        else:
            self.stdout.write(f"cohort {cohort.name!r}: {count} recordings (replay it: durable_replay --cohort ...)")

    def export(self, options: dict[str, Any]) -> None:
        lines = api.export_cohort(options["export"])
        first = next(lines, None)  # an unknown cohort is refused before any file is written
        if not options["output"]:
            for line in _chain(first, lines):
                self.stdout.write(line)
            return
        try:
            with open(options["output"], "w", encoding="utf-8") as handle:
                written = 0
                for line in _chain(first, lines):
                    handle.write(line + "\n")
                    written += 1
        except OSError as exc:
            raise _mistake(f"cannot write {options['output']!r}: {exc.strerror}; give a writable path") from None
        self.stdout.write(f"wrote {written} recordings of cohort {options['export']!r} to {options['output']}")

    def import_cohort(self, options: dict[str, Any]) -> None:
        if not options["cohort"]:
            raise _mistake("--import needs --cohort NAME: the name of the cohort it makes")
        path = Path(options["import_file"])
        description = options["description"] or ""
        try:
            if options["import_file"] == "-":
                cohort = api.import_cohort(options["cohort"], sys.stdin, description=description)
            else:
                with path.open(encoding="utf-8") as handle:
                    cohort = api.import_cohort(options["cohort"], handle, description=description)
        except OSError as exc:
            raise _mistake(f"cannot read {str(path)!r}: {exc.strerror}; give a JSON lines file") from None
        except UnicodeDecodeError:
            raise _mistake(f"{str(path)!r} is not UTF-8 text; give a JSON lines file") from None
        count = cohort.recordings.count()
        if options["json"]:
            self.emit_json({"cohort": cohort.name, "recordings": count})
        else:
            source = "stdin" if options["import_file"] == "-" else path
            self.stdout.write(f"cohort {cohort.name!r}: {count} recordings imported from {source}")


# ---- options ---------------------------------------------------------------------------------------------------


def _given(value: Any, dest: str = "") -> bool:
    # --as has a default (add_actor_argument's): only another actor counts as given.
    return value not in (None, False, []) and not (dest == "actor" and value == DEFAULT_ACTOR)


def _mode(options: dict[str, Any]) -> str | None:
    """The one mode the options ask for (None: replay), after refusing what does not go with it."""
    asked = [mode for mode in MODES if mode is not None and _given(options.get(mode))]
    if len(asked) > 1:
        named = " and ".join(flag(m) for m in asked)
        raise _mistake(f"{named} do not go together: give one of {', '.join(flag(m) for m in MODES if m)}")
    mode = asked[0] if asked else None
    allowed = set(MODES[mode])
    for dest in (*SELECTION, "cohort", *CANDIDATE, *RUNNING, "output", "description"):
        if dest in allowed or not _given(options.get(dest), dest):
            continue
        if mode is None:
            owners = [flag(m) for m, dests in MODES.items() if m and dest in dests]
            raise _mistake(f"{flag(dest)} goes with {' or '.join(owners)} only")
        raise _mistake(f"{flag(dest)} does not go with {flag(mode)}")
    return mode


def _mistake(message: str) -> CommandError:
    return CommandError(message, returncode=USER_MISTAKE)


def _selection(options: dict[str, Any]) -> dict[str, Any]:
    selection: dict[str, Any] = {}
    if options["runs"]:
        selection["runs"] = [operations.resolve_run_id(run) for run in options["runs"]]
    for key in ("workflow", "status"):
        if options[key]:
            selection[key] = options[key]
    for key in ("since", "until"):
        if options[key]:
            selection[key] = _when(options[key], f"--{key}")
    if options["sample"] is not None:
        selection["sample"] = _whole(options["sample"], "--sample", low=1)
    return selection


def _candidate(options: dict[str, Any]) -> dict[str, Any]:
    if options["instructions"] is not None and options["instructions_file"] is not None:
        raise _mistake("--instructions and --instructions-file do not go together: give one")
    instructions = options["instructions"]
    if options["instructions_file"] is not None:
        try:
            instructions = Path(options["instructions_file"]).read_text(encoding="utf-8")
        except OSError as exc:
            raise _mistake(f"cannot read {options['instructions_file']!r}: {exc.strerror}") from None
        except UnicodeDecodeError:
            raise _mistake(f"{options['instructions_file']!r} is not UTF-8 text") from None
    descriptions = {}
    for text in options["tool_description"] or ():
        name, sep, description = text.partition("=")
        if not sep or not name.strip():
            raise _mistake(f"--tool-description takes NAME=TEXT, e.g. issue_refund='Refund ...'; got {text!r}")
        descriptions[name.strip()] = description
    thinking = options["thinking"]
    if thinking is not None and thinking.lstrip().startswith("{"):
        thinking = parse_json_option(thinking, "--thinking", THINKING_EXAMPLE)
    candidate = {
        "model": options["candidate_model"],
        "participant": options["candidate_participant"],
        "instructions": instructions,
        "tool_descriptions": descriptions,
        "effort": options["effort"],
    }
    if thinking is not None:
        candidate["thinking"] = thinking
    return candidate


def _stubs(texts: list[str] | None) -> dict[str, Any]:
    stubs = {}
    for text in texts or ():
        name, sep, value = text.partition("=")
        if not sep or not name.strip():
            raise _mistake(f"--stub takes TOOL=JSON, e.g. {STUB_EXAMPLE}; got {text!r}")
        stubs[name.strip()] = parse_json_option(value, f"--stub {name.strip()}", STUB_EXAMPLE)
    return stubs


def fail_under(options: dict[str, Any]) -> float | None:
    text = options["fail_under"]
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value <= 1:
        raise _mistake(f"--fail-under is the share of runs that must agree, from 0 to 1 (e.g. 0.95); got {text!r}")
    return value


def _whole(text: str | None, what: str, low: int | None = None) -> int | None:
    if text is None:
        return None
    try:
        value = int(text)
    except ValueError:
        raise _mistake(f"{what} takes a whole number; got {text!r}") from None
    if low is not None and value < low:
        raise _mistake(f"{what} must be at least {low}; got {value}")
    return value


def _dollars(text: str | None) -> Decimal | None:
    if text is None:
        return None
    try:
        value = Decimal(text)
    except InvalidOperation:
        value = Decimal("NaN")
    if not value.is_finite() or value <= 0:
        raise _mistake(f"--budget-usd takes a positive amount of dollars, e.g. 5 or 0.50; got {text!r}")
    return value


def _seconds(text: str | None) -> float:
    if text is None:
        return 3600.0
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value < math.inf:
        raise _mistake(f"--timeout takes seconds, 0 or more; got {text!r}")
    return value


def _when(text: str, what: str) -> datetime:
    """An ISO time; a date alone is its midnight; without an offset, the current time zone's."""
    moment = None
    try:
        moment = parse_datetime(text)
        if moment is None and (day := parse_date(text)) is not None:
            moment = datetime.combine(day, day_start())
    except ValueError:
        moment = None
    if moment is None:
        raise _mistake(f"{what} takes an ISO time, e.g. 2026-11-01 or 2026-11-01T09:30:00Z; got {text!r}")
    return timezone.make_aware(moment) if timezone.is_naive(moment) else moment


def _chain(first: str | None, rest: Any) -> Any:
    if first is None:
        return
    yield first
    yield from rest

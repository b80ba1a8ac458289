"""Instructions a start and an advance cost the client process, counted by callgrind: a figure that does not move with
what else the machine does.

    python bench/instructions.py [--ops 200]

Needs Postgres, valgrind and a C compiler with valgrind's headers (Debian's valgrind package has them). Starts --ops
one-step runs one by one (`api.start`, autocommit), then advances each in this process (`tasks.advance`: its claim,
the no-op step, its commit), after a warm-up of 20 of each. The process runs under `valgrind --tool=callgrind`, its
counting switched on around each of the two loops only (CALLGRIND_START_INSTRUMENTATION, through a small library
compiled here), so Django's set-up and the warm-up are left out. Prints instructions per start and per advance. Postgres
does its share in its own processes, which this leaves out (bench/steps.py reads their CPU from /proc). No wake-up
is sent (bench.baseline.UNWOKEN): the broker's client is not counted either. Runs take 1-2 minutes under valgrind.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

try:
    from bench._setup import configure, reset_database
except ModuleNotFoundError:  # run as `python bench/x.py`: the repository root is not on sys.path yet
    from _setup import configure, reset_database

DB_NAME = os.environ.get("BENCH_DATABASE", "durable_bench_instructions")
WARM_UP = 20
# Callgrind's client requests, as functions ctypes can call (they are macros in callgrind.h).
CONTROL = """
#include <valgrind/callgrind.h>
void counting_on(void) { CALLGRIND_ZERO_STATS; CALLGRIND_START_INSTRUMENTATION; CALLGRIND_TOGGLE_COLLECT; }
void counting_off(void) { CALLGRIND_TOGGLE_COLLECT; CALLGRIND_DUMP_STATS; CALLGRIND_STOP_INSTRUMENTATION; }
"""


def counted(ops: int, control: str) -> None:
    """Under callgrind: the two loops, each counted alone (two dumps)."""
    configure(DB_NAME)
    import django

    django.setup()
    from django.conf import settings
    from django.test.utils import override_settings

    from bench.baseline import UNWOKEN
    from durable_agents import api, tasks

    override_settings(DURABLE_AGENTS={**getattr(settings, "DURABLE_AGENTS", {}), **UNWOKEN}).enable()

    counting = ctypes.CDLL(control)
    for run in [api.start("noop", {"steps": 1}) for _ in range(WARM_UP)]:
        tasks.advance.run(str(run.id))
    counting.counting_on()
    ids = [str(api.start("noop", {"steps": 1}).id) for _ in range(ops)]
    counting.counting_off()
    counting.counting_on()
    for run_id in ids:
        tasks.advance.run(run_id)
    counting.counting_off()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", type=int, default=200)
    parser.add_argument("--counted", help=argparse.SUPPRESS)  # the library's path: this process runs under valgrind
    args = parser.parse_args()
    if args.counted:
        counted(args.ops, args.counted)
        return
    if not shutil.which("valgrind"):
        sys.exit("valgrind is not installed (Debian: apt-get install valgrind)")
    root = configure(DB_NAME)
    reset_database(DB_NAME)
    with tempfile.TemporaryDirectory() as scratch:
        source, library = Path(scratch) / "control.c", Path(scratch) / "control.so"
        source.write_text(CONTROL)
        subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", library, source], check=True)
        out = Path(scratch) / "callgrind.out"
        command = ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--collect-atstart=no"]
        command += [f"--callgrind-out-file={out}", sys.executable, __file__, "--ops", str(args.ops)]
        subprocess.run([*command, "--counted", str(library)], cwd=root, check=True, capture_output=True)
        start, advance = (_instructions(Path(f"{out}.{n}")) for n in (1, 2))
    print(f"client instructions, {args.ops} of each (callgrind; Postgres's processes not counted):")
    print(f"  a start (api.start, one step):                {start / args.ops:>12,.0f}")
    print(f"  an advance (claim, no-op step, commit):       {advance / args.ops:>12,.0f}")


def _instructions(dump: Path) -> int:
    for line in dump.read_text().splitlines():
        if line.startswith("summary:"):
            return int(line.split()[1])
    raise SystemExit(f"{dump} has no summary line")


if __name__ == "__main__":
    main()

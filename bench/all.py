"""Every benchmark, one command: step cost, starting runs, engine at scale, tokens, the console at a million runs, the
zombie window, the replay lab, half-price batch turns.

    python bench/all.py            # the full figures (about 10 minutes on 2 cores)
    python bench/all.py --quick    # smaller counts, for a first look

Each bench measures its baseline in the same run and prints its own table; nothing is asserted.
Needs Postgres and Redis (scripts/test starts them).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

FULL = [
    ["steps.py", "--steps", "500", "--runs", "500"],
    ["starts.py", "--runs", "2000"],
    ["engine_scale.py", "--kills", "20", "--waiting", "10000", "--sweep-runs", "100000"],
    ["tokens.py"],
    ["admin_scale.py", "--runs", "1000000"],
    ["zombie_window.py", "--runs", "50"],
    ["children.py", "--children", "1000", "--parents", "1000"],
    ["overload.py"],
    ["replay.py", "--runs", "1000"],
    ["batches.py", "--runs", "1000"],
]
QUICK = [
    ["steps.py", "--steps", "200", "--runs", "200"],
    ["starts.py", "--runs", "500", "--repeat", "3"],
    ["engine_scale.py", "--kills", "5", "--waiting", "2000", "--sweep-runs", "20000"],
    ["tokens.py"],
    ["admin_scale.py", "--runs", "100000"],
    ["zombie_window.py", "--runs", "10"],
    ["children.py", "--children", "200", "--parents", "200"],
    ["overload.py", "--waves", "2"],
    ["replay.py", "--runs", "200", "--concurrency", "100"],
    ["batches.py", "--runs", "200", "--processing", "20"],
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    failed = []
    for script, *options in QUICK if args.quick else FULL:
        print(f"\n=== bench/{script} {' '.join(options)}", flush=True)
        began = time.monotonic()
        if subprocess.run([sys.executable, str(HERE / script), *options], cwd=HERE.parent).returncode:
            failed.append(script)
        print(f"=== bench/{script} took {time.monotonic() - began:.0f} s", flush=True)
    if failed:
        print(f"\nthese benches did not finish: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

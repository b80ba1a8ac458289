"""Notifications vs. steps: a 10-step run's time while one webhook hangs, before and after the outbox task.

    python bench/notifications.py [--before 2c3a68d] [--window 60] [--waits 3] [--settle 35]

The scenario of issue 13, item 6: `--waits` runs wait for approval and their notifications go to a webhook
that accepts the request and never answers (the notifier's timeout, 10 s, runs out each time). One
worker (prefork, 2 slots, beat embedded, sweep every 5 s, every other setting a default) runs the steps.
After `--settle` seconds (past NOTIFY_RETRY_SECONDS, when the old sweep starts re-sending), 10-step
`noop` runs are timed back to back for `--window` seconds (at least one run; created → finished, on the
database's clock), beside one timed before any wait existed. The window spans several retries of the
notifications, so a run that meets a send hanging in its slot shows in the max.

Variants, each on a fresh database (`durable_bench_outbox`) and Redis DB 12:
  before        the code at --before (exported with `git archive` into a temporary directory)
  after         this tree, notifications on the default queue, same single worker
  after-routed  this tree, notifications routed to their own queue and worker (as docs/howto/notifications.md advises)

Prints figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socketserver
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DB_NAME = "durable_bench_outbox"
BROKER = os.environ.get("BENCH_BROKER_URL", "redis://127.0.0.1:6379/12")
QUEUE = "durable_notifications"


class HangingWebhook(socketserver.ThreadingTCPServer):
    """Accepts each request and never answers it: the receiver of the issue."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self) -> None:
        self.released = threading.Event()
        self.requests = 0
        super().__init__(("127.0.0.1", 0), self._Handler)

    class _Handler(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            self.request.recv(65536)
            self.server.requests += 1  # type: ignore[attr-defined]
            self.server.released.wait(600)  # type: ignore[attr-defined]


def measure(variant: str, window: float, waits: int, settle: float) -> dict[str, object]:
    """One variant, in this tree: prints nothing, returns the figures."""
    webhook = HangingWebhook()
    threading.Thread(target=webhook.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{webhook.server_address[1]}/hook"
    os.environ.update(
        DJANGO_SETTINGS_MODULE="bench.notify_settings",
        DATABASE_URL=f"postgres://postgres@127.0.0.1:5432/{DB_NAME}",
        CELERY_BROKER_URL=BROKER,
        DURABLE_LOG_LEVEL="CRITICAL",
        BENCH_DURABLE_AGENTS=json.dumps({"NOTIFIER": "durable_agents.notify.WebhookNotifier", "WEBHOOK_URL": url}),
    )
    if variant == "after-routed":
        os.environ["BENCH_NOTIFY_QUEUE"] = QUEUE
    for sql in (f"DROP DATABASE IF EXISTS {DB_NAME}", f"CREATE DATABASE {DB_NAME}"):
        subprocess.run(["psql", "-h", "127.0.0.1", "-U", "postgres", "-qc", sql], check=True, capture_output=True)
    subprocess.run([sys.executable, "manage.py", "migrate", "-v0"], cwd=Path.cwd(), check=True)
    sys.path.insert(0, str(Path.cwd()))

    import django

    django.setup()
    import redis

    from durable_agents import api
    from durable_agents.models import Run
    from durable_agents.testing import WorkerProcess, wait_for

    redis.Redis.from_url(BROKER).flushdb()
    logs = Path(tempfile.mkdtemp(prefix=f"bench-notify-{variant}-"))
    workers = [
        WorkerProcess(pool="prefork", concurrency=2, beat=True, cwd=Path.cwd(), log_path=logs / "steps.log").start()
    ]
    if variant == "after-routed":
        workers.append(WorkerProcess(extra_args=["--queues", QUEUE], cwd=Path.cwd(), log_path=logs / "notify.log"))
        workers[-1].start()

    def ten_steps() -> float:
        run = api.start("noop", {"steps": 10})
        done = wait_for(
            lambda: Run.objects.filter(pk=run.id, status="completed").first(),
            timeout=900,
            interval=0.01,
            what="a 10-step run",
        )
        return (done.finished_at - done.created_at).total_seconds()

    try:
        ten_steps()  # warm-up: imports and connections in both slots
        quiet = ten_steps()
        parked = [api.start("approve_charge", {"order_id": f"B-{i}"}).id for i in range(waits)]
        wait_for(
            lambda: Run.objects.filter(pk__in=parked, status="waiting").count() == waits,
            timeout=300,
            what="the approvals to wait",
        )
        time.sleep(settle)
        timed = [ten_steps()]
        ends = time.monotonic() + window
        while time.monotonic() < ends:
            timed.append(ten_steps())
    finally:
        for worker in workers:
            worker.kill()
        webhook.released.set()
        webhook.shutdown()
    return {"variant": variant, "quiet": quiet, "timed": timed, "webhook_requests": webhook.requests}


def export_tree(commit: str) -> Path:
    """The code at `commit` in a temporary directory, with this bench copied in; the repository is untouched."""
    tree = Path(tempfile.mkdtemp(prefix="bench-notify-before-"))
    archive = subprocess.run(["git", "archive", commit], cwd=ROOT, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    for name in ("notifications.py", "notify_settings.py"):
        shutil.copy(ROOT / "bench" / name, tree / "bench" / name)
    return tree


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", default="2c3a68d", help="commit of the code before the change")
    parser.add_argument("--window", type=float, default=60.0)
    parser.add_argument("--waits", type=int, default=3)
    parser.add_argument("--settle", type=float, default=35.0)
    parser.add_argument("--variant", help=argparse.SUPPRESS)  # a child process measuring one variant
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(measure(args.variant, args.window, args.waits, args.settle)))
        return

    print(f"{args.waits} approvals notifying a webhook that never answers; 10-step noop runs, 1 worker x 2 slots")
    print(f"{'variant':<14} {'quiet':>8} {'runs':>5} {'median':>9} {'p95':>9} {'max':>9}  webhook requests")
    before = export_tree(args.before)
    try:
        for variant, tree in (("before", before), ("after", ROOT), ("after-routed", ROOT)):
            child = [sys.executable, str(tree / "bench" / "notifications.py"), "--variant", variant]
            child += ["--window", str(args.window), "--waits", str(args.waits), "--settle", str(args.settle)]
            out = subprocess.run(child, cwd=tree, check=True, capture_output=True, text=True).stdout
            result = json.loads(out.strip().splitlines()[-1])
            timed = sorted(result["timed"])
            p95 = timed[min(len(timed) - 1, int(0.95 * len(timed)))]
            print(
                f"{variant:<14} {result['quiet']:>7.2f}s {len(timed):>5} {statistics.median(timed):>8.2f}s "
                f"{p95:>8.2f}s {timed[-1]:>8.2f}s  {result['webhook_requests']}"
            )
    finally:
        shutil.rmtree(before, ignore_errors=True)


if __name__ == "__main__":
    main()

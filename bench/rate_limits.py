"""A thousand conversations against an API limited to 50 requests a second: 429s with and without the shared limiter.

The fake Messages API answers 429 (`retry-after`) beyond `--api-rps` requests a second (a bucket of that many,
refilled at that rate). The same `--runs` conversations (bench/scale_agent.py: two model calls each) run on the
Procfile's model worker (gevent) twice: without MODEL_RATE_LIMITS, then with a limit of `--limit-fraction` of
the API's rate, kept in Postgres (or `--backend` redis://...). Printed for each: the 429s the API answered, the
requests it received, wall time from the first wake-up, and how many runs completed. No asserts: figures.

    python bench/rate_limits.py                    # 1,000 runs, API of 50/s, limiter at 90 % of it
    python bench/rate_limits.py --runs 200 --latency 0.5
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import agent_scale  # noqa: E402  (prepares the bench database, sets Django up)
from bench.scale_agent import answer  # noqa: E402
from durable_agents.models import Run, RunStatus  # noqa: E402
from durable_agents.testing.fake_anthropic import FakeAnthropic  # noqa: E402


def scenario(args: argparse.Namespace, limits: dict[str, object] | None) -> dict[str, float]:
    """The runs on a fresh model worker and sweeper, with `limits` as MODEL_RATE_LIMITS (None: no limiter)."""
    from django.test import override_settings

    extra = {"MODEL_RATE_LIMITS": limits, "RATE_LIMIT_BACKEND": args.backend} if limits else {}
    env = {"DURABLE_MODEL_RATE_LIMITS": json.dumps(limits or None), "DURABLE_RATE_LIMIT_BACKEND": args.backend}
    with FakeAnthropic(responder=answer, latency=args.latency, requests_per_second=args.api_rps) as fake:
        sweeper = agent_scale.worker("sweeper", fake, pool="prefork", concurrency=1, queues="celery", **env).start()
        model = agent_scale.worker(
            "model_worker",
            fake,
            pool="gevent",
            concurrency=args.concurrency,
            queues=agent_scale.MODEL_QUEUE,
            DJANGO_DB_POOL=str(args.pool_size),
            **env,
        ).start()
        try:
            durable = {**agent_scale._durable(), "MODEL_QUEUE": agent_scale.MODEL_QUEUE, **extra}
            with override_settings(DURABLE_AGENTS=durable):
                agent_scale.run_all(1, f"warm-{bool(limits)}-{time.monotonic_ns()}", timeout=120)
                fake.reset()
                started = time.monotonic()
                prefix = f"rl-{bool(limits)}-{time.monotonic_ns()}"
                try:
                    elapsed, ids = agent_scale.run_all(args.runs, prefix, timeout=args.timeout)
                    completed = args.runs
                except (SystemExit, AssertionError) as exc:  # report how far it got
                    print(f"  not all runs completed: {exc}", flush=True)
                    elapsed = time.monotonic() - started
                    completed = Run.objects.filter(
                        workflow="bench_scale_conversation", status=RunStatus.COMPLETED
                    ).count()
            requests = len([r for r in fake.requests if r.path == "/v1/messages"])
            return {"429s": fake.rate_limited, "requests": requests, "seconds": elapsed, "completed": completed}
        finally:
            model.kill()
            sweeper.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=1000, help="conversations started at once")
    parser.add_argument("--api-rps", type=float, default=50.0, help="the fake API's limit, requests a second")
    parser.add_argument("--limit-fraction", type=float, default=0.9, help="the limiter's rate, a share of the API's")
    parser.add_argument("--latency", type=float, default=1.0, help="seconds the fake takes per answer")
    parser.add_argument("--concurrency", type=int, default=1000, help="greenlets of the model worker")
    parser.add_argument("--pool-size", type=int, default=16, help="the model worker's Postgres connections")
    parser.add_argument("--backend", default="postgres", help='RATE_LIMIT_BACKEND: "postgres" or a redis:// URL')
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for the runs of a scenario")
    args = parser.parse_args()
    rpm = args.api_rps * args.limit_fraction * 60
    without = scenario(args, None)
    with_limiter = scenario(args, {"*": {"requests_per_minute": rpm}})
    print(
        f"\n{args.runs} conversations × 2 calls against an API of {args.api_rps:g} requests/s ({args.latency:g} s each)"
    )
    print(f"{'':<40} {'429s':>7} {'requests':>9} {'wall s':>8} {'completed':>10}")
    for label, figures in (
        ("no limiter", without),
        (f"limiter: {rpm:g}/min in {args.backend.split(':')[0]}", with_limiter),
    ):
        print(
            f"{label:<40} {figures['429s']:>7} {figures['requests']:>9} {figures['seconds']:>8.1f} "
            f"{figures['completed']:>10}/{args.runs}"
        )
    print(f"ideal wall time at {args.api_rps:g}/s: {2 * args.runs / args.api_rps:.0f} s")


if __name__ == "__main__":
    main()

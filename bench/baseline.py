"""Raw Celery no-op tasks, the baseline the durable step is measured against (same broker, same settings)."""

from __future__ import annotations

import os
import time

import redis
from celery import shared_task

_redis = redis.Redis.from_url(os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/13"))


@shared_task(name="bench.hop", acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def hop(remaining: int, key: str) -> None:
    """A chain of no-op hops: each task sends the next, like a run's steps do."""
    if remaining > 1:
        hop.delay(remaining - 1, key)
    else:
        _redis.set(key, time.time())


@shared_task(name="bench.noop", acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def noop(key: str) -> None:
    """One independent no-op task; counts itself so the bench knows when all are done."""
    _redis.incr(key)


def no_wake(run_id: str, countdown: float | None = None, queue: str | None = None) -> None:
    """A WAKER that sends nothing: for benches that measure the database side alone."""


# DURABLE_AGENTS settings under which a start wakes nothing: WAKER sends nothing, and no start is gathered (a gathered
# wake-up is sent by the process's sender thread after WAKE_GATHER_MS, through the WAKER of that moment: the bench's
# own wake-up after the block would be a second message, every run claimed twice).
UNWOKEN = {"WAKER": "bench.baseline.no_wake", "WAKE_GATHER_MS": 0}

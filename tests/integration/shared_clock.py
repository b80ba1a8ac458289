"""SharedClock: a test's shift of the engine's time, in the test process and in every worker started with its `env`.

tests/celery.py reads the shift before each task of a worker whose environment names its key; the shift lives in a
Redis database (the test broker's, unless the workers' broker is not Redis: then name one).
"""

from __future__ import annotations

import os
import uuid
from datetime import timedelta

import redis

from durable_agents import clock


class SharedClock:
    """The engine's time shift, for this process and every worker started with `env`."""

    def __init__(self, redis_url: str | None = None) -> None:
        url = redis_url or os.environ["CELERY_BROKER_URL"]
        self.key = f"durable-test:clock:{uuid.uuid4().hex}"
        self.redis = redis.Redis.from_url(url)
        self.redis.set(self.key, 0)
        self.env = {"DURABLE_TEST_CLOCK_KEY": self.key, "DURABLE_TEST_CLOCK_REDIS": url}

    def advance(self, delta: timedelta) -> None:
        clock.advance(delta)
        self.redis.set(self.key, clock.offset().total_seconds())

    def to_half_past(self) -> None:
        """Move to the next HH:30, so hourly slots are half an hour away whatever the real time of the test."""
        now = clock.now()
        self.advance(timedelta(minutes=(30 - now.minute) % 60 or 60, seconds=-now.second))

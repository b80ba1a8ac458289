"""How requests flow through the fake Anthropic API: its rate limit, and the count of requests in flight.

`RequestBucket` is the API's request limit, a bucket of N requests refilled at N a second
(https://platform.claude.com/docs/en/api/rate-limits): a request beyond it is a 429 with a `retry-after` (whole
seconds); answers within it carry `anthropic-ratelimit-requests-{limit,remaining,reset}`, the reset an RFC 3339
time (here: when the bucket will be full again). `InFlight` counts the requests being answered, and its peak.

Example::

    bucket = RequestBucket(50)
    wait = bucket.take(headers)   # None: go on (headers filled in); else seconds until a request would fit
    with flight:                  # counted in flight while answered
        ...
"""

from __future__ import annotations

import math
import threading
import time
from datetime import UTC, datetime, timedelta
from types import TracebackType

__all__ = ["InFlight", "RequestBucket"]


class RequestBucket:
    """The allowance of `rate` requests a second (`rate` None or 0: no limit), and the 429s it caused."""

    def __init__(self, rate: float | None) -> None:
        self.rate = rate
        self.limited = 0  # requests answered 429 by this limit
        self._lock = threading.Lock()
        self._allowance = float(rate or 0.0)
        self._at = time.monotonic()

    def take(self, headers: dict[str, str]) -> float | None:
        """None if a request fits (taking its share, and adding the rate-limit headers to `headers`), else the
        seconds until one would."""
        rate = self.rate
        if not rate:
            return None
        with self._lock:
            now = time.monotonic()
            self._allowance = min(rate, self._allowance + (now - self._at) * rate)
            self._at = now
            if self._allowance < 1.0:
                self.limited += 1
                return (1.0 - self._allowance) / rate
            self._allowance -= 1.0
            full = datetime.now(UTC) + timedelta(seconds=(rate - self._allowance) / rate)
            headers.update(
                {
                    "anthropic-ratelimit-requests-limit": str(math.ceil(rate)),
                    "anthropic-ratelimit-requests-remaining": str(math.floor(self._allowance)),
                    "anthropic-ratelimit-requests-reset": full.isoformat(timespec="seconds").replace("+00:00", "Z"),
                }
            )
            return None


class InFlight:
    """Requests being answered (entered and not yet left), the most at once, and a wait for a number of them."""

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._count = 0
        self._peak = 0

    @property
    def count(self) -> int:
        with self._condition:
            return self._count

    @property
    def peak(self) -> int:
        with self._condition:
            return self._peak

    def reset_peak(self) -> None:
        with self._condition:
            self._peak = self._count

    def wait_for(self, n: int, timeout: float) -> bool:
        """Block until at least `n` are in flight (True), or `timeout` seconds passed (False)."""
        with self._condition:
            return self._condition.wait_for(lambda: self._count >= n, timeout=timeout)

    def __enter__(self) -> InFlight:
        with self._condition:
            self._count += 1
            self._peak = max(self._peak, self._count)
            self._condition.notify_all()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        with self._condition:
            self._count -= 1

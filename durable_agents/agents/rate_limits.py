"""Shared model rate limits: requests, input tokens and output tokens per minute, per model and API key.

Every worker asks the same limiter (a row per bucket in Postgres, or a hash in Redis) before each call, so a
thousand conversations on ten machines stay under the API's limits together instead of all meeting its 429s.

Each dimension is a GCRA bucket: one number, its theoretical arrival time (TAT), on the backend's clock (the
database's STATEMENT_TIMESTAMP, or Redis' TIME; never a worker's). A call costs 1 request, its input tokens and
its max_tokens; each cost advances its bucket's TAT by cost / rate, and the call may go once every TAT, less
RATE_LIMIT_BURST_SECONDS, has passed (a call larger than the burst goes alone, once its bucket is empty). A
reservation is atomic over the three buckets (one UPDATE ... RETURNING, or one Lua script) and is a place in
line: the caller sleeps until its start, holding no database connection, and callers after it line up behind.
A wait longer than RATE_LIMIT_MAX_WAIT_SECONDS reserves nothing: the call raises ModelUnavailableError with
`retry_after` the time until capacity, and the engine parks the step (releasing the worker) until then.

Input tokens are an estimate before the call (about four characters a token of the request's JSON: count_tokens
needs the network and costs a call of its own) and corrected after it by the tokens billed (uncached input and
cache writes; cache reads do not count against the API's limit); output tokens are reserved as max_tokens and the
unused rest refunded. A 429 empties the bucket until its `retry-after` has passed, so the other workers stop
sending too. Buckets are named "<model>|<fingerprint>", the fingerprint a SHA-256 prefix of the API key: the key
itself is never stored. With COUNT_TOKENS the caller may pass the API's count of the prompt instead.

The API says how much of its own limits is left on every answer (`anthropic-ratelimit-{requests,tokens,
input-tokens,output-tokens}-{limit,remaining,reset}`, reset an RFC 3339 time). The configured limits are a guess at
the API's; the headers are the API's own count, and they also see other clients of the same organization. When an
answer shows less than HEADROOM of a limit left, the bucket is emptied until that limit's reset, the way a 429's
`retry-after` empties it, so every worker holds its next call before the API has to refuse it. The documentation
gives the reset as the time the limit has room again and promises nothing sooner, so the hold lasts until then; it
only starts below HEADROOM, where limits configured under the API's never lead, so it is the safety net for limits
set too high or for another client of the same organization. The reset is read against the answer's `date` header
(the API's clock, not this worker's), which errs late by under a second. A model MODEL_RATE_LIMITS does not limit
has no shared bucket: its hold is kept in this process only. Without MODEL_RATE_LIMITS there is no limiter, and the
headers are not read.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from email.utils import parsedate_to_datetime
from typing import Any, Protocol

from django.db import connection

from durable_agents import clock
from durable_agents.agents.messages import Usage
from durable_agents.conf import settings
from durable_agents.connections import release_connection
from durable_agents.errors import ModelUnavailableError

DIMENSIONS = ("requests_per_minute", "input_tokens_per_minute", "output_tokens_per_minute")
FINGERPRINT_CHARS = 16
CHARS_PER_TOKEN = 4
# A Redis bucket outlives its last reservation by this long, then expires (a Postgres row stays: one per model).
REDIS_KEEP_SECONDS = 86400
# The API's limits named in its response headers: anthropic-ratelimit-<name>-{limit,remaining,reset}. "tokens" is the
# most restrictive token limit in effect (https://platform.claude.com/docs/en/api/rate-limits).
HEADER_LIMITS = ("requests", "tokens", "input-tokens", "output-tokens")
# Less than this share of one of the API's limits left holds every worker's next call until that limit's reset.
HEADROOM = 0.05
# The API's limits are per minute and refill continuously: a reset further ahead than this is a clock not to trust.
LONGEST_HEADER_HOLD_SECONDS = 60.0

logger = logging.getLogger(__name__)

# Set by the step that asks (journal.ask): after a wait for room it proves its lease again, so the window between
# its last proof and the request stays the lease's own, never RATE_LIMIT_MAX_WAIT_SECONDS (a worker taken over
# while it waited stops here, before paying for an answer).
_after_wait: ContextVar[Callable[[], None] | None] = ContextVar("durable_after_rate_wait", default=None)


@contextmanager
def proving_after_waits(prove: Callable[[], None]) -> Iterator[None]:
    """Within: `prove()` runs after every wait for room, right before the request; what it raises stops the call."""
    token = _after_wait.set(prove)
    try:
        yield
    finally:
        _after_wait.reset(token)


def _waited() -> None:
    prove = _after_wait.get()
    if prove is not None:
        prove()


@dataclass(frozen=True)
class Limits:
    """Per-second rates of one model's buckets; 0: that dimension is not limited."""

    requests: float = 0.0
    input_tokens: float = 0.0
    output_tokens: float = 0.0

    @classmethod
    def per_minute(cls, configured: dict[str, float]) -> Limits:
        rates = [float(configured.get(name) or 0.0) / 60.0 for name in DIMENSIONS]
        return cls(*rates)

    def seconds(self, requests: float, input_tokens: float, output_tokens: float) -> tuple[float, float, float]:
        """How far each bucket's TAT moves for this cost (negative: a refund)."""
        pairs = ((requests, self.requests), (input_tokens, self.input_tokens), (output_tokens, self.output_tokens))
        return tuple(cost / rate if rate else 0.0 for cost, rate in pairs)  # type: ignore[return-value]


def limits_for(model: str) -> Limits | None:
    """The limits of `model`: its own entry, else the longest prefix of its name, else "*"; None: unlimited."""
    configured = settings.MODEL_RATE_LIMITS
    if not configured:
        return None
    if model in configured:
        return Limits.per_minute(configured[model])
    prefixes = [name for name in configured if name != "*" and model.startswith(name)]
    if prefixes:
        return Limits.per_minute(configured[max(prefixes, key=len)])
    return Limits.per_minute(configured["*"]) if "*" in configured else None


def fingerprint(api_key: str) -> str:
    """A short SHA-256 prefix naming an API key in bucket names: enough to tell keys apart, never the key."""
    return hashlib.sha256(api_key.encode()).hexdigest()[:FINGERPRINT_CHARS]


def estimate_input_tokens(request: dict[str, Any]) -> int:
    """The input tokens of a Messages request, estimated offline: its JSON's characters / 4 (an estimate; the
    call's billed usage corrects the bucket after)."""
    return max(1, len(json.dumps(request, separators=(",", ":"), default=str)) // CHARS_PER_TOKEN)


@dataclass(frozen=True)
class Allowance:
    """One of the API's own limits, as an answer's `anthropic-ratelimit-<name>-*` headers state it."""

    name: str
    limit: int
    remaining: int
    resets_in: float  # seconds after the answer

    @property
    def is_low(self) -> bool:
        """Less than HEADROOM of the limit is left: the next calls may well be refused."""
        return self.limit > 0 and self.remaining < HEADROOM * self.limit


def allowances(headers: Mapping[str, str], now: float | None = None) -> list[Allowance]:
    """The API's limits an answer's headers state; `now` (epoch seconds) is when it answered, by default its `date`.

    Tokens remaining are rounded to the nearest thousand by the API. A header that cannot be read is left out: the
    headers refine the pacing, they never fail a call.
    """
    answered = now if now is not None else _answered_at(headers)
    found = []
    for name in HEADER_LIMITS:
        prefix = f"anthropic-ratelimit-{name}-"
        limit, remaining, reset = (headers.get(prefix + part) for part in ("limit", "remaining", "reset"))
        if limit is None or remaining is None:
            continue
        try:
            resets_in = datetime.fromisoformat(reset).timestamp() - answered if reset else 0.0
            found.append(Allowance(name, int(limit), int(remaining), max(resets_in, 0.0)))
        except (TypeError, ValueError):
            continue
    return found


def header_hold(headers: Mapping[str, str], now: float | None = None) -> float:
    """Seconds to hold new calls after an answer with these headers: until the latest reset of a limit nearly spent
    (at most LONGEST_HEADER_HOLD_SECONDS); 0 when every limit has room."""
    low = [allowance.resets_in for allowance in allowances(headers, now) if allowance.is_low]
    return min(max(low, default=0.0), LONGEST_HEADER_HOLD_SECONDS)


def _answered_at(headers: Mapping[str, str]) -> float:
    # The API's clock: a reset compared with this worker's clock would be off by the machines' skew.
    try:
        return parsedate_to_datetime(headers["date"]).timestamp()
    except (KeyError, TypeError, ValueError, IndexError):
        return time.time()


class Backend(Protocol):
    @property
    def last_wait(self) -> float:
        """The wait the last refused reservation of this thread would have had."""
        ...

    def reserve(self, bucket: str, moves: tuple[float, float, float], burst: float, max_wait: float) -> float | None:
        """Reserve a call: seconds until it may go; or None, reserving nothing, if that is more than `max_wait`
        (then `last_wait` says how long)."""
        ...

    def debit(self, bucket: str, moves: tuple[float, float, float]) -> None:
        """Move the TATs by `moves` (a correction after the call; negative refunds), never below now."""
        ...

    def block(self, bucket: str, seconds: float, burst: float) -> None:
        """Empty every bucket until `seconds` from now (a 429's retry-after)."""
        ...


@dataclass(frozen=True)
class Reservation:
    """A call's place in line: what was reserved, to correct once the usage is known."""

    bucket: str
    limits: Limits
    input_tokens: int
    output_tokens: int
    waited: float


class RateLimiter:
    """Consulted by the Anthropic participant around each call: `acquire` before, `settle` or `rate_limited` after."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    def acquire(
        self, model: str, api_key: str, request: dict[str, Any], max_tokens: int, *, input_tokens: int | None = None
    ) -> Reservation | None:
        """Wait for room for this call (holding no database connection), or raise ModelUnavailableError with
        `retry_after` when the wait is longer than RATE_LIMIT_MAX_WAIT_SECONDS. None: the model is not limited.

        `input_tokens`: the API's count of the prompt (COUNT_TOKENS), reserved instead of the estimate."""
        limits = limits_for(model)
        bucket = bucket_name(model, api_key)
        max_wait = float(settings.RATE_LIMIT_MAX_WAIT_SECONDS)
        if limits is None:
            self._wait_out_local_hold(model, bucket, max_wait)
            return None
        estimate = max(1, input_tokens) if input_tokens else estimate_input_tokens(request)
        wait = self.backend.reserve(
            bucket, limits.seconds(1, estimate, max_tokens), float(settings.RATE_LIMIT_BURST_SECONDS), max_wait
        )
        if wait is None:
            raise _capacity_wait(model, self.backend.last_wait, max_wait)
        # The model call comes next: the Postgres backend's reservation opened this thread's connection again, and
        # the step must not hold it while Claude thinks (nor while it waits for its turn).
        release_connection()
        reservation = Reservation(bucket, limits, estimate, max_tokens, wait)
        if wait > 0:
            time.sleep(wait)
            try:
                _waited()
            except BaseException:
                self._give_back(reservation)  # nothing is sent: the tokens are the other workers' again
                raise
        return reservation

    def _give_back(self, reservation: Reservation) -> None:
        try:
            self.settle(reservation, Usage())
        except Exception:  # noqa: BLE001 - what stopped the call matters more; the bucket refills by itself
            logger.warning("could not give back the reservation of %s", reservation.bucket, exc_info=True)

    def settle(self, reservation: Reservation, usage: Usage) -> None:
        """Correct the estimate by the billed tokens: debit the input beyond it, refund the unused max_tokens."""
        billed_input = usage.input_tokens + usage.cache_write_tokens
        moves = reservation.limits.seconds(
            0, billed_input - reservation.input_tokens, usage.output_tokens - reservation.output_tokens
        )
        if any(moves):
            self.backend.debit(reservation.bucket, moves)

    def rate_limited(self, reservation: Reservation, retry_after: float | None) -> None:
        """A 429: nothing was billed (refund the tokens), and nobody sends until its retry-after has passed."""
        self.settle(reservation, Usage())
        if retry_after:
            self.backend.block(reservation.bucket, retry_after, float(settings.RATE_LIMIT_BURST_SECONDS))

    def observe(self, model: str, api_key: str, headers: Mapping[str, str]) -> float:
        """Read an answer's `anthropic-ratelimit-*` headers: if one of the API's limits is nearly spent, hold every
        worker's next call of this model and key until it resets (a limited model's bucket is emptied until then, as
        by a 429; an unlimited one is held in this process). Returns the hold in seconds, 0 for none."""
        hold = header_hold(headers)
        if hold <= 0:
            return 0.0
        bucket = bucket_name(model, api_key)
        if limits_for(model) is None:
            _hold_locally(bucket, hold)
        else:
            self.backend.block(bucket, hold, float(settings.RATE_LIMIT_BURST_SECONDS))
        logger.info("the API's rate limit of %s is nearly spent: new calls wait %.1f s", model, hold)
        return hold

    def _wait_out_local_hold(self, model: str, bucket: str, max_wait: float) -> None:
        wait = _local_hold(bucket)
        if wait > max_wait:
            raise _capacity_wait(model, wait, max_wait)
        if wait > 0:
            release_connection()
            time.sleep(wait)
            _waited()


def bucket_name(model: str, api_key: str) -> str:
    return f"{model}|{fingerprint(api_key)}"


def _capacity_wait(model: str, wait: float, max_wait: float) -> ModelUnavailableError:
    return ModelUnavailableError(
        f"the shared rate limit of {model} has no room for {wait:.1f} s "
        f"(more than RATE_LIMIT_MAX_WAIT_SECONDS, {max_wait:g} s); the step waits without a worker",
        retry_after=wait,
        capacity_wait=True,
    )


# Holds of models without a shared bucket, by bucket name: when (time.monotonic()) their next call may go.
_holds: dict[str, float] = {}
_holds_lock = threading.Lock()


def _hold_locally(bucket: str, seconds: float) -> None:
    with _holds_lock:
        _holds[bucket] = max(_holds.get(bucket, 0.0), time.monotonic() + seconds)


def _local_hold(bucket: str) -> float:
    """Seconds the process-local hold of `bucket` still has to run (0: none)."""
    with _holds_lock:
        until = _holds.get(bucket)
        if until is None:
            return 0.0
        left = until - time.monotonic()
        if left <= 0:
            del _holds[bucket]
        return max(left, 0.0)


# -- Postgres -------------------------------------------------------------------------------------------------------

_NOW = "(EXTRACT(EPOCH FROM STATEMENT_TIMESTAMP() + %(shift)s))::float8"
_COLUMNS = ("requests_tat", "input_tat", "output_tat")


def _start_sql() -> str:
    """When a reservation could go: after every bucket's TAT (plus its move) less the burst, or, for a call larger
    than the burst, once its bucket is empty; never before now. Old column values only (SET sees the old row)."""
    starts = [
        f"LEAST(GREATEST(b.{column}, n.now) + %(move{i})s - %(burst)s, GREATEST(b.{column}, n.now))"
        for i, column in enumerate(_COLUMNS)
    ]
    return f"GREATEST(n.now, {', '.join(starts)})"


def _reserve_sql() -> str:
    start = _start_sql()
    granted = f"({start} - n.now <= %(max_wait)s)"
    moved = ",\n".join(
        f"{column} = CASE WHEN {granted} THEN GREATEST(b.{column}, n.now) + %(move{i})s ELSE b.{column} END"
        for i, column in enumerate(_COLUMNS)
    )
    # One statement: the row lock it takes re-reads b.* before SET, so racing workers line up, never overbook.
    return (
        f"UPDATE durable_agents_ratebucket AS b SET {moved}, start_at = {start}, reserved = {granted} "
        f"FROM (SELECT {_NOW} AS now) AS n WHERE b.key = %(key)s RETURNING b.reserved, b.start_at - n.now"
    )


def _debit_sql() -> str:
    moved = ", ".join(
        f"{column} = GREATEST(GREATEST(b.{column}, n.now) + %(move{i})s, n.now)" for i, column in enumerate(_COLUMNS)
    )
    return f"UPDATE durable_agents_ratebucket AS b SET {moved} FROM (SELECT {_NOW} AS now) AS n WHERE b.key = %(key)s"


def _block_sql() -> str:
    moved = ", ".join(f"{column} = GREATEST(b.{column}, n.now + %(until)s)" for column in _COLUMNS)
    return f"UPDATE durable_agents_ratebucket AS b SET {moved} FROM (SELECT {_NOW} AS now) AS n WHERE b.key = %(key)s"


class PostgresBackend:
    """Buckets as rows of durable_agents_ratebucket, each reservation one UPDATE ... RETURNING on the database's
    clock (shifted by `clock.advance()` in tests, like the engine's)."""

    RESERVE, DEBIT, BLOCK = _reserve_sql(), _debit_sql(), _block_sql()

    def __init__(self) -> None:
        self.local = threading.local()

    @property
    def last_wait(self) -> float:
        return getattr(self.local, "wait", 0.0)

    def reserve(self, bucket: str, moves: tuple[float, float, float], burst: float, max_wait: float) -> float | None:
        params = {"key": bucket, "burst": burst, "max_wait": max_wait, **_moves(moves)}
        row = self._update(self.RESERVE, params, fetch=True)
        reserved, wait = row
        self.local.wait = max(float(wait), 0.0)
        return self.local.wait if reserved else None

    def debit(self, bucket: str, moves: tuple[float, float, float]) -> None:
        self._update(self.DEBIT, {"key": bucket, **_moves(moves)})

    def block(self, bucket: str, seconds: float, burst: float) -> None:
        self._update(self.BLOCK, {"key": bucket, "until": seconds + burst})

    def _update(self, sql: str, params: dict[str, Any], *, fetch: bool = False) -> Any:
        params["shift"] = clock.offset()
        with connection.cursor() as cursor:
            for _ in range(2):
                cursor.execute(sql, params)
                if cursor.rowcount:
                    return cursor.fetchone() if fetch else None
                # First use of this bucket: make its row (all TATs in the past), then update it.
                cursor.execute(
                    "INSERT INTO durable_agents_ratebucket (key, requests_tat, input_tat, output_tat, start_at, "
                    "reserved) VALUES (%s, 0, 0, 0, 0, false) ON CONFLICT (key) DO NOTHING",
                    [params["key"]],
                )
        raise AssertionError(f"rate bucket {params['key']!r} vanished while in use")


def _moves(moves: tuple[float, float, float]) -> dict[str, float]:
    return {f"move{i}": float(move) for i, move in enumerate(moves)}


# -- Redis ----------------------------------------------------------------------------------------------------------

# KEYS[1]: the bucket's hash. ARGV: operation, test shift (s), burst, max wait / until, then the three moves.
# Replies are strings: Redis would truncate a Lua number to an integer.
LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000 + tonumber(ARGV[2])
local op, burst, limit = ARGV[1], tonumber(ARGV[3]), tonumber(ARGV[4])
local names = {'requests', 'input', 'output'}
local tats = redis.call('HMGET', KEYS[1], unpack(names))
local latest = now
for i = 1, 3 do
  local tat = math.max(tonumber(tats[i]) or 0, now)
  local move = tonumber(ARGV[4 + i])
  if op == 'reserve' then
    tats[i] = {tat, tat + move}
    latest = math.max(latest, math.min(tat + move - burst, tat))
  elseif op == 'debit' then
    tats[i] = math.max(tat + move, now)
  else
    tats[i] = math.max(tat, now + limit)
  end
end
if op == 'reserve' then
  if latest - now > limit then
    return {0, tostring(latest - now)}
  end
  for i = 1, 3 do tats[i] = tats[i][2] end
end
local furthest = now
for i = 1, 3 do
  redis.call('HSET', KEYS[1], names[i], tostring(tats[i]))
  furthest = math.max(furthest, tats[i])
end
redis.call('EXPIRE', KEYS[1], math.ceil(furthest - now) + tonumber(ARGV[8]))
return {1, tostring(latest - now)}
"""


class RedisBackend:
    """Buckets as Redis hashes ("durable_agents:rate:<bucket>"), each operation one Lua script on Redis' TIME
    (shifted by `clock.advance()` in tests)."""

    _clients: dict[str, Any] = {}
    _lock = threading.Lock()

    def __init__(self, url: str) -> None:
        import redis

        with self._lock:
            if url not in self._clients:
                client = redis.Redis.from_url(url)
                self._clients[url] = (client, client.register_script(LUA))
        self.client, self.script = self._clients[url]
        self.local = threading.local()

    @property
    def last_wait(self) -> float:
        return getattr(self.local, "wait", 0.0)

    def reserve(self, bucket: str, moves: tuple[float, float, float], burst: float, max_wait: float) -> float | None:
        reserved, wait = self._run(bucket, "reserve", burst, max_wait, moves)
        self.local.wait = max(float(wait), 0.0)
        return self.local.wait if int(reserved) else None

    def debit(self, bucket: str, moves: tuple[float, float, float]) -> None:
        self._run(bucket, "debit", 0.0, 0.0, moves)

    def block(self, bucket: str, seconds: float, burst: float) -> None:
        self._run(bucket, "block", burst, seconds + burst, (0.0, 0.0, 0.0))

    def _run(self, bucket: str, op: str, burst: float, limit: float, moves: tuple[float, float, float]) -> Any:
        shift = clock.offset().total_seconds()
        args = [op, repr(shift), repr(burst), repr(limit), *(repr(float(m)) for m in moves), REDIS_KEEP_SECONDS]
        return self.script(keys=[f"durable_agents:rate:{bucket}"], args=args)


def backend() -> Backend:
    """The configured backend: RATE_LIMIT_BACKEND "postgres", or a redis:// (rediss://, unix://) URL."""
    configured = str(settings.RATE_LIMIT_BACKEND)
    if configured == "postgres":
        return _postgres
    return RedisBackend(configured)


def limiter() -> RateLimiter | None:
    """The process's limiter, or None when MODEL_RATE_LIMITS is empty (no call is limited, nothing is asked)."""
    if not settings.MODEL_RATE_LIMITS:
        return None
    return RateLimiter(backend())


_postgres = PostgresBackend()

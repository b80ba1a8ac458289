"""App settings: the `DURABLE_AGENTS` dict in Django settings, each key declared once below.

A declaration gives the key's default, its type, the bounds of a number and a one-line doc. The system checks
(`durable_agents/checks.py`) validate the configured values against them, and the documentation's settings
reference (docs/reference/settings.md) is rendered from them when it is built (`settings_table()`).

Example::

    DURABLE_AGENTS = {"LEASE_SECONDS": 30, "STUCK_AFTER_SECONDS": 600}

    from durable_agents.conf import settings
    settings.LEASE_SECONDS  # 30; read on every access, so override_settings works
"""

from __future__ import annotations

import math
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal

from django.conf import settings as django_settings


@dataclass(frozen=True)
class Setting:
    """One DURABLE_AGENTS key: its default, the type a value must have, its bounds (numbers) and what it does.

    `type` is a builtin, a generic (`list[str]`), a `Literal[...]` or a union of them (`int | None`). An int
    is a number where a float is asked for; a bool is never a number; a tuple is a list and a list a tuple.
    """

    default: Any
    type: Any
    doc: str
    # Bounds of a number (and of each number inside the value): greater than, or at least.
    above: float | None = None
    at_least: float | None = None
    # At most: a duration must fit a timestamp (and timedelta), a limit a Postgres bigint.
    at_most: float | None = None

    def problem(self, value: Any) -> str | None:
        """Why `value` cannot be this setting, or None if it can."""
        if not _matches(self.type, value):
            return f"must be {describe(self.type)}, got {_show(value)} ({type(value).__name__})"
        for number in _numbers(value):
            if not _is_finite(number):
                return f"must be a finite number, got {_show(value)}"
            if self.above is not None and not number > self.above:
                return f"must be greater than {self.above:g}, got {_show(value)}"
            if self.at_least is not None and not number >= self.at_least:
                return f"must be at least {self.at_least:g}, got {_show(value)}"
            if self.at_most is not None and not number <= self.at_most:
                return f"must be at most {self.at_most:g}, got {_show(value)}"
        return None

    def describe(self) -> str:
        """The type and bounds in words, e.g. "float, > 0"."""
        bounds = f", > {self.above:g}" if self.above is not None else ""
        bounds += f", >= {self.at_least:g}" if self.at_least is not None else ""
        bounds += f", <= {self.at_most:g}" if self.at_most is not None else ""
        return describe(self.type) + bounds


# (input, output, cache write, cache read) or with the 1 h cache write last (default: twice the input).
Prices = dict[str, tuple[float, float, float, float] | tuple[float, float, float, float, float]]

RateDimension = Literal["requests_per_minute", "input_tokens_per_minute", "output_tokens_per_minute"]

# The longest duration and the largest SQL limit a setting may hold: about 31 years, a billion rows. Beyond them a
# value passes every other bound and breaks at run time: `timedelta(seconds=1e300)` overflows in every sweep or
# claim, STATEMENT_TIMESTAMP() + 1e12 s is out of a timestamp's range, a LIMIT of 10**19 out of a bigint's.
LONGEST_SECONDS = 1e9
MOST_ROWS = 10**9

SETTINGS: dict[str, Setting] = {
    "LEASE_SECONDS": Setting(
        15.0, float, "a step's lease; a heartbeat renews it every third of this", above=0, at_most=LONGEST_SECONDS
    ),
    "IDLE_RESWEEP_SECONDS": Setting(
        10.0,
        float,
        "a runnable run with no progress for this long is woken again by the sweep (lost message)",
        above=0,
        at_most=LONGEST_SECONDS,
    ),
    "RESWEEP_BACKOFF_MAX_SECONDS": Setting(
        300.0,
        float,
        "a run the sweep re-woke without progress is re-woken ever more rarely (after as long as it had been "
        "stalled), at least this often",
        above=0,
        at_most=LONGEST_SECONDS,
    ),
    "SWEEP_BATCH": Setting(
        1000, int, "at most this many runs re-enqueued by one sweep pass", at_least=1, at_most=MOST_ROWS
    ),
    "STUCK_AFTER_SECONDS": Setting(
        600.0,
        float,
        "a running run with no progress for this long is flagged stuck in the console",
        above=0,
        at_most=LONGEST_SECONDS,
    ),
    "BEHIND_AFTER_SECONDS": Setting(
        60.0,
        float,
        "a runnable run waiting this long for a worker (while workers and the sweep are alive) makes health say the "
        "workers are behind",
        above=0,
        at_most=LONGEST_SECONDS,
    ),
    "SWEEP_LATE_AFTER_SECONDS": Setting(
        120.0,
        float,
        "the sweep not run for this long (it is scheduled every few seconds) makes `durable_status` ask if beat is up",
        above=0,
        at_most=LONGEST_SECONDS,
    ),
    "WORKER_HEARTBEAT_SECONDS": Setting(
        10.0, float, "each worker records that it is alive this often (one UPDATE)", above=0, at_most=LONGEST_SECONDS
    ),
    "WORKER_CHECKS": Setting(
        "refuse",
        Literal["refuse", "warn"],
        "a `celery worker` (or the beat that schedules the sweep) runs the system checks as it starts: on an error "
        '"refuse" logs each in a line and exits 78 before it takes a message; "warn" starts anyway, saying so at ERROR',
    ),
    "WORKER_GONE_AFTER_SECONDS": Setting(
        60.0,
        float,
        "a worker not heard from for this long counts as gone",
        above=0,
        at_most=LONGEST_SECONDS,
    ),
    "HEARTBEAT_KEEP_SECONDS": Setting(
        86400.0,
        float,
        "the sweep forgets workers not heard from for this long",
        above=0,
        at_most=LONGEST_SECONDS,
    ),
    "RESULT_INLINE_MAX_BYTES": Setting(
        64 * 1024,
        int,
        "step results larger than this (JSON bytes) are stored out of row, by sha256, verified when read back",
        at_least=0,
    ),
    # A storage alias, e.g. STORAGES = {..., "durable_results": {"BACKEND": "storages.backends.s3.S3Storage"}}
    # with DURABLE_AGENTS = {"RESULT_STORAGE": "durable_results"}. Never a worker's local disk: a next step on
    # another machine, or after a redeploy, must read it.
    "RESULT_STORAGE": Setting(
        None,
        str | None,
        "where out-of-row results live: None, the Payload table beside their run; or a STORAGES alias "
        "every worker shares (e.g. S3)",
    ),
    "INPUT_MAX_BYTES": Setting(1024 * 1024, int, "run inputs larger than this (JSON bytes) are refused", at_least=1),
    # A broker countdown is held by the worker that receives it until it is due; on RabbitMQ without native delayed
    # delivery (a quorum queue on a direct exchange) it holds the worker's prefetch slot: keep the countdowns short.
    "MAX_COUNTDOWN_SECONDS": Setting(
        2.0,
        float,
        "a delay (a retry's backoff, a wait for the model's capacity) up to this long goes out as a broker countdown; "
        "a longer one parks the run until its wake_at (database clock) for the sweep, with no message (0: every one)",
        at_least=0,
        at_most=LONGEST_SECONDS,
    ),
    "RETRY_MAX_ATTEMPTS": Setting(5, int, "default attempts in all of a failing step", at_least=1),
    "RETRY_BACKOFF_SECONDS": Setting(
        0.5, float, "default backoff base between attempts of a step", at_least=0, at_most=LONGEST_SECONDS
    ),
    "RETRY_BACKOFF_MAX_SECONDS": Setting(
        60.0, float, "default backoff cap between attempts of a step", at_least=0, at_most=LONGEST_SECONDS
    ),
    "RETRY_AFTER_MAX_SECONDS": Setting(
        600.0,
        float,
        "the longest a service's `retry-after` (a 429, a 529) may delay a step; `durable_resume` clears it",
        at_least=0,
        at_most=LONGEST_SECONDS,
    ),
    "RETRY_AFTER_JITTER": Setting(
        1.0,
        float,
        "a `retry-after` is never shortened, and spread by a random share of it up to this fraction",
        at_least=0,
    ),
    "MAX_CLAIMS_PER_STEP": Setting(
        25, int, "a step claimed this many times without finishing (its worker keeps dying) fails", at_least=1
    ),
    "EAGER_SLICE_MS": Setting(
        100.0,
        float,
        "a worker that committed a step claims and runs the next one itself, without a broker hop, while its task "
        "has run for less than this; 0: one step per task",
        at_least=0,
        at_most=LONGEST_SECONDS,
    ),
    "EAGER_MAX_STEPS": Setting(
        50,
        int,
        "the most steps one task runs after the one it was sent for (within EAGER_SLICE_MS); 0: one step per task",
        at_least=0,
        at_most=MOST_ROWS,
    ),
    "WAKE_BATCH_SIZE": Setting(
        25,
        int,
        "runs woken by one transaction (started together, re-woken by the sweep) go out this many to a message, "
        "advanced one after another by one task within EAGER_SLICE_MS (the rest then a message each; model-bound runs "
        "with a MODEL_QUEUE: a message each); 1 (or EAGER_SLICE_MS 0): one message per run",
        at_least=1,
        at_most=MOST_ROWS,
    ),
    "WAKE_GATHER_MS": Setting(
        0.0,
        float,
        "above 0, runs started one per transaction have their wake-ups gathered by a thread of the starting process "
        "for this long after the first (or until WAKE_BATCH_SIZE are in), then sent together, as runs started in one "
        "transaction are (e.g. 10 for a web process starting a run per request); 0: each start sends its own "
        "wake-up as it commits",
        at_least=0,
        at_most=60_000,
    ),
    "EFFECT_MAX_INVOCATIONS": Setting(
        10, int, "an effect invoked this many times without a recorded outcome goes to an operator", at_least=1
    ),
    "TOOL_CONCURRENCY": Setting(
        4,
        int,
        "an agent runs at most this many tool calls of one model response at once, each on a database connection "
        "of its own (1: one after the other)",
        at_least=1,
        at_most=1000,
    ),
    "DEFAULT_MODEL": Setting(
        "claude-sonnet-5-5", str, "the model of steps that name none: a current model of the installed SDK"
    ),
    "DEFAULT_PARTICIPANT": Setting(
        "anthropic", str, 'who answers model turns by default: "anthropic" (Claude) or a registered participant'
    ),
    "MODEL_TIMEOUT_SECONDS": Setting(
        120.0, float, "the longest one model request may take", above=0, at_most=LONGEST_SECONDS
    ),
    "MODEL_QUEUE": Setting(
        "",
        str,
        "the Celery queue of steps that wait on the model (agent, judge, planner, approval), for a gevent worker; "
        '"" sends them with every other step',
    ),
    "REPLAY_QUEUE": Setting(
        "",
        str,
        "the Celery queue of replay runs (replays.py), served by a worker of their own so replays never wait in "
        'front of real runs; "" sends them where real runs go (each wake-up then costs no lookup)',
    ),
    "BATCH_WINDOW_SECONDS": Setting(
        60.0,
        float,
        'model turns sent with delivery="batch" within this long go out as one Message Batch (or sooner, once '
        "BATCH_MAX_REQUESTS are waiting)",
        at_least=0,
        at_most=LONGEST_SECONDS,
    ),
    "BATCH_MAX_REQUESTS": Setting(
        10_000, int, "at most this many turns in one Message Batch (the API takes 100,000)", at_least=1, at_most=100_000
    ),
    "BATCH_MAX_BYTES": Setting(
        200_000_000,
        int,
        "at most this many bytes of requests in one Message Batch (the API takes 256 MB)",
        at_least=1_000,
        at_most=256_000_000,
    ),
    "BATCH_POLL_SECONDS": Setting(
        30.0,
        float,
        "a Message Batch in flight is first polled this long after it was sent, then less often",
        above=0,
        at_most=LONGEST_SECONDS,
    ),
    "BATCH_POLL_MAX_SECONDS": Setting(
        600.0,
        float,
        "the longest wait between two polls of a Message Batch (the backoff doubles up to it)",
        above=0,
        at_most=LONGEST_SECONDS,
    ),
    "BATCH_SUBMIT_GRACE_SECONDS": Setting(
        300.0,
        float,
        "a Message Batch whose create request went without an answer is looked for among the API's batches this "
        "long after (then adopted, or sent again if the API has no such batch); longer than MODEL_TIMEOUT_SECONDS",
        above=0,
        at_most=LONGEST_SECONDS,
    ),
    "QUEUE": Setting(
        "",
        str,
        "the Celery queue durable_agents' own tasks are sent to, over the product's routes; \"\" is Celery's "
        "default queue (put the sweep's beat entry there too)",
    ),
    "NOTIFY_QUEUE": Setting(
        "", str, 'the queue of notification deliveries, so a slow receiver never holds a step\'s slot; "": QUEUE'
    ),
    "MODEL_MAX_CONNECTIONS": Setting(
        1000, int, "HTTP connections the process's Anthropic client may open: the model worker's threads", at_least=1
    ),
    "MODEL_PRICES": Setting(
        {},
        Prices,
        "USD per million tokens by model name prefix, over the model table's prices (a negotiated rate): input, "
        "output, cache write, cache read[, 1 h cache write]",
        at_least=0,
    ),
    "MODELS": Setting(
        {},
        dict[str, dict[str, typing.Any]],
        "rows added to or changed in the model table (durable_agents/agents/capabilities.py), by model id: "
        "context_window, max_output, thinking_default, thinking_types, efforts, prefill, forced_tool_choice, "
        "sampling, prefix_check, prices",
    ),
    "MODEL_RATE_LIMITS": Setting(
        None,
        dict[str, dict[RateDimension, float]] | None,
        "calls per minute each model may take per API key, shared by every worker, by model name (exact, else the "
        'longest prefix, else "*"): requests_per_minute, input_tokens_per_minute, output_tokens_per_minute; '
        "None: no limiter",
        above=0,
    ),
    "PREPARED_STATEMENTS": Setting(
        None,
        bool | None,
        "the engine's hot statements prepared on the server (True) or sent plain (False); None: prepared unless "
        "DATABASES says a transaction-mode pooler stands between (DISABLE_SERVER_SIDE_CURSORS, or OPTIONS "
        "prepare_threshold None)",
    ),
    "COUNT_TOKENS": Setting(
        False,
        bool,
        "the shared rate limit reserves a conversation's first request by the API's count of its prompt "
        "(messages.count_tokens: free, one more round trip, its own requests-per-minute limit) instead of ~4 "
        "characters a token; on any error, the estimate",
    ),
    "RATE_LIMIT_BACKEND": Setting(
        "postgres",
        str,
        "where the shared limits are kept: \"postgres\" (the database's clock) or a redis:// URL (Redis' TIME)",
    ),
    "RATE_LIMIT_BURST_SECONDS": Setting(
        1.0,
        float,
        "a limit lets this many seconds' worth of calls go at once (and at least one call), then paces them",
        above=0,
        at_most=LONGEST_SECONDS,
    ),
    "RATE_LIMIT_MAX_WAIT_SECONDS": Setting(
        30.0,
        float,
        "a call waits in-process for capacity up to this long; a longer wait parks the step (retried then)",
        at_least=0,
        at_most=LONGEST_SECONDS,
    ),
    "NOTIFIER": Setting(
        "durable_agents.notify.EmailNotifier", str, "dotted path of the class that sends approval notifications"
    ),
    "APPROVERS": Setting([], list[str], "who is notified of an approval that names no `notify_to`"),
    "WEBHOOK_URL": Setting("", str, "where `durable_agents.notify.WebhookNotifier` POSTs notifications"),
    "BASE_URL": Setting("http://127.0.0.1:8000", str, "the site's address, the start of the decision links sent"),
    "LINK_MAX_AGE_SECONDS": Setting(
        7 * 24 * 3600, float, "a decision link expires after this long", at_least=0, at_most=LONGEST_SECONDS
    ),
    "NOTIFY_RETRY_SECONDS": Setting(
        30.0,
        float,
        "a notification no task picked up this long after it was enqueued is enqueued again",
        above=0,
        at_most=LONGEST_SECONDS,
    ),
    "NOTIFY_MAX_ATTEMPTS": Setting(
        10, int, "attempts in all to send a notification before it is failed and needs attention", at_least=1
    ),
    "NOTIFY_BACKOFF_SECONDS": Setting(
        10.0, float, "backoff base between attempts to send", at_least=0, at_most=LONGEST_SECONDS
    ),
    "NOTIFY_BACKOFF_MAX_SECONDS": Setting(
        3600.0, float, "backoff cap between attempts to send", at_least=0, at_most=LONGEST_SECONDS
    ),
    "NOTIFY_SEND_TIMEOUT_SECONDS": Setting(
        10.0,
        float,
        "the longest one send may take; a custom notifier must time out after it too",
        above=0,
        at_most=LONGEST_SECONDS,
    ),
    "APPROVAL_DEADLINE_SECONDS": Setting(
        None,
        float | None,
        "deadline of approvals of tools marked needs_approval (None: none); policy reject",
        above=0,
        at_most=LONGEST_SECONDS,
    ),
    "WAKER": Setting(
        "durable_agents.tasks.wake",
        str,
        "dotted path of `waker(run_id, countdown=None, queue=None)`, which wakes a run (so the engine needs no Celery)",
    ),
    "BATCH_WAKER": Setting(
        "durable_agents.tasks.wake_many",
        str,
        "dotted path of `waker(run_ids, queue=None)`, which wakes several runs with one message (WAKE_BATCH_SIZE); "
        "empty, or left at its default beside a WAKER of your own: WAKER once per run",
    ),
    "NOTIFICATION_ENQUEUER": Setting(
        "durable_agents.tasks.enqueue_notification",
        str,
        "dotted path of the callable that hands a notification's outbox row id to a worker",
    ),
    "RETENTION": Setting(
        None,
        dict[str, dict[str, str | None]] | None,
        'how long finished runs are kept, by workflow ("default": the rest) and status, e.g. {"default": '
        '{"completed": "30d", "failed": "180d", "cancelled": "30d"}}; None (an age or the whole policy): for ever',
    ),
    "RETENTION_BATCH": Setting(
        50,
        int,
        "runs deleted per transaction by the prune (children deleted explicitly in it)",
        at_least=1,
        at_most=100_000,
    ),
    "RETENTION_PAUSE_SECONDS": Setting(
        0.0,
        float,
        "the prune rests at least this long between batches (RETENTION_DUTY_CYCLE may ask for longer), as --pause",
        at_least=0,
        at_most=3600,
    ),
    "RETENTION_DUTY_CYCLE": Setting(
        0.1,
        float,
        "the share of the wall clock the prune may work: after a batch of t seconds it rests "
        "t × (1 − share) / share, so a pass never takes more than this share of the database; 1: flat out",
        at_least=0.01,
        at_most=1,
    ),
    "RETENTION_ARCHIVE": Setting(
        None,
        str | None,
        "a STORAGES alias each pruned batch is written to first, as gzipped JSON lines; None: no archive",
    ),
    "SCHEDULES": Setting(
        {},
        dict[str, dict[str, Any]],
        'schedules declared in code, by name: api.schedule\'s options, e.g. {"nightly-digest": {"workflow": '
        '"digest", "cron": "0 3 * * *", "timezone": "Europe/Paris", "input": {"days": 1}}}; each sweep creates, '
        "updates and deletes their rows to match (an operator's pause stays)",
    ),
    "METRICS_TOKEN": Setting(
        None, str | None, "bearer token Prometheus sends to /metrics; None: only staff logins may read it"
    ),
    "METRICS_WINDOW_SECONDS": Setting(
        300.0,
        float,
        "step latency and retry metrics cover the steps finished in the last this-many seconds",
        above=0,
        at_most=LONGEST_SECONDS,
    ),
    "ADMIN_EXACT_COUNT_LIMIT": Setting(
        1000,
        int,
        "admin lists count matching runs exactly up to this many, then show a Postgres estimate",
        at_least=0,
        at_most=MOST_ROWS,
    ),
    "ADMIN_REFRESH_SECONDS": Setting(
        5.0,
        float,
        "the run list and the run page refresh themselves this often while open (paused under the operator's "
        "hands, off once a run finished); 0: never",
        at_least=0,
        at_most=3600,
    ),
    "COMPACT_AT_PROMPT_TOKENS": Setting(
        100_000,
        int | None,
        "an agent folds older turns into a summary once a prompt reached this many tokens (None: never)",
        at_least=1,
    ),
    "KEEP_RECENT_TURNS": Setting(6, int, "turns a compaction keeps verbatim after the summary", at_least=1),
    "COMPACTION_MAX_TOKENS": Setting(4096, int, "the most a compaction's summary may take", at_least=1),
    "TRACING": Setting(
        False,
        bool,
        "OpenTelemetry spans of runs, steps, model calls, tools, effects and waits, sent to the application's tracer "
        "provider (needs opentelemetry-api: the durable-agents[otel] extra); off: nothing imported",
    ),
    "TRACE_CONTENT": Setting(
        False,
        bool,
        "with TRACING, spans also carry prompts, answers and tool arguments, redacted as the logs are",
    ),
    "TRACE_URL": Setting(
        "",
        str,
        'the run page links to its trace: a URL with "{trace_id}", e.g. "http://jaeger:16686/trace/{trace_id}"',
    ),
    "PROMPT_CACHE_TTL": Setting(
        "5m",
        Literal["5m", "1h"] | None,
        "prompt caching of tools, system prompt, summary and conversation (1 h writes cost 2x input); None: off",
    ),
}

DEFAULTS: dict[str, Any] = {name: setting.default for name, setting in SETTINGS.items()}


# What Django's settings object has read already: LazySettings keeps each setting in its own __dict__ as it reads it,
# and empties or drops it whenever settings change (override_settings, assigning or deleting one, with or without
# Django's setting_changed). Read there, a setting costs a dict look-up, not a call of LazyObject's __getattribute__.
_READ: dict[str, Any] = object.__getattribute__(django_settings, "__dict__")


class _Settings:
    """Attribute access to DURABLE_AGENTS with defaults, as Django's settings hold it on every access, so tests can
    override."""

    def __getattr__(self, name: str) -> Any:
        try:
            default = DEFAULTS[name]
        except KeyError:
            raise AttributeError(f"unknown durable_agents setting {name!r}") from None
        declared = _READ.get("DURABLE_AGENTS")
        if declared is None:
            declared = getattr(django_settings, "DURABLE_AGENTS", {})
        return declared.get(name, default)


settings = _Settings()


def settings_table() -> str:
    """The table of DURABLE_AGENTS keys, one row per declaration (docs/reference/settings.md renders it)."""
    rows = ["| key | default | type | meaning |", "|---|---|---|---|"]
    for name, setting in SETTINGS.items():
        cells = (f"`{name}`", f"`{_show(setting.default, limit=None)}`", f"`{setting.describe()}`", setting.doc)
        rows.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(rows)


def describe(kind: Any) -> str:
    """A type as a settings file's reader writes it: `float`, `list[str]`, `'5m' | '1h' | None`."""
    if kind is None or kind is type(None):
        return "None"
    if typing.get_origin(kind) is Literal:
        return " | ".join(_show(choice) for choice in typing.get_args(kind))
    if _is_union(kind):
        return " | ".join(describe(member) for member in typing.get_args(kind))
    if typing.get_origin(kind) is not None:
        args = ", ".join("..." if a is Ellipsis else describe(a) for a in typing.get_args(kind))
        return f"{typing.get_origin(kind).__name__}[{args}]"
    return getattr(kind, "__name__", str(kind))


def _is_union(kind: Any) -> bool:
    return typing.get_origin(kind) in (typing.Union, types.UnionType)


def _matches(kind: Any, value: Any) -> bool:
    if kind is None or kind is type(None):
        return value is None
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin is Literal:
        return any(type(value) is type(choice) and value == choice for choice in args)
    if _is_union(kind):
        return any(_matches(member, value) for member in args)
    if kind is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin in (list, tuple):
        # A list or a tuple alike: JSON read from the environment gives lists, Python settings files tuples.
        if not isinstance(value, list | tuple):
            return False
        if origin is tuple and args and args[-1] is not Ellipsis:
            return len(value) == len(args) and all(_matches(a, v) for a, v in zip(args, value, strict=True))
        return all(_matches(args[0], item) for item in value) if args else True
    if origin is dict:
        if not isinstance(value, dict):
            return False
        key_kind, value_kind = args or (Any, Any)
        return all(_matches(key_kind, k) and _matches(value_kind, v) for k, v in value.items())
    if kind is Any:
        return True
    return isinstance(kind, type) and isinstance(value, kind)


def _is_finite(number: float) -> bool:
    try:
        return math.isfinite(number)
    except OverflowError:  # an int too large for a float: every use of the setting would fail the same way
        return False


def _numbers(value: Any) -> list[float]:
    """The numbers a value holds (itself, or those inside its lists and dicts), for the bounds."""
    if isinstance(value, bool):
        return []
    if isinstance(value, int | float):
        return [value]
    if isinstance(value, list | tuple):
        return [n for item in value for n in _numbers(item)]
    if isinstance(value, dict):
        return [n for item in value.values() for n in _numbers(item)]
    return []


def _show(value: Any, limit: int | None = 80) -> str:
    """repr() for a message: shortened, and never raising (a hostile __repr__ is still a value)."""
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - a setting's value may be any object; the message must still be written
        text = f"<{type(value).__name__} object>"
    return text if limit is None or len(text) <= limit else text[: limit - 3] + "..."

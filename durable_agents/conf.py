"""App settings: the `DURABLE_AGENTS` dict in Django settings, over these defaults.

Example::

    DURABLE_AGENTS = {"LEASE_SECONDS": 30, "STUCK_AFTER_SECONDS": 600}
"""

from __future__ import annotations

from typing import Any

from django.conf import settings as django_settings

DEFAULTS: dict[str, Any] = {
    # A step's lease; a heartbeat renews it every third of this while the step runs.
    "LEASE_SECONDS": 15.0,
    # A runnable run with no progress for this long is woken again by the sweep (lost message).
    "IDLE_RESWEEP_SECONDS": 10.0,
    # At most this many runs re-enqueued by one sweep pass.
    "SWEEP_BATCH": 1000,
    # A running run with no progress for this long is flagged stuck in the console.
    "STUCK_AFTER_SECONDS": 600.0,
    # Step results larger than this (JSON bytes) are stored out of row, content-addressed by sha256, and
    # read back with their hash verified.
    "RESULT_INLINE_MAX_BYTES": 64 * 1024,
    # Where out-of-row results live. None: the Payload table in Postgres, beside their run (deleted with it).
    # Or the alias of a Django STORAGES entry shared by every worker (e.g. S3), for results too big for the
    # database:  STORAGES = {..., "durable_results": {"BACKEND": "storages.backends.s3.S3Storage", ...}}
    #             DURABLE_AGENTS = {"RESULT_STORAGE": "durable_results"}
    # Never a worker's local disk: a next step on another machine, or after a redeploy, must read it.
    "RESULT_STORAGE": None,
    # Run inputs larger than this are refused.
    "INPUT_MAX_BYTES": 1024 * 1024,
    # Retries in-process with a countdown up to this long; longer waits are left to the sweep.
    "MAX_COUNTDOWN_SECONDS": 30.0,
    # Default retry policy for steps: attempts in all, backoff base and cap (seconds).
    "RETRY_MAX_ATTEMPTS": 5,
    "RETRY_BACKOFF_SECONDS": 0.5,
    "RETRY_BACKOFF_MAX_SECONDS": 60.0,
    # The longest a service's `retry-after` (a 429, a 529) may delay a step; longer answers are capped.
    # `durable_resume` wakes a run at once, clearing any backoff.
    "RETRY_AFTER_MAX_SECONDS": 600.0,
    # A `retry-after` is honoured, never shortened, and spread: each run waits it plus a random share of it
    # up to this fraction, so a 429 answered to a thousand conversations does not come back as one wave.
    "RETRY_AFTER_JITTER": 1.0,
    # A step claimed this many times without finishing (its worker keeps dying) fails as a crash loop.
    "MAX_CLAIMS_PER_STEP": 25,
    # An external effect invoked this many times without a recorded outcome goes to an operator.
    "EFFECT_MAX_INVOCATIONS": 10,
    # The model agent steps use unless they name one: a current model of the installed SDK.
    "DEFAULT_MODEL": "claude-sonnet-5-5",
    # Who answers model turns by default: "anthropic" (Claude) or a registered participant name.
    "DEFAULT_PARTICIPANT": "anthropic",
    "MODEL_TIMEOUT_SECONDS": 120.0,
    # The Celery queue durable_agents' own tasks are sent to ("": Celery's default queue), so a product routes
    # them to workers of their own without touching its global Celery configuration.
    "QUEUE": "",
    # The queue notification deliveries are sent to ("": QUEUE): a slow receiver then never holds a step's slot.
    "NOTIFY_QUEUE": "",
    # The Celery queue for steps that wait on the model (agent, judge, planner, approval with its brief), to be
    # served by a threads-pool worker (README: "Workers"); "" sends them with every other step.
    "MODEL_QUEUE": "",
    # HTTP connections the process's one Anthropic client may open: size it to the model worker's concurrency.
    "MODEL_MAX_CONNECTIONS": 1000,
    # USD per million tokens: (input, output, cache write, cache read), by model name prefix.
    "MODEL_PRICES": {
        "claude-opus": (5.0, 25.0, 6.25, 0.5),
        "claude-sonnet": (3.0, 15.0, 3.75, 0.3),
        "claude-haiku": (1.0, 5.0, 1.25, 0.1),
    },
    # Humans in the loop: the notifier (dotted path), default recipients, links.
    "NOTIFIER": "durable_agents.notify.EmailNotifier",
    "APPROVERS": [],
    "WEBHOOK_URL": "",
    "BASE_URL": "http://127.0.0.1:8000",
    "LINK_MAX_AGE_SECONDS": 7 * 24 * 3600,
    # Notifications are sent by their own task (`durable_agents.deliver_notification`), never by the sweep.
    # A notification no task picked up this long after it was written or enqueued (its message was lost)
    # is enqueued again by the sweep.
    "NOTIFY_RETRY_SECONDS": 30.0,
    # Attempts in all before a notification is given up: status `failed`, `needs_attention` set, an event.
    "NOTIFY_MAX_ATTEMPTS": 10,
    # Backoff between attempts (exponential from the base, capped, with jitter), in seconds.
    "NOTIFY_BACKOFF_SECONDS": 10.0,
    "NOTIFY_BACKOFF_MAX_SECONDS": 3600.0,
    # The longest one send may take; the built-in notifiers time out after it, and a custom one must too
    # (a send is held against other senders for this long plus the backoff).
    "NOTIFY_SEND_TIMEOUT_SECONDS": 10.0,
    # Deadline for approvals of tools marked needs_approval (None: no deadline); policy "reject".
    "APPROVAL_DEADLINE_SECONDS": None,
    # Callable path that wakes a run, `waker(run_id, countdown=None, queue=None)` (`queue` passed only with a
    # MODEL_QUEUE): the engine never imports Celery itself.
    "WAKER": "durable_agents.tasks.wake",
    # Callable path that hands a notification's outbox row id to a worker (the Celery task by default).
    "NOTIFICATION_ENQUEUER": "durable_agents.tasks.enqueue_notification",
    # Bearer token Prometheus sends to /metrics (Authorization: Bearer ...); None: only staff logins may read it.
    "METRICS_TOKEN": None,
    # Step latency and retry metrics cover steps finished (retries scheduled) in the last this-many seconds.
    "METRICS_WINDOW_SECONDS": 300.0,
    # Admin lists count matching runs exactly up to this many; beyond it they show a Postgres estimate.
    "ADMIN_EXACT_COUNT_LIMIT": 1000,
    # An agent step folds its older turns into a summary once a prompt reached this many tokens
    # (None: never; an agent(compact_at_prompt_tokens=...) overrides it).
    "COMPACT_AT_PROMPT_TOKENS": 100_000,
    # Turns a compaction keeps verbatim after the summary (an agent(keep_recent_turns=...) overrides it).
    "KEEP_RECENT_TURNS": 6,
    # The most a compaction call's summary may take.
    "COMPACTION_MAX_TOKENS": 4096,
    # Prompt caching of tools, system prompt, summary and conversation: "5m", "1h" (writes cost 2x input), or None.
    "PROMPT_CACHE_TTL": "5m",
}


class _Settings:
    """Attribute access to DURABLE_AGENTS with defaults, read on every access so tests can override."""

    def __getattr__(self, name: str) -> Any:
        if name not in DEFAULTS:
            raise AttributeError(f"unknown durable_agents setting {name!r}")
        return getattr(django_settings, "DURABLE_AGENTS", {}).get(name, DEFAULTS[name])


settings = _Settings()

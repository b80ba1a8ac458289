"""System checks: a misconfiguration is an error with a hint when Django starts, not a stuck run in production.

Registered in `DurableAgentsConfig.ready()` under the tag `durable_agents`; `manage.py check` runs them, and
`manage.py check --deploy` adds the production-only ones (DEPLOY_CHECKS).

    E001  DURABLE_AGENTS is not a dict
    E002  an unknown DURABLE_AGENTS key (with the nearest known one)
    E003  a value of the wrong type, or out of bounds
    E004  NOTIFIER, WAKER, BATCH_WAKER (unless empty) or NOTIFICATION_ENQUEUER does not import, or is not callable
    E005  DEFAULT_PARTICIPANT is neither "anthropic" nor a registered participant
    E006  RESULT_STORAGE names no STORAGES entry
    E007  steps ask Claude, and the anthropic SDK is not installed
    E008  CELERY_ACCEPT_CONTENT does not accept JSON: workers drop every durable message
    E009  QUEUE, MODEL_QUEUE, NOTIFY_QUEUE or REPLAY_QUEUE is not declared, and Celery creates no missing queue
    E010  RATE_LIMIT_BACKEND is neither "postgres" nor a Redis URL
    E011  RETENTION names a status that is not finished, or an age that is not a duration
    E012  RETENTION_ARCHIVE names no STORAGES entry
    E013  a MODELS entry is not a model profile (an unknown field, a wrong value)
    E014  a model step asks its model for what the model table says it refuses (thinking, effort, max_tokens)
    E015  durable_agents.urls is not included, and the project asks people for approvals (steps, tools, APPROVERS)
    E016  TRACING is on, and the OpenTelemetry API (opentelemetry-api) is not installed
    E017  a declared schedule (SCHEDULES, or a workflow's schedule=cron(...)) is invalid: an unknown workflow or
          option, a bad cron, time zone or policy; the sweep skips it
    E018  a schedule name is declared twice (in SCHEDULES and on a workflow, or on two workflows); neither applies
    E019  (database: `check --database default`) a declared schedule's name is held by an `api.schedule` one
    E020  the broker is kombu's filesystem://, and a folder it reads or writes does not exist: workers die
    W000  a check could not run (its own bug; it reports instead of raising)
    W001  no `durable_agents.sweep` in CELERY_BEAT_SCHEDULE: runs whose message was lost are never woken
    W002  Celery may send or accept pickle
    W003  (deploy) SQLite is the database, with DEBUG off
    W004  decision links would point at localhost: BASE_URL left at its default while notifications go out
    W005  LOGIN_URL leads nowhere, so an approver who is not signed in cannot open a decision link
    W006  (deploy) steps ask Claude, and ANTHROPIC_API_KEY is not set
    W007  durable_agents.urls is not included, so no decision link can be made (nothing asks for an approval yet)
    W008  QUEUE names the durable workers' queue, but beat sends the sweep elsewhere
    W009  a model step names a model the model table does not know: requests follow the conservative profile
    W010  RabbitMQ with a quorum queue, and the durable queue on a direct exchange: a worker would hold each countdown
          (up to MAX_COUNTDOWN_SECONDS) in its only prefetch slot until due (broker.py says exactly when)
    W011  RabbitMQ with a quorum queue, and worker_detect_quorum_queues off: workers ask for global QoS, refused
    W012  worker_cancel_long_running_tasks_on_connection_loss is on: a broker blip stops every step in flight
    W013  TRACE_URL has no "{trace_id}": every run page would link to the same page

A check never raises on odd input: a traceback at start-up is worse than no check, so each one is guarded
and reports W000 instead.
"""

from __future__ import annotations

import difflib
import functools
import importlib.util
import os
import shlex
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any
from urllib.parse import urlsplit

from celery.app import routes
from django.conf import settings as django_settings
from django.core.checks import CheckMessage, Error, Warning
from django.db import DatabaseError
from django.urls import NoReverseMatch, Resolver404, resolve, reverse
from django.utils.module_loading import import_string

from durable_agents.agents.capabilities import ModelChoice, model_profile, problems
from durable_agents.agents.participants import participants
from durable_agents.broker import (
    cancels_steps_on_connection_loss,
    countdowns_holding_a_slot,
    missing_filesystem_folders,
    quorum_queue_refusing_global_qos,
)
from durable_agents.conf import SETTINGS, describe
from durable_agents.engine.declared import colliding, declarations
from durable_agents.errors import InvalidInputError
from durable_agents.models import StepKind
from durable_agents.retention import load_policy
from durable_agents.tools import Tool, tools
from durable_agents.workflows import StepDef, Workflow, registry

Check = Callable[..., list[CheckMessage]]
HOOKS = ("NOTIFIER", "WAKER", "BATCH_WAKER", "NOTIFICATION_ENQUEUER")
OPTIONAL_HOOKS = frozenset({"BATCH_WAKER"})  # empty: none
QUEUES = ("QUEUE", "MODEL_QUEUE", "NOTIFY_QUEUE", "REPLAY_QUEUE")
SWEEP_TASK = "durable_agents.sweep"
PICKLE = {"pickle", "application/x-python-serialize"}
JSON = {"json", "application/json"}
LOCAL_HOSTS = {"localhost", "127.0.0.1", "::1", "0.0.0.0"}
MODEL_KINDS = {StepKind.AGENT, StepKind.JUDGE, StepKind.PLANNER}
ANTHROPIC = "anthropic"
REDIS_SCHEMES = {"redis", "rediss", "unix"}
OTEL_API = "opentelemetry.trace"


def _never_raises(check: Check) -> Check:
    @functools.wraps(check)
    def guarded(app_configs: Sequence[Any] | None = None, **kwargs: Any) -> list[CheckMessage]:
        try:
            return check(app_configs, **kwargs)
        except Exception as exc:  # noqa: BLE001 - a check must report, never take the process down
            return [
                Warning(
                    f"durable_agents could not run its check {check.__name__}: {type(exc).__name__}: {exc}",
                    hint="The check itself failed on this configuration; if the error above is not in your "
                    "settings, report it to durable_agents with your DURABLE_AGENTS setting.",
                    id="durable_agents.W000",
                )
            ]

    return guarded


def _configured() -> dict[Any, Any]:
    value = getattr(django_settings, "DURABLE_AGENTS", {})
    return value if isinstance(value, dict) else {}


def _value(name: str) -> Any:
    """The configured value if it fits its declaration, else the default (E003 reports the bad one)."""
    configured = _configured()
    if name in configured and SETTINGS[name].problem(configured[name]) is None:
        return configured[name]
    return SETTINGS[name].default


def _key(name: object) -> str:
    return f"DURABLE_AGENTS[{name!r}]"


@_never_raises
def check_settings(app_configs: Sequence[Any] | None = None, **kwargs: Any) -> list[CheckMessage]:
    """E001-E003: DURABLE_AGENTS is a dict of known keys, each holding a value of its declared type."""
    configured = getattr(django_settings, "DURABLE_AGENTS", {})
    if not isinstance(configured, dict):
        return [
            Error(
                f"DURABLE_AGENTS must be a dict, got {type(configured).__name__}",
                hint='Write DURABLE_AGENTS = {"LEASE_SECONDS": 15, ...}, or leave it out for the defaults.',
                id="durable_agents.E001",
            )
        ]
    messages: list[CheckMessage] = []
    for name, value in configured.items():
        if name not in SETTINGS:
            messages.append(_unknown(name))
            continue
        problem = SETTINGS[name].problem(value)
        if problem is not None:
            messages.append(Error(f"{_key(name)} {problem}", hint=_fix(name, value), id="durable_agents.E003"))
    return messages


def _unknown(name: object) -> Error:
    near = difflib.get_close_matches(name.upper(), SETTINGS, n=1) if isinstance(name, str) else []
    hint = f"Did you mean {near[0]!r}?" if near else "The known keys are declared in durable_agents/conf.py."
    return Error(f"{_key(name)} is not a durable_agents setting", hint=hint, id="durable_agents.E002")


def _fix(name: str, value: Any) -> str:
    setting = SETTINGS[name]
    kind = describe(setting.type)
    if isinstance(value, str) and kind.startswith("list["):
        return f"Write a list: [{value!r}]."
    if isinstance(value, str) and ("float" in kind or "int" in kind) and _is_number(value):
        return f"Write the number without quotes: {value.strip()}."
    example = repr(setting.default)
    example = f"e.g. its default {example}" if len(example) <= 40 else "as its default in durable_agents/conf.py"
    return f"Set {_key(name)} to {setting.describe()}, {example}; or remove it for the default."


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


@_never_raises
def check_hooks(app_configs: Sequence[Any] | None = None, **kwargs: Any) -> list[CheckMessage]:
    """E004: the dotted paths of NOTIFIER, WAKER, BATCH_WAKER and NOTIFICATION_ENQUEUER import a callable."""
    messages: list[CheckMessage] = []
    for name in HOOKS:
        path = _value(name)
        if not path and name in OPTIONAL_HOOKS:
            continue
        try:
            target = import_string(path)
        except Exception as exc:  # noqa: BLE001 - importing user code may raise anything; report it all
            problem = f"does not import: {type(exc).__name__}: {exc}"
        else:
            if callable(target):
                continue
            problem = f"is not callable (it is a {type(target).__name__})"
        messages.append(
            Error(
                f"{_key(name)} = {path!r} {problem}",
                hint=f"Give the dotted path of an importable callable, e.g. the default {SETTINGS[name].default!r}.",
                id="durable_agents.E004",
            )
        )
    return messages


@_never_raises
def check_default_participant(app_configs: Sequence[Any] | None = None, **kwargs: Any) -> list[CheckMessage]:
    """E005: DEFAULT_PARTICIPANT is "anthropic" or registered (workflows modules register theirs in ready())."""
    name = _value("DEFAULT_PARTICIPANT")
    known = participants.names()
    if name in known:
        return []
    near = difflib.get_close_matches(name, known, n=1)
    return [
        Error(
            f"{_key('DEFAULT_PARTICIPANT')} = {name!r} is not a registered participant "
            f"(registered: {', '.join(known)})",
            hint=(f"Did you mean {near[0]!r}? " if near else "")
            + "Register it with participants.register(name, participant) in an installed app's workflows module, "
            'or use "anthropic".',
            id="durable_agents.E005",
        )
    ]


@_never_raises
def check_result_storage(app_configs: Sequence[Any] | None = None, **kwargs: Any) -> list[CheckMessage]:
    """E006: RESULT_STORAGE, when set, names an entry of STORAGES."""
    alias = _value("RESULT_STORAGE")
    storages = getattr(django_settings, "STORAGES", {})
    if alias is None or (isinstance(storages, dict) and alias in storages):
        return []
    return [
        Error(
            f"{_key('RESULT_STORAGE')} = {alias!r} is not a key of STORAGES: large step results could not be stored",
            hint=f'Add STORAGES[{alias!r}] = {{"BACKEND": ...}} (a storage every worker shares), '
            "or set RESULT_STORAGE to None to keep them in the database.",
            id="durable_agents.E006",
        )
    ]


@_never_raises
def check_retention(app_configs: Sequence[Any] | None = None, **kwargs: Any) -> list[CheckMessage]:
    """E011-E012: RETENTION's statuses and ages parse; RETENTION_ARCHIVE, when set, names an entry of STORAGES."""
    messages: list[CheckMessage] = []
    try:
        load_policy(_value("RETENTION"))
    except InvalidInputError as exc:
        hint = 'e.g. {"default": {"completed": "30d", "failed": "180d", "cancelled": "30d"}}'
        messages.append(Error(f"{_key('RETENTION')}: {exc}", hint=hint, id="durable_agents.E011"))
    alias = _value("RETENTION_ARCHIVE")
    storages = getattr(django_settings, "STORAGES", {})
    if alias is not None and not (isinstance(storages, dict) and alias in storages):
        messages.append(
            Error(
                f"{_key('RETENTION_ARCHIVE')} = {alias!r} is not a key of STORAGES: no pruned run could be archived, "
                "so none is deleted",
                hint=f'Add STORAGES[{alias!r}] = {{"BACKEND": ...}}, or set RETENTION_ARCHIVE to None (no archive).',
                id="durable_agents.E012",
            )
        )
    return messages


@_never_raises
def check_sweep_schedule(app_configs: Sequence[Any] | None = None, **kwargs: Any) -> list[CheckMessage]:
    """W001: celery beat schedules the sweep, the only thing that finds runs whose wake-up message was lost."""
    if getattr(django_settings, "CELERY_BEAT_SCHEDULER", None):
        return []  # a database scheduler (django-celery-beat) keeps its schedule where a check cannot read it
    schedule = getattr(django_settings, "CELERY_BEAT_SCHEDULE", None)
    entries = schedule.values() if isinstance(schedule, dict) else []
    sweeps = [entry for entry in entries if isinstance(entry, dict) and entry.get("task") == SWEEP_TASK]
    if sweeps:
        return _sweep_queue(sweeps)
    return [
        Warning(
            f"No {SWEEP_TASK!r} task in CELERY_BEAT_SCHEDULE: a run whose Celery message was lost, or whose worker "
            "died, is never woken again, and wait deadlines and reminders never fire.",
            hint='Add CELERY_BEAT_SCHEDULE = {"durable-agents-sweep": {"task": "durable_agents.sweep", '
            '"schedule": timedelta(seconds=5), "options": {"expires": 30}}} and run exactly one `celery beat`; '
            "if beat is scheduled elsewhere, add this id to SILENCED_SYSTEM_CHECKS.",
            id="durable_agents.W001",
        )
    ]


def _sweep_queue(sweeps: list[dict[str, Any]]) -> list[CheckMessage]:
    """W008: with QUEUE set, the durable workers may serve only that queue; a sweep sent to Celery's default
    queue would then wait for a worker that never comes."""
    configured = getattr(django_settings, "DURABLE_AGENTS", None)
    queue = configured.get("QUEUE") if isinstance(configured, dict) else None
    if not isinstance(queue, str) or not queue:
        return []
    options = [entry.get("options") if isinstance(entry.get("options"), dict) else {} for entry in sweeps]
    # An entry that names no queue goes over the product's routes (CELERY_TASK_ROUTES), like any message.
    destinations = [_queue_name(o["queue"]) if "queue" in o else _routed_queue(SWEEP_TASK) for o in options]
    if queue in destinations:
        return []
    return [
        Warning(
            f"DURABLE_AGENTS['QUEUE'] is {queue!r}, but beat sends {SWEEP_TASK!r} to another queue: unless a worker "
            "serves that one, lost runs are never woken again.",
            hint=f'Add "queue": {queue!r} to the sweep entry\'s "options" in CELERY_BEAT_SCHEDULE.',
            id="durable_agents.W008",
        )
    ]


def _queue_name(queue: Any) -> Any:
    """A queue's name, given as a name or a kombu Queue."""
    return getattr(queue, "name", queue)


def _routed_queue(task: str) -> Any:
    """The queue CELERY_TASK_ROUTES send `task` to, as Celery's router reads them; None if none says."""
    try:
        for router in routes.prepare(getattr(django_settings, "CELERY_TASK_ROUTES", None)):
            route = router(task, (), {}, {}, task=None)
            if route:
                return _queue_name(route.get("queue") if isinstance(route, dict) else route)
    except Exception:  # noqa: BLE001 - a router of the product's that fails here is not this check's to report
        return None
    return None


@_never_raises
def check_queues(app_configs: Sequence[Any] | None = None, **kwargs: Any) -> list[CheckMessage]:
    """E009: with CELERY_TASK_CREATE_MISSING_QUEUES off, QUEUE, MODEL_QUEUE and NOTIFY_QUEUE are declared queues.

    Celery then refuses to send to any other (QueueNotFound): every wake-up, the sweep's too, would fail to send.
    """
    if getattr(django_settings, "CELERY_TASK_CREATE_MISSING_QUEUES", True) is not False:
        return []
    declared = getattr(django_settings, "CELERY_TASK_QUEUES", None) or ()
    names = set(declared) if isinstance(declared, dict) else {getattr(q, "name", q) for q in declared}
    if not names:  # Celery declares its default queue alone
        names = {getattr(django_settings, "CELERY_TASK_DEFAULT_QUEUE", None) or "celery"}
    return [
        Error(
            f"{_key(name)} = {_value(name)!r} is not in CELERY_TASK_QUEUES, and CELERY_TASK_CREATE_MISSING_QUEUES is "
            "off: Celery refuses to send there, so those messages never leave and the runs stop.",
            hint=f"Add Queue({_value(name)!r}) to CELERY_TASK_QUEUES (and start a worker with --queues "
            f"{_value(name)}), or set {_key(name)} to a declared queue.",
            id="durable_agents.E009",
        )
        for name in QUEUES
        if _value(name) and _value(name) not in names
    ]


@_never_raises
def check_serializer(app_configs: Sequence[Any] | None = None, **kwargs: Any) -> list[CheckMessage]:
    """E008, W002: workers accept JSON (durable_agents' tasks carry ids only, as JSON), and Celery neither sends nor
    accepts pickle."""
    serializer = getattr(django_settings, "CELERY_TASK_SERIALIZER", "json")
    accepted = getattr(django_settings, "CELERY_ACCEPT_CONTENT", ["json"])
    # Celery takes any iterable of names or content types (kombu's prepare_accept_content); None accepts anything.
    accepted = JSON | PICKLE if accepted is None else accepted
    accepted = [accepted] if isinstance(accepted, str) else accepted if isinstance(accepted, Iterable) else []
    accepted = {a for a in accepted if isinstance(a, str)}
    messages: list[CheckMessage] = []
    if not JSON.intersection(accepted):
        messages.append(
            Error(
                f"CELERY_ACCEPT_CONTENT = {sorted(accepted)!r} does not accept JSON: workers refuse and drop every "
                "durable_agents message (and the sweep's), so no run ever progresses.",
                hint='Add "json" to CELERY_ACCEPT_CONTENT (durable_agents\' tasks send ids only, as JSON, whatever '
                "CELERY_TASK_SERIALIZER says).",
                id="durable_agents.E008",
            )
        )
    sends_pickle = isinstance(serializer, str) and serializer in PICKLE
    if not sends_pickle and not PICKLE.intersection(accepted):
        return messages
    return messages + [
        Warning(
            "Celery is set to send or accept pickle (CELERY_TASK_SERIALIZER / CELERY_ACCEPT_CONTENT): a worker "
            "then runs whatever code a message on the broker carries.",
            hint='durable_agents\' tasks take ids only: set CELERY_TASK_SERIALIZER = "json" and '
            'CELERY_ACCEPT_CONTENT = ["json"].',
            id="durable_agents.W002",
        )
    ]


@_never_raises
def check_database(app_configs: Sequence[Any] | None = None, **kwargs: Any) -> list[CheckMessage]:
    """W003 (deploy): production runs on Postgres; SQLite is the embedded default of the demo."""
    databases = getattr(django_settings, "DATABASES", {})
    default = databases.get("default") if isinstance(databases, dict) else None
    engine = str(default.get("ENGINE", "")) if isinstance(default, dict) else ""
    if "sqlite" not in engine or django_settings.DEBUG:
        return []
    return [
        Warning(
            "The default database is SQLite with DEBUG off. SQLite is the embedded demo default: it has one writer "
            "at a time and no SELECT ... FOR UPDATE SKIP LOCKED, so workers queue behind each other.",
            hint="Set DATABASE_URL (DATABASES['default']) to PostgreSQL, the database the guarantees are proven on.",
            id="durable_agents.W003",
        )
    ]


@_never_raises
def check_base_url(app_configs: Sequence[Any] | None = None, **kwargs: Any) -> list[CheckMessage]:
    """W004: decision links sent to approvers start with BASE_URL, so it must be the site's public address."""
    if django_settings.DEBUG or not (_value("APPROVERS") or _value("WEBHOOK_URL")):
        return []
    base = _value("BASE_URL")
    if _is_public(base):
        return []
    return [
        Warning(
            f"{_key('BASE_URL')} is {base!r} while approval notifications go out (APPROVERS or WEBHOOK_URL is set): "
            "the decision links in them would point at this machine, not at your site.",
            hint='Set DURABLE_AGENTS["BASE_URL"] to the address approvers reach the site at, '
            'e.g. "https://ops.example.com".',
            id="durable_agents.W004",
        )
    ]


def _is_public(url: str) -> bool:
    try:
        parts = urlsplit(url)
        host = parts.hostname
    except ValueError:  # e.g. "http://[::1": not a URL a link could start with
        return False
    return parts.scheme in ("http", "https") and bool(host) and host not in LOCAL_HOSTS


@_never_raises
def check_decision_links(app_configs: Sequence[Any] | None = None, **kwargs: Any) -> list[CheckMessage]:
    """W005, W007, E015: decision links resolve, and so does the login page they send a signed-out approver to."""
    try:
        reverse("durable_agents:decide_wait", kwargs={"wait_id": 1, "token": "t"})
    except NoReverseMatch:
        hint = 'Add path("durable/", include("durable_agents.urls")) to your urlpatterns.'
        asking = _who_asks_for_approvals()
        if asking:
            return [
                Error(
                    f"durable_agents.urls is not included in ROOT_URLCONF, and {asking} ask people for approvals: "
                    "no decision link can be made, so no approval request, reminder or escalation is sent.",
                    hint=f"{hint} (To decide in the admin and by command only, add 'durable_agents.E015' to "
                    "SILENCED_SYSTEM_CHECKS: each request is then failed, visibly, and its wait stays open.)",
                    id="durable_agents.E015",
                )
            ]
        return [
            Warning(
                "durable_agents.urls is not included in ROOT_URLCONF: no decision link can be made, so an "
                "approval notification could not be sent.",
                hint=hint,
                id="durable_agents.W007",
            )
        ]
    login_url = str(getattr(django_settings, "LOGIN_URL", "") or "")
    if _leads_somewhere(login_url):
        return []
    return [
        Warning(
            f"LOGIN_URL = {login_url!r} matches no URL pattern: an approver who is not signed in and clicks a decision "
            "link is sent there (the page requires a login) and lands on a 404.",
            hint='Set LOGIN_URL = "admin:login" (the admin\'s login page admits staff users only: make approvers '
            'staff), or include django.contrib.auth.urls, e.g. path("accounts/", include("django.contrib.auth.urls")).',
            id="durable_agents.W005",
        )
    ]


def _who_asks_for_approvals() -> str:
    """What in this project asks people for approvals (for a message), or "" if nothing does: an approval step, a
    tool marked needs_approval (an agent's, or a registered one a planner may call), or notifications configured
    to go out (APPROVERS, WEBHOOK_URL)."""
    asking: list[str] = []
    for name in registry.names():
        for version in registry.versions(name):
            definition = registry.get(name, version)
            for step in definition.steps:
                spec = step.options.get("agent")
                if step.kind == StepKind.APPROVAL or any(_needs_approval(t) for t in getattr(spec, "tools", ())):
                    asking.append(f"{definition.label} step {step.name!r}")
    asking += [f"tool {name!r}" for name in tools.names() if _needs_approval(tools.get(name))]
    asking += [_key(name) for name in ("APPROVERS", "WEBHOOK_URL") if _value(name)]
    more = f" (and {len(asking) - 3} more)" if len(asking) > 3 else ""
    return f"{', '.join(asking[:3])}{more}" if asking else ""


def _needs_approval(tool: Tool[..., Any]) -> bool:
    # A predicate may say no to some arguments, but it may say yes: the links are needed.
    return bool(tool.effectful and tool.needs_approval)


def _leads_somewhere(login_url: str) -> bool:
    """True if LOGIN_URL is another site's address, a URL pattern's name, or a path this site serves."""
    if not login_url:
        return False
    if "://" in login_url or login_url.startswith("//"):
        return True  # a single sign-on service elsewhere: not ours to resolve
    try:
        reverse(login_url)
    except NoReverseMatch:
        pass
    else:
        return True
    try:
        path = urlsplit(login_url).path
    except ValueError:
        return False
    prefix = str(getattr(django_settings, "FORCE_SCRIPT_NAME", "") or "").rstrip("/")
    if prefix and path.startswith(prefix + "/"):
        path = path[len(prefix) :]
    if not path.startswith("/"):
        return False
    try:
        resolve(path)
    except Resolver404:
        return False
    return True


@_never_raises
def check_anthropic_key(app_configs: Sequence[Any] | None = None, **kwargs: Any) -> list[CheckMessage]:
    """W006 (deploy): steps that ask Claude find an API key in the environment (the SDK reads it from there)."""
    if os.environ.get("ANTHROPIC_API_KEY") or os.environ.get("ANTHROPIC_AUTH_TOKEN"):
        return []
    asking = _steps_asking_claude_label()
    if not asking:
        return []
    return [
        Warning(
            f"{asking} ask Claude, and ANTHROPIC_API_KEY is not set: those steps will fail with "
            "an authentication error.",
            hint="Set ANTHROPIC_API_KEY in the environment of every worker (it is never stored), "
            "or give those steps a registered participant.",
            id="durable_agents.W006",
        )
    ]


@_never_raises
def check_anthropic_sdk(app_configs: Sequence[Any] | None = None, **kwargs: Any) -> list[CheckMessage]:
    """E007: steps that ask Claude can import the SDK (an optional extra of the package)."""
    if importlib.util.find_spec("anthropic") is not None:
        return []
    asking = _steps_asking_claude_label()
    if not asking:
        return []
    return [
        Error(
            f"{asking} ask Claude, and the anthropic SDK is not installed: those steps fail.",
            hint='pip install "durable-agents[anthropic]", or give those steps a registered participant.',
            id="durable_agents.E007",
        )
    ]


@_never_raises
def check_tracing(app_configs: Sequence[Any] | None = None, **kwargs: Any) -> list[CheckMessage]:
    """E016, W013: traces need the OpenTelemetry API (an optional extra), and a trace link needs the trace's id.

    The API is looked for only with TRACING on: off, nothing of OpenTelemetry is imported, this check included.
    """
    messages: list[CheckMessage] = []
    if _value("TRACING") and not _importable(OTEL_API):
        messages.append(
            Error(
                f"{_key('TRACING')} is on, and the OpenTelemetry API (opentelemetry-api) is not installed: every "
                "step would fail starting its span.",
                hint='pip install "durable-agents[otel]" (and an SDK to export the spans, e.g. opentelemetry-sdk), '
                f"or set {_key('TRACING')} = False.",
                id="durable_agents.E016",
            )
        )
    url = _value("TRACE_URL")
    if url and "{trace_id}" not in url:
        messages.append(
            Warning(
                f"{_key('TRACE_URL')} is {url!r}, with no {{trace_id}}: every run page would link to that one page.",
                hint='Put "{trace_id}" where the viewer takes a trace id, e.g. "http://jaeger:16686/trace/{trace_id}".',
                id="durable_agents.W013",
            )
        )
    return messages


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package is missing
        return False


@_never_raises
def check_rate_limit_backend(app_configs: Sequence[Any] | None = None, **kwargs: Any) -> list[CheckMessage]:
    """E010: the shared rate limits live in Postgres or in a Redis the URL names."""
    backend = _value("RATE_LIMIT_BACKEND")
    if backend == "postgres" or urlsplit(backend).scheme in REDIS_SCHEMES:
        return []
    return [
        Error(
            f"{_key('RATE_LIMIT_BACKEND')} is {backend!r}: the model rate limits cannot be shared.",
            hint='Write "postgres", or a Redis URL every worker reaches, e.g. "redis://127.0.0.1:6379/0".',
            id="durable_agents.E010",
        )
    ]


@_never_raises
def check_models(app_configs: Sequence[Any] | None = None, **kwargs: Any) -> list[CheckMessage]:
    """E013, E014, W009: the model table's additions are profiles, and every step asking Claude asks what its model
    takes (a scripted or function participant is not held to a model's rules)."""
    configured = getattr(django_settings, "DURABLE_AGENTS", {})
    if not isinstance(configured, dict) or any(
        SETTINGS[name].problem(configured[name]) for name in ("MODELS", "DEFAULT_MODEL") if name in configured
    ):
        return []  # E001 or E003 says what to fix first; the model table cannot be read until then
    messages: list[CheckMessage] = []
    table = _value("MODELS")
    for model, overrides in table.items() if isinstance(table, dict) else ():
        for problem in problems(overrides) if isinstance(overrides, dict) else ["must be a dict of profile fields"]:
            messages.append(
                Error(
                    f"{_key('MODELS')}[{model!r}]: {problem}",
                    hint="See the model table (docs/explanation/claude-today.md) for the fields and their values.",
                    id="durable_agents.E013",
                )
            )
    if messages:
        return messages
    unknown: set[str] = set()
    for definition, step in _steps_asking_claude():
        choice: ModelChoice | None = step.options.get("model_choice")
        if choice is None:
            continue
        problem = choice.problem()
        if problem is not None:
            messages.append(
                Error(
                    f"{definition.label} step {step.name!r}: {problem}",
                    hint="Change the step's thinking=, effort= or max_tokens=, or its model "
                    "(every run of it would fail with a 400 from the API).",
                    id="durable_agents.E014",
                )
            )
        for model in (choice.resolved_model, choice.fallback_model):
            if model and not model_profile(model).known and model not in unknown:
                unknown.add(model)
                messages.append(
                    Warning(
                        f"{definition.label} step {step.name!r} asks {model!r}, which the model table does not "
                        "know: its requests follow the conservative profile (thinking on, no prefill, no forced "
                        "tool choice).",
                        hint=f"Check the model id, or describe it in {_key('MODELS')}.",
                        id="durable_agents.W009",
                    )
                )
    return messages


def _steps_asking_claude_label() -> str:
    """The steps that ask Claude, for a message: the first three named, the rest counted; "" if none."""
    asking = [f"{definition.label} step {step.name!r}" for definition, step in _steps_asking_claude()]
    more = f" (and {len(asking) - 3} more)" if len(asking) > 3 else ""
    return f"{', '.join(asking[:3])}{more}" if asking else ""


def _steps_asking_claude() -> Iterator[tuple[Workflow, StepDef]]:
    default = _value("DEFAULT_PARTICIPANT")
    for name in registry.names():
        for version in registry.versions(name):
            definition = registry.get(name, version)
            for step in definition.steps:
                if step.kind not in MODEL_KINDS:
                    continue
                spec = step.options.get("agent")
                chosen = spec.participant if spec is not None else step.options.get("participant")
                if (chosen or default) == ANTHROPIC:
                    yield definition, step


@_never_raises
def check_delayed_delivery(app_configs: Sequence[Any] | None = None, **kwargs: Any) -> list[CheckMessage]:
    """W010, W011: on RabbitMQ, workers consume the durable queues, and no countdown takes a worker's prefetch slot."""
    messages: list[CheckMessage] = []
    queue = quorum_queue_refusing_global_qos()
    if queue:
        messages.append(
            Warning(
                f"CELERY_WORKER_DETECT_QUORUM_QUEUES is off and {queue!r} is a quorum queue: workers ask RabbitMQ for "
                "global QoS, which quorum queues refuse (NOT_IMPLEMENTED), so they consume nothing.",
                hint="Remove CELERY_WORKER_DETECT_QUORUM_QUEUES = False (Celery's default is True).",
                id="durable_agents.W011",
            )
        )
    countdown = float(_value("MAX_COUNTDOWN_SECONDS"))
    if countdown <= 0 or _value("WAKER") != SETTINGS["WAKER"].default:
        return messages  # no countdown is sent, or a WAKER of the product's own sends it (its own business)
    destinations = [_value("QUEUE") or None, _value("MODEL_QUEUE") or None]
    for held in countdowns_holding_a_slot(destinations if destinations[1] else destinations[:1]):
        messages.append(
            Warning(
                f"RabbitMQ queue {held.queue!r} is on the direct exchange {held.exchange!r} beside quorum queues: "
                "Celery cannot delay a message there natively, so a worker holds each retry's countdown (up to "
                f"MAX_COUNTDOWN_SECONDS, {countdown:g} s) in its only prefetch slot until it is due, and runs "
                "nothing else meanwhile.",
                hint='Put the queue on a topic exchange (CELERY_TASK_DEFAULT_EXCHANGE_TYPE = "topic", with an '
                "exchange name RabbitMQ does not know yet: it refuses to change an exchange's type), or set "
                f"{_key('MAX_COUNTDOWN_SECONDS')} = 0 so that every delay waits for the sweep instead.",
                id="durable_agents.W010",
            )
        )
    return messages


@_never_raises
def check_connection_loss(app_configs: Sequence[Any] | None = None, **kwargs: Any) -> list[CheckMessage]:
    """W012: a broker connection that drops while steps run costs a `Couldn't ack` and a redelivery that runs
    nothing, unless workers are told to stop every late-acked task in flight (then each runs again)."""
    if not cancels_steps_on_connection_loss():
        return []
    return [
        Warning(
            "CELERY_WORKER_CANCEL_LONG_RUNNING_TASKS_ON_CONNECTION_LOSS is on: a broker blip stops every step in "
            "flight; each runs again from its checkpoint, and a model answer not yet journaled is asked for (and "
            "billed) again. Off, the step commits and its redelivered message finds it committed and runs nothing.",
            hint="Set CELERY_WORKER_CANCEL_LONG_RUNNING_TASKS_ON_CONNECTION_LOSS = False (Celery 5's default).",
            id="durable_agents.W012",
        )
    ]


@_never_raises
def check_broker_folders(app_configs: Sequence[Any] | None = None, **kwargs: Any) -> list[CheckMessage]:
    """E020: kombu's filesystem:// broker creates none of its message folders; a worker dies on a missing one."""
    missing = missing_filesystem_folders()
    if not missing:
        return []
    folders = " ".join(shlex.quote(folder) for _, folder in missing)
    return [
        Error(
            "CELERY_BROKER_URL is filesystem:// and these folders do not exist: "
            + ", ".join(f"{option} {folder!r}" for option, folder in missing)
            + ". A worker would die on its first poll.",
            hint=f"Create them (mkdir -p {folders}), or set CELERY_BROKER_TRANSPORT_OPTIONS to folders that exist.",
            id="durable_agents.E020",
        )
    ]


@_never_raises
def check_declared_schedules(app_configs: Sequence[Any] | None = None, **kwargs: Any) -> list[CheckMessage]:
    """E017-E018: each declared schedule names a registered workflow, a valid cron, time zone and options, once."""
    return [
        Error(problem.message, hint=problem.hint, id="durable_agents.E018")
        if problem.twice
        else Error(problem.message, hint=problem.hint, id="durable_agents.E017")
        for problem in declarations().problems
    ]


@_never_raises
def check_declared_collisions(
    app_configs: Sequence[Any] | None = None, databases: Sequence[str] | None = None, **kwargs: Any
) -> list[CheckMessage]:
    """E019 (a database check): no declared schedule's name is held by one `api.schedule` made."""
    if not databases or "default" not in databases:
        return []
    declared = {d.name: d.where for d in declarations().valid}
    try:
        taken = colliding(declared)
    except DatabaseError:
        return []  # not migrated yet (`migrate` runs the database checks first): nothing can collide
    return [
        Error(
            f"schedule {name!r} is declared ({declared[name]}) and was also made with api.schedule: the sweep "
            "leaves the api.schedule one as it is and does not apply the declaration",
            hint=f"Rename the declaration, or delete the other one (manage.py durable_schedules delete {name}) "
            "so the next sweep creates the declared one.",
            id="durable_agents.E019",
        )
        for name in taken
    ]


CHECKS: tuple[Check, ...] = (
    check_settings,
    check_hooks,
    check_default_participant,
    check_result_storage,
    check_retention,
    check_sweep_schedule,
    check_queues,
    check_delayed_delivery,
    check_connection_loss,
    check_broker_folders,
    check_serializer,
    check_base_url,
    check_decision_links,
    check_anthropic_sdk,
    check_tracing,
    check_rate_limit_backend,
    check_models,
    check_declared_schedules,
)
DATABASE_CHECKS: tuple[Check, ...] = (check_declared_collisions,)
DEPLOY_CHECKS: tuple[Check, ...] = (check_database, check_anthropic_key)

"""The system checks fire on each misconfiguration with their id and a hint, stay silent on a good one, never raise."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.core.checks import ERROR, run_checks
from django.test import override_settings

from durable_agents import checks, preflight
from durable_agents.agents.loop import agent
from durable_agents.conf import SETTINGS
from durable_agents.tools import ToolRegistry, tool
from durable_agents.waits import approval
from durable_agents.workflows import Registry, Workflow, call

ROOT = Path(__file__).resolve().parents[2]
SWEEP = {"sweep": {"task": "durable_agents.sweep", "schedule": 5.0}}
NOT_CALLABLE = {"a": "dict"}


def durable_messages(deploy: bool = False) -> list:
    return [m for m in run_checks(tags=["durable_agents"], include_deployment_checks=deploy) if m.id]


def ids(deploy: bool = False) -> list[str]:
    return sorted(m.id for m in durable_messages(deploy))


def test_checks__the_repository_configuration_passes_them():
    messages = durable_messages(deploy=False)
    assert not messages, f"tests.settings (on project/settings.py) trips the checks: {messages}"


@pytest.mark.parametrize(
    ("settings_module", "broker"),
    [
        ("project.settings", ""),
        ("project.settings", "amqp://guest:guest@rabbitmq.invalid:5672//"),  # its RabbitMQ configuration
        ("tests.settings", ""),
        ("tests.chaos.settings", ""),
    ],
)
def test_checks__manage_py_check_passes_for_each_settings_module(settings_module, broker, tmp_path):
    env = {"DJANGO_SETTINGS_MODULE": settings_module, "DURABLE_VAR_DIR": str(tmp_path)}
    result = _manage("check", env={**env, **({"CELERY_BROKER_URL": broker} if broker else {})})
    assert result.returncode == 0 and "durable_agents." not in result.stderr + result.stdout, (
        f"`manage.py check` with {settings_module} reports:\n{result.stdout}\n{result.stderr}"
    )


def test_checks__manage_py_check_fails_on_a_bad_setting_with_the_id_and_no_traceback(tmp_path):
    env = {
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "DURABLE_VAR_DIR": str(tmp_path),
        "DURABLE_TEST_SETTINGS": '{"LEASE_SECOND": 5, "APPROVERS": "ops@example.com", "WAKER": "nodot"}',
    }
    result = _manage("check", env=env)
    assert result.returncode != 0, f"a bad DURABLE_AGENTS passed `manage.py check`:\n{result.stderr}"
    expected_lines = ("durable_agents.E002", "Did you mean 'LEASE_SECONDS'?", "E003", "E004")
    for expected in expected_lines:
        assert expected in result.stderr, f"{expected!r} is missing from:\n{result.stderr}"
    assert "Traceback" not in result.stderr, f"a check raised instead of reporting:\n{result.stderr}"


def _manage(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=ROOT,
        env={**os.environ, "DJANGO_LOCAL_SECRET_KEY": "1", **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


# --- E001-E003: the DURABLE_AGENTS dict -------------------------------------------------------------------


@pytest.mark.parametrize("configured", [None, ["LEASE_SECONDS", 5], "LEASE_SECONDS=5", 5])
def test_check_settings__durable_agents_must_be_a_dict(configured):
    with override_settings(DURABLE_AGENTS=configured):
        assert ids() == ["durable_agents.E001"]


def test_check_settings__an_unknown_key_is_an_error_naming_the_nearest_known_one():
    with override_settings(DURABLE_AGENTS={"LEASE_SECOND": 5, "lease_seconds": 5, 7: 1}):
        messages = durable_messages()
    assert [m.id for m in messages] == ["durable_agents.E002"] * 3
    assert [m.hint for m in messages[:2]] == ["Did you mean 'LEASE_SECONDS'?"] * 2
    assert "declared in durable_agents/conf.py" in messages[2].hint


@pytest.mark.parametrize(
    ("name", "value", "hint"),
    [
        ("APPROVERS", "ops@example.com", "Write a list: ['ops@example.com']."),
        ("APPROVERS", ["ops@example.com", 7], "Set DURABLE_AGENTS['APPROVERS'] to list[str]"),
        ("LEASE_SECONDS", "15", "Write the number without quotes: 15."),
        ("LEASE_SECONDS", 0, "Set DURABLE_AGENTS['LEASE_SECONDS'] to float, > 0, <= 1e+09, e.g. its default 15.0"),
        ("LEASE_SECONDS", -3.0, "to float, > 0"),
        ("SWEEP_BATCH", 0, "to int, >= 1"),
        ("COMPACT_AT_PROMPT_TOKENS", "never", "to int | None, >= 1"),
        ("PROMPT_CACHE_TTL", "1 hour", "to '5m' | '1h' | None"),
        ("MODEL_PRICES", {"claude-x": "cheap"}, "to dict[str, tuple[float, float, float, float]"),
        ("APPROVAL_DEADLINE_SECONDS", 0, "to float | None, > 0"),
    ],
)
def test_check_settings__a_wrong_type_or_bound_is_an_error_with_a_fix(name, value, hint):
    with override_settings(DURABLE_AGENTS={name: value}):
        messages = durable_messages()
    assert [m.id for m in messages] == ["durable_agents.E003"], messages
    assert f"DURABLE_AGENTS[{name!r}]" in messages[0].msg
    assert hint in messages[0].hint, messages[0].hint


def test_check_settings__good_values_pass():
    good = {
        "LEASE_SECONDS": 30,
        "APPROVERS": ("ops@example.com",),
        "BASE_URL": "https://ops.example.com",
        "PROMPT_CACHE_TTL": None,
        "QUEUE": "durable",
    }
    sweep_on_its_queue = {"sweep": {**SWEEP["sweep"], "options": {"queue": "durable"}}}
    with override_settings(DURABLE_AGENTS=good, CELERY_BEAT_SCHEDULE=sweep_on_its_queue):
        assert ids() == []


class _Hostile:
    def __repr__(self) -> str:
        raise RuntimeError("no repr for you")


def _loop() -> list:
    loop: list = []
    loop.append(loop)
    return loop


HOSTILE = {
    "none": None,
    "nested-dicts": {"nested": {"deeper": [1, {"x": None}]}},
    "list": ["a", "list"],
    "no-dot": "nodot",
    "huge-int": 10**400,
    "inf": float("inf"),
    "bytes": b"bytes",
    "raising-repr": _Hostile(),
    "list-in-itself": _loop(),
}


@pytest.mark.parametrize("value", HOSTILE.values(), ids=HOSTILE.keys())
def test_checks__hostile_values_give_errors_never_a_traceback(value):
    """Every key at once holding the value: each check reports (E00x or nothing), none raises (W000)."""
    with override_settings(DURABLE_AGENTS=dict.fromkeys(SETTINGS, value)):
        messages = durable_messages(deploy=True)
    assert "durable_agents.W000" not in [m.id for m in messages], [m.msg for m in messages]
    wrong = {m.msg.split("]")[0] for m in messages if m.id == "durable_agents.E003"}
    accepted = {name for name, setting in SETTINGS.items() if setting.problem(value) is None}
    assert len(wrong) + len(accepted) == len(SETTINGS), f"unreported keys for {value!r}: {messages}"
    assert all(m.hint for m in messages), "every message tells what to do"


@pytest.mark.filterwarnings("ignore:Overriding setting DATABASES")
@pytest.mark.parametrize(
    "odd",
    [
        {"CELERY_TASK_SERIALIZER": ["pickle"], "CELERY_ACCEPT_CONTENT": None},
        {"CELERY_BEAT_SCHEDULE": {"sweep": {"task": ["durable_agents.sweep"]}}},
        {"STORAGES": None, "DURABLE_AGENTS": {"RESULT_STORAGE": "results"}},
        {"DATABASES": {"default": None}},
        {"LOGIN_URL": object()},
        {"FORCE_SCRIPT_NAME": 7},
    ],
    ids=["serializer-list", "task-list", "storages-none", "database-none", "login-object", "script-name-int"],
)
def test_checks__odd_django_settings_give_messages_never_a_traceback(odd):
    with override_settings(**odd):
        assert "durable_agents.W000" not in ids(deploy=True)


# --- E004-E006: hooks, participant, storage -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "path", "said"),
    [
        ("WAKER", "nodot", "doesn't look like a module path"),
        ("NOTIFIER", "durable_agents.notify.NoSuchNotifier", "does not define"),
        ("NOTIFICATION_ENQUEUER", "no_such_module.enqueue", "No module named 'no_such_module'"),
        ("WAKER", "tests.unit.test_checks.NOT_CALLABLE", "is not callable (it is a dict)"),
        ("NOTIFIER", "broken_on_import.Notifier", "RuntimeError: broken at import"),
        ("BATCH_WAKER", "no_such_module.wake_many", "No module named 'no_such_module'"),
    ],
)
def test_check_hooks__an_unimportable_or_uncallable_path_is_an_error(name, path, said, tmp_path, monkeypatch):
    (tmp_path / "broken_on_import.py").write_text("raise RuntimeError('broken at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with override_settings(DURABLE_AGENTS={name: path}):
        messages = durable_messages()
    assert [m.id for m in messages] == ["durable_agents.E004"], messages
    assert said in messages[0].msg and SETTINGS[name].default in messages[0].hint


def test_check_hooks__an_empty_batch_waker_means_none():
    with override_settings(DURABLE_AGENTS={"BATCH_WAKER": ""}):
        assert [m for m in durable_messages() if m.id == "durable_agents.E004"] == []


def test_check_hooks__the_defaults_and_the_tests_own_hooks_import():
    hooks = {"NOTIFIER": "tests.testapp.notifiers.RecordingWebhookNotifier", "WAKER": "durable_agents.tasks.wake"}
    with override_settings(DURABLE_AGENTS=hooks):
        assert ids() == []


def test_check_default_participant__an_unregistered_name_is_an_error():
    with override_settings(DURABLE_AGENTS={"DEFAULT_PARTICIPANT": "reviewr"}):
        messages = durable_messages()
    assert [m.id for m in messages] == ["durable_agents.E005"]
    assert "Did you mean 'reviewer'?" in messages[0].hint


@pytest.mark.parametrize("name", ["anthropic", "reviewer"])
def test_check_default_participant__anthropic_or_a_registered_name_passes(name):
    with override_settings(DURABLE_AGENTS={"DEFAULT_PARTICIPANT": name}):
        assert ids() == []


def test_check_result_storage__an_alias_missing_from_storages_is_an_error():
    with override_settings(DURABLE_AGENTS={"RESULT_STORAGE": "durable_results"}):
        assert ids() == ["durable_agents.E006"]
    storages = {"durable_results": {"BACKEND": "django.core.files.storage.InMemoryStorage"}}
    with override_settings(DURABLE_AGENTS={"RESULT_STORAGE": "durable_results"}, STORAGES=storages):
        assert ids() == []


# --- W001-W008: Celery, the database, links, the model --------------------------------------------------------


@pytest.mark.parametrize("schedule", [{}, None, {"other": {"task": "app.cleanup"}}, {"bad": None}, ["sweep"]])
def test_check_sweep_schedule__no_sweep_in_beat_is_a_warning(schedule):
    with override_settings(CELERY_BEAT_SCHEDULE=schedule):
        assert ids() == ["durable_agents.W001"]


def test_check_sweep_schedule__a_sweep_under_any_name_or_a_database_scheduler_passes():
    with override_settings(CELERY_BEAT_SCHEDULE={"every-5s": SWEEP["sweep"]}):
        assert ids() == []
    with override_settings(CELERY_BEAT_SCHEDULE={}, CELERY_BEAT_SCHEDULER="django_celery_beat.schedulers:Database"):
        assert ids() == []


def test_check_sweep_schedule__with_a_queue_of_its_own_the_sweep_must_go_there_too():
    sweep = {"task": "durable_agents.sweep", "schedule": 5.0, "options": {"expires": 30}}
    with override_settings(DURABLE_AGENTS={"QUEUE": "durable"}, CELERY_BEAT_SCHEDULE={"s": sweep}):
        (warning,) = durable_messages()
        assert warning.id == "durable_agents.W008" and "\"queue\": 'durable'" in warning.hint
    routed = {**sweep, "options": {"expires": 30, "queue": "durable"}}
    with override_settings(DURABLE_AGENTS={"QUEUE": "durable"}, CELERY_BEAT_SCHEDULE={"s": routed}):
        assert ids() == []
    with override_settings(DURABLE_AGENTS={"QUEUE": "durable"}, CELERY_BEAT_SCHEDULE={"s": {**sweep, "options": 3}}):
        assert ids() == ["durable_agents.W008"]


# --- W010-W011: delayed wake-ups on RabbitMQ (durable_agents/broker.py has the rules, with their sources) -----------

# Never connected to: the checks read the configuration only. Celery takes its broker from the CELERY_BROKER_URL
# environment variable before its settings (celery/app/utils.py Settings.broker_url), so the tests set both.
RABBITMQ_URL = "amqp://guest:guest@rabbitmq.invalid:5672//"
QUORUM = {"CELERY_TASK_DEFAULT_QUEUE_TYPE": "quorum"}
TOPIC = {"CELERY_TASK_DEFAULT_EXCHANGE": "durable", "CELERY_TASK_DEFAULT_EXCHANGE_TYPE": "topic"}


@pytest.fixture
def rabbitmq(monkeypatch):
    monkeypatch.setenv("CELERY_BROKER_URL", RABBITMQ_URL)
    with override_settings(CELERY_BROKER_URL=RABBITMQ_URL):
        yield


def own_waker(run_id: str, countdown: float | None = None, queue: str | None = None) -> None:
    """A WAKER of the product's own."""


def test_check_delayed_delivery__a_quorum_queue_on_a_direct_exchange_is_a_warning(rabbitmq):
    # Celery's docs ("Using RabbitMQ" > "Using Quorum Queues" > "Limitations"): with quorum queues, "ETA/Countdown
    # will block the worker when received until the ETA arrives"; native delayed delivery, which avoids it, skips
    # direct exchanges (celery/app/base.py send_task, kombu bind_queue_to_native_delayed_delivery_exchange). Celery's
    # default exchange is direct: the README's first RabbitMQ configuration did exactly this.
    with override_settings(**QUORUM):
        (warning,) = durable_messages()
    assert warning.id == "durable_agents.W010", warning
    assert "'celery'" in warning.msg and "direct" in warning.msg and "prefetch slot" in warning.msg
    assert "topic" in warning.hint and "MAX_COUNTDOWN_SECONDS'] = 0" in warning.hint


def test_check_delayed_delivery__the_model_queue_on_a_direct_exchange_of_its_own_is_a_warning(rabbitmq):
    from kombu import Exchange, Queue

    quorum = {"x-queue-type": "quorum"}
    queues = [
        Queue("celery", Exchange("durable", type="topic"), routing_key="celery", queue_arguments=quorum),
        Queue("durable-model", Exchange("durable-model", type="direct"), routing_key="durable-model"),
    ]
    with override_settings(CELERY_TASK_QUEUES=queues, DURABLE_AGENTS={"MODEL_QUEUE": "durable-model"}):
        (warning,) = durable_messages()
    assert warning.id == "durable_agents.W010" and "'durable-model'" in warning.msg, warning


@pytest.mark.parametrize(
    "changes",
    [
        TOPIC,  # delayed in RabbitMQ (native delayed delivery)
        {"CELERY_TASK_DEFAULT_EXCHANGE": "durable", "CELERY_TASK_DEFAULT_EXCHANGE_TYPE": "fanout"},  # the same
        {"CELERY_TASK_DEFAULT_QUEUE_TYPE": "classic"},  # global QoS: a held message does not take the slot
        {"DURABLE_AGENTS": {"MAX_COUNTDOWN_SECONDS": 0}},  # no countdown is ever sent
        {"DURABLE_AGENTS": {"WAKER": f"{__name__}.own_waker"}},  # the product's own waker sends it its own way
    ],
    ids=["topic", "fanout", "classic", "no-countdowns", "own-waker"],
)
def test_check_delayed_delivery__passes_where_no_worker_holds_a_countdown(rabbitmq, changes):
    with override_settings(**{**QUORUM, **changes}):
        assert ids() == []


@pytest.mark.parametrize("broker", ["redis://127.0.0.1:6379/0", "filesystem://", None])
def test_check_delayed_delivery__another_broker_passes(broker, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    for folder in ("data_in", "data_out", "control"):  # kombu's filesystem:// folders, relative (E020 wants them)
        (tmp_path / folder).mkdir()
    if broker:
        monkeypatch.setenv("CELERY_BROKER_URL", broker)
    else:
        monkeypatch.delenv("CELERY_BROKER_URL", raising=False)
    with override_settings(**QUORUM, CELERY_BROKER_URL=broker):
        assert ids() == []


def test_check_delayed_delivery__quorum_queues_without_quorum_detection_are_a_warning(rabbitmq):
    # A worker that does not detect its quorum queues asks for global QoS (celery/worker/consumer/tasks.py
    # qos_global), and RabbitMQ refuses to consume a quorum queue with it: "NOT_IMPLEMENTED - queue ... does not
    # support global qos" (RabbitMQ 3.10, tried on this machine).
    with override_settings(**QUORUM, **TOPIC, CELERY_WORKER_DETECT_QUORUM_QUEUES=False):
        (warning,) = durable_messages()
    assert warning.id == "durable_agents.W011" and "'celery'" in warning.msg, warning
    with override_settings(**QUORUM, **TOPIC, CELERY_WORKER_DETECT_QUORUM_QUEUES=True):
        assert ids() == []


# --- W012: a broker blip must not stop every step in flight ----------------------------------------------------------


@pytest.mark.parametrize("broker", [None, "redis://127.0.0.1:6379/0", RABBITMQ_URL])
def test_check_connection_loss__cancelling_steps_in_flight_is_a_warning_on_any_broker(broker, monkeypatch):
    # Celery's docs (Configuration, worker_cancel_long_running_tasks_on_connection_loss): on, the worker "kills all
    # long-running tasks with late acknowledgment enabled on connection loss", so one broker blip stops every step
    # in flight; each runs again from its checkpoint, and a model answer not yet journaled is paid for twice.
    if broker:
        monkeypatch.setenv("CELERY_BROKER_URL", broker)
    with override_settings(CELERY_BROKER_URL=broker, CELERY_WORKER_CANCEL_LONG_RUNNING_TASKS_ON_CONNECTION_LOSS=True):
        (warning,) = durable_messages()
    assert warning.id == "durable_agents.W012", warning
    assert "every step in flight" in warning.msg and "= False" in warning.hint
    with override_settings(CELERY_BROKER_URL=broker, CELERY_WORKER_CANCEL_LONG_RUNNING_TASKS_ON_CONNECTION_LOSS=False):
        assert ids() == []


@pytest.mark.parametrize(
    ("serializer", "accept"),
    [
        ("pickle", ["json"]),
        ("json", ["json", "pickle"]),
        ("json", "pickle"),
        ("json", ["application/x-python-serialize"]),
    ],
)
def test_check_serializer__pickle_is_a_warning(serializer, accept):
    # Accepting pickle only, workers also refuse the durable tasks' JSON: that is E008
    # (tests/unit/test_checks_against_stalled_runs.py).
    refuses_json = "json" not in accept
    with override_settings(CELERY_TASK_SERIALIZER=serializer, CELERY_ACCEPT_CONTENT=accept):
        assert ids() == ["durable_agents.E008"] * refuses_json + ["durable_agents.W002"]
    with override_settings(CELERY_TASK_SERIALIZER="json", CELERY_ACCEPT_CONTENT=["json"]):
        assert ids() == []


SQLITE = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": "db.sqlite3"}}
POSTGRES = {"default": {"ENGINE": "django.db.backends.postgresql", "NAME": "app"}}


@pytest.mark.filterwarnings("ignore:Overriding setting DATABASES")
def test_check_database__sqlite_without_debug_is_a_deploy_warning():
    with override_settings(DATABASES=SQLITE, DEBUG=False):
        assert ids(deploy=False) == []
        assert "durable_agents.W003" in ids(deploy=True)
    with override_settings(DATABASES=SQLITE, DEBUG=True):
        assert "durable_agents.W003" not in ids(deploy=True)
    with override_settings(DATABASES=POSTGRES, DEBUG=False):
        assert "durable_agents.W003" not in ids(deploy=True)


@pytest.mark.parametrize(
    "configured",
    [
        {"APPROVERS": ["ops@example.com"]},
        {"WEBHOOK_URL": "https://hooks.example.com/x"},
        {"APPROVERS": ["ops@example.com"], "BASE_URL": "http://localhost:8000"},
        {"APPROVERS": ["ops@example.com"], "BASE_URL": "ops.example.com"},
        {"APPROVERS": ["ops@example.com"], "BASE_URL": "http://[::1"},
    ],
)
def test_check_base_url__local_links_while_notifying_is_a_warning(configured):
    with override_settings(DURABLE_AGENTS=configured, DEBUG=False):
        messages = durable_messages()
    assert [m.id for m in messages] == ["durable_agents.W004"]
    assert "BASE_URL" in messages[0].hint


@pytest.mark.parametrize(
    ("configured", "debug"),
    [
        ({"APPROVERS": ["ops@example.com"], "BASE_URL": "https://ops.example.com"}, False),
        ({"APPROVERS": ["ops@example.com"]}, True),
        ({}, False),
    ],
)
def test_check_base_url__a_public_address_debug_or_no_notifications_pass(configured, debug):
    with override_settings(DURABLE_AGENTS=configured, DEBUG=debug):
        assert ids() == []


@pytest.mark.parametrize("login_url", ["/accounts/login/", "accounts:login", "", "login", None])
def test_check_decision_links__a_login_url_that_leads_nowhere_is_a_warning(login_url):
    with override_settings(LOGIN_URL=login_url):
        messages = durable_messages()
    assert [m.id for m in messages] == ["durable_agents.W005"]
    assert 'LOGIN_URL = "admin:login"' in messages[0].hint


@pytest.mark.parametrize("login_url", ["admin:login", "/admin/login/", "https://sso.example.com/login"])
def test_check_decision_links__a_login_url_that_resolves_passes(login_url):
    with override_settings(LOGIN_URL=login_url):
        assert ids() == []


@pytest.fixture
def asking_nobody(monkeypatch):
    """A project whose workflows ask no human: one plain step, no tool that needs an approval."""
    workflows = Registry()
    workflows.register(Workflow("plain", 1, (call("work", lambda ctx: None),)))
    monkeypatch.setattr(checks, "registry", workflows)
    monkeypatch.setattr(checks, "tools", ToolRegistry())
    return workflows


def test_check_decision_links__urls_not_included_is_a_warning_where_nobody_is_asked(asking_nobody):
    with override_settings(ROOT_URLCONF="django.contrib.auth.urls"):
        messages = durable_messages()
    assert [m.id for m in messages] == ["durable_agents.W007"]
    assert 'include("durable_agents.urls")' in messages[0].hint


def _refund(order: str, *, idempotency_key: str) -> str:
    """Refund an order."""
    return order


@pytest.mark.parametrize("asks", ["an approval step", "an agent's tool", "a registered tool", "APPROVERS"])
def test_check_decision_links__urls_not_included_is_an_error_where_approvals_are_asked_for(asking_nobody, asks):
    """Every run that reaches an approval needs its link: without durable_agents.urls, the project is broken."""
    refund = tool(effectful=True, needs_approval=True, registry=ToolRegistry())(_refund)
    durable = {}
    if asks == "an approval step":
        asking_nobody.register(Workflow("asks", 1, (approval("ok", question="Refund?"),)))
    elif asks == "an agent's tool":
        asking_nobody.register(Workflow("asks", 1, (agent("think", instructions="x", tools=[refund]),)))
    elif asks == "a registered tool":
        checks.tools.register(refund)
    else:
        durable = {"APPROVERS": ["ops@example.com"], "BASE_URL": "https://ops.example.com"}
    with override_settings(ROOT_URLCONF="django.contrib.auth.urls", DURABLE_AGENTS=durable):
        messages = [m for m in durable_messages() if m.id != "durable_agents.W009"]
    assert [m.id for m in messages] == ["durable_agents.E015"], f"{asks}: {messages}"
    assert messages[0].level >= ERROR
    assert 'include("durable_agents.urls")' in messages[0].hint


@pytest.fixture
def model_workflows(monkeypatch):
    """A registry of its own: one agent step naming no participant, one naming a registered one."""
    workflows = Registry()
    workflows.register(Workflow("asks_default", 1, (agent("think", instructions="Think."),)))
    workflows.register(Workflow("asks_reviewer", 1, (agent("think", instructions="x", participant="reviewer"),)))
    monkeypatch.setattr(checks, "registry", workflows)
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    monkeypatch.delenv("ANTHROPIC_AUTH_TOKEN", raising=False)
    return workflows


def test_check_anthropic_key__claude_steps_without_a_key_are_a_deploy_warning(model_workflows):
    assert ids(deploy=False) == []
    messages = [m for m in durable_messages(deploy=True) if m.id == "durable_agents.W006"]
    assert len(messages) == 1 and "asks_default@1 step 'think'" in messages[0].msg
    assert "asks_reviewer" not in messages[0].msg


def test_check_anthropic_key__a_key_or_another_default_participant_passes(model_workflows, monkeypatch):
    with override_settings(DURABLE_AGENTS={"DEFAULT_PARTICIPANT": "reviewer"}):
        assert "durable_agents.W006" not in ids(deploy=True)
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-ant-test")
    assert "durable_agents.W006" not in ids(deploy=True)


def test_check_anthropic_sdk__claude_steps_without_the_sdk_are_an_error(model_workflows, monkeypatch):
    real_find_spec = checks.importlib.util.find_spec
    monkeypatch.setattr(
        checks.importlib.util, "find_spec", lambda name, *a: None if name == "anthropic" else real_find_spec(name, *a)
    )
    messages = [m for m in durable_messages() if m.id == "durable_agents.E007"]
    assert len(messages) == 1 and "asks_default@1 step 'think'" in messages[0].msg
    assert "durable-agents[anthropic]" in messages[0].hint
    with override_settings(DURABLE_AGENTS={"DEFAULT_PARTICIPANT": "reviewer"}):
        assert "durable_agents.E007" not in ids()


def test_checks__a_check_that_breaks_reports_instead_of_raising(monkeypatch):
    class Broken:
        def names(self) -> list[str]:
            raise RuntimeError("registry gone")

    monkeypatch.setattr(checks, "participants", Broken())
    messages = durable_messages()
    assert [m.id for m in messages] == ["durable_agents.W000"]
    assert "check_default_participant" in messages[0].msg and "registry gone" in messages[0].msg


def test_checks__errors_are_errors_and_warnings_warnings():
    with override_settings(DURABLE_AGENTS={"LEASE_SECOND": 1}, CELERY_BEAT_SCHEDULE={}):
        levels = {m.id: m.level >= ERROR for m in durable_messages()}
    assert levels == {"durable_agents.E002": True, "durable_agents.W001": False}


# --- Workers and beat run the checks as they start, and refuse to serve on an error -----------------------------


# LEASE_SECONDS as text, not -5: this process's lease renewer thread reads the setting live, and a negative one ends
# it (time.sleep). The workers' own tests (tests/integration/test_app_scoped_celery.py) start with -5.
def test_preflight__an_error_stops_the_process_with_one_line_each_and_what_to_do(caplog):
    with override_settings(DURABLE_AGENTS={"LEASE_SECONDS": "15", "LEASE_SECOND": 1}), pytest.raises(SystemExit) as out:
        preflight.check_before_serving("celery worker")
    assert out.value.code == preflight.EX_CONFIG, "a supervisor tells a bad configuration by its exit code (78)"
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("durable_agents")]
    errors = [line for line in lines if line.startswith("durable_agents.E")]
    assert [line.split(":")[0] for line in errors] == ["durable_agents.E003", "durable_agents.E002"], lines
    assert all("\n" not in line for line in lines), f"one line each: {lines}"
    assert "LEASE_SECONDS" in errors[0] and "HINT: Write the number without quotes: 15." in errors[0], errors[0]
    assert "celery worker refuses to start: 2 system check errors" in lines[-1], lines[-1]
    assert "DURABLE_AGENTS['WORKER_CHECKS'] = 'warn'" in lines[-1], "the last line names the override"


def test_preflight__warnings_are_logged_and_let_the_process_start(caplog):
    with override_settings(CELERY_BEAT_SCHEDULE={}):
        preflight.check_before_serving("celery worker")
    assert [r.levelname for r in caplog.records if "durable_agents.W001" in r.getMessage()] == ["WARNING"]


def test_preflight__a_silenced_error_lets_the_process_start_as_manage_py_does(caplog):
    with override_settings(DURABLE_AGENTS={"LEASE_SECOND": 1}, SILENCED_SYSTEM_CHECKS=["durable_agents.E002"]):
        preflight.check_before_serving("celery worker")
    assert not [r for r in caplog.records if "E002" in r.getMessage()], "a silenced check is not reported"


def test_preflight__the_override_starts_anyway_and_says_so_loudly(caplog):
    with override_settings(DURABLE_AGENTS={"LEASE_SECOND": 1, "WORKER_CHECKS": "warn"}):
        preflight.check_before_serving("celery worker")
    loud = [r for r in caplog.records if "WORKER_CHECKS" in r.getMessage()]
    assert len(loud) == 1 and loud[0].levelname == "ERROR", [r.getMessage() for r in caplog.records]
    assert "starts despite 1 system check error" in loud[0].getMessage(), loud[0].getMessage()


def test_preflight__a_bad_override_value_refuses(caplog):
    with override_settings(DURABLE_AGENTS={"WORKER_CHECKS": "ignore"}), pytest.raises(SystemExit):
        preflight.check_before_serving("celery worker")
    assert any("durable_agents.E003" in r.getMessage() and "WORKER_CHECKS" in r.getMessage() for r in caplog.records)


def test_preflight__celery_skip_checks_skips_them_and_says_so(caplog, monkeypatch):
    # `celery --skip-checks` sets CELERY_SKIP_CHECKS, and Celery's Django fixup then runs no check
    # (celery/bin/celery.py, celery/fixups/django.py DjangoWorkerFixup.validate_models).
    monkeypatch.setenv("CELERY_SKIP_CHECKS", "true")
    with override_settings(DURABLE_AGENTS={"LEASE_SECONDS": "15"}):
        preflight.check_before_serving("celery worker")
    said = [r.getMessage() for r in caplog.records if r.name.startswith("durable_agents")]
    assert len(said) == 1 and "skips the system checks" in said[0], said


def test_check_tracing__tracing_on_without_the_opentelemetry_api_is_an_error(monkeypatch):
    real_find_spec = checks.importlib.util.find_spec

    def find_spec(name, *args):
        if name.startswith("opentelemetry"):
            raise ModuleNotFoundError(f"No module named {name.split('.')[0]!r}", name=name.split(".")[0])
        return real_find_spec(name, *args)

    monkeypatch.setattr(checks.importlib.util, "find_spec", find_spec)
    with override_settings(DURABLE_AGENTS={"TRACING": True}):
        messages = [m for m in durable_messages() if m.id == "durable_agents.E016"]
    assert len(messages) == 1 and messages[0].level == ERROR, "TRACING on without the API: every span would fail"
    assert 'pip install "durable-agents[otel]"' in messages[0].hint
    assert "durable_agents.E016" not in ids(), "TRACING off: the API is not needed"


def test_check_tracing__the_opentelemetry_api_installed_passes():
    with override_settings(DURABLE_AGENTS={"TRACING": True}):
        assert "durable_agents.E016" not in ids()


def test_check_tracing__a_trace_url_without_the_trace_id_is_a_warning():
    with override_settings(DURABLE_AGENTS={"TRACE_URL": "http://jaeger:16686/search"}):
        messages = [m for m in durable_messages() if m.id == "durable_agents.W013"]
    assert len(messages) == 1 and "{trace_id}" in messages[0].hint
    with override_settings(DURABLE_AGENTS={"TRACE_URL": "http://jaeger:16686/trace/{trace_id}"}):
        assert "durable_agents.W013" not in ids()

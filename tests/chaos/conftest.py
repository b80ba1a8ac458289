"""Fixtures of the chaos suite: the fake Messages API playing the refund agent, chaos workers, brokers, logs."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.test.utils import override_settings

from durable_agents.testing.fake_anthropic import FakeAnthropic
from tests.chaos.fleet import API_KEY, DJANGO_SECRET_KEY
from tests.chaos.services import WAKE_BROKER_ENV, rabbit_vhost, require_rabbitmq
from tests.conftest import require_example_session

require_example_session()  # before the workload imports the example project's models

from tests.chaos.workload import Model  # noqa: E402
from tests.integration.tracing_helpers import spans  # noqa: E402, F401 - an in-memory SDK in the test process

SECRET_SCAN = "tests/chaos/test_secret_scan.py"


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """The secret scan reads the logs every chaos worker wrote, so it runs after all other tests."""
    scans = [item for item in items if item.nodeid.startswith(SECRET_SCAN)]
    if scans:
        items[:] = [item for item in items if not item.nodeid.startswith(SECRET_SCAN)] + scans


@pytest.fixture(scope="session")
def chaos_log_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where chaos workers write their logs, kept for the secret scan (and CI artifacts when set)."""
    if "DURABLE_TEST_ARTIFACTS" in os.environ:
        root = Path(os.environ["DURABLE_TEST_ARTIFACTS"]) / "chaos"
        root.mkdir(parents=True, exist_ok=True)
        return root
    return tmp_path_factory.mktemp("chaos-logs")


@pytest.fixture
def chaos_logs(chaos_log_root: Path, request: pytest.FixtureRequest) -> Path:
    folder = chaos_log_root / re.sub(r"[^\w.-]+", "_", request.node.name)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture
def model() -> Model:
    """The model's side: the refund script after a model-like pause; set `.fault` to inject failures."""
    return Model()


@pytest.fixture
def fake(model: Model) -> Iterator[FakeAnthropic]:
    with FakeAnthropic(responder=model) as server:
        yield server


@pytest.fixture
def chaos_env(worker_env: dict[str, str], fake: FakeAnthropic) -> dict[str, str]:
    """A chaos worker's environment: this test's database and broker, instrumented steps, the fake model."""
    return {
        **worker_env,
        **fake.environ(api_key=API_KEY),
        "DJANGO_SETTINGS_MODULE": "tests.chaos.settings",
        "DJANGO_SECRET_KEY": DJANGO_SECRET_KEY,
        "DURABLE_CHAOS_RECORD": "refund_agent",
    }


@pytest.fixture(params=["redis", "rabbitmq"])
def broker(request: pytest.FixtureRequest, broker_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The broker the workers consume from; the test process's wake-ups are published there too."""
    if request.param == "redis":
        yield broker_url
        return
    require_rabbitmq()
    with rabbit_vhost() as url:
        monkeypatch.setenv(WAKE_BROKER_ENV, url)
        with publishing_wakeups():
            yield url


def publishing_wakeups() -> override_settings:
    """Send the test process's wake-ups to DURABLE_CHAOS_WAKE_BROKER instead of its own broker."""
    from django.conf import settings

    return override_settings(DURABLE_AGENTS={**settings.DURABLE_AGENTS, "WAKER": "tests.chaos.services.wake"})

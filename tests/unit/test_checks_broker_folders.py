"""E020: kombu's filesystem:// broker creates none of its message folders, so a worker on a missing one dies.

kombu's filesystem transport (kombu/transport/filesystem.py, "Transport Options": data_folder_in, data_folder_out,
control_folder, processed_folder with store_processed) reads `os.listdir(data_folder_in)` on every poll and never
creates it: a worker started before `mkdir` dies with a FileNotFoundError traceback.
"""

from __future__ import annotations

import pytest
from django.test import override_settings

from durable_agents.checks import check_broker_folders


@pytest.fixture(autouse=True)
def filesystem_broker(monkeypatch):
    # Celery reads CELERY_BROKER_URL from the environment before the settings (as the suite's workers are told).
    monkeypatch.setenv("CELERY_BROKER_URL", "filesystem://")


def _options(base, **extra):
    return {
        "data_folder_in": str(base / "queue"),
        "data_folder_out": str(base / "queue"),
        "control_folder": str(base / "control"),
        **extra,
    }


def test_check_broker_folders__a_missing_folder_is_an_error_that_says_which_and_how(tmp_path):
    with override_settings(CELERY_BROKER_URL="filesystem://", CELERY_BROKER_TRANSPORT_OPTIONS=_options(tmp_path)):
        (error,) = check_broker_folders()
    assert error.id == "durable_agents.E020", error
    assert "data_folder_in" in error.msg and str(tmp_path / "queue") in error.msg
    assert f"mkdir -p {tmp_path / 'queue'}" in error.hint and str(tmp_path / "control") in error.hint


def test_check_broker_folders__existing_folders_pass(tmp_path):
    (tmp_path / "queue").mkdir()
    (tmp_path / "control").mkdir()
    with override_settings(CELERY_BROKER_URL="filesystem://", CELERY_BROKER_TRANSPORT_OPTIONS=_options(tmp_path)):
        assert check_broker_folders() == []


def test_check_broker_folders__the_processed_folder_counts_only_when_messages_are_kept(tmp_path):
    (tmp_path / "queue").mkdir()
    (tmp_path / "control").mkdir()
    kept = _options(tmp_path, store_processed=True, processed_folder=str(tmp_path / "processed"))
    with override_settings(CELERY_BROKER_URL="filesystem://", CELERY_BROKER_TRANSPORT_OPTIONS=kept):
        (error,) = check_broker_folders()
    assert "processed_folder" in error.msg
    dropped = {**kept, "store_processed": False}
    with override_settings(CELERY_BROKER_URL="filesystem://", CELERY_BROKER_TRANSPORT_OPTIONS=dropped):
        assert check_broker_folders() == []


def test_check_broker_folders__kombus_relative_defaults_are_checked_from_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with override_settings(CELERY_BROKER_URL="filesystem://", CELERY_BROKER_TRANSPORT_OPTIONS={}):
        (error,) = check_broker_folders()
    assert all(f"'{name}'" in error.msg for name in ("data_in", "data_out", "control")), error.msg
    for name in ("data_in", "data_out", "control"):
        (tmp_path / name).mkdir()
    with override_settings(CELERY_BROKER_URL="filesystem://", CELERY_BROKER_TRANSPORT_OPTIONS={}):
        assert check_broker_folders() == []


def test_check_broker_folders__other_brokers_are_not_its_business(monkeypatch):
    monkeypatch.setenv("CELERY_BROKER_URL", "redis://127.0.0.1:6379/0")
    with override_settings(CELERY_BROKER_URL="redis://127.0.0.1:6379/0"):
        assert check_broker_folders() == []

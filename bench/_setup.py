"""The set-up the benches share: the environment Django reads, a fresh database of their own, Django set up.

A bench imports it before anything of Django or the project, both when run as `python bench/x.py` (bench/ is
sys.path[0], the repository root is not on the path yet) and when imported as `bench.x` by another bench:

    try:
        from bench._setup import prepare
    except ModuleNotFoundError:  # run as `python bench/x.py`: the repository root is not on sys.path yet
        from _setup import prepare

    ROOT = prepare("durable_bench_x", "redis://127.0.0.1:6379/13", DURABLE_SWEEP_SECONDS="0.5")

    from durable_agents import api  # noqa: E402

`prepare` does it all at once; `configure` and `reset_database` are its halves, for the benches that set the
environment at import and make their database only in `main` (after parsing their options).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PSQL = ["psql", "-h", "127.0.0.1", "-U", "postgres", "-qc"]


def configure(db_name: str, broker: str | None = None, **env: str) -> Path:
    """Put the repository root on sys.path and set the environment the settings read; returns the root.

    DATABASE_URL names `db_name` on the local server, CELERY_BROKER_URL is `broker` (left as it is when None: the
    bench sends no task), DJANGO_SETTINGS_MODULE the project's settings, DJANGO_LOCAL_SECRET_KEY "1" (a random key
    for this machine, project/settings.py; a DJANGO_SECRET_KEY, when set, takes precedence) and DURABLE_LOG_LEVEL
    ERROR. `env` is set after those, so it overrides any of them (e.g. DJANGO_SETTINGS_MODULE, DATABASE_URL). The
    workers a bench starts inherit all of it.
    """
    sys.path.insert(0, str(ROOT))
    os.environ.update(
        DJANGO_SETTINGS_MODULE="project.settings",
        DJANGO_LOCAL_SECRET_KEY="1",
        DATABASE_URL=f"postgres://postgres@127.0.0.1:5432/{db_name}",
        DURABLE_LOG_LEVEL="ERROR",
    )
    if broker is not None:
        os.environ["CELERY_BROKER_URL"] = broker
    os.environ.update(env)
    return ROOT


def reset_database(db_name: str, env: Mapping[str, str] | None = None) -> None:
    """Drop and create database `db_name` on the local server, and migrate it (`manage.py migrate`, in a process
    of its own with `env`, by default this process's environment: Django is not set up here before it is made)."""
    subprocess.run([*PSQL, f"DROP DATABASE IF EXISTS {db_name}"], check=True, capture_output=True)  # its NOTICE
    subprocess.run([*PSQL, f"CREATE DATABASE {db_name}"], check=True)
    subprocess.run([sys.executable, "manage.py", "migrate", "-v0"], cwd=ROOT, env=env, check=True)


def prepare(db_name: str, broker: str | None = None, *, reset: bool = True, **env: str) -> Path:
    """`configure`, `reset_database` (unless `reset` is false: a bench reusing its database), then
    `django.setup()`; returns the repository root."""
    configure(db_name, broker, **env)
    if reset:
        reset_database(db_name)
    import django

    django.setup()
    return ROOT

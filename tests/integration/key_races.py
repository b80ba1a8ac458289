"""Two starts racing on one idempotency key: the winner commits while the loser's statement already runs.

The loser's snapshot cannot see the winner's run; its INSERT waits on the key's unique index for the winner's
transaction. `key_race` makes that happen for sure, with no sleep: the winner starts its run in a transaction of its
own thread and holds it open until Postgres shows the loser waiting on it (pg_blocking_pids), then commits.

    with key_race("noop", {"steps": 1}, "order-1") as race:
        loser = api.start("noop", {"steps": 1}, idempotency_key="order-1")
    assert loser.id == race.winner.id

Needs a transactional test (`django_db(transaction=True)`): the winner commits for real.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from django.db import connection, transaction

from durable_agents import api
from durable_agents.models import Run

WAIT_SECONDS = 60


class KeyRace:
    def __init__(self, workflow: str, run_input: Any, key: str) -> None:
        self.workflow, self.run_input, self.key = workflow, run_input, key
        self.winner: Run | None = None
        self.waited_on = False
        self.error: BaseException | None = None
        self._pid: int | None = None
        self._started = threading.Event()
        self._release = threading.Event()
        self._threads = [threading.Thread(target=self._win), threading.Thread(target=self._watch)]

    def _win(self) -> None:
        try:
            with transaction.atomic():
                self.winner = api.start(self.workflow, self.run_input, idempotency_key=self.key)
                with connection.cursor() as cursor:
                    cursor.execute("SELECT pg_backend_pid()")
                    self._pid = cursor.fetchone()[0]
                self._started.set()
                self._release.wait(WAIT_SECONDS)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            self.error = exc
        finally:
            self._started.set()
            connection.close()

    def _watch(self) -> None:
        """Commit the winner once another backend waits on its transaction (the loser's INSERT on the key)."""
        self._started.wait(WAIT_SECONDS)
        deadline = time.monotonic() + WAIT_SECONDS
        try:
            while not self._release.is_set() and time.monotonic() < deadline:
                with connection.cursor() as cursor:
                    cursor.execute(
                        "SELECT EXISTS (SELECT FROM pg_stat_activity WHERE %s = ANY(pg_blocking_pids(pid)))",
                        [self._pid],
                    )
                    if cursor.fetchone()[0]:
                        self.waited_on = True
                        break
                time.sleep(0.01)
        finally:
            self._release.set()
            connection.close()


@contextmanager
def key_race(workflow: str, run_input: Any, key: str) -> Iterator[KeyRace]:
    """A winner holding `key` uncommitted until the block's start waits on it (see the module's docstring)."""
    race = KeyRace(workflow, run_input, key)
    race._threads[0].start()
    race._started.wait(WAIT_SECONDS)
    race._threads[1].start()
    try:
        yield race
    finally:
        race._release.set()
        for thread in race._threads:
            thread.join(WAIT_SECONDS)
    if race.error is not None:
        raise race.error

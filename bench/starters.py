"""Starting work from several threads at once, as a web server's request threads would: each start its own transaction.

Standard library only: bench/dbos_steps.py imports it too, from DBOS's own virtualenv.

    with Starters(4, connect=lambda: connection.ensure_connection(), disconnect=lambda: connection.close()) as s:
        with meter:
            began = time.time()
            ids = s.run(500, lambda i: api.start("noop", {"steps": 1}).id)

The threads are made and `connect` is called in each (a connection made, so the timed part does not pay for it)
before `run` is called; `run` lets them all go at once and returns every start's result in order. `s.cpu` is the
CPU seconds the threads spent in `start`; `disconnect` runs in each thread as the block ends. Both are lambdas so
that `connection`, Django's per-thread proxy, is read in each starting thread, not in the one that made them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any


class Starters:
    """`threads` threads, each with its own connection, that start `runs` items between them when `run` is called.

    A thread that cannot connect makes the `with` raise its error, and one that raises in `start` makes `run` raise
    it, once every thread has stopped; an exception in the caller's block stops the threads without a wait.
    """

    def __init__(
        self, threads: int, connect: Callable[[], Any] = lambda: None, disconnect: Callable[[], Any] = lambda: None
    ) -> None:
        if threads < 1:
            raise ValueError(f"threads must be 1 or more, not {threads}")
        self.threads, self.connect, self.disconnect = threads, connect, disconnect
        self.cpu = 0.0
        self._opened = threading.Barrier(threads + 1)
        self._go = threading.Barrier(threads + 1)
        self._ended = threading.Barrier(threads + 1)
        self._work: tuple[int, Callable[[int], Any]] | None = None
        self._results: list[Any] = []
        self._errors: list[BaseException] = []
        self._lock = threading.Lock()
        self._pool = [threading.Thread(target=self._serve, args=(k,), daemon=True) for k in range(threads)]

    def __enter__(self) -> Starters:
        for thread in self._pool:
            thread.start()
        self._opened.wait()
        if self._errors:
            self._stop(abort=True)
            raise self._errors[0]
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        self._stop(abort=kind is not None)

    def run(self, runs: int, start: Callable[[int], Any]) -> list[Any]:
        """Start item 0 to `runs` - 1 with `start(i)`, spread over the threads, all let go at once: the results."""
        self._work, self._results, self._errors, self.cpu = (runs, start), [None] * runs, [], 0.0
        self._go.wait()
        self._ended.wait()
        if self._errors:
            raise self._errors[0]
        return self._results

    def _stop(self, abort: bool) -> None:
        """End the threads: let them see no work, or break the barriers they wait at (they end their loop first)."""
        self._work = None
        if abort:
            self._go.abort()
            self._ended.abort()
        else:
            self._go.wait()
        for thread in self._pool:
            thread.join()

    def _serve(self, k: int) -> None:
        connected = False
        try:
            try:
                self.connect()
                connected = True
            except BaseException as error:  # noqa: BLE001 - raised by __enter__
                self._errors.append(error)
            self._opened.wait()
            while True:
                self._go.wait()
                if self._work is None:
                    return
                runs, start = self._work
                began = time.thread_time()
                try:
                    for i in range(k, runs, self.threads):
                        self._results[i] = start(i)
                except BaseException as error:  # noqa: BLE001 - raised by run()
                    self._errors.append(error)
                finally:
                    with self._lock:
                        self.cpu += time.thread_time() - began
                self._ended.wait()
        except threading.BrokenBarrierError:
            return
        finally:
            if connected:
                self.disconnect()

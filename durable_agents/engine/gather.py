"""Wake-ups of runs started one per transaction, gathered in this process and sent together (WAKE_GATHER_MS).

Off by default (0: each start sends its own wake-up as it commits): a web process starting one run per request then
builds and publishes one broker message per run, and a worker takes each in a task of its own. With WAKE_GATHER_MS
above 0, each committed start hands its run to this process's sender thread, which waits WAKE_GATHER_MS after the
first (or until WAKE_BATCH_SIZE are in), then sends what has gathered with `wake_many` — the batching a start of
many runs in one transaction gets (WAKE_BATCH_SIZE to a message, model-bound runs a message each) — while the
requests go on. A lone start's wake-up leaves at most WAKE_GATHER_MS (plus the publish) after its commit.

What is guaranteed is what a wake-up always promised: none is needed for correctness. The run is committed before
it is handed over; a wake-up never sent — a process killed in the window, a broker that refused it, a sender
thread a server does not run (uWSGI without enable-threads) — leaves a pending run, which the sweep wakes within
its period. Not guaranteed: that the message has left when `api.start` returns (with WAKE_GATHER_MS 0 it has, or
the broker refused it). A process that exits normally sends what it holds first (atexit, up to FLUSH_TIMEOUT
seconds); a forked child starts empty, and its parent sends what it held. What is held is bounded
(MOST_HELD_BATCHES): past it, a start sends the lot itself.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Sequence

from django.db import connections

from durable_agents.conf import settings
from durable_agents.engine.wake import wake_many

logger = logging.getLogger("durable_agents.engine")

# The longest an exiting process waits for the sender's batches in flight, once it has sent the rest itself.
FLUSH_TIMEOUT = 5.0
# The most wake-ups held, in batches (WAKE_BATCH_SIZE): a start that finds this many sends them itself, as a start did
# before gathering, so a sender that cannot keep up (stuck in a send, or a thread the server never runs) costs the
# requests their publish again, not memory without end.
MOST_HELD_BATCHES = 8

Send = Callable[[Sequence[str], Sequence[str | None]], object]


class Gatherer:
    """One process's gathered wake-ups and the daemon thread that sends them: `add` hands a committed run over,
    `flush` sends what is held now (and waits for a batch in flight)."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self._reset()

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)
        self._idle = threading.Condition(self._lock)
        self._pending: list[tuple[str, str | None]] = []
        self._in_flight = 0
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()

    def add(self, run_id: uuid.UUID | str, kind: str | None) -> None:
        """Hand over the run of a committed start: sent within WAKE_GATHER_MS with the others gathered by then (by
        this start itself, with the rest held, if MOST_HELD_BATCHES are held or no sender thread can start). Never
        raises: the start has committed."""
        if self._pid != os.getpid():  # a fork the at-fork hook missed (an os.fork from C)
            self._reset()
        with self._lock:
            self._pending.append((str(run_id), kind))
            held, full = len(self._pending), int(settings.WAKE_BATCH_SIZE)
            send_now = held >= MOST_HELD_BATCHES * full
            if self._thread is None or not self._thread.is_alive():
                send_now = not self._start_sender() or send_now
            # The sender waits for a first arrival, then for WAKE_GATHER_MS or a full batch: only those two wake it.
            # Waking it at every start would cost each one a thread switch (and the GIL) for nothing to send.
            if held == 1 or held >= full:
                self._arrived.notify()
        if send_now:
            self._send_gathered()

    def _start_sender(self) -> bool:
        """Start the sender thread; False if none can start (at interpreter shutdown on 3.12+, no threads left)."""
        self._thread = threading.Thread(target=self._serve, name="durable-agents-wake", daemon=True)
        try:
            self._thread.start()
        except RuntimeError:
            return False
        return True

    def flush(self, timeout: float = FLUSH_TIMEOUT) -> None:
        """Send what is gathered now, in this thread, and return once the batches the sender has in flight are out
        too — one it took meanwhile included (or `timeout`)."""
        deadline = time.monotonic() + timeout
        self._send_gathered()
        with self._lock:
            while self._in_flight and (left := deadline - time.monotonic()) > 0:
                self._idle.wait(left)

    def held(self) -> int:
        """Wake-ups gathered and not yet handed to the broker (in flight included)."""
        with self._lock:
            return len(self._pending) + self._in_flight

    def _serve(self) -> None:
        while True:
            with self._lock:
                while not self._pending:
                    self._arrived.wait()
                # Gather for WAKE_GATHER_MS after the first, or until a message's worth (WAKE_BATCH_SIZE) is in.
                deadline = time.monotonic() + float(settings.WAKE_GATHER_MS) / 1000
                full = int(settings.WAKE_BATCH_SIZE)
                while len(self._pending) < full and (left := deadline - time.monotonic()) > 0:
                    self._arrived.wait(left)
            try:
                self._send_gathered()
            except BaseException:  # noqa: BLE001 - a waker's sys.exit(), a gevent Timeout: the runs are the sweep's
                logger.warning("a wake-up batch was interrupted; the sweep wakes its runs", exc_info=True)
            finally:
                # Closed after each batch, as a request's is: routing a run may query (REPLAY_QUEUE), and a
                # connection this thread kept would outlive a database restart, broken, and hold a pool's slot.
                connections.close_all()

    def _send_gathered(self) -> None:
        with self._lock:
            gathered, self._pending = self._pending, []
            self._in_flight += len(gathered)
        if not gathered:
            return
        try:
            self._send([run_id for run_id, _ in gathered], [kind for _, kind in gathered])
        except Exception:  # noqa: BLE001 - the runs are committed: the sweep wakes them; the thread must live on
            logger.warning("could not wake %d started runs now; the sweep will", len(gathered), exc_info=True)
        finally:
            with self._lock:
                self._in_flight -= len(gathered)
                self._idle.notify_all()


GATHERER = Gatherer(lambda run_ids, kinds: wake_many(run_ids, kinds=kinds))
os.register_at_fork(after_in_child=GATHERER._reset)  # the parent sends what it held; the child starts empty
atexit.register(GATHERER.flush)


def gathering() -> bool:
    """True if starts' wake-ups are gathered (WAKE_GATHER_MS > 0), else each is sent as its start commits."""
    return float(settings.WAKE_GATHER_MS) > 0

"""Kill points of batch delivery, for chaos workers (loaded by tests/chaos/apps.py when DURABLE_CHAOS_BATCH=1).

With DURABLE_CHAOS_BATCH=1 the worker sends every model call of refund_agent through the Message Batches API (its
workflow re-registered with `delivery="batch"`), and the batcher's job lease lasts DURABLE_CHAOS_BATCH_LEASE
seconds (a SIGKILLed batcher's lease lapses that soon, not after two minutes).

DURABLE_CHAOS_BATCH_POINT names one point where the first process to reach it stops, for the test to SIGKILL:

    queued      the step journaled its turn as submitted (BatchTurn committed), before its run parks
    opened      the batcher committed the MessageBatch row (its outbox row), before the create request goes
    created     the create request was answered (the batch exists at the API), before its id is recorded
    collecting  the batcher recorded the first answer of a batch of several, before the others
    recorded    the step, woken by its answer, is about to journal it as a Turn

The process that reaches it first claims the marker file DURABLE_CHAOS_BATCH_MARK (O_EXCL: one process, once per
test), writes its pid there and sleeps until it is killed; every other process, and every later pass, goes on.
Nothing in durable_agents is changed: the module functions the batcher and the step call are wrapped here.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Callable
from typing import Any

POINTS = ("queued", "opened", "created", "collecting", "recorded")


def install() -> None:
    from durable_agents.agents import batcher, batching
    from durable_agents.engine import batches

    batcher.LEASE_SECONDS = float(os.environ.get("DURABLE_CHAOS_BATCH_LEASE", "3"))
    point = os.environ.get("DURABLE_CHAOS_BATCH_POINT", "")
    if not point:
        return
    if point not in POINTS:
        raise ValueError(f"DURABLE_CHAOS_BATCH_POINT={point!r} is none of {POINTS}")
    if point == "queued":
        batches.queue_turn = _then_stop(batches.queue_turn)
    elif point == "opened":
        batches.open_batch = _then_stop(batches.open_batch, when=lambda batch: batch is not None)
    elif point == "created":
        batches.submitted = _stop_first(batches.submitted)
    elif point == "collecting":
        batches.record_result = _stop_after_first_answer(batches.record_result)
    else:
        # The step's own call (the batcher bound its own name to the original when it was imported).
        batching.response_of = _stop_first(batching.response_of)


def stop_here() -> None:
    """Claim the marker and sleep until SIGKILLed; return at once if another process claimed it first."""
    try:
        fd = os.open(os.environ["DURABLE_CHAOS_BATCH_MARK"], os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return
    os.write(fd, str(os.getpid()).encode())
    os.close(fd)
    while True:
        time.sleep(3600)


def _then_stop(fn: Callable[..., Any], when: Callable[[Any], bool] = lambda _: True) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        value = fn(*args, **kwargs)
        if when(value):
            stop_here()
        return value

    return wrapped


def _stop_first(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        stop_here()
        return fn(*args, **kwargs)

    return wrapped


def _stop_after_first_answer(fn: Callable[..., Any]) -> Callable[..., Any]:
    answered: dict[int, int] = {}
    lock = threading.Lock()

    @functools.wraps(fn)
    def wrapped(batch: Any, *args: Any, **kwargs: Any) -> Any:
        outcome = fn(batch, *args, **kwargs)
        if outcome == "answered" and batch.request_count >= 2:
            with lock:
                answered[batch.pk] = answered.get(batch.pk, 0) + 1
                first = answered[batch.pk] == 1
            if first:
                stop_here()
        return outcome

    return wrapped

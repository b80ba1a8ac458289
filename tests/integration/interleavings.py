"""Helpers of the interleaving tests (sagas, claims, forks): a ledger's entries, and an action run on a
connection of its own in another thread, joined before the test's next act (no sleeps for timing)."""

from __future__ import annotations

import threading
from typing import Any

from django.db import connections

from tests.testapp.models import LedgerEntry


def ledger(order_id: str) -> list[tuple[str, int]]:
    return list(LedgerEntry.objects.filter(order_id=order_id).order_by("id").values_list("kind", "amount"))


def in_another_connection(action) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def target() -> None:
        try:
            out["value"] = action()
        except BaseException as exc:  # noqa: BLE001 - surfaced to the caller
            out["error"] = exc
        finally:
            connections.close_all()

    thread = threading.Thread(target=target)
    thread.start()
    return thread, out


def joined(thread: threading.Thread, out: dict[str, Any]) -> Any:
    thread.join()
    if "error" in out:
        raise out["error"]
    return out.get("value")

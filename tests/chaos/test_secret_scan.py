"""The secret scan: after a workload with failures, no API key or secret appears in any table or any log.

Every chaos worker runs with ANTHROPIC_API_KEY and DJANGO_SECRET_KEY set to recognisable secrets
(tests/chaos/fleet.py). This test runs last (tests/chaos/conftest.py orders it), adds a workload of its own in
which the fake Messages API echoes the key back in its error messages (401: permanent, 500: retried, on a
plain and on a streaming worker) and a refund waits for an approval (notification, signed link), then scans:

* every row of every table of the database (raw SELECT *, so tables without a model are covered too),
* every file the app stored out of row (MEDIA_ROOT),
* every log the chaos suite's workers wrote (this test's and the earlier tests'),
* every request the model received (bodies and headers).
"""

from __future__ import annotations

import random
from decimal import Decimal
from pathlib import Path

import pytest
from django.conf import settings
from django.db import connection

from durable_agents import api
from durable_agents.models import Event, Run, RunStatus, Wait, WaitStatus
from durable_agents.testing import wait_for
from durable_agents.testing.fake_anthropic import Fault, RecordedRequest
from tests.chaos.fleet import API_KEY, DJANGO_SECRET_KEY, Fleet, prefork
from tests.chaos.workload import Case, describe, make_cases, seed, start, timeout, wait_until_finished

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, timeout()]


def secrets() -> dict[str, str]:
    return {
        "ANTHROPIC_API_KEY": API_KEY,
        "DJANGO_SECRET_KEY (workers)": DJANGO_SECRET_KEY,
        "SECRET_KEY (this process)": settings.SECRET_KEY,
    }


def test_secret_scan__no_api_key_or_secret_in_any_table_file_or_log(
    chaos_env, chaos_logs, chaos_log_root, fake, model, monkeypatch
):
    monkeypatch.setenv("ANTHROPIC_API_KEY", API_KEY)
    rng = random.Random(17)
    cases = make_cases(6, rng, prefix="S")
    denied, flaky = cases[0].number, cases[1].number
    big = Case("S-999999", "refund", "My sofa arrived broken. Could I get a refund, please?", Decimal("80.00"),
               "delivered", Decimal("80.00"))  # fmt: skip
    seed([*cases, big])

    def hostile(request: RecordedRequest) -> Fault | None:
        prompt = str(request.messages[:1])
        if denied in prompt:
            return Fault.status(401, f"invalid x-api-key: {API_KEY}")
        if flaky in prompt and request.attempt == 1:
            return Fault.status(500, f"upstream failed for key {API_KEY}")
        return None

    model.fault = hostile
    env = {**chaos_env, "DURABLE_LOG_LEVEL": "INFO"}
    with Fleet(env, chaos_logs, [prefork(2, beat=True), prefork(1, DURABLE_CHAOS_STREAM="1")]):
        runs = {start(case): case for case in [*cases, big]}
        approval = wait_for(
            lambda: Wait.objects.filter(run_id__in=list(runs), status=WaitStatus.OPEN).first(),
            timeout=120,
            what="the refund above 50.00 to wait for a manager",
        )
        api.decide(approval.pk, True, by="manager@example.com", comment="ok")
        left = wait_until_finished(runs, timeout=180)
        assert not left, f"{len(left)} runs did not finish:\n  {describe(left)}"

    failed = Run.objects.get(id__in=list(runs), input__order_id=denied)
    assert failed.status == RunStatus.FAILED and "401" in failed.error["message"], failed.error
    assert "[redacted]" in failed.error["message"], "the key the API echoed is redacted, not dropped silently"
    assert Event.objects.filter(run_id__in=list(runs), kind="step_retry").exists(), "the 500 was retried"

    found = []
    for place, text in _places(chaos_log_root, fake):
        found += [f"{name} in {place}" for name, secret in secrets().items() if secret in text]
    places = sum(1 for _ in _places(chaos_log_root, fake))
    logs = sorted(chaos_log_root.rglob("*.log"))
    print(
        f"\nSecret scan: {places} places scanned ({len(_tables())} tables, {len(logs)} log files of the chaos "
        f"suite, {len(fake.requests)} model requests) for {len(secrets())} secrets: {len(found)} found"
    )
    assert logs and any("step error" in p.read_text(errors="replace") for p in logs), "the logs hold the errors"
    assert not found, f"secrets leaked: {found[:20]}"


def _tables() -> list[str]:
    return connection.introspection.table_names()


def _places(log_root: Path, fake):  # type: ignore[no-untyped-def]
    """(where, text) for every row of every table, stored file, log file and model request."""
    quote = connection.ops.quote_name
    with connection.cursor() as cursor:
        for table in _tables():
            cursor.execute(f"SELECT * FROM {quote(table)}")  # noqa: S608 - table names from introspection
            for number, row in enumerate(cursor.fetchall()):
                yield f"table {table} row {number}", " ".join(map(str, row))
    media = Path(settings.MEDIA_ROOT)
    if media.exists():
        for path in media.rglob("*"):
            if path.is_file():
                yield f"file {path}", path.read_bytes().decode(errors="replace")
    for path in sorted(log_root.rglob("*")):
        if path.is_file():
            yield f"log {path}", path.read_bytes().decode(errors="replace")
    for number, request in enumerate(fake.requests):
        yield f"model request {number}", f"{request.headers} {request.body}"

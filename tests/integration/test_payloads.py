"""Step results: large ones live in Postgres (not on a worker's disk); unstorable ones fail the step at once.

Guarantee 10 (Postgres is the only state): a result over RESULT_INLINE_MAX_BYTES is a Payload row of its
run, so a next step on another machine reads it. Item 8 of issue 13: a result jsonb cannot hold
(\\u0000, a lone surrogate, NaN, Infinity) is refused before the commit with a PermanentError naming the
spot, instead of a DataError inside the commit that left the lease held and re-ran the step on every expiry.
"""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path

import pytest
from django.conf import settings
from django.core.files.base import ContentFile
from django.core.files.storage import default_storage
from django.db import connections
from django.test.utils import override_settings

from durable_agents import api
from durable_agents.engine import payloads as payloads_module
from durable_agents.engine.payloads import load_result, store_result
from durable_agents.errors import PermanentError, RunNotFoundError
from durable_agents.models import Effect, EffectStatus, Payload, Run, RunStatus, Step
from durable_agents.testing import drive, wait_for_run
from tests.testapp.models import Execution, LedgerEntry

pytestmark = pytest.mark.django_db(transaction=True)

SMALL_INLINE = {"RESULT_INLINE_MAX_BYTES": 1000}


def files_under(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if p.is_file() and "results" in p.parts]


def test_results__a_large_result_is_in_postgres_and_a_worker_on_a_fresh_machine_reads_it(start_worker, tmp_path):
    machine_a, machine_b = tmp_path / "machine-a", tmp_path / "machine-b"
    machine_a.mkdir()
    machine_b.mkdir()
    first = start_worker(env={"DURABLE_VAR_DIR": str(machine_a)})
    run = api.start("big_handoff", {"size": 100_000})
    wait_for_run(run.id, "waiting")

    big = Step.objects.get(run=run, step_id="big")
    payload = Payload.objects.filter(run=run).first()
    assert payload is not None and big.result_ref == f"payload:{payload.sha256}", (
        f"a 100 kB result must be a Payload row of its run, got ref {big.result_ref!r}"
    )
    assert payload.size > 100_000 and payload.sha256 == big.result_hash
    assert hashlib.sha256(bytes(payload.data)).hexdigest() == big.result_hash
    assert files_under(machine_a) == [] and files_under(Path(settings.MEDIA_ROOT)) == [], (
        "a result was written to a worker's disk: a step on another machine could not read it"
    )

    first.kill()
    start_worker(env={"DURABLE_VAR_DIR": str(machine_b)})  # a fresh machine: an empty var dir of its own
    api.send_signal(run.id, "go")
    run = wait_for_run(run.id, "completed")
    reads = Step.objects.get(run=run, step_id="reads_big")
    assert reads.result == {"length": 100_000}, f"the fresh machine read {reads.result!r}"
    assert files_under(machine_b) == []


@override_settings(DURABLE_AGENTS=SMALL_INLINE)
def test_results__a_re_executed_step_reuses_its_payload_row():
    run = api.start("noop", {"steps": 1})
    value = {"blob": "y" * 5000}
    first = store_result(run.id, "s", value)
    again = store_result(run.id, "s", value)  # a step re-executed after its worker died before the commit
    other = store_result(run.id, "s", {"blob": "z" * 5000})
    assert first == again and first.ref.startswith("payload:"), (first, again)
    assert Payload.objects.filter(run=run).count() == 2, "the same bytes must be stored once per run"
    assert other.ref != first.ref
    assert load_result(first.ref, first.sha256, run_id=run.id) == value


@override_settings(DURABLE_AGENTS=SMALL_INLINE)
def test_results__a_changed_payload_fails_its_hash_check():
    run = api.start("noop", {"steps": 1})
    stored = store_result(run.id, "s", {"blob": "y" * 5000})
    Payload.objects.filter(run=run).update(data=b'{"blob":"tampered"}')
    with pytest.raises(PermanentError, match="does not match its hash"):
        load_result(stored.ref, stored.sha256, run_id=run.id)


def test_results__a_reference_from_before_payloads_still_reads():
    raw = json.dumps({"blob": "old"}).encode()
    name = default_storage.save("durable_agents/results/legacy/big-0123.json", ContentFile(raw))
    try:
        assert load_result(name, hashlib.sha256(raw).hexdigest()) == {"blob": "old"}
    finally:
        default_storage.delete(name)


def test_results__an_explicitly_configured_shared_storage_holds_large_results(tmp_path):
    shared = tmp_path / "shared-bucket"
    storages = {
        **settings.STORAGES,
        "durable_results": {"BACKEND": "django.core.files.storage.FileSystemStorage", "OPTIONS": {"location": shared}},
    }
    with override_settings(STORAGES=storages, DURABLE_AGENTS={**SMALL_INLINE, "RESULT_STORAGE": "durable_results"}):
        run = drive(api.start("big", {"size": 5000}).id)
        big = Step.objects.get(run=run, step_id="big")
        assert big.result_ref.startswith("storage:durable_results:"), big.result_ref
        assert run.status == RunStatus.COMPLETED and Step.objects.get(run=run, step_id="reads_big").result == {
            "length": 5000
        }
    assert len(list(shared.rglob("*.json"))) == 1 and not Payload.objects.exists()


@override_settings(DURABLE_AGENTS={**SMALL_INLINE, "RESULT_STORAGE": "no_such_storage"})
def test_results__an_unknown_result_storage_fails_the_step_saying_what_to_set():
    run = drive(api.start("big", {"size": 5000}).id)
    assert run.status == RunStatus.FAILED and "not a key of settings.STORAGES" in run.error["message"], run.error


@override_settings(DURABLE_AGENTS=SMALL_INLINE)
def test_fork__the_fork_owns_copies_of_its_out_of_row_results():
    source = drive(api.start("big", {"size": 5000}).id)
    fork = api.fork(source.id, "reads_big")
    Run.objects.filter(pk=source.id).delete()  # its payloads go with it
    fork = drive(fork.id)
    assert fork.status == RunStatus.COMPLETED, f"the fork lost its copied result: {fork.error}"
    assert Step.objects.get(run=fork, step_id="reads_big").result == {"length": 5000}


@override_settings(DURABLE_AGENTS=SMALL_INLINE)
def test_fork__a_source_deleted_while_it_is_forked_is_a_clear_error_and_nothing_is_forked(monkeypatch):
    source = drive(api.start("big", {"size": 5000}).id)
    keys = payloads_module.Payload.objects.filter  # the fork reads the payloads' keys, then each payload by key

    def deleted_meanwhile(*args, **kwargs):
        if set(kwargs) == {"pk"}:  # between the two reads: another connection deletes the source, and commits
            deleter = threading.Thread(
                target=lambda: (Run.objects.filter(pk=source.id).delete(), connections.close_all())
            )
            deleter.start()
            deleter.join()
        return keys(*args, **kwargs)

    monkeypatch.setattr(payloads_module.Payload.objects, "filter", deleted_meanwhile)
    with pytest.raises(RunNotFoundError, match="deleted while it was being forked"):
        api.fork(source.id, "reads_big")
    monkeypatch.undo()
    assert not Run.objects.exists(), "no fork is left half made"


# --- Item 8: results Postgres cannot store --------------------------------------------------------------------

UNSTORABLE_CASES = [
    ("nul", 'result["items"][1]["name"] contains \\u0000, which Postgres cannot store; remove it or encode the text'),
    ("surrogate", 'result["text"] contains a lone surrogate (\\udce9), which is not valid Unicode'),
    ("nan", 'result["scores"][1] is NaN, which JSON and Postgres cannot store; use null or a string'),
    ("infinity", 'result["total"] is Infinity, which JSON and Postgres cannot store'),
    ("nul-key", 'a key of result["labels"] ("a\\u0000") contains \\u0000'),
]


@pytest.mark.parametrize("padding", [0, 5000], ids=["inline", "out-of-row"])
@pytest.mark.parametrize(("kind", "message"), UNSTORABLE_CASES, ids=[c[0] for c in UNSTORABLE_CASES])
@override_settings(DURABLE_AGENTS=SMALL_INLINE)
def test_results__an_unstorable_result_fails_the_step_at_once_naming_the_spot(kind, message, padding):
    run = drive(api.start("unstorable", {"kind": kind, "padding": padding}).id)
    assert run.status == RunStatus.FAILED, f"the run should fail permanently, it is {run.status}"
    assert run.error["type"] == "PermanentError" and message in run.error["message"], run.error
    assert run.lease_owner == "" and run.lease_expires_at is None, "the failed step left its lease held"
    assert Execution.objects.filter(run_id=run.id, step_id="bad").count() == 1, "the step body ran again"
    assert not Payload.objects.filter(run=run).exists(), "an unstorable result was stored out of row"


def test_results__an_unstorable_result_fails_on_a_real_worker_without_holding_the_lease(start_worker):
    start_worker()
    run = wait_for_run(api.start("unstorable", {"kind": "nul"}).id, "failed")
    assert "contains \\u0000" in run.error["message"] and run.lease_owner == "", run.error
    assert Execution.objects.filter(run_id=run.id, step_id="bad").count() == 1


def test_failure__an_error_message_postgres_cannot_store_is_recorded_escaped():
    run = drive(api.start("raises_unstorable").id)
    assert run.status == RunStatus.FAILED and run.lease_owner == "", "recording the error must not crash"
    assert run.error["message"] == "bad row a\\u0000b in caf\\udce9.csv", run.error
    assert Execution.objects.filter(run_id=run.id, step_id="bad").count() == 1


def test_effects__an_unstorable_tool_result_rolls_the_effect_back_and_fails_the_step_saying_where():
    run = drive(api.start("charge_nan_receipt", {"order_id": "N-1"}).id)
    assert run.status == RunStatus.FAILED and run.lease_owner == "", run.error
    assert """the result of tool 'charge_with_a_nan_receipt'["receipt"]["fee"] is NaN""" in run.error["message"]
    assert Effect.objects.get(run=run).status == EffectStatus.FAILED
    assert not LedgerEntry.objects.filter(order_id="N-1").exists(), "the charge stayed applied without a record"

"""Starting runs (engine/starts.py, engine/startpath.py): what a start costs in statements, and that `start_many`
starts exactly what as many `start` calls would — rows, plan rows, keys, concurrency keys, spans — all or none.

In-process tests count statements with CaptureQueriesContext (Django logs BEGIN, COMMIT and savepoints there too)
and record what the engine hands its wakers; the key races are made by the database itself (tests/integration/
key_races.py); one test runs the runs on a real worker, one runs the same starts on SQLite.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from datetime import timedelta
from typing import Any

import pytest
from django.conf import settings
from django.db import connection, connections, transaction
from django.test.utils import CaptureQueriesContext, override_settings

from durable_agents import api
from durable_agents.engine import statements
from durable_agents.engine.admission import admit
from durable_agents.models import Run, RunStatus, Step, StepStatus
from durable_agents.testing import wait_for_run
from durable_agents.workflows import PlannedStep, call, registry, workflow
from tests.conftest import ROOT
from tests.integration.key_races import key_race
from tests.testapp.models import Execution

pytestmark = pytest.mark.django_db(transaction=True)

woken: list[str] = []
batches: list[list[str]] = []


def record_wake(run_id: str, countdown: float | None = None, **routed: str) -> None:
    """A WAKER that only records what the engine asked for."""
    woken.append(str(run_id))


def record_batch(run_ids: list[str], **routed: str) -> None:
    """A BATCH_WAKER that only records what the engine asked for."""
    batches.append([str(run_id) for run_id in run_ids])


@pytest.fixture
def recorded():
    """The wakes this process asks for, recorded instead of sent (25 runs to a batch)."""
    woken.clear()
    batches.clear()
    recording = {"WAKER": f"{__name__}.record_wake", "BATCH_WAKER": f"{__name__}.record_batch", "WAKE_BATCH_SIZE": 25}
    with override_settings(DURABLE_AGENTS={**settings.DURABLE_AGENTS, **recording}):
        yield


def _sent() -> list[str]:
    return woken + [run_id for batch in batches for run_id in batch]


def _statements(captured: CaptureQueriesContext) -> list[str]:
    return [query["sql"].split()[0] for query in captured.captured_queries]


def _rows(run: Run) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A run's row and its plan rows as stored, without what differs from run to run (ids, times, keys, traces)."""
    own = {"id", "idempotency_key", "created_at", "updated_at", "trace_context"}
    stored = Run.objects.filter(pk=run.id).values()[0]
    steps = Step.objects.filter(run_id=run.id).order_by("position").values()
    step_own = {"id", "run_id", "created_at", "updated_at"}
    return (
        {k: v for k, v in stored.items() if k not in own},
        [{k: v for k, v in step.items() if k not in step_own} for step in steps],
    )


# --- what a start costs ----------------------------------------------------------------------------------------


def test_start__outside_a_transaction_is_one_statement_and_one_wake_up(recorded):
    with CaptureQueriesContext(connection) as plain:
        run = api.start("noop", {"steps": 3})
    with CaptureQueriesContext(connection) as keyed:
        keyed_run = api.start("noop", {"steps": 3}, idempotency_key="order-1")
    with CaptureQueriesContext(connection) as again:
        found = api.start("noop", {"steps": 3}, idempotency_key="order-1")

    assert [_statements(q) for q in (plain, keyed, again)] == [["WITH"]] * 3, (
        "a start is one statement in autocommit, its key settled in it (no BEGIN, COMMIT, savepoint or key lookup)"
    )
    assert found.id == keyed_run.id and _sent() == [str(run.id), str(keyed_run.id)], "the run found is not woken"
    assert Step.objects.filter(run=run).count() == 3


def _round_trips(fn: Any) -> int:
    """The round trips to Postgres while fn runs, read from libpq's protocol trace of what this process sends: each
    simple Query (client-side binding, Django's default), or each Sync of the extended protocol, is one."""
    connection.ensure_connection()
    pgconn = connection.connection.pgconn
    with tempfile.TemporaryFile("w+") as trace:
        pgconn.trace(trace.fileno())
        try:
            fn()
        finally:
            pgconn.untrace()
        trace.seek(0)
        fields = [line.split("\t") for line in trace.read().splitlines()]
    return sum(1 for f in fields if len(f) > 3 and f[1] == "F" and f[3].split()[0] in ("Query", "Sync"))


def test_start__outside_a_transaction_is_one_round_trip_on_the_wire(recorded):
    """Django's query log shows what Django sends; the protocol trace shows what crosses the wire (no BEGIN psycopg
    would send on its own, no hidden lookup). The statement is prepared on the server at its second use on a
    connection (engine/statements.py), a round trip more that once: psycopg waits for the Parse before it binds."""
    assert _round_trips(lambda: api.start("noop", {"steps": 3})) == 1, "its first use on a connection: sent plain"
    assert _round_trips(lambda: api.start("noop", {"steps": 3})) == 2, "its second: prepared, then executed"
    assert _round_trips(lambda: api.start("noop", {"steps": 3})) == 1
    assert _round_trips(lambda: api.start_many("noop", [{"steps": 3}] * 50)) == 1, "the same statement"
    # With keys, a statement of its own: the third start finds the run holding its key in the same round trip.
    for key, trips in [("wire-1", 1), ("wire-2", 2), ("wire-1", 1), ("wire-3", 1)]:
        assert _round_trips(lambda key=key: api.start("noop", {"steps": 3}, idempotency_key=key)) == trips, key
    assert Run.objects.filter(idempotency_key__startswith="wire").count() == 3


def test_start__inside_a_transaction_is_one_statement_of_it_without_a_savepoint(recorded):
    with transaction.atomic(), CaptureQueriesContext(connection) as inside:
        run = api.start("noop", {"steps": 2}, idempotency_key="order-2")
        assert _sent() == [], "nothing is woken before the caller's transaction commits"
    assert _statements(inside) == ["WITH"]
    assert _sent() == [str(run.id)]


def _prepare_the_start_statements() -> None:
    """Send each shape of the start statement twice on this connection (without keys; with keys in autocommit and in
    a transaction): those that are prepared are prepared from then on."""
    for i in range(2):
        api.start("noop", {"steps": 1})
        api.start("noop", {"steps": 1}, idempotency_key=f"prepared-{i}")
        with transaction.atomic():
            api.start("noop", {"steps": 1}, idempotency_key=f"prepared-in-{i}")
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_prepared_statements WHERE statement LIKE %s", ["%unnest%"])
        assert cursor.fetchone()[0] >= 2


def _a_column_widened() -> None:
    """What a rolling deploy's migration does beside a web process: the type of a column the keyed start returns
    changes, and Postgres refuses, before running it, a statement prepared before ("cached plan must not change
    result type")."""
    other = connections.create_connection("default")  # the migration's own
    try:
        with other.cursor() as cursor:
            cursor.execute(f"ALTER TABLE {Run._meta.db_table} ALTER COLUMN workflow TYPE varchar(250)")
    finally:
        other.close()


def _a_pooler_switched_the_session() -> None:
    """What an undeclared transaction-mode pooler does between two transactions: the server session the client gets
    has none of the statements it prepared."""
    with connection.cursor() as cursor:
        cursor.execute("DO $$BEGIN EXECUTE 'DEALLOCATE ALL'; END$$")  # psycopg keeps believing they are there


@pytest.fixture
def workflow_column_restored():
    yield
    connection.close()
    column = Run._meta.get_field("workflow")
    with connection.cursor() as cursor:
        cursor.execute(f"ALTER TABLE {Run._meta.db_table} ALTER COLUMN workflow TYPE varchar({column.max_length})")


@pytest.mark.parametrize("refusal", [_a_column_widened, _a_pooler_switched_the_session], ids=["migrated", "pooler"])
@pytest.mark.usefixtures("workflow_column_restored")
def test_start__inside_a_request_s_transaction_survives_a_prepared_statement_the_server_refuses(refusal, monkeypatch):
    """A start in the caller's transaction (ATOMIC_REQUESTS, a view's atomic()) is sent plain: a prepared statement
    the server refuses aborts the transaction it was sent in, and the request would fail with it. In autocommit the
    refused statement is sent again (engine/statements.py)."""
    monkeypatch.setattr(statements, "_pooler_seen", False)
    connection.close()
    _prepare_the_start_statements()
    refusal()
    with transaction.atomic():
        held = api.start("noop", {"steps": 1}, idempotency_key="prepared-0")  # the run holding it, read back
        new = api.start("noop", {"steps": 1}, idempotency_key="in-the-request")
        plain = api.start("noop", {"steps": 1})
    assert Run.objects.filter(pk__in=[held.id, new.id, plain.id]).count() == 3
    again = api.start("noop", {"steps": 1}, idempotency_key="in-the-request")  # autocommit: sent again if refused
    assert again.id == new.id
    connection.close()


def test_start_many__a_hundred_runs_are_one_statement_and_four_wake_up_messages(recorded):
    with CaptureQueriesContext(connection) as started:
        runs = api.start_many("noop", [{"steps": 3}] * 100)

    assert _statements(started) == ["WITH"], "the runs and their 300 plan rows in one statement"
    assert Run.objects.count() == 100 and Step.objects.count() == 300
    assert batches == [[str(run.id) for run in runs[i : i + 25]] for i in range(0, 100, 25)] and woken == [], (
        "the runs go out together, WAKE_BATCH_SIZE to a message, in the order given"
    )


def test_start_many__keyed_runs_are_one_statement_too(recorded):
    keys = [f"batch-{i}" for i in range(30)]
    with CaptureQueriesContext(connection) as started:
        runs = api.start_many("noop", [{"steps": 1}] * 30, idempotency_keys=keys)
    with CaptureQueriesContext(connection) as again:
        found = api.start_many("noop", [{"steps": 1}] * 30, idempotency_keys=keys)

    assert [_statements(started), _statements(again)] == [["WITH"], ["WITH"]]
    assert [run.id for run in found] == [run.id for run in runs] and Run.objects.count() == 30
    assert len(_sent()) == 30, "the runs found are not woken again"


def test_start_many__an_empty_list_starts_nothing_and_costs_nothing(recorded):
    with CaptureQueriesContext(connection) as started:
        assert api.start_many("noop", []) == []
    assert started.captured_queries == [] and _sent() == []


# --- the same runs as start writes --------------------------------------------------------------------------------


def _plan(run_input: dict[str, Any]) -> list[PlannedStep]:
    return [PlannedStep("observe", "observe"), PlannedStep("act", "act", args={"amount": run_input["amount"]})]


@pytest.fixture
def rich():
    """A workflow whose plan has arguments, a freshness budget, dependencies and search attributes."""
    with registry.isolated():
        workflow(
            "start_rich",
            version=3,
            steps=[
                call("observe", lambda ctx: {}, fresh_for=timedelta(minutes=5)),
                call("act", lambda ctx: {}, depends_on=["observe"]),
            ],
            plan=_plan,
            search=("order_id",),
        )
        yield "start_rich"


def test_start_many__writes_the_rows_start_writes(rich, recorded):
    one = api.start(rich, {"order_id": "A-1", "amount": "12.50"}, idempotency_key="one")
    (many,) = api.start_many(rich, [{"order_id": "A-1", "amount": "12.50"}], idempotency_keys=["many"])

    assert _rows(many) == _rows(one), "start_many wrote another run than start"
    run, steps = _rows(many)
    assert run["search"] == {"order_id": "A-1"} and run["workflow_version"] == 3 and run["step_count"] == 2
    assert [(s["step_id"], s["args"], s["fresh_for"], s["depends_on"]) for s in steps] == [
        ("observe", {}, timedelta(minutes=5), []),
        ("act", {"amount": "12.50"}, None, ["observe"]),
    ]


def test_start_many__the_returned_runs_are_as_stored_and_created_in_the_order_given(recorded):
    runs = api.start_many("noop", [{"steps": i} for i in range(5)], idempotency_keys=[f"k{i}" for i in range(5)])

    fields = [f.attname for f in Run._meta.concrete_fields]
    stored = Run.objects.in_bulk([run.id for run in runs])
    for run in runs:
        assert {f: getattr(run, f) for f in fields} == {f: getattr(stored[run.id], f) for f in fields}
    assert sorted(runs, key=lambda run: run.created_at) == runs, "a batch's runs are created in the order given"
    assert [run.step_count for run in runs] == [0, 1, 2, 3, 4]


# --- idempotency keys -----------------------------------------------------------------------------------------


def test_start_many__one_key_twice_with_one_input_is_one_run(recorded):
    runs = api.start_many("noop", [{"steps": 1}, {"steps": 2}, {"steps": 1}], idempotency_keys=["a", None, "a"])

    assert runs[0] is runs[2] and runs[1].id != runs[0].id
    assert Run.objects.count() == 2 and sorted(_sent()) == sorted([str(runs[0].id), str(runs[1].id)])


def test_start_many__one_key_twice_with_two_inputs_starts_none(recorded):
    with pytest.raises(api.IdempotencyKeyReusedError, match=r"'a' is given for inputs\[2\] .* different input"):
        api.start_many("noop", [{"steps": 1}, {"steps": 2}, {"steps": 3}], idempotency_keys=["a", None, "a"])
    assert not Run.objects.exists() and _sent() == []


def test_start_many__a_key_a_run_holds_gets_that_run_and_the_others_start(recorded):
    held = api.start("noop", {"steps": 1}, idempotency_key="held")
    runs = api.start_many("noop", [{"steps": 2}, {"steps": 1}], idempotency_keys=["new", "held"])

    assert runs[1].id == held.id and runs[1].status == RunStatus.PENDING
    assert Run.objects.count() == 2 and _sent() == [str(held.id), str(runs[0].id)], "the held run is not woken again"


def test_start_many__a_key_a_run_holds_with_another_input_starts_none(recorded):
    held = api.start("noop", {"steps": 1}, idempotency_key="held")
    with pytest.raises(api.IdempotencyKeyReusedError, match=f"used for run {held.id}"):
        api.start_many("noop", [{"steps": 2}, {"steps": 3}], idempotency_keys=["new", "held"])
    assert list(Run.objects.values_list("id", flat=True)) == [held.id], "no run of the refused batch was written"


def test_start_many__a_key_a_racing_start_takes_meanwhile_gets_the_winner_s_run(recorded):
    """Outside a transaction the statement fails whole on the key's constraint and is sent again: it then sees the
    winner's run, and starts the other input."""
    with key_race("noop", {"steps": 1}, "raced") as race:
        runs = api.start_many("noop", [{"steps": 1}, {"steps": 2}], idempotency_keys=["raced", "other"])

    assert race.waited_on, "the batch's statement should have waited on the racing start's key"
    assert runs[0].id == race.winner.id and Run.objects.filter(pk=runs[1].id, step_count=2).exists()
    assert Run.objects.count() == 2


def test_start_many__in_a_transaction_a_racing_key_is_skipped_and_the_winner_s_run_returned(recorded):
    with key_race("noop", {"steps": 1}, "raced") as race, transaction.atomic():
        runs = api.start_many("noop", [{"steps": 1}, {"steps": 2}], idempotency_keys=["raced", "other"])

    assert race.waited_on and runs[0].id == race.winner.id
    assert Run.objects.count() == 2 and str(runs[1].id) in _sent()
    assert _sent().count(str(race.winner.id)) == 1, "the winner's run is woken by its own start only"


def test_start_many__in_a_transaction_a_racing_key_with_another_input_rolls_the_batch_back(recorded):
    """The batch's other run is already written in the caller's transaction: the caller cannot commit it, even if it
    goes on after the error (Django's needs_rollback, as for any statement that failed in its transaction)."""
    with key_race("noop", {"steps": 9}, "raced") as race, transaction.atomic():
        with pytest.raises(api.IdempotencyKeyReusedError, match="with a different input"):
            api.start_many("noop", [{"steps": 1}, {"steps": 2}], idempotency_keys=["raced", "other"])
        assert transaction.get_rollback(), "the caller's transaction would commit half a batch"

    assert race.waited_on and list(Run.objects.values_list("id", flat=True)) == [race.winner.id]


def test_start__a_key_a_racing_start_takes_with_another_input_is_refused_and_writes_nothing(recorded):
    with key_race("noop", {"steps": 9}, "raced") as race, pytest.raises(api.IdempotencyKeyReusedError) as refused:
        api.start("noop", {"steps": 1}, idempotency_key="raced")
    assert f"used for run {race.winner.id}" in str(refused.value)
    assert race.waited_on and Run.objects.count() == 1 and Step.objects.count() == 9


def test_start__a_key_s_run_is_returned_though_the_plan_now_refuses_its_input(recorded):
    """A start with a key finds the key's run without planning its input again: a deploy whose plan refuses the
    input does not turn a retried request into an error."""
    strict = {"on": False}

    def validate(run_input: dict[str, Any]) -> None:
        if strict["on"]:
            raise api.InvalidInputError("this version refuses it")

    with registry.isolated():
        workflow("start_strict", steps=[call("only", lambda ctx: {})], validate_input=validate)
        first = api.start("start_strict", {"n": 1}, idempotency_key="strict")
        strict["on"] = True
        assert api.start("start_strict", {"n": 1}, idempotency_key="strict").id == first.id
        runs = api.start_many("start_strict", [{"n": 1}, {"n": 1}], idempotency_keys=["strict", "strict"])
        assert [run.id for run in runs] == [first.id, first.id]
        with pytest.raises(api.InvalidInputError, match="this version refuses it"):
            api.start("start_strict", {"n": 2}, idempotency_key="strict-2")
        with pytest.raises(api.IdempotencyKeyReusedError):
            api.start_many("start_strict", [{"n": 2}], idempotency_keys=["strict"])


# --- refused inputs ------------------------------------------------------------------------------------------------


def test_start_many__bad_inputs_start_none_and_the_error_names_each(recorded):
    inputs = [{"steps": 1}, {"steps": "two"}, {"steps": 1}, {"steps": -1}, {"steps": float("nan")}]
    with CaptureQueriesContext(connection) as tried, pytest.raises(api.InvalidInputError) as refused:
        api.start_many("noop", inputs)

    message = str(refused.value)
    assert message.startswith("3 of 5 inputs are refused, so no run was started (fix them or leave them out"), message
    assert "start the batch again): inputs[1]: noop takes" in message, message
    assert "inputs[3]: noop takes" in message and "inputs[4]" in message and "NaN" in message, message
    assert tried.captured_queries == [] and not Run.objects.exists() and _sent() == []


@override_settings(DURABLE_AGENTS={"INPUT_MAX_BYTES": 100})
def test_start_many__an_oversized_input_is_input_too_large_naming_it():
    with pytest.raises(api.InputTooLargeError, match=r"^inputs\[1\] is \d+ bytes, over the 100-byte limit"):
        api.start_many("noop", [{"steps": 1}, {"steps": 1, "pad": "x" * 200}])
    assert not Run.objects.exists()


@pytest.mark.parametrize(
    ("call_args", "error", "message"),
    [
        (("nope", [{}]), api.UnknownWorkflowError, "nope"),
        (("noop", {"steps": 1}), api.InvalidInputError, r"inputs is a list \(one input a run; for one run, use start"),
        (("noop", "abc"), api.InvalidInputError, "inputs is a list"),
        (("noop", [{}, {}], ["a"]), api.InvalidInputError, "2 inputs but 1 idempotency keys: give one key"),
        (("noop", [{}], "a"), api.InvalidInputError, "idempotency_keys is a list"),
        (("noop", [{}, {}], [None, 7]), api.InvalidInputError, r"idempotency_keys\[1\] must be a string"),
        (("noop", [{}], ["k" * 256]), api.InvalidInputError, r"idempotency_keys\[0\] is 256 characters long"),
        (("noop", [{}], [" "]), api.InvalidInputError, "idempotency key must be a non-empty string"),
    ],
)
def test_start_many__refused_arguments_start_nothing(call_args, error, message):
    workflow_name, inputs, *keys = call_args
    with pytest.raises(error, match=message):
        api.start_many(workflow_name, inputs, idempotency_keys=keys[0] if keys else None)
    assert not Run.objects.exists()


# --- concurrency keys and traces ---------------------------------------------------------------------------------


def test_start_many__runs_with_a_concurrency_key_are_queued_and_admitted_in_the_order_given(recorded):
    runs = api.start_many("keyed", [{"customer": "c-1", "n": i} for i in range(4)] + [{"customer": "c-2"}])

    admitted = set(Run.objects.filter(admitted_at__isnull=False).values_list("id", flat=True))
    assert admitted == {runs[0].id, runs[4].id}, "each key admits its first run once the start commits"
    assert _sent() == [str(runs[0].id), str(runs[4].id)], "a queued run is woken by its admission, not its start"
    queue = Run.objects.queued().filter(concurrency_key="c-1").order_by("created_at", "id")
    assert [run.id for run in queue] == [run.id for run in runs[1:4]], "the key's queue is in the order given"
    Run.objects.filter(pk=runs[0].id).update(status=RunStatus.COMPLETED)
    assert admit("c-1") == [runs[1].id]


def test_start_many__each_run_has_its_own_span_and_trace(spans):
    runs = api.start_many("noop", [{"steps": 1}] * 3, idempotency_keys=["t1", "t2", "t3"])
    again = api.start_many("noop", [{"steps": 1}], idempotency_keys=["t2"])

    started = spans.named("run noop")
    assert len(started) == 3 and len({s.context.trace_id for s in started}) == 3
    by_run = {s.attributes["durable_agents.run.id"]: s for s in started}
    for run in Run.objects.filter(pk__in=[run.id for run in runs]):
        assert run.trace_context[3:35] == f"{by_run[str(run.id)].context.trace_id:032x}"
    (reused,) = spans.named("reuse run noop")
    assert reused.attributes["durable_agents.run.id"] == str(again[0].id) == str(runs[1].id)


# --- on a real worker, and on SQLite ---------------------------------------------------------------------------------


def test_start_many__runs_complete_on_a_worker_each_step_once(start_worker):
    start_worker()
    runs = api.start_many("eager", [{"steps": 2}] * 20, idempotency_keys=[f"w{i}" for i in range(20)])
    for run in runs:
        wait_for_run(run.id, "completed", timeout=120)

    ids = [run.id for run in runs]
    assert Step.objects.filter(run_id__in=ids, status=StepStatus.DONE).count() == 40
    assert Execution.objects.filter(run_id__in=ids).count() == 40, "a step ran twice, or not at all"


ON_SQLITE = """
import json
from durable_agents import api
from durable_agents.models import Run, Step

one = api.start("noop", {"steps": 2}, idempotency_key="a")
runs = api.start_many("noop", [{"steps": 1}, {"steps": 2}, {"steps": 1}], idempotency_keys=["b", "a", "b"])
refused = []
for inputs, keys in (([{"steps": 1}, {"steps": "x"}], None), ([{"steps": 1}, {"steps": 3}], ["c", "a"])):
    try:
        api.start_many("noop", inputs, idempotency_keys=keys)
    except api.DurableAgentsError as exc:
        refused.append(type(exc).__name__)
print(json.dumps({
    "same": [runs[1].id == one.id, runs[0] is runs[2]],
    "runs": Run.objects.count(),
    "steps": sorted(Step.objects.values_list("run__idempotency_key", "step_id")),
    "refused": refused,
}))
"""


def test_start_many__on_sqlite_starts_what_it_starts_on_postgres(worker_env, tmp_path):
    env = {**worker_env, "DATABASE_URL": f"sqlite:///{tmp_path / 'embedded.sqlite3'}"}
    for command in (["migrate", "-v0"], ["shell", "-c", ON_SQLITE]):
        done = subprocess.run(
            [sys.executable, "-m", "django", *command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr[-2000:]
    shown = json.loads(done.stdout.strip().splitlines()[-1])
    assert shown == {
        "same": [True, True],
        "runs": 2,
        "steps": [["a", "tick-1"], ["a", "tick-2"], ["b", "tick-1"]],
        "refused": ["InvalidInputError", "IdempotencyKeyReusedError"],
    }, shown


def test_start__the_statement_stays_within_psycopg_s_parse_cache():
    """psycopg parses a query's placeholders once per text up to 4,096 bytes and 50 parameters (above, at every
    call): a column added to a run or a step must not push the start's statement past it."""
    from psycopg._queries import MAX_CACHED_STATEMENT_LENGTH, MAX_CACHED_STATEMENT_PARAMS

    from durable_agents.engine import startpath

    for shape in ((False, False), (True, False), (True, True)):
        sql = startpath._start_sql(*shape)
        assert len(sql.encode()) <= MAX_CACHED_STATEMENT_LENGTH, f"{len(sql.encode())} bytes: shorten {shape}"
        assert sql.count("%(") <= MAX_CACHED_STATEMENT_PARAMS

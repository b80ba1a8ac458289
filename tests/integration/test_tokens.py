"""The token economy: ledger, budgets, compaction and prompt caching, against the fake Messages API.

Runs are driven in-process through the real SDK. The fake model plays a ticker (`agent_ticks`): it calls
`tick(n)` with the next n until it reached the count the prompt asks for, and answers compaction requests
with a short structured summary. Assertions are on tokens, never on time.
"""

from __future__ import annotations

import json
import logging
import re
import socket
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from decimal import Decimal
from typing import Any

import anthropic
import psycopg
import pytest
from django.db import OperationalError, connection
from django.db.models import Sum
from django.test.utils import CaptureQueriesContext

from durable_agents import api, operations
from durable_agents.agents import unjournaled
from durable_agents.agents.claude import AnthropicParticipant
from durable_agents.agents.compaction import COMPACTION_INSTRUCTION, SUMMARY_OPEN
from durable_agents.agents.messages import Usage
from durable_agents.agents.participants import ModelRequest, ScriptedParticipant, participants, text, tool_use
from durable_agents.engine import turnpath
from durable_agents.models import Event, Run, RunStatus, Step, Turn
from durable_agents.testing import drive
from durable_agents.testing.fake_anthropic import FakeAnthropic, Fault, RecordedRequest, Reply

pytestmark = pytest.mark.django_db(transaction=True)
API_KEY = "sk-ant-test-secret-0123456789"
USAGE_FIELDS = ("input_tokens", "output_tokens", "cache_write_tokens", "cache_read_tokens")
SERVED_FIELDS = ("input_tokens", "output_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")


class MeteredFake(FakeAnthropic):
    """The fake server, summing the usage of every message it served (`billed`): what the API would bill."""

    def start(self) -> MeteredFake:
        super().start()
        # Headers and body go out in two writes: without TCP_NODELAY, Nagle and delayed ACKs add ~40 ms to
        # every request, 10 s to a 200-turn run. Accepted sockets inherit the option from the listener.
        self._server.socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return self

    def billed_total(self) -> tuple[int, ...]:
        return tuple(sum(u[name] for u in self.billed) for name in SERVED_FIELDS)

    def messages_requests(self) -> list[RecordedRequest]:
        return [r for r in self.requests if r.path == "/v1/messages"]


class Ticker:
    """The fake model's side: tick(n) with the next n, then "done"; once, a fault or reply instead of tick n."""

    def __init__(self) -> None:
        self.instead: dict[int, Reply | Fault] = {}

    def __call__(self, request: RecordedRequest) -> Reply | Fault:
        done = max((json.loads(r["content"])["n"] for r in request.tool_results if not r.get("is_error")), default=0)
        if COMPACTION_INSTRUCTION in request.last_user_text:
            return Reply.text(f"## Task\nTick as asked.\n## Done\ntick 1 to {done}.\n## Open\nContinue at {done + 1}.")
        wanted = int(re.search(r"tick tool (\d+) times", json.dumps(request.messages[0]["content"])).group(1))
        if done >= wanted:
            return Reply.text("done")
        if done + 1 in self.instead:
            return self.instead.pop(done + 1)
        return Reply.tool_use("tick", {"n": done + 1})


@pytest.fixture
def model(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[MeteredFake, Ticker]]:
    """This process's 'anthropic' participant talks to a metered fake server playing the ticker."""
    monkeypatch.setenv("ANTHROPIC_API_KEY", API_KEY)
    ticker = Ticker()
    with MeteredFake(responder=ticker) as fake:
        client = anthropic.Anthropic(api_key=API_KEY, base_url=fake.url, max_retries=0, timeout=5.0)
        previous = participants._participants.get("anthropic")
        participants.register("anthropic", AnthropicParticipant(client=client))
        yield fake, ticker
        participants._participants.pop("anthropic", None)
        if previous is not None:
            participants.register("anthropic", previous)


def prompt_tokens(turn: Turn) -> int:
    return turn.input_tokens + turn.cache_write_tokens + turn.cache_read_tokens


def agent_turns(run: Run) -> list[Turn]:
    return list(Turn.objects.filter(run=run, purpose="turn").order_by("index"))


def spent(run: Run) -> int:
    return sum(getattr(run, name) for name in USAGE_FIELDS)


def ticks_of(run: Run) -> list[int]:
    return [block["input"]["n"] for t in agent_turns(run) for block in t.content if block.get("type") == "tool_use"]


# --- ledger ----------------------------------------------------------------------------------------------------


def test_ledger__sums_match_the_usage_the_server_reported_including_retries(model):
    fake, ticker = model
    ticker.instead = {4: Fault.status(529), 11: Fault.status(500)}
    run = drive(api.start("agent_ticks", {"ticks": 40}).id)

    assert run.status == RunStatus.COMPLETED, run.error
    ledger = tuple(getattr(run, name) for name in USAGE_FIELDS)
    assert ledger == fake.billed_total(), "the run's counters must equal what the API billed, call for call"
    turns = Turn.objects.filter(run=run)
    sums = turns.aggregate(*(Sum(name) for name in USAGE_FIELDS), Sum("cost_usd"))
    assert tuple(sums[f"{name}__sum"] for name in USAGE_FIELDS) == ledger, "the turns are the ledger's lines"
    assert sums["cost_usd__sum"] == run.cost_usd > 0
    assert turns.filter(purpose="compaction").exists(), "compaction calls are billed and journaled too"
    assert len(fake.messages_requests()) == turns.count() + 2, "two failed attempts (not billed), each retried"
    assert Event.objects.filter(run=run, kind="step_retry").count() == 2

    shown = operations.describe_run(run.id)
    step = next(s for s in shown["step_rows"] if s["step_id"] == "ticker")
    assert (step["tokens"]["input"], step["tokens"]["cache_read"]) == (run.input_tokens, run.cache_read_tokens)
    assert shown["usage"]["cost_usd"] == str(run.cost_usd)


def test_ledger__a_billed_answer_that_fails_the_run_is_counted(model):
    fake, ticker = model
    ticker.instead = {3: Reply.text("I won't tick any more.", stop_reason="refusal")}
    run = drive(api.start("agent_ticks", {"ticks": 10}).id)

    assert run.status == RunStatus.FAILED and run.error["type"] == "ModelRefusalError"
    assert tuple(getattr(run, name) for name in USAGE_FIELDS) == fake.billed_total(), "the refusal was billed"


@contextmanager
def after_the_answer(participant: Any, monkeypatch: pytest.MonkeyPatch, *, turn: int) -> Iterator[dict[str, Any]]:
    """`state["answered"]` turns True once `participant` has answered request `turn` (of the whole run): what a
    fault injected below waits for, so it hits the journaling of a billed answer and nothing before it."""
    state: dict[str, Any] = {"answered": False, "asked": 0}
    real_respond = participant.respond

    def respond(request: ModelRequest) -> Any:
        response = real_respond(request)
        state["asked"] += 1
        if state["asked"] == turn + 1:
            state["answered"] = True
        return response

    monkeypatch.setattr(participant, "respond", respond)
    yield state


def lose_the_reply_of_the_next_commit(state: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Once `state["answered"]`, the next COMMIT is carried out, but its reply is lost, as when the connection dies
    inside COMMIT: the writer gets an error and cannot know whether its transaction committed."""
    real_commit = connection.commit
    state["lost"] = 0

    def commit() -> None:
        real_commit()
        if state["answered"] and not state["lost"]:
            state["lost"] += 1
            raise OperationalError("server closed the connection unexpectedly (the COMMIT's reply was lost)")

    monkeypatch.setattr(connection, "commit", commit)


def lose_the_reply_of_the_next_journal_statement(state: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Once `state["answered"]`, the next journal statement (one statement in autocommit on Postgres:
    engine/turnpath.py) is carried out, but its reply is lost: the writer cannot know whether it committed."""
    real_journal = turnpath.journal_turn
    state["lost"] = 0

    def journal_turn(*args: Any, **kwargs: Any) -> Any:
        turn = real_journal(*args, **kwargs)
        if state["answered"] and not state["lost"]:
            state["lost"] += 1
            raise OperationalError("server closed the connection unexpectedly (the journal's reply was lost)")
        return turn

    monkeypatch.setattr(turnpath, "journal_turn", journal_turn)


@pytest.mark.parametrize("lose", ["the statement's reply", "the COMMIT's reply"])
def test_ledger__a_journal_commit_whose_reply_was_lost_is_neither_asked_again_nor_counted_twice(
    lose, model, monkeypatch
):
    """The journal's retry on a fresh connection must first look for the Turn its failed write may have committed:
    writing it again would collide with itself (taken for another worker's), and counting it as unjournaled would
    bill it twice. On Postgres a turn is journaled in one statement; elsewhere (and with the statement turned off
    here) in a transaction whose COMMIT's reply is lost."""
    fake, _ticker = model
    with after_the_answer(participants.get("anthropic"), monkeypatch, turn=2) as state:
        if lose == "the statement's reply":
            lose_the_reply_of_the_next_journal_statement(state, monkeypatch)
        else:
            monkeypatch.setattr(turnpath, "is_available", lambda: False)
            lose_the_reply_of_the_next_commit(state, monkeypatch)
        run = drive(api.start("agent_ticks", {"ticks": 5}).id)

    assert state["lost"] == 1, "the journal's write was never hit"
    assert run.status == RunStatus.COMPLETED, run.error
    assert ticks_of(run) == [1, 2, 3, 4, 5]
    assert len(fake.messages_requests()) == Turn.objects.filter(run=run).count(), "a journaled turn was asked again"
    assert not Event.objects.filter(run=run, kind="unjournaled_usage").exists(), "a journaled answer counted twice"
    assert tuple(getattr(run, name) for name in USAGE_FIELDS) == fake.billed_total()


def test_ledger__a_verdict_whose_journal_commit_reply_was_lost_is_journaled_once(monkeypatch):
    """The same for a judge's call (journaled at the step's next index): the retry finds the verdict it wrote."""
    with after_the_answer(participants.get("reviewer"), monkeypatch, turn=0) as state:
        lose_the_reply_of_the_next_commit(state, monkeypatch)
        run = drive(api.start("judged_redo").id)

    assert state["lost"] == 1, "the COMMIT of the verdict's journal was never hit"
    verdicts = Turn.objects.filter(run=run, purpose="judge")
    assert run.status == RunStatus.COMPLETED, run.error
    assert verdicts.count() == 2, "one verdict per review (the failing one, then the one after the redo), each once"
    assert not Event.objects.filter(run=run, kind="unjournaled_usage").exists(), "a journaled verdict counted twice"
    assert spent(run) == sum(spent(t) for t in verdicts)


class _Trigger(logging.Handler):
    """Calls `then()` when a record at ERROR or above containing `text` is logged."""

    def __init__(self, text: str, then: Any) -> None:
        super().__init__(logging.ERROR)
        self.text, self.then = text, then

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.then()


def test_ledger__an_answer_the_database_never_took_is_logged_kept_and_counted_once_it_is_back(
    model, monkeypatch, caplog
):
    """The database goes away right after an answer: the journal, its retry on a fresh connection and the count of
    the unjournaled usage all fail to connect. The worker says so at ERROR, with the numbers, and keeps the figure;
    the database is back once it has said so, and the figure is recorded after the worker's next journal write."""
    fake, _ticker = model
    real_connect = connection.get_new_connection
    outage = {"over": False, "refused": 0}
    back = _Trigger("billed usage not recorded", lambda: outage.update(over=True))
    logging.getLogger("durable_agents.engine").addHandler(back)
    try:
        with after_the_answer(participants.get("anthropic"), monkeypatch, turn=1) as state:

            def connect(conn_params: dict[str, Any]) -> Any:
                # The step gave its connection back before the model call: the journal connects after the answer.
                if state["answered"] and not outage["over"]:
                    outage["refused"] += 1
                    raise psycopg.OperationalError("connection refused (the database is away)")
                return real_connect(conn_params)

            monkeypatch.setattr(connection, "get_new_connection", connect)
            run = drive(api.start("agent_ticks", {"ticks": 3}).id)
    finally:
        logging.getLogger("durable_agents.engine").removeHandler(back)

    assert outage["refused"] >= 3, f"the outage refused {outage['refused']} connections: it missed the journal"
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR and "not recorded" in r.getMessage()]
    assert len(lines) == 1, lines
    lost = fake.billed[1]  # the second answer: the one the database never took
    assert f"input_tokens={lost['input_tokens']} output_tokens={lost['output_tokens']}" in lines[0], lines[0]
    assert run.status == RunStatus.COMPLETED, run.error
    events = list(Event.objects.filter(run=run, kind="unjournaled_usage"))
    assert [e.detail.get("late") for e in events] == [True], [e.detail for e in events]
    assert not unjournaled.owed(), "the worker still owes what it recorded"
    assert tuple(getattr(run, name) for name in USAGE_FIELDS) == fake.billed_total(), (
        "the run's counters must equal what the API billed: the answer the database never took was billed"
    )


def test_ledger__an_answer_whose_journal_connections_died_is_counted_at_once_on_a_live_connection(
    model, monkeypatch, caplog
):
    """The journal's write dies with its connection, and so does its retry on a fresh one (a failover ending the
    worker's connections); then one more connection is refused. The count of the billed usage has two chances to
    record it at once — this thread's connection, then a fresh one — and a connection known dead is no chance: one
    statement in autocommit leaves it on the thread (where a transaction's failed rollback closed it), so it is
    dropped first and both attempts reach the database."""
    fake, _ticker = model
    real_journal, real_connect = turnpath.journal_turn, connection.get_new_connection
    state_of = {"ended": 0, "refuse": 0}

    def journal_turn(*args: Any, **kwargs: Any) -> Any:
        if state["answered"] and state_of["ended"] < 2:
            connection.ensure_connection()
            with psycopg.connect(_admin_dsn(), autocommit=True) as admin:
                admin.execute("SELECT pg_terminate_backend(%s, 10000)", [connection.connection.info.backend_pid])
            state_of["ended"] += 1
            state_of["refuse"] = 1 if state_of["ended"] == 2 else 0  # the next connection is refused, once
        return real_journal(*args, **kwargs)

    def connect(conn_params: dict[str, Any]) -> Any:
        if state_of["refuse"]:
            state_of["refuse"] -= 1
            raise psycopg.OperationalError("connection refused (the database is failing over)")
        return real_connect(conn_params)

    with after_the_answer(participants.get("anthropic"), monkeypatch, turn=1) as state:
        monkeypatch.setattr(turnpath, "journal_turn", journal_turn)
        monkeypatch.setattr(connection, "get_new_connection", connect)
        run = drive(api.start("agent_ticks", {"ticks": 3}).id)

    assert state_of["ended"] == 2, "the journal's write and its retry were not both hit"
    assert not [r.getMessage() for r in caplog.records if "not recorded" in r.getMessage()], (
        "the billed usage was owed by the process instead of recorded: one of its two chances went to a dead connection"
    )
    events = list(Event.objects.filter(run=run, kind="unjournaled_usage"))
    assert [e.detail.get("late") for e in events] == [None], [e.detail for e in events]
    assert run.status == RunStatus.COMPLETED, run.error
    assert tuple(getattr(run, name) for name in USAGE_FIELDS) == fake.billed_total()


def _admin_dsn() -> str:
    db = connection.settings_dict
    return psycopg.conninfo.make_conninfo(
        dbname=db["NAME"], user=db["USER"] or None, host=db["HOST"] or None, port=db["PORT"] or None
    )


def test_ledger__billed_usage_of_a_run_deleted_meanwhile_is_dropped_not_owed_forever(caplog):
    """A run deleted (retention) while its answer was counted has nothing left to count against: the count is
    dropped, not kept owed by the process, where it would fail again after every journal write."""
    gone = unjournaled.Unjournaled(
        run_id=uuid.uuid4(),
        step_pk=0,
        step_id="ticker",
        index=3,
        usage=Usage(input_tokens=100, output_tokens=20),
        cost=Decimal("0.0004"),
        reason="lease lost",
    )
    unjournaled.count_unjournaled(gone)
    assert not unjournaled.owed(), "the usage of a deleted run is owed by the process"
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], "a deleted run is no database failure"


# --- budgets ---------------------------------------------------------------------------------------------------


def test_budget__stops_before_the_call_that_would_exceed_it_also_after_a_resume(model):
    fake, _ticker = model
    run = api.start("agent_ticks", {"ticks": 60})
    api.set_budget(run.id, tokens=15_000)

    run = drive(run.id)
    assert run.status == RunStatus.FAILED and run.error["type"] == "BudgetExceededError", run.error
    assert f"durable_budget {run.id} --tokens" in run.error["message"]
    assert f"durable_resume {run.id}" in run.error["message"]
    first_stop = len(agent_turns(run))
    _assert_stopped_short_of(run, budget=15_000, fake=fake)

    api.set_budget(run.id, tokens=40_000, actor="ops")
    run = drive(api.resume(run.id).id)
    assert run.status == RunStatus.FAILED and run.error["type"] == "BudgetExceededError", run.error
    assert len(agent_turns(run)) > first_stop, "the raised budget let the run go on"
    _assert_stopped_short_of(run, budget=40_000, fake=fake)

    api.set_budget(run.id, tokens=10_000_000)
    run = drive(api.resume(run.id).id)
    assert run.status == RunStatus.COMPLETED, run.error
    assert ticks_of(run) == list(range(1, 61)), "every tick once, in order, across both stops"
    assert len(fake.messages_requests()) == Turn.objects.filter(run=run).count(), "no turn was asked twice"


def _assert_stopped_short_of(run: Run, *, budget: int, fake: MeteredFake) -> None:
    assert spent(run) <= budget, f"the run spent {spent(run)} tokens, over its budget of {budget}"
    assert len(fake.messages_requests()) == Turn.objects.filter(run=run).count(), "a call was sent past the budget"
    last = agent_turns(run)[-1]
    next_call = prompt_tokens(last) + 2 * 256 + 400  # the next prompt, its max_tokens, and a margin
    assert spent(run) + next_call > budget, "the run stopped long before its budget was near"


def test_budget__the_workflow_budget_holds_until_the_run_overrides_it(model):
    run = drive(api.start("agent_ticks_capped", {"ticks": 30}).id)
    assert run.status == RunStatus.FAILED and run.error["type"] == "BudgetExceededError"
    assert spent(run) <= 12_000 and "of its 12000 tokens" in run.error["message"]

    api.set_budget(run.id, tokens=1_000_000)
    run = drive(api.resume(run.id).id)
    assert run.status == RunStatus.COMPLETED, run.error


def test_budget__a_cost_budget_stops_the_run_too(model):
    run = api.start("agent_ticks", {"ticks": 60})
    api.set_budget(run.id, cost_usd="0.02")
    run = drive(run.id)
    assert run.status == RunStatus.FAILED and run.error["type"] == "BudgetExceededError"
    assert run.cost_usd <= Decimal("0.02") and f"durable_budget {run.id} --cost" in run.error["message"]


# --- compaction and caching -----------------------------------------------------------------------------------


def test_compaction__a_200_turn_run_compacts_and_its_prompt_stays_flat_also_on_resume(model):
    fake, ticker = model
    ticker.instead = {150: Fault.status(400)}  # a permanent failure at tick 150: the run stops, then resumes
    run = drive(api.start("agent_ticks", {"ticks": 200}).id)
    assert run.status == RunStatus.FAILED and run.error["type"] == "ModelRequestError"
    failed_request = fake.messages_requests()[-1]

    with CaptureQueriesContext(connection) as queries:
        run = drive(api.resume(run.id).id)
    assert run.status == RunStatus.COMPLETED, run.error

    turns = agent_turns(run)
    assert ticks_of(run) == list(range(1, 201)) and len(turns) == 201
    step = Step.objects.get(run=run, step_id="ticker")
    assert step.result["turns"] == 201
    compactions = Turn.objects.filter(run=run, purpose="compaction").count()
    assert compactions >= 5 and Event.objects.filter(run=run, kind="compacted").count() == compactions
    assert step.context["covers_until"] > 150 and "tick 1 to" in step.context["summary"]

    at_20, last = prompt_tokens(turns[20]), prompt_tokens(turns[-1])
    resumed = next(t for t in turns if any(b.get("input", {}).get("n") == 150 for b in t.content))
    assert at_20 > 2000, "the conversation should have grown by turn 20"
    assert last <= 2 * at_20, f"the last prompt ({last} tokens) grew with history (turn 20: {at_20})"
    assert prompt_tokens(resumed) <= 2 * at_20, f"the resumed prompt ({prompt_tokens(resumed)}) grew with history"
    assert max(prompt_tokens(t) for t in turns) <= 4000 + 2 * 256 + 400, "a prompt outgrew the compaction threshold"

    resumed_request = next(r for r in fake.messages_requests() if r.time > failed_request.time)
    assert resumed_request.messages == failed_request.messages, "a resume rebuilds exactly the prompt it had"
    assert resumed.cache_read_tokens > 0.8 * prompt_tokens(resumed), "the resumed prompt is a cache read"
    journal_reads = [q["sql"] for q in queries.captured_queries if 'FROM "durable_agents_turn"' in q["sql"]]
    assert journal_reads and all('"index" >=' in sql for sql in journal_reads if "SELECT" in sql[:10]), (
        "a resume must read the turns since the last compaction only, not the whole journal"
    )


def test_cache__a_resumed_runs_first_request_reads_the_cached_prefix(model):
    fake, ticker = model
    ticker.instead = {8: Fault.status(400)}
    run = drive(api.start("agent_ticks", {"ticks": 12}).id)
    assert run.status == RunStatus.FAILED
    before = agent_turns(run)[-1]

    run = drive(api.resume(run.id).id)
    assert run.status == RunStatus.COMPLETED, run.error
    first_after = Turn.objects.get(run=run, index=before.index + 1)
    assert first_after.cache_read_tokens >= 0.95 * prompt_tokens(before), (
        "the resumed request must read (about) the whole previous prompt from the cache"
    )
    assert run.cache_read_tokens > 0 and run.cache_write_tokens > 0, "cache reads and writes are in the ledger"
    body = fake.messages_requests()[-1].body
    assert "cache_control" in body["tools"][-1] and "cache_control" in body["system"][-1]
    assert "cache_control" in body["messages"][-1]["content"][-1], "the conversation so far is a breakpoint"


def test_compaction__a_scripted_participant_compacts_with_a_deterministic_summary():
    def script(request: ModelRequest) -> list[dict[str, Any]]:
        done = max((json.loads(r["content"])["n"] for r in request.tool_results), default=0)
        return [text("done")] if done >= 60 else [tool_use("tick", {"n": done + 1})]

    participants.register("ticker-script", ScriptedParticipant(script, name="ticker-script"))
    run = api.start("agent_ticks", {"ticks": 60})
    api.swap_participant(run.id, "ticker-script")
    run = drive(run.id)

    assert run.status == RunStatus.COMPLETED, run.error
    assert ticks_of(run) == list(range(1, 61))
    ids = [b["id"] for t in agent_turns(run) for b in t.content if b.get("type") == "tool_use"]
    assert len(set(ids)) == len(ids), "tool_use ids must stay unique after compaction (they key effects)"
    context = Step.objects.get(run=run, step_id="ticker").context
    summary = json.loads(context["summary"])
    folded_compactions = Turn.objects.filter(run=run, purpose="compaction", index__lt=context["covers_until"]).count()
    covered = context["covers_until"] - folded_compactions
    assert summary["turns"] == summary["calls"]["tick"] == covered, "the summary counts every folded turn"
    assert len(summary["recent"]) <= 5, "the deterministic summary is bounded"
    assert SUMMARY_OPEN not in context["summary"]

"""What one conversation costs the database on Postgres: its statements, each written once, none compiled by the ORM.

The bench's conversation (bench/scale_agent.py: a tool call, then the answer; its tool an external effect) is advanced
in this process against the fake Messages API, every statement Django sends counted — with the BEGIN and COMMIT of a
transaction, which Django logs as statements: each is a round trip. The claim and the commit are one statement each
(engine/hotpath.py), a model turn two (the lease proven with the spend read, then the journal: engine/turnpath.py),
an external effect two (its outbox row under the lease proof, then its outcome) and the turn's tool results one, which
proves the lease for the turn after it: that turn is its journal alone.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from django.db import connection
from django.db.models.sql.query import Query
from django.test.utils import CaptureQueriesContext

from bench.scale_agent import WORKFLOW, answer
from durable_agents import api
from durable_agents.engine.advance import Outcome, advance
from durable_agents.models import Effect, EffectStatus, Run, RunStatus, Turn

pytestmark = pytest.mark.django_db(transaction=True)

CLAIM, STEP_JOURNAL, COMMIT = 1, 1, 1
PER_TURN = 2  # the lease proven (with the spend), the answer journaled
JOURNAL = 1  # a turn after tool results: the answer journaled (its proof was the results' write)
PER_EFFECT = 2  # the outbox row under the lease proof, the outcome
TOOL_RESULTS = 1  # and the lease proven (with the spend) for the next turn, which saves that turn its own proof


@pytest.fixture
def compiled(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Every ORM query compiled meanwhile: the model of each."""
    seen: list[str] = []
    get_compiler = Query.get_compiler

    def counting(self: Query, *args: object, **kwargs: object) -> object:
        seen.append(self.model.__name__ if self.model else "?")
        return get_compiler(self, *args, **kwargs)

    monkeypatch.setattr(Query, "get_compiler", counting)
    yield seen


def test_a_conversation_of_two_turns_and_one_effect_is_nine_statements_and_no_orm_query(fake_anthropic, compiled):
    fake_anthropic.responder = answer
    run = api.start(WORKFLOW, {"order_id": "A-1"})
    compiled.clear()
    with CaptureQueriesContext(connection) as queries:
        assert advance(run.id) is Outcome.COMPLETED
    sent = [q["sql"] for q in queries.captured_queries]

    assert len(sent) == CLAIM + STEP_JOURNAL + PER_TURN + PER_EFFECT + TOOL_RESULTS + JOURNAL + COMMIT, "\n".join(sent)
    # The second turn's proof is the tool results' write: the journal follows it, the model call between them.
    results = next(i for i, sql in enumerate(sent) if "SET tool_results" in sql)
    assert "lease_expires_at" in sent[results] and "RETURNING" in sent[results]
    assert "INSERT INTO" in sent[results + 1] and "durable_agents_turn" in sent[results + 1], sent[results + 1]
    assert compiled == [], "the conversation's hot path compiled ORM queries"
    assert not any(s.strip().upper() in ("BEGIN", "COMMIT") for s in sent), "each statement is its own transaction"
    # And it wrote what the ORM path writes.
    run = Run.objects.get(pk=run.id)
    assert run.status == RunStatus.COMPLETED
    turns = list(Turn.objects.filter(run=run).order_by("index"))
    assert [t.stop_reason for t in turns] == ["tool_use", "end_turn"]
    assert turns[0].tool_results and turns[0].tool_results[0]["type"] == "tool_result"
    assert run.input_tokens == sum(t.input_tokens for t in turns) > 0
    assert run.cost_usd == sum(t.cost_usd for t in turns) > 0
    effect = Effect.objects.get(run=run)
    assert (effect.status, effect.attempts, effect.result["status"]) == (EffectStatus.APPLIED, 1, "delivered")
    assert effect.applied_at is not None
    assert run.steps.get().frozen_request["model"] == turns[0].model

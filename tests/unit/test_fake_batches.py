"""The fake Anthropic API's Message Batches endpoints, exercised through the real `anthropic` SDK over loopback.

Each rule cites the documentation page it was written from.
"""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import anthropic
import pytest

from durable_agents.testing.fake_anthropic import FakeAnthropic, Fault, RecordedRequest, Reply

GUIDE = "https://platform.claude.com/docs/en/build-with-claude/batch-processing"
CREATE_DOCS = "https://platform.claude.com/docs/en/api/creating-message-batches"
RETRIEVE_DOCS = "https://platform.claude.com/docs/en/api/retrieving-message-batches"
LIST_DOCS = "https://platform.claude.com/docs/en/api/listing-message-batches"
CANCEL_DOCS = "https://platform.claude.com/docs/en/api/canceling-message-batches"
DELETE_DOCS = "https://platform.claude.com/docs/en/api/deleting-message-batches"
RESULTS_DOCS = "https://platform.claude.com/docs/en/api/retrieving-message-batch-results"

MODEL = "claude-fake-1"


@pytest.fixture
def fake() -> Iterator[FakeAnthropic]:
    with FakeAnthropic() as server:
        yield server


@pytest.fixture
def client(fake: FakeAnthropic) -> anthropic.Anthropic:
    return fake.client(max_retries=0)


def params(text: str = "hello", conversation: str | None = None, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 64, "messages": [{"role": "user", "content": text}]}
    if conversation:
        body["metadata"] = {"user_id": conversation}
    return {**body, **extra}


def requests(*custom_ids: str) -> list[dict[str, Any]]:
    return [{"custom_id": cid, "params": params(cid, conversation=f"conv-{cid}")} for cid in custom_ids]


def results(client: anthropic.Anthropic, batch_id: str) -> dict[str, Any]:
    return {line.custom_id: line.result for line in client.messages.batches.results(batch_id)}


def raw(fake: FakeAnthropic, method: str, path: str, body: Any = None, key: bool = True) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    headers = {"content-type": "application/json", **({"x-api-key": "test-key"} if key else {})}
    request = urllib.request.Request(fake.url + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


# -- create, retrieve, results ------------------------------------------------------------------------------------


def test_batches_create__returns_an_in_progress_message_batch(fake: FakeAnthropic, client: anthropic.Anthropic) -> None:
    # CREATE_DOCS / RETRIEVE_DOCS: the MessageBatch object; expires_at is 24 hours after creation.
    fake.hold_batches()

    batch = client.messages.batches.create(requests=requests("a", "b"))  # type: ignore[arg-type]

    assert batch.id.startswith("msgbatch_") and batch.type == "message_batch"
    assert batch.processing_status == "in_progress"
    counts = batch.request_counts
    assert (counts.processing, counts.succeeded, counts.errored, counts.canceled, counts.expired) == (2, 0, 0, 0, 0)
    assert batch.expires_at - batch.created_at == timedelta(hours=24), "expires_at must be created_at + 24 h"
    assert (batch.ended_at, batch.archived_at, batch.cancel_initiated_at, batch.results_url) == (None,) * 4
    assert [(b.id, b.custom_ids, b.request_count) for b in fake.batches] == [(batch.id, ["a", "b"], 2)]
    assert fake.batch_creates == 1 and fake.batch_requests_answered == 0, "a held batch must not be answered yet"


def test_batches_results__each_request_answered_like_a_live_one(
    fake: FakeAnthropic, client: anthropic.Anthropic
) -> None:
    # RESULTS_DOCS: one JSON line per request, matched by custom_id; succeeded carries the Message.
    fake.responder = lambda request: Reply.text(f"echo {request.last_user_text}")
    batch = client.messages.batches.create(requests=requests("a", "b"))  # type: ignore[arg-type]

    ended = client.messages.batches.retrieve(batch.id)
    lines = results(client, batch.id)

    assert ended.processing_status == "ended" and ended.ended_at is not None
    assert (ended.request_counts.succeeded, ended.request_counts.processing) == (2, 0)
    assert ended.results_url == f"{fake.url}/v1/messages/batches/{batch.id}/results", "results_url must be absolute"
    assert set(lines) == {"a", "b"}
    for custom_id, result in lines.items():
        assert result.type == "succeeded"
        thinking, text = result.message.content
        assert thinking.type == "thinking" and thinking.signature, "a batched reply is built like a live one"
        assert text.text == f"echo {custom_id}"
        assert result.message.usage.input_tokens >= 1
    assert fake.batch_requests_answered == 2


def test_batches_results__a_batched_thinking_block_is_accepted_back_live(
    fake: FakeAnthropic, client: anthropic.Anthropic
) -> None:
    # GUIDE: a batch request is a Messages request; its signed thinking block continues the conversation live.
    batch = client.messages.batches.create(requests=requests("a"))  # type: ignore[arg-type]
    client.messages.batches.retrieve(batch.id)
    message = results(client, batch.id)["a"].message

    follow_up = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": [block.model_dump() for block in message.content]},
        {"role": "user", "content": "and then?"},
    ]
    reply = client.messages.create(model=MODEL, max_tokens=64, messages=follow_up)  # type: ignore[arg-type]

    assert reply.stop_reason == "end_turn", "the fake must accept the thinking block it signed in a batch"


def test_batches_results__before_the_batch_ended_are_refused(fake: FakeAnthropic, client: anthropic.Anthropic) -> None:
    # RETRIEVE_DOCS: results_url is set only once processing ended; GUIDE: results are available once the whole
    # batch ended. The SDK refuses without a results_url; the URL itself answers 400 until then.
    fake.hold_batches()
    batch = client.messages.batches.create(requests=requests("a"))  # type: ignore[arg-type]

    with pytest.raises(anthropic.AnthropicError, match="results_url"):
        results(client, batch.id)
    status, body = raw(fake, "GET", f"/v1/messages/batches/{batch.id}/results")

    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    assert "not finished processing" in body["error"]["message"]


def test_batches__unknown_id_is_404(fake: FakeAnthropic, client: anthropic.Anthropic) -> None:
    # RETRIEVE_DOCS: the batch is addressed by id; an id that does not exist is not_found_error.
    for call in (client.messages.batches.retrieve, client.messages.batches.cancel, client.messages.batches.delete):
        with pytest.raises(anthropic.NotFoundError):
            call("msgbatch_01nosuchbatch")


def test_batches__without_an_api_key_is_401(fake: FakeAnthropic) -> None:
    # https://platform.claude.com/docs/en/api/errors: 401 authentication_error, as for the Messages endpoints.
    status, body = raw(fake, "POST", "/v1/messages/batches", {"requests": requests("a")}, key=False)

    assert status == 401 and body["error"]["type"] == "authentication_error"
    assert fake.batch_creates == 0


# -- the create call's own rules -----------------------------------------------------------------------------


@pytest.mark.parametrize("custom_id", ["", "has space", "x" * 65, "dots.are.out"])
def test_batches_create__custom_id_outside_the_pattern_is_refused(
    fake: FakeAnthropic, client: anthropic.Anthropic, custom_id: str
) -> None:
    # CREATE_DOCS: custom_id is 1 to 64 of [a-zA-Z0-9_-].
    body = [{"custom_id": "ok", "params": params()}, {"custom_id": custom_id, "params": params()}]
    with pytest.raises(anthropic.BadRequestError, match=r"requests\.1\.custom_id"):
        client.messages.batches.create(requests=body)  # type: ignore[arg-type]
    assert fake.batch_creates == 0


def test_batches_create__duplicate_custom_id_is_refused(fake: FakeAnthropic, client: anthropic.Anthropic) -> None:
    # CREATE_DOCS: custom_id "Must be unique for each request within the Message Batch".
    with pytest.raises(anthropic.BadRequestError, match=r"requests\.2\.custom_id: Duplicate custom_id 'a'"):
        client.messages.batches.create(requests=requests("a", "b", "a"))  # type: ignore[arg-type]
    assert fake.batch_creates == 0


def test_batches_create__needs_at_least_one_request(fake: FakeAnthropic) -> None:
    # CREATE_DOCS / GUIDE: a batch holds 1 to 100,000 requests.
    status, body = raw(fake, "POST", "/v1/messages/batches", {"requests": []})

    assert status == 400 and body["error"]["message"].startswith("requests: List should have at least 1 item")


def test_batches_create__a_body_over_256_mb_is_413(fake: FakeAnthropic) -> None:
    # GUIDE: a batch is limited to 256 MB. The declared size is enough: the fake reads (and drops) what comes.
    host, port = fake.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/messages/batches HTTP/1.1\r\nhost: fake\r\nx-api-key: k\r\n"
            b"content-type: application/json\r\ncontent-length: %d\r\n\r\n{" % (256 * 1024 * 1024 + 1)
        )
        sock.shutdown(socket.SHUT_WR)
        answer = sock.makefile("rb").read()

    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b"request_too_large" in answer and fake.batch_creates == 0


# -- each request answered as a live one -----------------------------------------------------------------------


def test_batches_results__a_refused_request_is_errored_with_the_live_message(
    fake: FakeAnthropic, client: anthropic.Anthropic
) -> None:
    # GUIDE: params are validated as the Messages API would, and a refused request ends errored; the batch stands.
    bad = params(temprature=0.5)
    with pytest.raises(anthropic.BadRequestError) as live:
        client.messages.create(**params(), extra_body={"temprature": 0.5})
    live_message = live.value.body["error"]["message"]  # type: ignore[index]

    batch = client.messages.batches.create(  # type: ignore[arg-type]
        requests=[{"custom_id": "bad", "params": bad}, {"custom_id": "good", "params": params()}]
    )
    client.messages.batches.retrieve(batch.id)
    lines = results(client, batch.id)

    assert lines["bad"].type == "errored"
    assert lines["bad"].error.error.type == "invalid_request_error"
    assert lines["bad"].error.error.message == live_message, "a batched refusal must say what the live one says"
    assert lines["good"].type == "succeeded"


def test_batches_results__stream_in_params_is_errored(fake: FakeAnthropic, client: anthropic.Anthropic) -> None:
    # GUIDE: a few Messages parameters are not supported in a batch and fail validation; streaming is one.
    batch = client.messages.batches.create(  # type: ignore[arg-type]
        requests=[{"custom_id": "s", "params": params(stream=True)}]
    )
    client.messages.batches.retrieve(batch.id)
    result = results(client, batch.id)["s"]

    assert result.type == "errored" and result.error.error.type == "invalid_request_error"
    assert result.error.error.message.startswith("stream:")


def test_batches_results__a_fault_is_errored_with_its_type(fake: FakeAnthropic, client: anthropic.Anthropic) -> None:
    # RESULTS_DOCS: errored carries the error response; a request's own failure does not fail the batch.
    fake.enqueue(Reply.text("first"), Fault.status(529), Fault.reset(), Fault.retired_model())
    batch = client.messages.batches.create(requests=requests("a", "b", "c", "d"))  # type: ignore[arg-type]

    counts = client.messages.batches.retrieve(batch.id).request_counts
    lines = results(client, batch.id)

    assert (counts.succeeded, counts.errored) == (1, 3)
    assert lines["a"].type == "succeeded"
    assert lines["b"].error.error.type == "overloaded_error"
    assert lines["c"].error.error.type == "api_error", "a dropped connection inside a batch is a server error"
    assert (lines["d"].error.error.type, lines["d"].error.error.message) == ("not_found_error", f"model: {MODEL}")


def test_batches_results__expired_and_canceled_faults_end_those_requests(
    fake: FakeAnthropic, client: anthropic.Anthropic
) -> None:
    # RESULTS_DOCS: a request that was not processed ends canceled or expired, with no message.
    fake.enqueue(Fault.expired(), Fault.canceled())
    batch = client.messages.batches.create(requests=requests("a", "b", "c"))  # type: ignore[arg-type]

    counts = client.messages.batches.retrieve(batch.id).request_counts
    lines = results(client, batch.id)

    assert (counts.expired, counts.canceled, counts.succeeded) == (1, 1, 1)
    assert [lines[c].type for c in ("a", "b", "c")] == ["expired", "canceled", "succeeded"]


def test_fault_expired__served_live_is_a_500_saying_batch_only(
    fake: FakeAnthropic, client: anthropic.Anthropic
) -> None:
    fake.enqueue(Fault.expired())
    with pytest.raises(anthropic.InternalServerError, match="batch"):
        client.messages.create(**params())


def test_batches__a_batch_past_its_expiry_ends_with_requests_expired(
    fake: FakeAnthropic, client: anthropic.Anthropic
) -> None:
    # GUIDE: a batch not done within 24 hours expires; its unprocessed requests end expired (here: 0 s, held).
    fake.hold_batches()
    fake.responder = lambda request: pytest.fail("an expired request must never be answered")
    fake.batch_expire_after_seconds = 0.0
    batch = client.messages.batches.create(requests=requests("a", "b"))  # type: ignore[arg-type]

    ended = client.messages.batches.retrieve(batch.id)

    assert ended.processing_status == "ended" and ended.request_counts.expired == 2
    assert {r.type for r in results(client, batch.id).values()} == {"expired"}
    assert fake.batch_requests_answered == 0 and not fake.errors


# -- processing time, hold, release, end ------------------------------------------------------------------------


def test_batches__held_batches_stay_in_progress_until_released(
    fake: FakeAnthropic, client: anthropic.Anthropic
) -> None:
    # RETRIEVE_DOCS: every request counts as processing until the whole batch ends.
    fake.hold_batches()
    batch = client.messages.batches.create(requests=requests("a"))  # type: ignore[arg-type]

    held = client.messages.batches.retrieve(batch.id)
    fake.release_batches()
    released = client.messages.batches.retrieve(batch.id)

    assert (held.processing_status, held.request_counts.processing) == ("in_progress", 1)
    assert (released.processing_status, released.request_counts.succeeded) == ("ended", 1)


def test_batches__end_batches_answers_the_requests_in_order(fake: FakeAnthropic, client: anthropic.Anthropic) -> None:
    seen: list[str] = []
    fake.responder = lambda request: seen.append(request.last_user_text)  # type: ignore[func-returns-value]
    fake.batch_processing_seconds = 3600.0
    batch = client.messages.batches.create(requests=requests("c", "a", "b"))  # type: ignore[arg-type]
    assert client.messages.batches.retrieve(batch.id).processing_status == "in_progress"
    assert seen == [], "requests are answered when the batch ends, not when it is created"

    fake.end_batches()

    assert seen == ["c", "a", "b"]
    assert client.messages.batches.retrieve(batch.id).processing_status == "ended"


def test_batches__a_batch_ends_after_its_processing_time(fake: FakeAnthropic, client: anthropic.Anthropic) -> None:
    # CREATE_DOCS: processing starts at creation; the fake ends a batch `batch_processing_seconds` later.
    fake.batch_processing_seconds = 3600.0
    batch = client.messages.batches.create(requests=requests("a"))  # type: ignore[arg-type]
    assert client.messages.batches.retrieve(batch.id).processing_status == "in_progress"

    fake.batch_processing_seconds = 0.01
    deadline = time.monotonic() + 30  # generous: a condition waited on, never a duration asserted
    while client.messages.batches.retrieve(batch.id).processing_status != "ended":
        assert time.monotonic() < deadline, "a batch past its processing time must end when it is next retrieved"
        time.sleep(0.01)

    assert fake.batch_requests_answered == 1


# -- list, cancel, delete --------------------------------------------------------------------------------------


def test_batches_list__newest_first_and_paginated(fake: FakeAnthropic, client: anthropic.Anthropic) -> None:
    # LIST_DOCS: most recently created first; limit (default 20, 1 to 1000); after_id pages on, before_id back.
    ids = [client.messages.batches.create(requests=requests("a")).id for _ in range(5)]  # type: ignore[arg-type]
    newest_first = ids[::-1]

    first = client.messages.batches.list(limit=2)
    walked = [batch.id for batch in client.messages.batches.list(limit=2)]  # the SDK follows after_id
    back = client.messages.batches.list(limit=2, before_id=newest_first[3])

    assert [b.id for b in first.data] == newest_first[:2]
    assert (first.has_more, first.first_id, first.last_id) == (True, newest_first[0], newest_first[1])
    assert walked == newest_first
    assert [b.id for b in back.data] == newest_first[1:3] and back.has_more is True
    assert [b.id for b in client.messages.batches.list().data] == newest_first, "the default limit is 20"
    with pytest.raises(anthropic.BadRequestError, match="limit"):
        client.messages.batches.list(limit=1001)


def test_batches_cancel__unprocessed_requests_end_canceled(fake: FakeAnthropic, client: anthropic.Anthropic) -> None:
    # CANCEL_DOCS: the batch enters canceling, then ends; its unprocessed requests are canceled.
    fake.hold_batches()
    batch = client.messages.batches.create(requests=requests("a", "b"))  # type: ignore[arg-type]

    canceling = client.messages.batches.cancel(batch.id)
    still = client.messages.batches.retrieve(batch.id)
    fake.release_batches()
    ended = client.messages.batches.retrieve(batch.id)

    assert canceling.processing_status == "canceling" and canceling.cancel_initiated_at is not None
    assert still.processing_status == "canceling", "a held batch stays canceling"
    assert (ended.processing_status, ended.request_counts.canceled) == ("ended", 2)
    assert {r.type for r in results(client, batch.id).values()} == {"canceled"}
    assert fake.batch_requests_answered == 0 and fake.count("conv-a", 0) == 0, "canceled requests were never asked"


def test_batches_delete__only_once_ended(fake: FakeAnthropic, client: anthropic.Anthropic) -> None:
    # DELETE_DOCS: "Message Batches can only be deleted once they've finished processing."
    fake.hold_batches()
    batch = client.messages.batches.create(requests=requests("a"))  # type: ignore[arg-type]

    with pytest.raises(anthropic.BadRequestError, match="still processing"):
        client.messages.batches.delete(batch.id)
    client.messages.batches.cancel(batch.id)
    fake.end_batches()
    deleted = client.messages.batches.delete(batch.id)

    assert (deleted.id, deleted.type) == (batch.id, "message_batch_deleted")
    with pytest.raises(anthropic.NotFoundError):
        client.messages.batches.retrieve(batch.id)
    assert client.messages.batches.list().data == []


# -- faults of the batch endpoints themselves, the request log -----------------------------------------------


def test_fail_batch_call__after_create_the_batch_exists_but_the_client_cannot_know(
    fake: FakeAnthropic, client: anthropic.Anthropic
) -> None:
    fake.fail_batch_call("create", Fault.reset(), after=True)

    with pytest.raises(anthropic.APIConnectionError):
        client.messages.batches.create(requests=requests("a"))  # type: ignore[arg-type]

    assert fake.batch_creates == 1, "after=True: the create took effect before the connection dropped"
    assert [b.custom_ids for b in fake.batches] == [["a"]]
    assert [b.id for b in client.messages.batches.list().data] == [fake.batches[0].id]


def test_fail_batch_call__before_the_call_nothing_happens(fake: FakeAnthropic, client: anthropic.Anthropic) -> None:
    fake.fail_batch_call("create", Fault.status(529))
    fake.fail_batch_call("retrieve", Fault.status(500))

    with pytest.raises(anthropic.InternalServerError):
        client.messages.batches.create(requests=requests("a"))  # type: ignore[arg-type]
    batch = client.messages.batches.create(requests=requests("a"))  # type: ignore[arg-type]
    with pytest.raises(anthropic.InternalServerError):
        client.messages.batches.retrieve(batch.id)

    assert fake.batch_creates == 1
    assert client.messages.batches.retrieve(batch.id).processing_status == "ended", "only the next call fails"


def test_fail_batch_call__after_cancel_the_batch_is_canceling(fake: FakeAnthropic, client: anthropic.Anthropic) -> None:
    fake.hold_batches()
    batch = client.messages.batches.create(requests=requests("a"))  # type: ignore[arg-type]
    fake.fail_batch_call("cancel", Fault.reset(), after=True)

    with pytest.raises(anthropic.APIConnectionError):
        client.messages.batches.cancel(batch.id)

    assert client.messages.batches.retrieve(batch.id).processing_status == "canceling"


def test_request_log__marks_batched_requests(fake: FakeAnthropic, client: anthropic.Anthropic) -> None:
    client.messages.create(**params("live", conversation="conv-a"))
    batch = client.messages.batches.create(requests=requests("a"))  # type: ignore[arg-type]
    client.messages.batches.retrieve(batch.id)

    asks: list[RecordedRequest] = fake.requests_for("conv-a")

    assert [(r.path, r.batch_id) for r in asks] == [("/v1/messages", None), ("/v1/messages", batch.id)]
    assert fake.count("conv-a", 0) == 2, "count() must count batched asks of a turn too"
    assert asks[1].attempt == 2

"""Durable state: runs, their plan steps (each also its checkpoint) and their history. Data and constraints only."""

from __future__ import annotations

import json
import uuid

from django.db import connections, models
from django.db.models import Q, Value
from django.db.models.functions import Now

from durable_agents import search as search_attributes
from durable_agents.states import (
    ACTIVE_RUN_STATUSES,
    FINISHED_RUN_STATUSES,
    RUNNABLE_RUN_STATUSES,
    BatchTurnStatus,
    EffectStatus,
    MessageBatchStatus,
    RunStatus,
    StepStatus,
    WaitStatus,
)


class OrderedJSONField(models.JSONField):
    """JSON kept as written, keys in their order: text on Postgres, not `jsonb` (which sorts an object's keys).

    A conversation must be sent again byte for byte (a thinking block's signature covers everything before it), so
    what the model returned — a tool_use's input keys in the model's order — is stored as it came. Text rather
    than Postgres' `json` type: a process still on the previous version during a rolling deploy reads text as its
    JSONField expects (psycopg would decode `json` itself, and Django would then fail to decode it again), and its
    `jsonb` writes are assigned to text by Postgres' I/O cast.
    """

    def db_type(self, connection):  # type: ignore[no-untyped-def]
        return "text" if connection.vendor == "postgresql" else super().db_type(connection)

    def get_db_prep_value(self, value, connection, prepared=False):  # type: ignore[no-untyped-def]
        if connection.vendor != "postgresql":
            return super().get_db_prep_value(value, connection, prepared)
        if not prepared:
            value = self.get_prep_value(value)
        return json.dumps(value, cls=self.encoder)


class StepKind(models.TextChoices):
    CALL = "call"
    TOOL = "tool"
    AGENT = "agent"
    APPROVAL = "approval"
    SIGNAL = "signal"
    TIMER = "timer"
    JUDGE = "judge"
    PLANNER = "planner"
    COMPENSATE = "compensate"
    CHILDREN = "children"


class EffectKind(models.TextChoices):
    EFFECT = "effect"
    COMPENSATION = "compensation"
    NOTIFICATION = "notification"


# A run waiting for its concurrency key's slot: it holds no worker and no lease, and no claim takes it.
QUEUED = Q(status=RunStatus.PENDING, concurrency_key__isnull=False, admitted_at__isnull=True)
# The same, for a query that names its run by key (see `Unindexed`).
QUEUED_KEYED = Q(status__unindexed=RunStatus.PENDING, concurrency_key__isnull=False, admitted_at__isnull=True)


class Unindexed(models.Transform):
    """`status__unindexed__in=[...]`: the column as an expression no index matches, for a query that names its row by
    its key. Statistics taken before rows reached a status say almost none are in it; Postgres then plans `pk = %s AND
    status IN (...)` as a scan of a status index (a partial one included) over every row in that status, filtered by
    the key. engine/hotpath.py's statements do the same (`_status_in`)."""

    lookup_name = "unindexed"
    template = "(%(expressions)s || '')"
    output_field = models.CharField()


class RunQuerySet(models.QuerySet["Run"]):
    def active(self) -> RunQuerySet:
        return self.filter(status__in=ACTIVE_RUN_STATUSES)

    def finished(self) -> RunQuerySet:
        return self.filter(status__in=FINISHED_RUN_STATUSES)

    def stuck(self, *, now, stuck_after) -> RunQuerySet:
        """Running with an expired lease, or runnable with no progress for `stuck_after` (a run queued behind its
        concurrency key is waiting its turn, not stuck)."""
        return self.filter(
            Q(status=RunStatus.RUNNING, lease_expires_at__lt=now)
            | Q(status__in=RUNNABLE_RUN_STATUSES, updated_at__lt=now - stuck_after)
        ).exclude(QUEUED)

    def queued(self) -> RunQuerySet:
        """Pending behind a concurrency key: not admitted yet (engine/admission.py)."""
        return self.filter(QUEUED)

    def matching_search(self, search: dict[str, str]) -> RunQuerySet:
        """Runs whose search attributes hold every `field: value` given (search.py; the GIN index on Postgres)."""
        return self.filter(search_attributes.matching(search, connections[self.db].vendor))

    def holding_search_value(self, value: str, fields: list[str]) -> RunQuerySet:
        """Runs with `value` in any of the search `fields`."""
        return self.filter(search_attributes.holding(value, fields, connections[self.db].vendor))


class JsonContainsIndex(models.Index):
    """An index for `field__contains` on Postgres: GIN with the opclass given (`jsonb_path_ops`: smaller and faster
    than the default, for `@>` only). Other databases have no `@>` and get a plain index, which their SQL accepts."""

    def create_sql(self, model, schema_editor, using="", **kwargs):
        if schema_editor.connection.vendor == "postgresql":
            using = " USING gin"
        return super().create_sql(model, schema_editor, using=using, **kwargs)


class Run(models.Model):
    """One execution of a workflow: the durable record the engine advances step by step."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    workflow = models.CharField(max_length=200)
    workflow_version = models.PositiveIntegerField()
    status = models.CharField(max_length=16, choices=RunStatus.choices, default=RunStatus.PENDING)
    input = models.JSONField(default=dict)
    input_hash = models.CharField(max_length=64, editable=False)
    output = models.JSONField(null=True, blank=True)
    error = models.JSONField(null=True, blank=True, help_text="{type, message, step} when the run failed")
    idempotency_key = models.CharField(max_length=255, null=True, blank=True)

    # The plan cursor: position of the next step to execute, and the attempt the current step is on.
    cursor = models.PositiveIntegerField(default=0)
    step_count = models.PositiveIntegerField(default=0)
    attempt = models.PositiveIntegerField(default=0)
    # Not runnable before this time (retry backoff); the sweep wakes the run when it passes.
    wake_at = models.DateTimeField(null=True, blank=True)
    # The last time the sweep re-enqueued this run, so a backlog is not flooded with duplicates.
    swept_at = models.DateTimeField(null=True, blank=True)

    # The lease: one writer per run. The token fences zombies: every commit must match it.
    lease_owner = models.CharField(max_length=200, blank=True, default="")
    lease_token = models.BigIntegerField(default=0)
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    previous_lease_owner = models.CharField(max_length=200, blank=True, default="")
    # Set by the claim statement itself (no extra write): when the current attempt took the lease, and, captured
    # like previous_lease_owner, when the previous holder had taken it and when its lease ran out. A takeover
    # records them, so an attempt whose worker died is drawn on the run's timeline.
    claimed_at = models.DateTimeField(null=True, blank=True)
    previous_claimed_at = models.DateTimeField(null=True, blank=True)
    previous_lease_expires_at = models.DateTimeField(null=True, blank=True)

    input_tokens = models.BigIntegerField(default=0)
    output_tokens = models.BigIntegerField(default=0)
    cache_write_tokens = models.BigIntegerField(default=0)
    cache_read_tokens = models.BigIntegerField(default=0)
    cost_usd = models.DecimalField(max_digits=14, decimal_places=6, default=0)

    created_at = models.DateTimeField(db_default=Now())
    # Last progress or state change (not lease renewals): what "no progress for too long" measures.
    updated_at = models.DateTimeField(db_default=Now())
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    cancel_requested_at = models.DateTimeField(null=True, blank=True)
    cancel_reason = models.TextField(blank=True, default="")
    # Saga: undo applied effects when cancelled (if asked) — the plan then ends with compensation steps,
    # and the run finishes as `finish_as` (cancelled or failed) instead of completed.
    cancel_compensate = models.BooleanField(default=False)
    finish_as = models.CharField(max_length=16, blank=True, default="")
    # A child in a slot its family holds (engine/admission.py): the nearest ancestor holding the child's own key.
    # No constraint (nothing to validate when the column is added, nothing for a prune to trip on): a hint the
    # admission joins on, pointing at an ancestor that outlives the run (prune takes children first).
    slot_of = models.ForeignKey(
        "self",
        on_delete=models.DO_NOTHING,
        null=True,
        blank=True,
        related_name="+",
        db_index=False,
        db_constraint=False,
    )
    # A saga owed to its children too (engine/family.py): set when its compensation was asked for, cleared by the
    # sweep once it has ended and none of its children stands on what it applied.
    family_undo = models.BooleanField(default=False, db_default=False)  # db_default: the previous release inserts
    # Who answers model turns for this run, when not the workflow's default (an operator may swap it).
    participant = models.CharField(max_length=100, blank=True, default="")
    # A fork copies another run's checkpoints up to a step; with the same input it shares the source's
    # effect keys (effect_scope), so an effect the source applied is recognised, not repeated.
    # Indexed where set (Meta.indexes: durable_run_forks): a plain run writes no entry for a fork it is not.
    forked_from = models.ForeignKey(
        "self", on_delete=models.SET_NULL, null=True, blank=True, related_name="forks", db_index=False
    )
    effect_scope = models.CharField(max_length=64, blank=True, default="")
    # Budgets that hold across retries and resumes (None: the workflow's, or unlimited).
    token_budget = models.BigIntegerField(null=True, blank=True)
    cost_budget_usd = models.DecimalField(max_digits=14, decimal_places=6, null=True, blank=True)
    # A child run: started by its parent's step `parent_step` as item `child_index` of that step's fan-out.
    # (parent, parent_step, child_index) is the child's key: a re-executed step finds it, never starts it twice. Its
    # index (durable_run_child_uniq, where set) serves every look-up by parent: a plain run writes no entry for a
    # parent it has not.
    parent = models.ForeignKey(
        "self", on_delete=models.SET_NULL, null=True, blank=True, related_name="children", db_index=False
    )
    # Database defaults (db_default) on NOT NULL columns: processes of the previous release insert rows without naming
    # the columns added since, while `migrate` runs (docs/howto/upgrade.md; migration 0021 sets them on older installs).
    parent_step = models.CharField(max_length=200, blank=True, default="", db_default="")
    child_index = models.PositiveIntegerField(null=True, blank=True)
    # Concurrency key (engine/admission.py): at most `concurrency_limit` runs with one key are admitted and not
    # finished at a time; the others stay pending, not admitted (admitted_at NULL), holding nothing, in order.
    concurrency_key = models.CharField(max_length=255, null=True, blank=True)
    concurrency_limit = models.PositiveIntegerField(default=1, db_default=1)
    admitted_at = models.DateTimeField(null=True, blank=True)
    # The schedule that started this run for one of its slots (its name; engine/schedules.py), else "". Its
    # overlap policy asks "is any run of mine still live?" of the index below, whatever the schedule's history.
    # A database default too: processes still on the previous version insert runs while migration 0018 applies.
    schedule = models.CharField(max_length=200, blank=True, default="", db_default="")
    # Search attributes (search.py): the values of the fields its workflow declares searchable, read from the input
    # at start, as strings ({"order_id": "A-1001"}); the admin, durable_runs and api.runs find runs by them.
    search = models.JSONField(default=dict, db_default={}, blank=True)
    # A replay run (replays.py): "baseline" or "candidate", answered from a recorded run and applying nothing;
    # "" for a real run. Metrics and concurrency keys of real runs never count it. A database default: the previous
    # release inserts runs without naming it while the migration applies.
    replay_lane = models.CharField(max_length=16, blank=True, default="", db_default="")
    # The W3C traceparent of the run's span (tracing.py): every later span of the run is its child, on any worker.
    trace_context = models.CharField(max_length=64, blank=True, default="", db_default="", editable=False)

    objects = RunQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at"]
        permissions = [
            ("resume_run", "Can resume runs"),
            ("cancel_run", "Can cancel runs"),
            ("retry_step", "Can retry a failed step"),
            ("set_budget", "Can set a run's budget"),
            ("swap_participant", "Can swap a run's participant"),
            ("decide_wait", "Can approve or reject waits"),
            ("replan_run", "Can re-plan runs"),
            ("resolve_effect", "Can record the outcome of an effect"),
            ("signal_run", "Can deliver a signal to a run"),
            ("fork_run", "Can fork a run from a step"),
            ("replay_run", "Can replay runs with a candidate model or prompt"),
        ]
        constraints = [
            models.UniqueConstraint(
                fields=["idempotency_key"],
                condition=Q(idempotency_key__isnull=False),
                name="durable_run_idempotency_key_uniq",
            ),
            models.UniqueConstraint(
                fields=["parent", "parent_step", "child_index"],
                condition=Q(parent__isnull=False),
                name="durable_run_child_uniq",
            ),
        ]
        indexes = [
            models.Index(fields=["status", "updated_at"], name="durable_run_status_updated"),
            models.Index(fields=["workflow", "status"], name="durable_run_workflow_status"),
            models.Index(fields=["created_at"], name="durable_run_created"),
            models.Index(
                fields=["updated_at"],
                condition=Q(status__in=["pending", "running"]),
                name="durable_run_runnable_updated",
            ),
            # A join asks "any child of this step still live?" at every child's end: one probe, not a count.
            models.Index(
                fields=["parent", "parent_step"],
                condition=Q(parent__isnull=False, status__in=["pending", "running", "waiting"]),
                name="durable_run_live_children",
            ),
            # Concurrency keys (engine/admission.py): all runs of a key (the console's search), its queue in
            # admission order, and the runs holding it — the last two small whatever a key's history.
            models.Index(
                fields=["concurrency_key", "created_at"],
                condition=Q(concurrency_key__isnull=False),
                name="durable_run_concurrency_key",
            ),
            models.Index(
                fields=["concurrency_key", "created_at", "id"],
                condition=Q(status="pending", concurrency_key__isnull=False, admitted_at__isnull=True),
                name="durable_run_key_queue",
            ),
            models.Index(
                fields=["concurrency_key"],
                condition=Q(
                    status__in=["pending", "running", "waiting"],
                    concurrency_key__isnull=False,
                    admitted_at__isnull=False,
                ),
                name="durable_run_key_holders",
            ),
            models.Index(
                fields=["schedule"],
                condition=Q(status__in=["pending", "running", "waiting"]) & ~Q(schedule=""),
                name="durable_run_schedule_live",
            ),
            # Families whose saga is owed to their children (the sweep's share): few, whatever the table's size.
            models.Index(fields=["updated_at"], condition=Q(family_undo=True), name="durable_run_family_undo"),
            # `search @> {"order_id": "A-1001"}` at a million runs: a few pages of the index, whatever the table. Only
            # runs with search attributes: GIN keeps an entry even for an empty document, and every claim and commit
            # of a run without them would write one (search.matching and .holding say `search <> {}`).
            JsonContainsIndex(
                fields=["search"], opclasses=["jsonb_path_ops"], condition=~Q(search={}), name="durable_run_searched"
            ),
            models.Index(fields=["forked_from"], condition=Q(forked_from__isnull=False), name="durable_run_forks"),
            # Replay runs (replays.py), which metrics of real runs subtract: empty until the first replay.
            models.Index(fields=["workflow", "status"], condition=~Q(replay_lane=""), name="durable_run_replays"),
        ]

    def __str__(self) -> str:
        return f"{self.workflow}@{self.workflow_version} {str(self.id)[:8]} ({self.status})"

    @property
    def is_finished(self) -> bool:
        return self.status in FINISHED_RUN_STATUSES

    @property
    def is_queued(self) -> bool:
        """Pending behind its concurrency key, not admitted yet (the rule of `Run.objects.queued()`)."""
        return self.status == RunStatus.PENDING and self.concurrency_key is not None and self.admitted_at is None


class StepQuerySet(models.QuerySet["Step"]):
    def live(self) -> StepQuerySet:
        return self.exclude(status=StepStatus.SUPERSEDED)


class Step(models.Model):
    """A plan element and, once done, its checkpoint: the committed result of one unit of progress."""

    # Indexed with its position (Meta.indexes), not alone: see durable_step_run_position.
    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="steps", db_index=False)
    step_id = models.CharField(max_length=200)
    # The workflow's step definition this plan element executes (several plan elements may share one).
    name = models.CharField(max_length=200)
    position = models.PositiveIntegerField()
    kind = models.CharField(max_length=16, choices=StepKind.choices, default=StepKind.CALL)
    status = models.CharField(max_length=16, choices=StepStatus.choices, default=StepStatus.PENDING)
    args = models.JSONField(default=dict, blank=True)
    result = models.JSONField(null=True, blank=True)
    # Results above RESULT_INLINE_MAX_BYTES live in Django storage: path and sha256 of the JSON bytes.
    result_ref = models.CharField(max_length=500, blank=True, default="")
    result_hash = models.CharField(max_length=64, blank=True, default="")
    error = models.JSONField(null=True, blank=True)
    attempts = models.PositiveIntegerField(default=0)
    next_attempt_at = models.DateTimeField(null=True, blank=True)
    # Freshness: when this step observed the outside world, and for how long that observation holds.
    observed_at = models.DateTimeField(null=True, blank=True)
    fresh_for = models.DurationField(null=True, blank=True)
    # Step ids of the observations this step relies on: a stale one re-plans from it before this runs.
    depends_on = models.JSONField(default=list, blank=True)
    context_hash = models.CharField(max_length=64, blank=True, default="")
    # An agent step's compacted context, stored with its checkpoint: the summary and the first turn index
    # it does not cover. A resume reads this, not the whole journal.
    context = models.JSONField(null=True, blank=True)
    # A model step's conversation head (model, system, tools, first prompt, thinking, effort) as its first model
    # call sent it: every later call of the step sends the same, whatever code is deployed since.
    frozen_request = OrderedJSONField(null=True, blank=True)
    cost_usd = models.DecimalField(max_digits=14, decimal_places=6, default=0)
    input_tokens = models.BigIntegerField(default=0)
    output_tokens = models.BigIntegerField(default=0)
    cache_write_tokens = models.BigIntegerField(default=0)
    cache_read_tokens = models.BigIntegerField(default=0)
    created_at = models.DateTimeField(db_default=Now())
    updated_at = models.DateTimeField(db_default=Now())
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    objects = StepQuerySet.as_manager()

    class Meta:
        ordering = ["run", "position", "id"]
        constraints = [
            # Superseded steps stay as history; among live steps each id and position appears once.
            models.UniqueConstraint(
                fields=["run", "step_id"],
                condition=~Q(status="superseded"),
                name="durable_step_run_step_id_uniq",
            ),
            models.UniqueConstraint(
                fields=["run", "position"],
                condition=~Q(status="superseded"),
                name="durable_step_run_position_uniq",
            ),
        ]
        indexes = [
            # A run's steps, and its foreign key's checks and cascades. With the position in it, a step found by
            # its run and position is read from one entry through either index, whichever a plan made on stale
            # statistics prefers: an index of the run alone read every step of the run (0035).
            models.Index(fields=["run", "position"], name="durable_step_run_position"),
        ]

    def __str__(self) -> str:
        return f"{self.step_id} ({self.status})"


class Payload(models.Model):
    """A step result too large to keep inline, stored in Postgres beside the run (content-addressed by sha256).

    Postgres is the only state: a later step on another machine, or after a redeploy, reads it from here.
    """

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="payloads")
    sha256 = models.CharField(max_length=64)
    data = models.BinaryField()
    size = models.PositiveBigIntegerField()
    created_at = models.DateTimeField(db_default=Now())

    class Meta:
        constraints = [models.UniqueConstraint(fields=["run", "sha256"], name="durable_payload_run_sha_uniq")]

    def __str__(self) -> str:
        return f"payload {self.sha256[:12]} ({self.size} bytes)"


class Turn(models.Model):
    """One model request/response inside an agent step, journaled before any of its tool calls run."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="turns")
    step = models.ForeignKey(Step, on_delete=models.CASCADE, related_name="turns")
    index = models.PositiveIntegerField()
    # "turn" for the agent loop; other journaled model calls: "compaction", "brief", "judge", "planner".
    purpose = models.CharField(max_length=20, default="turn")
    request_digest = models.CharField(max_length=64)
    content = OrderedJSONField(default=list, help_text="the response's content blocks, as the API returned them")
    stop_reason = models.CharField(max_length=40, blank=True, default="")
    # The tool_result blocks sent back for this turn's tool_use blocks, once every tool call finished.
    tool_results = OrderedJSONField(null=True, blank=True)
    # A refusal's category and explanation, as the API gave them (null for every other stop reason).
    stop_details = models.JSONField(null=True, blank=True)
    model = models.CharField(max_length=100, blank=True, default="")
    participant = models.CharField(max_length=100, blank=True, default="")
    request_id = models.CharField(max_length=100, blank=True, default="")
    input_tokens = models.BigIntegerField(default=0)
    output_tokens = models.BigIntegerField(default=0)
    cache_write_tokens = models.BigIntegerField(default=0)
    cache_read_tokens = models.BigIntegerField(default=0)
    cost_usd = models.DecimalField(max_digits=14, decimal_places=6, default=0)
    created_at = models.DateTimeField(db_default=Now())

    class Meta:
        ordering = ["step", "index"]
        constraints = [models.UniqueConstraint(fields=["step", "index"], name="durable_turn_step_index_uniq")]

    def __str__(self) -> str:
        return f"turn {self.index} ({self.stop_reason})"


class Effect(models.Model):
    """The outbox row of one effectful tool invocation: written before the call, keyed for exactly-once."""

    idempotency_key = models.CharField(max_length=300)
    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="effects")
    step = models.ForeignKey(Step, on_delete=models.SET_NULL, null=True, blank=True, related_name="effects")
    kind = models.CharField(max_length=16, choices=EffectKind.choices, default=EffectKind.EFFECT)
    tool = models.CharField(max_length=64)
    args = models.JSONField(default=dict)
    args_hash = models.CharField(max_length=64)
    status = models.CharField(max_length=16, choices=EffectStatus.choices, default=EffectStatus.PENDING)
    result = models.JSONField(null=True, blank=True)
    error = models.JSONField(null=True, blank=True)
    # Invocations started; for an external tool a crash after the call cannot tell whether it landed.
    attempts = models.PositiveIntegerField(default=0)
    # Set when the outcome cannot be known any more: an operator must decide (never retried forever).
    needs_attention = models.TextField(blank=True, default="")
    # Notifications: not sent again before this time (backoff, and a lease against overlapping senders).
    next_attempt_at = models.DateTimeField(null=True, blank=True)
    compensates = models.OneToOneField(
        "self", on_delete=models.CASCADE, null=True, blank=True, related_name="compensation"
    )
    created_at = models.DateTimeField(db_default=Now())
    updated_at = models.DateTimeField(db_default=Now())
    applied_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["run", "id"]
        constraints = [
            models.UniqueConstraint(fields=["idempotency_key"], name="durable_effect_key_uniq"),
        ]
        indexes = [
            models.Index(fields=["run", "status"], name="durable_effect_run_status"),
            # The sweep looks for due notifications on every pass: only pending ones are indexed.
            models.Index(
                fields=["next_attempt_at"],
                condition=Q(kind="notification", status="pending"),
                name="durable_effect_notify_pending",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.tool} {self.idempotency_key} ({self.status})"


class Reliance(models.Model):
    """A run that relies on an effect another run applied: a fork built on a checkpoint that recorded it, or a
    run that found it already applied under a key it shares. A saga undoes an effect only once no run that
    relies on it still stands."""

    effect = models.ForeignKey(Effect, on_delete=models.CASCADE, related_name="reliances")
    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="reliances")
    # The plan row whose checkpoint relies on it: superseded (re-run), it no longer does.
    step = models.ForeignKey(Step, on_delete=models.CASCADE, related_name="reliances")
    created_at = models.DateTimeField(db_default=Now())

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["effect", "run", "step"], name="durable_reliance_effect_step_uniq")
        ]

    def __str__(self) -> str:
        return f"run {self.run_id} relies on effect {self.effect_id}"


class WaitKind(models.TextChoices):
    APPROVAL = "approval"
    SIGNAL = "signal"
    TIMER = "timer"
    CHILDREN = "children"  # a fan-out step waits for its child runs
    BATCH = "batch"  # a model turn waits for its Message Batch result (agents/batching.py)


class DeadlinePolicy(models.TextChoices):
    REJECT = "reject"
    FAIL = "fail"
    ESCALATE = "escalate"  # notify the escalation contact and extend once; then reject


class WaitQuerySet(models.QuerySet["Wait"]):
    def open(self, *, keyed: bool = False) -> WaitQuerySet:
        """Open waits. `keyed`: the query names its wait by its primary key, whose index must be used (see
        `Unindexed`). A query of a run's open wait needs no such care: durable_wait_one_open_per_run is the only
        index whose predicate it implies."""
        return self.filter(status__unindexed=WaitStatus.OPEN) if keyed else self.filter(status=WaitStatus.OPEN)


class Wait(models.Model):
    """A durable pause: an approval, a signal or a timer. A waiting run holds no worker, lease or socket."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="waits")
    step = models.ForeignKey(Step, on_delete=models.SET_NULL, null=True, blank=True, related_name="waits")
    kind = models.CharField(max_length=16, choices=WaitKind.choices)
    status = models.CharField(max_length=16, choices=WaitStatus.choices, default=WaitStatus.OPEN)
    # The signal name, or the approval's name; for a tool approval, the effect key it guards.
    name = models.CharField(max_length=200, blank=True, default="")
    effect_key = models.CharField(max_length=300, blank=True, default="")
    # A tool approval authorises exactly the call it showed: this hash of the tool and its checked arguments.
    # db_default here, on `retired` and on Schedule's overlap fields: see Run.parent_step.
    args_hash = models.CharField(max_length=64, blank=True, default="", db_default="")
    # A rejected or expired decision stops governing its step once an operator resumes or re-plans it.
    retired = models.BooleanField(default=False, db_default=False)
    question = models.TextField(blank=True, default="")
    brief = models.TextField(blank=True, default="", help_text="why it matters, what happened, what each answer does")
    deadline = models.DateTimeField(null=True, blank=True)
    on_deadline = models.CharField(max_length=16, choices=DeadlinePolicy.choices, default=DeadlinePolicy.REJECT)
    escalate_to = models.CharField(max_length=300, blank=True, default="")
    escalated_at = models.DateTimeField(null=True, blank=True)
    warn_before = models.DurationField(null=True, blank=True)
    warned_at = models.DateTimeField(null=True, blank=True)
    remind_every = models.DurationField(null=True, blank=True)
    next_reminder_at = models.DateTimeField(null=True, blank=True)
    reminders_sent = models.PositiveIntegerField(default=0)
    notify_to = models.JSONField(default=list, blank=True, help_text="who is asked and reminded")
    decision = models.JSONField(null=True, blank=True, help_text="comment, or the signal's payload")
    decided_by = models.CharField(max_length=200, blank=True, default="")
    decided_at = models.DateTimeField(null=True, blank=True)
    # A fresh nonce per wait: decision links of one wait never open another.
    link_nonce = models.CharField(max_length=32, blank=True, default="")
    created_at = models.DateTimeField(db_default=Now())
    updated_at = models.DateTimeField(db_default=Now())

    objects = WaitQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at"]
        constraints = [
            # A run waits for one thing at a time: two racing parks cannot both open a wait.
            models.UniqueConstraint(fields=["run"], condition=Q(status="open"), name="durable_wait_one_open_per_run"),
        ]
        indexes = [
            # The sweep's: open waits due. Each names its column in its predicate too, so a query of a run's open wait
            # (`run_id = %s AND status = 'open'`) can only match durable_wait_one_open_per_run, whatever the
            # statistics (the sweep's `deadline <= %s` implies `deadline IS NOT NULL`).
            models.Index(
                fields=["deadline"],
                condition=Q(status="open", deadline__isnull=False),
                name="durable_wait_deadline_due",
            ),
            models.Index(
                fields=["next_reminder_at"],
                condition=Q(status="open", next_reminder_at__isnull=False),
                name="durable_wait_reminder_due",
            ),
            # The console's approvals queue, open approvals by deadline (NULLs last, as a btree keeps them): one page
            # read, however many are open.
            models.Index(
                fields=["deadline"], condition=Q(status="open", kind="approval"), name="durable_wait_open_approvals"
            ),
            models.Index(fields=["run", "kind", "name"], name="durable_wait_run_name"),
        ]

    def __str__(self) -> str:
        return f"{self.kind} {self.name or self.pk} ({self.status})"

    @property
    def is_open(self) -> bool:
        return self.status == WaitStatus.OPEN


class Event(models.Model):
    """Append-only history of a run: retries, takeovers, rejected zombie commits, operator actions."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="events")
    step_id = models.CharField(max_length=200, blank=True, default="")
    kind = models.CharField(max_length=64)
    detail = models.JSONField(default=dict, blank=True)
    actor = models.CharField(max_length=200, blank=True, default="")
    created_at = models.DateTimeField(db_default=Now())

    class Meta:
        ordering = ["run", "id"]
        indexes = [models.Index(fields=["run", "id"], name="durable_event_run")]

    def __str__(self) -> str:
        return f"{self.kind} {self.step_id}".strip()


class ProcessHeartbeat(models.Model):
    """The last time a background process showed life, on the database's clock: one row per thing.

    The sweep writes the row named "sweep" at the end of every pass; each Celery worker writes its own
    ("worker:<hostname>:<pid>") every WORKER_HEARTBEAT_SECONDS from a thread of its main process, and deletes
    it on a warm shutdown. A tiny table: `durable_status`, the metrics and the console read all of it.

    `load` is what the process measured as it beat: the sweep, the broker's queue depths at its pass
    ({"queued": {"celery": 12}, "measured_at": ..., "previous": {...}}; queued null: the broker did not answer);
    a worker, how busy it is ({"slots_busy": 8, "slots": 8, "pool": {"size": 1, "waiting": 40, ...}}).
    """

    class Kind(models.TextChoices):
        SWEEP = "sweep"
        WORKER = "worker"

    name = models.CharField(max_length=300, primary_key=True)
    kind = models.CharField(max_length=16, choices=Kind.choices)
    hostname = models.CharField(max_length=255, blank=True, default="")
    pid = models.PositiveIntegerField(null=True, blank=True)
    queues = models.JSONField(default=list, blank=True)
    started_at = models.DateTimeField(db_default=Now())
    last_seen = models.DateTimeField(db_default=Now())
    load = models.JSONField(default=dict, db_default=Value({}, output_field=models.JSONField()), blank=True)

    class Meta:
        ordering = ["kind", "name"]

    def __str__(self) -> str:
        return self.name


class JobLease(models.Model):
    """One pass at a time of a background job across every machine (the prune): who holds it, until when.

    A row per job name, taken by one conditional UPDATE when it is free (`expires_at` NULL) or lapsed, on the
    database's clock, with a fresh `token` that its renewals and its release must match (engine/job_lease.py).
    A row, not a session advisory lock: a pooler in transaction mode (PgBouncer) keeps no session for it.
    """

    name = models.CharField(max_length=100, primary_key=True)
    holder = models.CharField(max_length=300, blank=True, default="")  # "<worker or host>:<pid>", kept once released
    token = models.UUIDField(null=True, blank=True)
    taken_at = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField(null=True, blank=True)  # NULL: released

    def __str__(self) -> str:
        return self.name


class RateBucket(models.Model):
    """The shared rate limit of one model and API key (rate_limits.py): when each of its buckets is next free.

    A GCRA bucket per dimension keeps one number, its theoretical arrival time in seconds since the epoch on the
    database's clock: a call may go once that, less the burst, has passed. One UPDATE ... RETURNING reserves a
    call's share of all three at once. `key` is "<model>|<fingerprint of the API key>", never the key itself.
    """

    key = models.CharField(max_length=300, primary_key=True)
    requests_tat = models.FloatField(default=0.0)
    input_tat = models.FloatField(default=0.0)
    output_tat = models.FloatField(default=0.0)
    # The last reservation's outcome, for RETURNING: when the call may go, and whether it was reserved.
    start_at = models.FloatField(default=0.0)
    reserved = models.BooleanField(default=False)

    def __str__(self) -> str:
        return self.key


class MissedSlots(models.TextChoices):
    """What the sweep does with a schedule's slots that passed while nothing swept (beat down, a deploy)."""

    SKIP = "skip"  # start only the latest missed slot, late; the earlier ones are skipped
    CATCH_UP = "catch_up"  # start every missed slot, oldest first, at most `catch_up_limit` of them


class Overlap(models.TextChoices):
    """What the sweep does with a slot that falls due while a run the schedule started is still live."""

    SKIP = "skip"  # do not start it (nor owe it later); count it in `overlap_skipped`
    ALLOW = "allow"  # start it anyway: two runs of the schedule may be live at once


class Declared(models.TextChoices):
    """Where code declares a schedule (engine/declared.py syncs those rows at each sweep); blank: `api.schedule`'s."""

    SETTING = "setting"  # DURABLE_AGENTS["SCHEDULES"]
    WORKFLOW = "workflow"  # workflow(..., schedule=cron(...))


class Schedule(models.Model):
    """A recurring run: the sweep starts `workflow` with `input` at each slot of `cron`, in `timezone`.

    `next_slot` (UTC) is the first slot not yet started; the sweep starts due slots and advances it in one
    transaction, and each slot's run carries the idempotency key "schedule:<name>:<slot>", so a slot is started
    once even if that transaction is retried. A paused schedule starts nothing; resuming starts from the next
    slot after the moment of resuming. Under `overlap="skip"` a slot due while a run it started (`Run.schedule`)
    is still live is passed over (counted in `overlap_skipped`), never started late. `declared` says where code
    declares the schedule (the sweep creates, updates and removes those rows); blank for `api.schedule`'s.
    """

    name = models.CharField(max_length=200, unique=True)
    workflow = models.CharField(max_length=200)
    cron = models.CharField(max_length=200)
    timezone = models.CharField(max_length=64, default="UTC")
    input = models.JSONField(default=dict, blank=True)
    missed = models.CharField(max_length=16, choices=MissedSlots.choices, default=MissedSlots.SKIP)
    catch_up_limit = models.PositiveIntegerField(default=10)
    overlap = models.CharField(max_length=16, choices=Overlap.choices, default=Overlap.SKIP, db_default=Overlap.SKIP)
    overlap_skipped = models.PositiveIntegerField(default=0, db_default=0)
    paused = models.BooleanField(default=False)
    # Who set `paused` to what it is now (pause or resume: an operator's --as, the admin's user), and when: the
    # audit trail of a schedule, which has no run to hold an Event. Blank for a schedule never paused.
    paused_changed_by = models.CharField(max_length=200, blank=True, default="", db_default="")
    paused_changed_at = models.DateTimeField(null=True, blank=True)
    next_slot = models.DateTimeField()
    last_slot = models.DateTimeField(null=True, blank=True)
    # The run of the last slot started. No database constraint: pruning old runs (in batches, by SQL) must not
    # have to visit schedules; a pruned last run leaves an id the console shows without a link target.
    last_run = models.ForeignKey(
        Run, on_delete=models.SET_NULL, null=True, blank=True, related_name="+", db_constraint=False
    )
    last_error = models.TextField(blank=True, default="")
    declared = models.CharField(max_length=16, choices=Declared.choices, blank=True, default="", db_default="")
    created_at = models.DateTimeField(db_default=Now())
    updated_at = models.DateTimeField(db_default=Now())

    class Meta:
        ordering = ["name"]
        permissions = [
            ("pause_schedule", "Can pause and resume schedules"),
            ("trigger_schedule", "Can trigger a schedule now"),
        ]
        indexes = [
            models.Index(fields=["next_slot"], condition=Q(paused=False), name="durable_schedule_due"),
        ]

    def __str__(self) -> str:
        return self.name


class Cohort(models.Model):
    """A named set of recorded runs to replay (replays.py): chosen from the journal, or imported from a dataset."""

    name = models.CharField(max_length=200, unique=True)
    description = models.TextField(blank=True, default="")
    created_at = models.DateTimeField(db_default=Now())

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return self.name


class Recording(models.Model):
    """One case of a cohort: a run as it was recorded (input, steps, turns, tool calls, outcome), frozen when the
    cohort was made, so a replay reads it whatever retention did to the run since (replays.py has the schema)."""

    cohort = models.ForeignKey(Cohort, on_delete=models.CASCADE, related_name="recordings")
    position = models.PositiveIntegerField()
    # The recorded run, if it came from this database (no constraint: retention may prune it).
    source_run_id = models.UUIDField(null=True, blank=True)
    workflow = models.CharField(max_length=200)
    workflow_version = models.PositiveIntegerField()
    data = OrderedJSONField()

    class Meta:
        ordering = ["cohort", "position"]
        constraints = [models.UniqueConstraint(fields=["cohort", "position"], name="durable_recording_position")]

    def __str__(self) -> str:
        return f"{self.cohort.name} #{self.position}"


class Replay(models.Model):
    """One replay of a cohort: the candidate (model, participant, prompts, tool texts), its lanes and budget."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    # Deleting a cohort deletes its replays (their runs stay, and end at their next step: their recording is gone).
    cohort = models.ForeignKey(Cohort, on_delete=models.CASCADE, related_name="replays")
    candidate = models.JSONField(default=dict, blank=True)
    # A tool call the recording never made: "stop" ends that replay; a stub (tool name -> result) answers it.
    stubs = models.JSONField(default=dict, blank=True)
    budget_usd = models.DecimalField(max_digits=14, decimal_places=6, null=True, blank=True)
    seed = models.BigIntegerField(null=True, blank=True)
    created_by = models.CharField(max_length=200, blank=True, default="")
    created_at = models.DateTimeField(db_default=Now())
    # "batch": every model call of its runs goes through the Message Batches API, at half price; "": live.
    delivery = models.CharField(max_length=8, blank=True, default="", db_default="")

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"replay {str(self.id)[:8]} of {self.cohort.name}"


class ReplayRun(models.Model):
    """A replay run: which replay, which recording, which lane. Keyed by the run's id (no constraint: a pruned
    replay run leaves its row, and the report says so)."""

    run_id = models.UUIDField(primary_key=True)
    replay = models.ForeignKey(Replay, on_delete=models.CASCADE, related_name="runs")
    recording = models.ForeignKey(Recording, on_delete=models.CASCADE, related_name="replays")
    lane = models.CharField(max_length=16)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["replay", "recording", "lane"], name="durable_replay_run_lane"),
        ]

    def __str__(self) -> str:
        return f"{self.lane} {self.run_id}"


class MessageBatch(models.Model):
    """Turns sent to the Message Batches API as one batch: the batcher's outbox row (agents/batcher.py).

    Written, with its turns chosen, before the create request goes; `provider_id` once the API answered it. A row
    left `submitting` (the answer never came) is looked for among the API's batches before anything is sent again,
    so a batch is never created twice for the same turns.
    """

    provider_id = models.CharField(max_length=100, blank=True, default="", help_text="the API's msgbatch_ id")
    status = models.CharField(max_length=16, choices=MessageBatchStatus.choices, default=MessageBatchStatus.SUBMITTING)
    request_count = models.PositiveIntegerField(default=0)
    request_bytes = models.BigIntegerField(default=0)
    # The API's request_counts, as last polled: processing, succeeded, errored, canceled, expired.
    counts = models.JSONField(default=dict, blank=True)
    error = models.TextField(blank=True, default="")
    created_at = models.DateTimeField(db_default=Now())
    submitted_at = models.DateTimeField(null=True, blank=True)
    ended_at = models.DateTimeField(null=True, blank=True)
    polled_at = models.DateTimeField(null=True, blank=True)
    next_poll_at = models.DateTimeField(null=True, blank=True)
    polls = models.PositiveIntegerField(default=0)

    class Meta:
        ordering = ["-created_at"]
        verbose_name_plural = "message batches"
        constraints = [
            models.UniqueConstraint(
                fields=["provider_id"], condition=~Q(provider_id=""), name="durable_message_batch_provider_id"
            ),
        ]
        indexes = [
            models.Index(
                fields=["next_poll_at"],
                condition=Q(status__in=["submitting", "in_progress", "canceling"]),
                name="durable_batch_in_flight",
            ),
        ]

    def __str__(self) -> str:
        return f"batch {self.provider_id or self.pk} ({self.status})"


class BatchTurn(models.Model):
    """One model turn of a step with `delivery="batch"`: its request, the batch it went in, and the answer.

    Written (fenced by the run's lease) before the run parks on its `batch` wait; the batcher fills in `result`
    and closes the wait. The step, woken, journals the answer as a Turn of the same index like any other.
    """

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="batch_turns")
    step = models.ForeignKey(Step, on_delete=models.CASCADE, related_name="batch_turns")
    index = models.PositiveIntegerField()  # the Turn index it answers
    purpose = models.CharField(max_length=20, default="turn")
    custom_id = models.CharField(max_length=64, unique=True)
    model = models.CharField(max_length=100, blank=True, default="")
    request_digest = models.CharField(max_length=64)
    params = OrderedJSONField(help_text="the Messages request, as it goes in the batch")
    status = models.CharField(max_length=16, choices=BatchTurnStatus.choices, default=BatchTurnStatus.QUEUED)
    batch = models.ForeignKey(MessageBatch, on_delete=models.SET_NULL, null=True, blank=True, related_name="turns")
    # The batch's result for this request as the API gave it: {"type": "succeeded", "message": {...}} or another type.
    result = OrderedJSONField(null=True, blank=True)
    deadline = models.DateTimeField(null=True, blank=True)
    # Its answer was acted on: journaled as a Turn, or a failed result (errored, expired, canceled, past the deadline
    # with on_deadline="fail") raised once, so the next attempt sends the turn again.
    used = models.BooleanField(default=False)
    cost_usd = models.DecimalField(max_digits=14, decimal_places=6, default=0)
    created_at = models.DateTimeField(db_default=Now())
    submitted_at = models.DateTimeField(null=True, blank=True)
    ended_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["created_at"]
        indexes = [
            models.Index(fields=["step", "index"], name="durable_batch_turn_step"),
            models.Index(fields=["created_at"], condition=Q(status="queued"), name="durable_batch_turn_queued"),
            models.Index(
                fields=["run"], condition=Q(status__in=["queued", "submitted"]), name="durable_batch_turn_in_flight"
            ),
            # Answers no Turn journaled yet: the batcher looks among them for those no step will use.
            models.Index(
                fields=["step"], condition=Q(status="succeeded", used=False), name="durable_batch_turn_unused"
            ),
        ]

    def __str__(self) -> str:
        return f"batch turn {self.index} of step {self.step_id} ({self.status})"


for _model in (Run, Wait, Effect, MessageBatch):
    _model._meta.get_field("status").register_lookup(Unindexed)

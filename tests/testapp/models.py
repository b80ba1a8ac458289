"""Side tables written by test steps outside the engine's transactions, so crashes cannot hide executions."""

from django.db import models


class Execution(models.Model):
    """One execution of a step body, committed before the step returns (autocommit)."""

    run_id = models.UUIDField(db_index=True)
    step_id = models.CharField(max_length=200)
    pid = models.IntegerField()
    attempt = models.IntegerField()
    # True if the step's checkpoint was already committed when this execution began: a broken guarantee.
    after_commit = models.BooleanField(default=False)
    at = models.DateTimeField(auto_now_add=True)


class LedgerEntry(models.Model):
    """The receiving side of a transactional tool: a unique key, as a real ledger would enforce."""

    idempotency_key = models.CharField(max_length=300, unique=True)
    order_id = models.CharField(max_length=50)
    amount = models.DecimalField(max_digits=10, decimal_places=2)
    kind = models.CharField(max_length=10)
    at = models.DateTimeField(auto_now_add=True)


# --- The state-machine test's outside world (tests/testapp/machine.py) ------------------------------------


class MachineOrder(models.Model):
    """An order in the outside world: runs observe its amount, which the test changes between observations."""

    order_id = models.CharField(max_length=50, unique=True)
    amount = models.DecimalField(max_digits=10, decimal_places=2)


class ReceiverCall(models.Model):
    """Every call that reached a receiving system, kept as an audit: a ledger (in this database, written in
    the engine's transaction) or a shipping service (outside, deduping on the idempotency key).

    No unique key on purpose: a second application must be visible to the test, not aborted by a constraint.
    """

    receiver = models.CharField(max_length=20)  # "ledger" or "shipping"
    kind = models.CharField(max_length=10)  # "apply", or "undo" (a compensation)
    idempotency_key = models.CharField(max_length=300, db_index=True)
    # For an undo: the key of the effect it undoes.
    undoes = models.CharField(max_length=300, blank=True, default="")
    run_id = models.UUIDField(db_index=True)
    args = models.JSONField(default=dict)
    # The fencing token of the execution that called, and whether that token still held the run when
    # the call entered the tool (after every check the engine makes before calling out).
    token = models.BigIntegerField(null=True)
    held = models.BooleanField()
    # The receiver had already seen this key and changed nothing (only the shipping service dedupes).
    deduped = models.BooleanField(default=False)
    at = models.DateTimeField(auto_now_add=True)

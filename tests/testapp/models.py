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

from django.db import models


class Booking(models.Model):
    guest = models.CharField(max_length=100)
    nights = models.PositiveIntegerField()
    idempotency_key = models.CharField(max_length=200, unique=True)
    # What the compensating tool received, kept to show it (a real one would just cancel).
    cancelled_with = models.JSONField(null=True)

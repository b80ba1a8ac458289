"""App config of the refund example; its `workflows` module is loaded by durable_agents at startup."""

from django.apps import AppConfig


class RefundsConfig(AppConfig):
    name = "project.refunds"
    label = "refunds"
    verbose_name = "Refunds (example)"
    default_auto_field = "django.db.models.BigAutoField"

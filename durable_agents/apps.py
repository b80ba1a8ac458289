"""App config: loads workflow definitions from every installed app's `workflows` module."""

from django.apps import AppConfig
from django.utils.module_loading import autodiscover_modules


class DurableAgentsConfig(AppConfig):
    name = "durable_agents"
    verbose_name = "Durable agents"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from durable_agents import builtin  # noqa: F401  (registers the `noop` workflow)

        autodiscover_modules("workflows")

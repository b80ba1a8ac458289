"""App config: loads workflow definitions from every installed app's `workflows` module, registers the checks."""

from django.apps import AppConfig
from django.core.checks import register
from django.utils.module_loading import autodiscover_modules


class DurableAgentsConfig(AppConfig):
    name = "durable_agents"
    verbose_name = "Durable agents"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from durable_agents import builtin, checks  # noqa: F401  (builtin registers the `noop` workflow)

        autodiscover_modules("workflows")
        for check in checks.CHECKS:
            register(check, "durable_agents")
        for check in checks.DATABASE_CHECKS:
            register(check, "durable_agents", "database")
        for check in checks.DEPLOY_CHECKS:
            register(check, "durable_agents", deploy=True)

"""A test-only app: a side table that counts step executions, and workflows that exercise the engine."""

from django.apps import AppConfig


class TestAppConfig(AppConfig):
    name = "tests.testapp"
    label = "testapp"
    default_auto_field = "django.db.models.BigAutoField"

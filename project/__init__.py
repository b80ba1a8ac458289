"""The example Django project that hosts durable_agents: settings, urls and the Celery app."""

from project.celery import app as celery_app

__all__ = ["celery_app"]

"""The library's test suite. Its Celery app (`tests.celery`) loads with the package, as in Celery's Django layout."""

from tests.celery import app as celery_app

__all__ = ["celery_app"]

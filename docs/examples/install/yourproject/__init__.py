from yourproject.celery import app as celery_app

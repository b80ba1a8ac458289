"""The engine owns state: it alone changes the status of runs and steps (claim, execute, commit, sweep).

It never imports Celery, the admin or django.contrib: runs are woken through the WAKER setting.
"""

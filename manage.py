#!/usr/bin/env python
"""Django's command-line utility for administrative tasks."""

import os
import sys


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
    from django.core.management import execute_from_command_line

    from project import tracing

    # runserver's requests and a command's runs (durable_demo starts them) are traced like the web process's.
    tracing.configure(tracing.WEB, django=True, celery=True)
    execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()

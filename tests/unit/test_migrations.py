"""Models and migrations agree: a model change without its migration fails here."""

import pytest
from django.core.management import call_command


@pytest.mark.django_db
def test_migrations__no_model_change_lacks_a_migration():
    call_command("makemigrations", "--check", "--dry-run", verbosity=0)

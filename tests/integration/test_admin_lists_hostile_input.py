"""The admin's run list and wait list: a hostile address is never a server error (a NUL is a 400 saying so),
and every count shown past the exact limit says it is an estimate.
"""

from __future__ import annotations

import html
import re

import pytest
from django.conf import settings
from django.contrib.auth.models import Permission, User
from django.contrib.contenttypes.models import ContentType
from django.db import connection
from django.test.utils import override_settings

from durable_agents import api
from durable_agents.models import Run, RunStatus, Wait
from tests.integration.test_admin import LIST, login
from tests.integration.test_approvals_queue import WAITS

# --- the run list: hostile parameters, estimated counts ---------------------------------------------------------

HOSTILE = [
    "status__exact=bogus",
    "status__exact=running&status__exact=failed",
    "stuck=maybe",
    "stuck=yes&stuck=no",
    "aging=bogus",
    "p=999999999999999999999",
    "p=-1",
    "p=abc",
    "o=999",
    "o=1.-2.x",
    "q=" + "x" * 10_000,
    "q=%27%3B+DROP+TABLE+durable_agents_run%3B--",
    "q=%E2%80%AEevil",
    "created_at__year=99999",
    "created_at__year=-5",
    "created_at__month=13&created_at__year=2026",
    "created_at__day=40&created_at__month=2&created_at__year=2026",
    "created_at__gte=notadate",
    "workflow_version__exact=abc",
]
# Postgres text cannot hold NUL, and the admin filters on any local field named in the address.
WITH_NUL = ["workflow", "error_type", "status__exact", "lease_owner", "idempotency_key", "q"]


@pytest.mark.django_db
@pytest.mark.parametrize("query", HOSTILE + [f"{name}=a%00b" for name in WITH_NUL])
def test_run_list__a_hostile_address_is_never_a_server_error(query):
    api.start("noop", {"steps": 1})
    response = login("operator-hostile").get(f"{LIST}?{query}")
    assert response.status_code in (200, 302, 400), f"?{query[:80]}: {response.status_code}"
    if "%00" in query:
        assert response.status_code == 400 and b"NUL character" in response.content, "a clear message"


WAIT_FIELDS_WITH_NUL = ["name", "question", "kind", "kind__exact", "q"]


@pytest.mark.django_db
@pytest.mark.parametrize("name", WAIT_FIELDS_WITH_NUL)
def test_wait_list__a_nul_in_the_address_is_a_400_saying_so(name):
    client = login("operator-waits-nul")
    User.objects.get(username="operator-waits-nul").user_permissions.add(
        Permission.objects.get(content_type=ContentType.objects.get_for_model(Wait), codename="view_wait")
    )
    response = client.get(f"{WAITS}?{name}=a%00b")
    assert response.status_code == 400 and b"NUL character" in response.content


@pytest.mark.django_db
def test_run_list__every_count_shown_past_the_exact_limit_says_it_is_an_estimate():
    Run.objects.bulk_create(
        Run(workflow="noop", workflow_version=1, input={}, input_hash="-", status=RunStatus.COMPLETED)
        for _ in range(120)
    )
    with connection.cursor() as cursor:
        cursor.execute(f"ANALYZE {Run._meta.db_table}")
    client = login("operator-estimates", codenames=("resume_run", "cancel_run"))
    with override_settings(DURABLE_AGENTS={**settings.DURABLE_AGENTS, "ADMIN_EXACT_COUNT_LIMIT": 5}):
        for query in ("", "?status__exact=completed"):
            page = html.unescape(client.get(LIST + query).content.decode())
            text = re.sub(r"<[^>]+>", "", page)
            shown = re.findall(r"(≈ )?\b(1[0-9][0-9])\b (results?|runs|selected)", text)
            assert {kind for _, _, kind in shown} >= {"results", "runs", "selected"}, shown
            assert all(estimate for estimate, _, _ in shown), f"{query or 'the list'}: an estimate shown as exact"

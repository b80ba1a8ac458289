"""The console's landing page: `{% durable_overview %}` puts the overview (runs by status, stuck runs, health and
load) on any admin page — the example project's admin index opens on it — for staff who may view runs."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import AnonymousUser, Permission, User
from django.template import engines
from django.test import RequestFactory

from durable_agents import api

pytestmark = pytest.mark.django_db

PAGE = engines["django"].from_string("{% load durable %}{% durable_overview %}")


def _rendered_for(user) -> str:
    request = RequestFactory().get("/admin/")
    request.user = user
    return PAGE.render({}, request)


def test_overview_tag__shows_the_cards_and_health_with_links_to_the_run_list():
    api.start("noop", {"steps": 1})
    viewer = User.objects.create_user("viewer", is_staff=True)
    viewer.user_permissions.add(Permission.objects.get(codename="view_run"))

    html = _rendered_for(User.objects.get(pk=viewer.pk))

    assert 'id="durable-overview"' in html and 'id="durable-health"' in html
    assert 'href="/admin/durable_agents/run/?status__exact=pending"' in html, "a card leads to the run list, filtered"


def test_overview_tag__shows_nothing_to_whoever_may_not_view_runs():
    api.start("noop", {"steps": 1})
    assert "durable-overview" not in _rendered_for(AnonymousUser())
    assert "durable-overview" not in _rendered_for(User.objects.create_user("staff", is_staff=True))


def test_overview_tag__live_refreshes_its_cards_and_health_when_asked():
    viewer = User.objects.create_user("watcher", is_staff=True)
    viewer.user_permissions.add(Permission.objects.get(codename="view_run"))
    request = RequestFactory().get("/admin/")
    request.user = User.objects.get(pk=viewer.pk)

    live = engines["django"].from_string("{% load durable %}{% durable_overview live=True %}").render({}, request)

    assert 'id="durable-live"' in live and 'data-regions="#durable-overview,#durable-health"' in live, live
    assert 'id="durable-live"' not in _rendered_for(request.user), "live only where the page asks for it"


def test_overview_tag__a_live_refetch_of_the_page_spends_no_message():
    # The landing page's live overview is refetched every few seconds: the admin's base template lists (and so
    # spends) the session's messages, which belong to the page the operator opens next.
    from django.contrib.messages import get_messages, info
    from django.contrib.messages.storage.fallback import FallbackStorage
    from django.contrib.sessions.backends.db import SessionStore

    from durable_agents.admin.live import LIVE_HEADER

    viewer = User.objects.create_user("refetcher", is_staff=True)
    viewer.user_permissions.add(Permission.objects.get(codename="view_run"))
    request = RequestFactory().get("/admin/", headers={LIVE_HEADER: "1"})
    request.user, request.session = User.objects.get(pk=viewer.pk), SessionStore()
    request._messages = FallbackStorage(request)
    info(request, "Cancel: done")
    page = engines["django"].from_string(
        "{% load durable %}{% for m in messages %}{{ m }}{% endfor %}{% durable_overview live=True %}"
    )

    assert "Cancel: done" in page.render({"messages": get_messages(request)}, request)
    assert request._messages.used is False, "the refetch spent the message meant for the next page"

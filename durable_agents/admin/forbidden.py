"""A refusal in the console's own look: which permission is missing and who can grant it, with status 403.

Django's default 403 is a bare page that names neither; the console's views return this instead of raising
PermissionDenied (a project's own `403.html` covers every other page).

Example::

    if not request.user.has_perm("durable_agents.decide_wait"):
        return forbidden(request, "durable_agents.decide_wait", "decide approvals")
"""

from __future__ import annotations

from django.contrib import admin
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.http import HttpRequest
from django.template.response import TemplateResponse

TEMPLATE = "admin/durable_agents/403.html"
# How many of the site's administrators the page names as people to ask.
ADMINS_NAMED = 3


def forbidden(
    request: HttpRequest, permission: str, doing: str, *, site: admin.AdminSite | None = None
) -> TemplateResponse:
    """The 403 page saying that `doing` (e.g. "decide approvals") needs `permission` ("app.codename")."""
    app_label, _, codename = permission.partition(".")
    described = (
        Permission.objects.filter(content_type__app_label=app_label, codename=codename)
        .values_list("name", flat=True)
        .first()
    )
    admins = list(
        get_user_model()
        .objects.filter(is_superuser=True, is_active=True)
        .order_by("pk")
        .values_list(get_user_model().USERNAME_FIELD, flat=True)[:ADMINS_NAMED]
    )
    context = {
        **(site or admin.site).each_context(request),
        "title": "Permission needed",
        "doing": doing,
        "permission": permission,
        "permission_name": described or "",
        "admins": admins,
    }
    return TemplateResponse(request, TEMPLATE, context, status=403)

"""The decision page behind a signed link: a logged-in approver confirms approve or reject."""

from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.views.decorators.http import require_http_methods

from durable_agents import api
from durable_agents.engine.waits import get_wait
from durable_agents.errors import DurableAgentsError, InvalidInputError
from durable_agents.links import read_token


@login_required
@require_http_methods(["GET", "POST"])
def decide_wait(request: HttpRequest, wait_id: int, token: str) -> HttpResponse:
    """GET shows the brief and the choice; POST records the decision (CSRF-protected, permission-checked)."""
    try:
        read_token(wait_id, token)
        wait = get_wait(wait_id)
    except DurableAgentsError as exc:
        return render(request, "durable_agents/wait_decision.html", {"error": str(exc)}, status=400)
    if not request.user.has_perm("durable_agents.decide_wait"):
        message = "You are signed in, but you may not decide approvals (permission durable_agents.decide_wait)."
        return render(request, "durable_agents/wait_decision.html", {"error": message, "wait": wait}, status=403)
    context = {"wait": wait}
    if request.method == "POST":
        choice = request.POST.get("decision")
        if choice not in ("approve", "reject"):
            context["error"] = "Choose approve or reject."
            return render(request, "durable_agents/wait_decision.html", context, status=400)
        try:
            wait = api.decide(
                wait.pk,
                choice == "approve",
                by=request.user.get_username(),
                comment=request.POST.get("comment", "")[:2000],
                via="link",
            )
        except DurableAgentsError as exc:
            context["error"] = str(exc)
            # A bad comment is the sender's to fix (400); a wait decided meanwhile is a conflict (409).
            status = 400 if isinstance(exc, InvalidInputError) else 409
            return render(request, "durable_agents/wait_decision.html", context, status=status)
        context.update(wait=wait, decided=True)
    elif not wait.is_open:
        context["error"] = f"This request is already {wait.status}" + (
            f" by {wait.decided_by}." if wait.decided_by else "."
        )
        return render(request, "durable_agents/wait_decision.html", context, status=409)
    return render(request, "durable_agents/wait_decision.html", context)

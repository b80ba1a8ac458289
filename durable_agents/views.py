"""The decision page behind a signed link: a logged-in approver confirms approve or reject of that one wait.

Who may see what: anyone not signed in goes to `LOGIN_URL` (and back); a signed-in user without the
permission `durable_agents.decide_wait` sees a refusal and nothing of the wait — a forwarded link must not
leak the question, the brief or the amounts. The link decides exactly its own wait; if that wait closed,
the page says who closed it and which request the run waits on now, and decides nothing.
"""

from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.views.decorators.http import require_http_methods

from durable_agents import api
from durable_agents.decisions import describe_closed
from durable_agents.errors import DurableAgentsError, InvalidInputError, WaitClosedError
from durable_agents.links import read_token
from durable_agents.models import Wait

TEMPLATE = "durable_agents/wait_decision.html"
PERMISSION = "durable_agents.decide_wait"


@login_required
@require_http_methods(["GET", "POST"])
def decide_wait(request: HttpRequest, wait_id: int, token: str) -> HttpResponse:
    """GET shows the brief and the choice; POST records the decision (CSRF-protected, permission-checked)."""
    # The permission before the token or the wait is read: a refused user learns nothing of the wait,
    # not even whether the link is still good.
    if not request.user.has_perm(PERMISSION):
        message = (
            f"You are signed in, but you may not decide approvals (permission {PERMISSION}). "
            "Ask an administrator for it, or sign in as someone who may."
        )
        return render(request, TEMPLATE, {"error": message}, status=403)
    try:
        read_token(wait_id, token)
    except DurableAgentsError as exc:
        return render(request, TEMPLATE, {"error": str(exc)}, status=400)
    wait = Wait.objects.select_related("run").filter(pk=wait_id).first()
    if wait is None:
        return render(request, TEMPLATE, {"error": "this request no longer exists"}, status=400)
    context: dict[str, object] = {"wait": wait}
    if not wait.is_open:
        context["error"] = describe_closed(wait)
        return render(request, TEMPLATE, context, status=409)
    if request.method == "POST":
        choice = request.POST.get("decision")
        if choice not in ("approve", "reject"):
            context["error"] = "Choose approve or reject."
            return render(request, TEMPLATE, context, status=400)
        try:
            wait = api.decide(
                wait.pk,
                choice == "approve",
                by=request.user.get_username(),
                comment=request.POST.get("comment", "")[:2000],
                via="link",
            )
        except WaitClosedError:
            # Decided elsewhere between this page's check and the decision: the API's compare-and-set won.
            context["error"] = describe_closed(wait)
            return render(request, TEMPLATE, context, status=409)
        except DurableAgentsError as exc:
            context["error"] = str(exc)
            # A bad comment is the sender's to fix (400); a wait decided meanwhile is a conflict (409).
            return render(request, TEMPLATE, context, status=400 if isinstance(exc, InvalidInputError) else 409)
        context.update(wait=wait, decided=True)
    return render(request, TEMPLATE, context)

"""The server's side of the console's live refresh (durable_agents/static/durable_agents/live.js)."""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse

# Sent by live.js with every refetch of the page it shows.
LIVE_HEADER = "X-Durable-Live"


def is_refetch(request: HttpRequest) -> bool:
    """The page was asked for by live.js, not opened by the operator."""
    return request.headers.get(LIVE_HEADER) == "1"


def leave_messages(request: HttpRequest, response: HttpResponse) -> HttpResponse:
    """A refetch renders the page's messages but does not spend them: they belong to the page the operator opens
    next. A refetch from another tab racing an action's redirect would otherwise swallow its confirmation (and
    live.js swaps no message list anyway)."""
    if not is_refetch(request):
        return response

    if hasattr(response, "add_post_render_callback") and not getattr(response, "is_rendered", True):
        response.add_post_render_callback(lambda rendered: leave_messages_rendered(request))
    else:
        leave_messages_rendered(request)
    return response


def leave_messages_rendered(request: HttpRequest) -> None:
    """For a refetch, once the messages were rendered (a template tag rendered after the admin's message list
    calls this: the index's live overview): they stay for the page the operator opens next."""
    storage = getattr(request, "_messages", None)
    if storage is not None and is_refetch(request):
        # The message middleware stores what is left once a response is done: unused, nothing is touched.
        storage.used = False

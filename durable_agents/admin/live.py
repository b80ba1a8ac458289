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

    def unspent(response: HttpResponse) -> None:
        storage = getattr(request, "_messages", None)
        if storage is not None:
            # The message middleware stores what is left once a response is done: unused, nothing is touched.
            storage.used = False

    if hasattr(response, "add_post_render_callback") and not getattr(response, "is_rendered", True):
        response.add_post_render_callback(unspent)
    else:
        unspent(response)
    return response

"""What every console page does with hostile input it did not choose: an address holding a NUL is refused with
a 400 that says so, and the text direction controls in data are shown, not obeyed.

A worker's name, a step id or an error message an external service wrote may carry Unicode's explicit direction
controls (e.g. U+202E, right-to-left override): escaped HTML still lets them reverse the words after them, so
"lease expired 1h ago" could read backwards beside a spoofed name. The console prints each one visibly instead
(`⟨U+202E⟩`), in the HTML and in the SVG timeline alike; right-to-left letters are untouched.
"""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse, HttpResponseBadRequest

NUL_IN_FILTER = (
    "A filter or search value in this address contains a NUL character (%00), which no row can hold: remove it."
)
# Embeddings, overrides and isolates: the controls that change the order of the text after them.
DIRECTION_CONTROLS = [chr(c) for c in (*range(0x202A, 0x202F), *range(0x2066, 0x206A))]
_SHOWN = {control: f"⟨U+{ord(control):04X}⟩" for control in DIRECTION_CONTROLS}


def refuse_nul(request: HttpRequest) -> HttpResponse | None:
    """A 400 saying what is wrong if the address holds a NUL: Postgres text cannot, and a filter on any field
    (the admin allows every local field in the address) would be a 500."""
    if any("\x00" in value for _, values in request.GET.lists() for value in values):
        return HttpResponseBadRequest(NUL_IN_FILTER, content_type="text/plain; charset=utf-8")
    return None


def show_direction_controls(response: HttpResponse) -> HttpResponse:
    """The page with each direction control in it shown as `⟨U+202E⟩`, once rendered."""
    if hasattr(response, "add_post_render_callback") and not getattr(response, "is_rendered", True):
        response.add_post_render_callback(_shown)
    else:
        _shown(response)
    return response


def _shown(response: HttpResponse) -> None:
    if response.streaming or "html" not in response.get("Content-Type", ""):
        return
    text = response.content.decode(response.charset or "utf-8")
    if any(control in text for control in DIRECTION_CONTROLS):
        for control, shown in _SHOWN.items():
            text = text.replace(control, shown)
        response.content = text.encode(response.charset or "utf-8")

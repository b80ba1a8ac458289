"""What a decider is told when the request they saw is no longer open: who closed it, when, and what now.

Every decision surface (the run page's form, the waits queue, a signed link) decides exactly the wait it
showed. When that wait closed in the meantime nothing is decided, and the decider reads why — and, if
the run has since opened another request, which one, so a "yes" given to one question is never taken
as the answer to the next. Reads only; deciding goes through `durable_agents.api`.

Example::

    try:
        api.decide(wait.pk, True, by=user, via="admin")
    except api.WaitClosedError:
        messages.error(request, describe_closed(wait))
"""

from __future__ import annotations

from django.utils.text import Truncator

from durable_agents.display import when_text
from durable_agents.models import Wait

QUESTION_CHARS = 120


def wait_label(wait: Wait) -> str:
    """`wait 12 ("Refund 5000.00 to A-1002?")`: the id and what it asks, short enough for a message."""
    asks = Truncator(wait.question or wait.name or wait.kind).chars(QUESTION_CHARS)
    return f'wait {wait.pk} ("{asks}")'


def describe_closed(wait: Wait) -> str:
    """Why `wait` cannot be decided now, naming the request its run waits on instead, if any."""
    wait.refresh_from_db(fields=["status", "decided_by", "decided_at"])
    sentence = f"This request, {wait_label(wait)}, is already {wait.status}"
    if wait.decided_by:
        sentence += f" by {wait.decided_by}"
    if wait.decided_at:
        sentence += f" at {when_text(wait.decided_at)}"
    sentence += "; nothing was decided."
    current = (
        Wait.objects.open()
        .filter(run_id=wait.run_id)
        .exclude(pk=wait.pk)
        .only("id", "run_id", "kind", "name", "question")
        .first()
    )
    if current is not None:
        sentence += (
            f" Run {str(wait.run_id)[:8]} now waits on another request, {wait_label(current)}; "
            "read its brief and decide it on its own."
        )
    return sentence

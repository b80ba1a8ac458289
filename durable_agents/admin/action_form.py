"""The form every run action shows: bare, a confirmation; subclasses ask for what the action needs."""

from __future__ import annotations

from typing import Any

from django import forms

from durable_agents.models import Run


class RunActionForm(forms.Form):
    """An action's form; bare, it is a confirmation."""

    def __init__(self, *args: Any, run: Run | None = None, **kwargs: Any) -> None:
        self.run = run
        super().__init__(*args, **kwargs)

    def stale_reason(self) -> str | None:
        """Why what this form showed no longer holds (then nothing is done), or None."""
        return None

"""The operator console in the Django admin: the run list, the run page, and the actions operators take.

Modules: `runs` (the ModelAdmin), `filters`, `counting` (counts that stay cheap at a million rows),
`overview`, `run_page` (what the run page reads), `timeline` (its SVG), `actions` (resume, retry,
cancel, budget, swap — each through the public API).
"""

from durable_agents.admin.runs import RunAdmin

__all__ = ["RunAdmin"]

"""The operator console in the Django admin: the run list, the run page, and the actions operators take.

Modules: `runs` (the ModelAdmin), `filters`, `counting` (counts that stay cheap at a million rows),
`overview`, `run_page` (what the run page reads), `timeline` (its SVG), `actions` (resume, retry,
cancel, budget, swap, approve, reject, re-plan — each through the public API), `waits` (the pending
approvals queue), `schedules` (the scheduled runs, paused and resumed).
"""

from durable_agents.admin.runs import RunAdmin
from durable_agents.admin.schedules import ScheduleAdmin
from durable_agents.admin.waits import WaitAdmin

__all__ = ["RunAdmin", "ScheduleAdmin", "WaitAdmin"]

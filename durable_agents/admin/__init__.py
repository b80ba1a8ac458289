"""The operator console in the Django admin: the run list, the run page, and the actions operators take.

Modules: `runs` (the ModelAdmin), `filters`, `counting` (counts that stay cheap at a million rows),
`overview`, `run_page` (what the run page reads), `timeline` (its SVG), `actions` (resume, retry,
cancel, budget, swap, approve, reject, deliver a signal, re-plan, fork — each through the public API) with their
forms (`action_forms`, `run_forms`) and `bulk` (the list's), `audit` (each console action in the admin's log),
`waits` (the pending approvals queue), `schedules` (the scheduled runs, paused, resumed and triggered now),
`replays` (the replay lab: replays with their reports and side-by-side cases, cohorts) with `replay_forms` (starting
a replay) and `conversations` (a case's conversations), `batches` (the Message Batches sent, read-only).
"""

from durable_agents.admin.batches import MessageBatchAdmin
from durable_agents.admin.replays import CohortAdmin, ReplayAdmin
from durable_agents.admin.runs import RunAdmin
from durable_agents.admin.schedules import ScheduleAdmin
from durable_agents.admin.waits import WaitAdmin

__all__ = ["CohortAdmin", "MessageBatchAdmin", "ReplayAdmin", "RunAdmin", "ScheduleAdmin", "WaitAdmin"]

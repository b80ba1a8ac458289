"""durable_agents: durable LLM agents and workflows on Django, Postgres and Celery.

The public API lives in `durable_agents.api` (an app's `__init__` cannot import models).
"""

__version__ = "0.1.0"

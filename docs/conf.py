"""Sphinx configuration for the durable_agents documentation (`python -m sphinx -W -n docs docs/_build/html`).

The reference is generated from the code when the site is built: the API from the docstrings of
`durable_agents.api.__all__` (autodoc), the settings from durable_agents/conf.py, the commands from their
argument parsers, the system checks from durable_agents/checks.py and the exception tree from
durable_agents/errors.py (docs/_ext/durable_docs.py). Nothing there is copied by hand, so nothing drifts.
"""

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "docs" / "_ext"))

# autodoc imports the models: Django is set up on settings that open no database and reach no broker.
os.environ["DJANGO_SETTINGS_MODULE"] = "docs_settings"
import django  # noqa: E402

django.setup()

import durable_agents  # noqa: E402

project = "durable_agents"
author = "durable_agents contributors"
copyright = "2026, durable_agents contributors"
release = durable_agents.__version__
version = release

extensions = ["myst_parser", "sphinx.ext.autodoc", "durable_docs"]
myst_enable_extensions = ["colon_fence", "deflist", "fieldlist"]
myst_heading_anchors = 3
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build", "_ext"]

# Docstrings write `name` for code, as the rest of the project does.
default_role = "code"
add_module_names = False  # `start(...)`, not `durable_agents.api.start(...)`: the page says where they live
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_typehints_format = "short"
autodoc_default_options = {"exclude-members": "DoesNotExist, MultipleObjectsReturned"}

# -n (nitpicky) resolves every type in a signature. Types from outside durable_agents are not documented here
# (no intersphinx: the build needs no network), so they are the only references allowed to dangle.
nitpick_ignore_regex = [
    (r"py:.*", r"(typing|collections\.abc|datetime|decimal|uuid|enum|types|pathlib|re)\..*"),
    (r"py:.*", r"(django|celery|anthropic|kombu)\..*"),
    (r"py:class", r"(Any|Callable|Iterable|Iterator|Mapping|Sequence|Literal|Self|QuerySet|datetime|timedelta)"),
    (r"py:class", r"(Decimal|UUID|date|time|Path|Manager)"),
    (r"py:class", r"(int|str|float|bool|dict|list|tuple|set|frozenset|bytes|object|type|None|Exception)"),
    # tool()'s type variables and the registry it writes to: how the decorator is typed, nothing a user handles.
    (r"py:class", r"(P|durable_agents\.tools\.(R|P|ToolRegistry))"),
    # A replay report's rows: Report's docstring describes them.
    (r"py:class", r"durable_agents\.replays\.(Case|LaneSummary)"),
]

html_theme = "furo"
html_title = f"durable_agents {release}"
html_static_path = ["_static"]
html_css_files = ["reference.css"]

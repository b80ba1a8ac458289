"""Sphinx configuration for the durable_agents documentation (`python -m sphinx -W docs docs/_build/html`)."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import durable_agents  # noqa: E402

project = "durable_agents"
author = "durable_agents contributors"
copyright = "2026, durable_agents contributors"
release = durable_agents.__version__
version = release

extensions = ["myst_parser"]
myst_enable_extensions = ["colon_fence", "deflist", "fieldlist"]
myst_heading_anchors = 3
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]

html_theme = "furo"
html_title = f"durable_agents {release}"

"""Fixtures shared by the end-to-end tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture
def artifacts(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    """A folder for this test's screenshots and logs: under DURABLE_TEST_ARTIFACTS when set, kept after the run."""
    root = os.environ.get("DURABLE_TEST_ARTIFACTS")
    folder = Path(root) / request.node.name if root else tmp_path
    folder.mkdir(parents=True, exist_ok=True)
    return folder

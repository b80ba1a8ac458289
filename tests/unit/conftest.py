"""The documentation site, built once per session for the tests that read it (tests/unit/test_docs_build.py)."""

from __future__ import annotations

import html
import re
import subprocess
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class BuiltDocs:
    """The HTML build of docs/ with warnings as errors (-W) and every reference resolved (-n)."""

    result: subprocess.CompletedProcess[str]
    html: Path

    def page(self, name: str) -> str:
        return (self.html / f"{name}.html").read_text()

    def headings(self, name: str, level: int) -> set[str]:
        """The text of the page's headings of that level (`<h3>durable_agents.E001</h3>`), tags and links removed."""
        found = re.findall(rf"<h{level}>(.*?)</h{level}>", self.page(name), flags=re.DOTALL)
        return {html.unescape(re.sub(r"<[^>]+>|¶", "", heading)).strip() for heading in found}

    def objects(self) -> set[str]:
        """The names objects.inv lists (what other Sphinx sites can link to): `durable_agents.api.start`, ..."""
        data = (self.html / "objects.inv").read_bytes()
        # Four header lines ("# Sphinx inventory version 2", project, version, compression), then zlib.
        body = zlib.decompress(data.split(b"\n", 4)[4]).decode()
        return {line.split(" ", 1)[0] for line in body.splitlines() if line}


@pytest.fixture(scope="session")
def built_docs(tmp_path_factory: pytest.TempPathFactory) -> BuiltDocs:
    out = tmp_path_factory.mktemp("docs")
    command = [sys.executable, "-m", "sphinx", "-W", "-n", "--keep-going", "-q", "-b", "html"]
    command += ["-d", str(out / "doctrees"), "docs", str(out / "html")]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    return BuiltDocs(result, out / "html")

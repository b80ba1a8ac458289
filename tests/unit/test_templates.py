"""The console's templates: nothing meant as a comment reaches the page.

Django's `{# #}` comment is single-line only ("Template comments ... cannot span multiple lines", Django docs,
"The Django template language": Comments); a multi-line one is printed as text. Multi-line comments take
`{% comment %}`.
"""

from __future__ import annotations

import re
from pathlib import Path

import durable_agents

ROOTS = (Path(durable_agents.__file__).parent / "templates", Path(__file__).parents[2] / "project" / "templates")
OPENED_NOT_CLOSED = re.compile(r"\{#(?:(?!#\}).)*$", re.M)


def test_templates__no_comment_spans_lines():
    templates = [path for root in ROOTS for path in root.rglob("*.html")]
    assert templates, f"no templates found under {ROOTS}"
    spanning = [
        f"{path.relative_to(path.parents[3])}:{text[: match.start()].count(chr(10)) + 1}"
        for path in templates
        for text in [path.read_text()]
        for match in OPENED_NOT_CLOSED.finditer(text)
    ]
    assert not spanning, f"a {{# #}} comment that spans lines is printed on the page; use {{% comment %}}: {spanning}"

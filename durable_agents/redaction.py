"""Secrets out of text the app stores or logs: API keys, bearer tokens, passwords, SECRET_KEY, env secrets.

Failure messages and tracebacks are persisted (error fields, events) and logged; they carry whatever the
failing code put in them: an exception quoting an API key, a source line holding a password, a database URL
with its credentials. `redact` replaces what looks like a secret with "[redacted]" before any of it is written.

Two nets, because neither catches everything alone:

* shapes: `sk-…` keys (Anthropic's `sk-ant-api03-…`), `Authorization: …` and `Bearer …`, `password=…`,
  `"api_key": "…"` and friends, the password of a `scheme://user:password@host` URL;
* values: settings.SECRET_KEY (and its fallbacks), the databases' passwords, and every environment variable
  whose name says KEY, TOKEN, SECRET or PASSWORD — wherever they appear, whatever their shape. Values shorter
  than MIN_SECRET_CHARS are left alone (replacing "1" everywhere would wreck the text and hide nothing worth
  hiding), and so are values naming a file or directory (the secret is in the file; its path is in tracebacks).

Example::

    redact("401: invalid x-api-key: sk-ant-api03-AbC…")   # '401: invalid x-api-key: [redacted]'
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable

from django.conf import settings

REDACTED = "[redacted]"
MIN_SECRET_CHARS = 8

SECRET_ENV_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL", re.IGNORECASE)

# What a secret looks like, whoever's it is; each pattern's first group (the name of what is hidden) is kept.
# Known values are replaced first, so a shape may meet "[redacted]" and must leave it whole.
SECRET_SHAPES: tuple[re.Pattern[str], ...] = (
    # name=value, name: value, "name": "value" — for names that say they hold a secret. A comparison
    # (`password == x`) is not an assignment: the value may not start with "=".
    re.compile(
        r"""(?ix)
        (\b[\w.-]*(?:password|passwd|pwd|secret|token(?!s)|api[_-]?key|access[_-]?key|private[_-]?key)[\w-]*
         ['"]?\s*[:=]\s*)
        (?!\[redacted\])
        (?:"[^"\r\n]*"|'[^'\r\n]*'|[^\s'",;&)}\[\]=][^\s'",;&)}\[\]]*)
        """
    ),
    # An Authorization header's value, to the end of its line or quote, in any spelling of the header.
    re.compile(r"""(?i)(\bauthorization['"]?\s*[:=]\s*+['"]?+)(?!\[redacted\])[^'"\r\n]+"""),
    re.compile(r"(?i)(\bbearer\s+)[A-Za-z0-9._~+/=-]{6,}"),
    # API keys: Anthropic's sk-ant-api03-…, sk-ant-admin01-…, and other sk- keys of that kind.
    re.compile(r"()\bsk-[A-Za-z0-9_-]{16,}"),
    # The password of a URL: postgres://user:password@host/db.
    re.compile(r"(?i)(\b[a-z][a-z0-9+.-]*://[^\s/:@]*:)(?!\[redacted\])[^\s/@]+(?=@)"),
)


def redact(text: str) -> str:
    """`text` with everything that looks like a secret, or is a known one, replaced by "[redacted]"."""
    return redactor()(text)


def redactor() -> Callable[[str], str]:
    """`redact` with the known secrets read once: for redacting many texts in a row (a traceback's parts)."""
    known = sorted(_known_secrets(), key=len, reverse=True)

    def apply(text: str) -> str:
        for value in known:
            if value in text:
                text = text.replace(value, REDACTED)
        for shape in SECRET_SHAPES:
            text = shape.sub(_keep_name, text)
        return text

    return apply


def _keep_name(match: re.Match[str]) -> str:
    return match.group(1) + REDACTED


def _known_secrets() -> set[str]:
    """Secret values of this process: Django's signing keys, database passwords, secret-named env vars."""
    found: set[str] = set()
    if settings.configured:
        found.add(str(getattr(settings, "SECRET_KEY", "") or ""))
        found.update(str(key) for key in getattr(settings, "SECRET_KEY_FALLBACKS", []) or [])
        found.update(str(db.get("PASSWORD") or "") for db in getattr(settings, "DATABASES", {}).values())
    found.update(value for name, value in os.environ.items() if SECRET_ENV_NAME.search(name))
    return {value for value in found if _is_secret_value(value)}


def _is_secret_value(value: str) -> bool:
    if len(value) < MIN_SECRET_CHARS:
        return False
    # A path names where a secret is kept; file paths are all over tracebacks and must stay readable.
    return not (value.startswith(("/", "~", ".")) and os.path.exists(os.path.expanduser(value)))

"""Signed, expiring, single-use decision links for waits (django.core.signing with a purpose salt).

The token names the wait, its run and the wait's nonce: a tampered token fails the signature, an old
one fails max_age, a token of another wait or run fails the match, and a used one finds the wait closed.
"""

from __future__ import annotations

from dataclasses import dataclass

from django.conf import settings as django_settings
from django.core import signing
from django.core.exceptions import ImproperlyConfigured
from django.urls import NoReverseMatch, reverse

from durable_agents.conf import settings
from durable_agents.errors import DecisionLinkError, InvalidInputError
from durable_agents.models import Wait

SALT = "durable_agents.wait-decision"
# Keys published in this repository (the example settings' former fallback): anyone can sign with them, so a
# link signed with one proves nothing. Links are neither made nor accepted under them, nor as fallbacks.
PUBLIC_SECRET_KEYS = frozenset({"django-insecure-demo-key-set-DJANGO_SECRET_KEY-in-production"})


@dataclass(frozen=True)
class LinkClaim:
    wait_id: int
    run_id: str
    nonce: str


def make_token(wait: Wait) -> str:
    return signing.dumps(
        {"w": wait.pk, "r": str(wait.run_id), "n": wait.link_nonce}, key=_signing_key(), salt=SALT, compress=True
    )


def _signing_key() -> str:
    key = str(django_settings.SECRET_KEY)
    if key in PUBLIC_SECRET_KEYS:
        raise ImproperlyConfigured(
            "SECRET_KEY is a published key, so decision links signed with it could be forged; "
            "set DJANGO_SECRET_KEY (settings.SECRET_KEY) to a long random value of your own"
        )
    return key


def _fallback_keys() -> list[str]:
    return [str(k) for k in getattr(django_settings, "SECRET_KEY_FALLBACKS", []) if str(k) not in PUBLIC_SECRET_KEYS]


def decision_path(wait: Wait) -> str:
    """The site path of the wait's decision page; DecisionLinkError if this site cannot make one."""
    try:
        return reverse("durable_agents:decide_wait", args=[wait.pk, make_token(wait)])
    except NoReverseMatch:
        raise DecisionLinkError(
            "no decision link can be made: durable_agents.urls is not included in ROOT_URLCONF (system check "
            'durable_agents.E015); add path("durable/", include("durable_agents.urls"))'
        ) from None
    except ImproperlyConfigured as exc:
        raise DecisionLinkError(f"no decision link can be made: {exc}") from None


def decision_url(wait: Wait) -> str:
    return f"{settings.BASE_URL.rstrip('/')}{decision_path(wait)}"


def read_token(wait_id: int, token: str) -> LinkClaim:
    """The link's claim, or InvalidInputError saying why the link cannot be used."""
    try:
        key = _signing_key()
    except ImproperlyConfigured:
        raise InvalidInputError(
            "decision links are disabled: this site's SECRET_KEY is a published one; decide in the admin, "
            "and ask its administrator to set DJANGO_SECRET_KEY"
        ) from None
    try:
        data = signing.loads(
            token, key=key, fallback_keys=_fallback_keys(), salt=SALT, max_age=float(settings.LINK_MAX_AGE_SECONDS)
        )
    except signing.SignatureExpired:
        raise InvalidInputError("this decision link has expired; ask for a new one or decide in the admin") from None
    except signing.BadSignature:
        raise InvalidInputError("this decision link is not valid (it was altered or is incomplete)") from None
    claim = LinkClaim(wait_id=int(data.get("w", -1)), run_id=str(data.get("r", "")), nonce=str(data.get("n", "")))
    wait = Wait.objects.filter(pk=wait_id).only("id", "run_id", "link_nonce").first()
    if claim.wait_id != wait_id or wait is None or str(wait.run_id) != claim.run_id or wait.link_nonce != claim.nonce:
        raise InvalidInputError("this decision link belongs to another request")
    return claim

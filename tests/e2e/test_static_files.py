"""The admin is styled with DEBUG off: the Procfile's `release` and `web` lines, run as a platform runs them
(project/settings.py, an explicit key, no DJANGO_DEBUG), serve the admin's CSS through WhiteNoise, and an
approver who opens a decision link before signing in lands on that styled login page and comes back.

The processes run against this test's database; the browser is Debian's headless Chromium.
"""

from __future__ import annotations

import http.client
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from email.message import Message
from pathlib import Path
from urllib.parse import quote

import pytest
from django.conf import settings
from django.contrib.auth.hashers import PBKDF2PasswordHasher

from durable_agents import api
from durable_agents.links import decision_path
from durable_agents.models import Wait, WaitStatus
from durable_agents.testing import drive
from tests.e2e.test_admin_browser import CHROMIUM, approver, chromium_page

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

ROOT = Path(__file__).resolve().parents[2]
# A cold gunicorn on a busy 2-core machine: readiness is polled for, this is only the give-up point.
BOOT_TIMEOUT_SECONDS = 120
UNSTYLED = ("rgba(0, 0, 0, 0)", "transparent")


def procfile_command(process: str) -> str:
    for line in (ROOT / "Procfile").read_text().splitlines():
        name, _, command = line.partition(":")
        if name.strip() == process:
            return command.strip()
    raise AssertionError(f"the Procfile has no `{process}:` line")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass(frozen=True)
class Response:
    status: int
    headers: Message
    body: bytes


def get(port: int, path: str, headers: dict[str, str] | None = None) -> Response:
    """One GET, redirects not followed (http.client never follows them)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        connection.request("GET", path, headers=headers or {})
        response = connection.getresponse()
        return Response(response.status, response.headers, response.read())
    finally:
        connection.close()


@dataclass(frozen=True)
class Web:
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture
def web(worker_env: dict[str, str], tmp_path: Path, artifacts: Path) -> Iterator[Web]:
    """The Procfile's `release` then `web`, on project/settings.py with DEBUG off, until gunicorn answers."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO_", "DURABLE_"))}
    env.update(
        DJANGO_SETTINGS_MODULE="project.settings",
        DATABASE_URL=worker_env["DATABASE_URL"],
        CELERY_BROKER_URL=worker_env["CELERY_BROKER_URL"],
        # The test's own key: the decision links signed in this process are good in gunicorn's.
        DJANGO_SECRET_KEY=settings.SECRET_KEY,
        DURABLE_VAR_DIR=str(tmp_path / "var"),
        PORT=str(free_port()),
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        PYTHONUNBUFFERED="1",
    )
    release = subprocess.run(
        ["sh", "-c", procfile_command("release")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert release.returncode == 0, f"the Procfile's release step failed:\n{release.stdout[-2000:]}{release.stderr}"
    assert (tmp_path / "var" / "static" / "admin" / "css" / "base.css").exists(), "collectstatic left no admin CSS"

    web = Web(port=int(env["PORT"]), log=artifacts / "gunicorn.log")
    with web.log.open("wb") as log:
        process = subprocess.Popen(
            ["sh", "-c", procfile_command("web")],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # gunicorn's master and workers share a process group: one signal ends them
        )
    try:
        wait_until_serving(process, web)
        yield web
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def wait_until_serving(process: subprocess.Popen, web: Web) -> None:
    deadline = time.monotonic() + BOOT_TIMEOUT_SECONDS
    while True:
        if process.poll() is not None:
            pytest.fail(f"gunicorn exited with {process.returncode}:\n{web.log.read_text()[-3000:]}")
        try:
            if get(web.port, "/admin/login/").status == 200:
                return
        except OSError:
            pass  # not listening yet
        if time.monotonic() > deadline:
            pytest.fail(f"gunicorn did not answer in {BOOT_TIMEOUT_SECONDS}s:\n{web.log.read_text()[-3000:]}")
        time.sleep(0.2)


def header_background(page) -> str:
    return page.locator("#header").evaluate("element => getComputedStyle(element).backgroundColor")


def test_web__debug_off_serves_the_admin_css_and_the_browser_applies_it(web, artifacts):
    if not CHROMIUM.exists():
        pytest.fail("Debian's chromium is missing: `apt-get install -y chromium` (scripts/test installs it)")
    login = get(web.port, "/admin/login/")
    assert login.status == 200, login.body[:500]
    stylesheets = re.findall(r'<link rel="stylesheet" href="([^"]+)"', login.body.decode())
    base_css = next((href for href in stylesheets if href.endswith("admin/css/base.css")), None)
    assert base_css, f"the login page links no admin/css/base.css: {stylesheets}"

    css = get(web.port, base_css, {"Accept-Encoding": "gzip"})
    assert css.status == 200, (
        f"{base_css} answered {css.status} with DEBUG off: is WhiteNoise in MIDDLEWARE and did collectstatic run? "
        f"log: {web.log}"
    )
    assert css.headers.get_content_type() == "text/css", css.headers
    assert css.headers["Content-Encoding"] == "gzip", "WhiteNoise should serve the compressed copy collectstatic made"

    with chromium_page() as page:
        page.goto(f"{web.url}/admin/login/")
        page.wait_for_selector("#id_username")
        background = header_background(page)
        page.screenshot(path=str(artifacts / "01-admin-login-debug-off.png"), full_page=True)
    assert background not in UNSTYLED, f"the admin header has no background ({background}): its CSS was not applied"


def test_web__debug_off_serves_the_consoles_live_refresh_script(web):
    script = get(web.port, f"/{settings.STATIC_URL.strip('/')}/durable_agents/live.js")

    assert script.status == 200, f"the run pages' live refresh script answered {script.status}; log: {web.log}"
    assert script.headers.get_content_type() in ("text/javascript", "application/javascript"), script.headers
    assert b"durable-live" in script.body


def test_decision_link__anonymous_approver_is_sent_to_the_admin_login_and_back(web, artifacts):
    if not CHROMIUM.exists():
        pytest.fail("Debian's chromium is missing: `apt-get install -y chromium` (scripts/test installs it)")
    manager = approver("manager-1")
    # gunicorn checks passwords with project/settings.py's hashers; the test settings hash with MD5 only.
    hasher = PBKDF2PasswordHasher()
    manager.password = hasher.encode("correct horse battery", hasher.salt())
    manager.save(update_fields=["password"])
    run = drive(api.start("approve_charge", {"order_id": "ST-1"}).id)
    wait = Wait.objects.get(run=run, status=WaitStatus.OPEN)
    path = decision_path(wait)

    anonymous = get(web.port, path)
    login_url = f"/admin/login/?next={quote(path)}"
    assert anonymous.status == 302 and anonymous.headers["Location"] == login_url, (
        f"LOGIN_URL = 'admin:login' must send an anonymous approver to the admin's login and back: "
        f"{anonymous.status} {anonymous.headers['Location']}"
    )
    login = get(web.port, login_url)
    assert login.status == 200 and b'id="id_username"' in login.body, login.body[:500]
    assert f'name="next" value="{path}"'.encode() in login.body, "the login form must carry the decision link on"

    with chromium_page() as page:
        page.goto(f"{web.url}{path}")
        page.wait_for_selector("#id_username")
        landed = page.url
        background = header_background(page)
        page.screenshot(path=str(artifacts / "01-decision-link-login.png"), full_page=True)
        page.fill("#id_username", "manager-1")
        page.fill("#id_password", "correct horse battery")
        page.click("input[type=submit]")
        page.wait_for_url(f"**{path}")
        question = page.locator("#content-main").inner_text()
        page.screenshot(path=str(artifacts / "02-decision-page.png"), full_page=True)
    assert landed == f"{web.url}{login_url}", landed
    assert background not in UNSTYLED, f"the login page is unstyled ({background})"
    assert "Charge the customer 40.00?" in question, question
    assert Wait.objects.get(pk=wait.pk).is_open, "opening the link decides nothing"

"""The admin dashboard in a real headless browser, against a real gateway and the real built-in backend.

Chromium is Debian's package (Playwright's own browser download needs the internet); on a machine
without it the module fixture installs it with apt-get, or skips (fails under CI or
CACHEGW_REQUIRE_BROWSER) when it cannot.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx  # noqa: E402
import pytest  # noqa: E402

from tests.services import apt_install, missing  # noqa: E402
from tests.test_gateway import ask, backend_url, chat, gateway, settings_for  # noqa: E402, F401

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
REQUIRE_BROWSER = "CACHEGW_REQUIRE_BROWSER"
ADMIN_TOKEN = "cgw-admin-dashboard-test-token"
MARKUP = 'What does <b>bold</b> <img src="x"> mean in HTML?'
# The artifact (git-ignored); CACHEGW_UPDATE_DOCS=1 also refreshes the screenshot in docs/.
ARTIFACT = Path(__file__).resolve().parent / "artifacts" / "dashboard.png"
DOCS_SHOT = Path(__file__).resolve().parent.parent / "docs" / "dashboard.png"


@pytest.fixture(scope="module")
def chromium() -> str:
    """Debian's chromium, installed with apt-get when missing (we run as root in CI)."""
    pytest.importorskip("playwright.sync_api")
    if os.path.exists(CHROMIUM):
        return CHROMIUM
    log = apt_install("chromium")
    if os.path.exists(CHROMIUM):
        return CHROMIUM
    missing(
        f"{CHROMIUM} is missing and could not be installed:\n" + "\n".join(log), "CACHEGW_REQUIRE_BROWSER"
    )


@pytest.fixture(scope="module")
def browser(chromium) -> Iterator:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture()
def admin_gw(backend_url, tmp_path) -> Iterator[str]:  # noqa: F811
    s = settings_for(tmp_path / "data", [backend_url])
    s = s.model_copy(update={"admin": s.admin.model_copy(update={"token": ADMIN_TOKEN})})
    with gateway(s) as url:
        yield url


def pct(ratio: float) -> str:
    """How the page prints a ratio."""
    return f"{ratio * 100:.1f}%"


@pytest.mark.slow
def test_dashboard_end_to_end(admin_gw, browser, tmp_path):
    auth = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    http = httpx.Client(base_url=admin_gw, headers=auth, timeout=30)

    # Traffic: a miss and its exact repeat, a miss and a paraphrase of it, a query holding markup;
    # flag the last hit bad.
    chat(admin_gw, ask("What is the capital of France?"))
    _, h, _ = chat(admin_gw, ask("What is the capital of France?"))
    assert h["x-cache"] == "exact-hit"
    chat(admin_gw, ask("How do I reset my password?"))
    _, h2, _ = chat(admin_gw, ask("How can I reset my password?"))
    flagged_id = (h2 if h2["x-cache"] == "semantic-hit" else h)["x-request-id"]
    chat(admin_gw, ask(MARKUP))
    r = http.post("/admin/api/feedback", json={"verdict": "bad", "request_id": flagged_id})
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + 10  # the request log is written in batches, off the request path
    while http.get("/admin/api/stats").json()["overall"]["requests"] < 5 and time.monotonic() < deadline:
        time.sleep(0.1)

    page = browser.new_page(viewport={"width": 1440, "height": 900})
    requests: list[str] = []
    console_errors: list[tuple[str, str]] = []
    phase = {"now": "login"}
    page.on("request", lambda req: requests.append(req.url))
    page.on("console", lambda m: m.type == "error" and console_errors.append((phase["now"], m.text)))
    page.on("pageerror", lambda exc: console_errors.append((phase["now"], f"uncaught: {exc}")))

    page.goto(f"{admin_gw}/admin")
    # A wrong token: the API's 401, said clearly.
    page.fill("#token", "not-the-token")
    page.click("#login")
    page.locator("#login-error").wait_for(state="visible")
    assert "Invalid admin token" in page.locator("#login-error").inner_text()
    assert page.locator("#app").is_hidden()
    bad_login_errors = [e for e in console_errors if e[0] == "login"]
    phase["now"] = "app"

    page.fill("#token", ADMIN_TOKEN)
    page.click("#login")
    page.wait_for_function("document.querySelector('#hit-ratio').textContent.includes('%')")
    assert page.locator("#login-error").is_hidden()
    stats = http.get("/admin/api/stats", params={"window": "1h"}).json()
    assert stats["overall"]["requests"] == 5
    assert page.locator("#hit-ratio").inner_text() == pct(stats["overall"]["hit_ratio"])
    # no false-hit target here: the false-hit chart says so rather than drawing an empty line
    page.locator("#fhr-chart text", has_text="No audited hits in this window").wait_for()
    assert page.locator("#fhr-sub").inner_text() == "no hits audited"
    entries = http.get("/admin/api/entries", params={"order": "hits"}).json()["data"]
    assert entries
    page.locator("#entries button[data-entry-id]").first.wait_for()
    assert page.locator("#flagged tbody tr td").first.inner_text() != "No hit has been flagged bad."
    # the backend that answered the misses, with its request count and prefix-cache ratio
    [(backend, answered)] = stats["by_backend"].items()
    row = page.locator("#backends tbody tr", has_text=backend)
    row.wait_for()
    cells = row.locator("td").all_inner_texts()
    assert cells[1] == str(answered["requests"]) and cells[2] == pct(answered["prefix_cache_ratio"])
    assert answered["requests"] == stats["overall"]["misses"] + stats["overall"]["bypasses"]
    # why the misses were not hits: the same counts as the stats API, with a bar per busy bucket
    assert stats["reasons"] and sum(r["requests"] for r in stats["reasons"]) == stats["overall"]["misses"]
    for reason in stats["reasons"]:
        row = page.locator(f'#reasons tbody tr[data-reason="{reason["result"]}:{reason["reason"]}"]')
        row.wait_for()
        cells = row.locator("td").all_inner_texts()
        assert cells[:4] == [
            reason["result"],
            reason["reason"],
            str(reason["requests"]),
            pct(reason["share"]),
        ]
        assert row.locator("svg rect").count() >= 1
    # user text is shown as text, never parsed as markup
    page.locator("#entries td", has_text=MARKUP).wait_for()
    assert page.locator("#entries img, #entries b").count() == 0

    # The global threshold through the page.
    assert page.locator("#threshold-scope").input_value() == "default"
    page.fill("#threshold-input", "0.91")
    page.locator("#whatif th", has_text="at 0.91").wait_for()
    is_put = lambda r: r.url.endswith("/admin/api/settings") and r.request.method == "PUT"
    with page.expect_response(is_put) as put:
        page.click("#threshold-apply")
    assert put.value.status == 200
    assert http.get("/admin/api/settings").json()["thresholds"]["default"] == 0.91
    page.locator("#threshold-msg", has_text="0.91").wait_for()

    # Delete an entry through its button.
    victim = entries[0]["id"]
    button = page.locator(f'#entries button[data-entry-id="{victim}"]')
    with page.expect_response(lambda r: f"/admin/api/entries/{victim}" in r.url) as deleted:
        button.click()
    assert deleted.value.status == 200
    button.wait_for(state="detached")
    listed = http.get("/admin/api/entries", params={"limit": 1000}).json()["data"]
    assert victim not in [e["id"] for e in listed]

    # A proposed value left on the slider: the what-if and the dashed line on the histogram.
    page.fill("#threshold-input", "0.86")
    page.locator("#whatif th", has_text="at 0.86").wait_for()
    page.locator("#hist-chart text", has_text="proposed 0.86").wait_for()
    page.locator("#hist-chart text", has_text="threshold 0.91").wait_for()
    page.locator("#toast").wait_for(state="hidden")
    page.evaluate("window.scrollTo(0, 0)")
    shot = page.screenshot(full_page=True)
    (tmp_path / "dashboard.png").write_bytes(shot)
    ARTIFACT.parent.mkdir(exist_ok=True)
    ARTIFACT.write_bytes(shot)
    if os.environ.get("CACHEGW_UPDATE_DOCS"):
        DOCS_SHOT.write_bytes(shot)
    page.close()
    http.close()

    hosts = {urlsplit(u).hostname for u in requests if not u.startswith("data:")}
    assert hosts == {"127.0.0.1"}, requests
    assert all("401" in text for _, text in bad_login_errors), bad_login_errors
    assert [e for e in console_errors if e[0] != "login"] == []

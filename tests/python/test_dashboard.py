"""The operator dashboard (GET /admin/ui) in a real headless Chromium, driven by Selenium.

An agent loop (the openai SDK) trips a guarded session; the page shows it with its state
as text, opens its trace, resets it after the confirm dialog, and shows the new state. A
wrong token shows the admin API's refusal on the page. A screenshot is saved in pytest's
temp dir (and in $DASHBOARD_SCREENSHOT_DIR when set, for the README) and checked not to
be blank.

Needs Debian's `chromium` and `chromium-driver` (.ci/run installs them) and pip
`selenium`: without them this test FAILS, it does not skip, so a machine that cannot run
it never passes silently. Selenium is given the system chromedriver explicitly and runs
offline (no Selenium Manager download).
"""

from __future__ import annotations

import os
import shutil
import struct
import time
import uuid
import zlib
from pathlib import Path

import openai
import pytest

from backstop_support import ADMIN_TOKEN, EFFECTS_KEY, FLEET_KEY, GUARDED_KEY

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
WAIT_S = 15.0


@pytest.fixture
def browser():
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not (os.path.isfile(p) and os.access(p, os.X_OK))]
    if missing:
        pytest.fail(f"missing {missing}: apt-get install chromium chromium-driver (see .ci/run)", pytrace=False)
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.fail("pip install selenium (see tests/python/requirements.txt)", pytrace=False)
    os.environ["SE_OFFLINE"] = "true"  # never let Selenium Manager reach the network
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1366,768", "--hide-scrollbars"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.set_window_size(1366, 768)
    yield driver
    driver.quit()


def wait_for(what, check, timeout=WAIT_S):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            value = check()
            if value:
                return value
        except Exception as exc:  # the page re-renders its tables under us
            last = exc
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what} (last error: {last!r})")


def login(driver, token):
    from selenium.webdriver.common.by import By

    field = wait_for("the token field", lambda: driver.find_element(By.ID, "token") if driver.find_element(By.ID, "token").is_displayed() else None)
    field.clear()
    field.send_keys(token)
    driver.find_element(By.ID, "login-button").click()


def session_row(driver, session):
    from selenium.webdriver.common.by import By

    rows = driver.find_elements(By.CSS_SELECTOR, f'#sessions tbody tr[data-session="{session}"]')
    return rows[0] if rows else None


def state_text(driver, session):
    from selenium.webdriver.common.by import By

    row = session_row(driver, session)
    return row.find_element(By.CSS_SELECTOR, "td.session-state").text.strip() if row else None


def click_in_row(driver, session, css):
    """Clicks a button of a session's row, finding it again if a poll re-rendered it."""
    from selenium.webdriver.common.by import By

    def click():
        row = session_row(driver, session)
        if row is None:
            return False
        row.find_element(By.CSS_SELECTOR, css).click()
        return True

    wait_for(f"{css} of {session}", click)


def png_pixels(data: bytes):
    """(width, height, distinct colours) of an 8-bit RGB/RGBA PNG, with the stdlib only."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, header = 8, b"", None
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        chunk = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", chunk)
        elif kind == b"IDAT":
            idat += chunk
        pos += 12 + length
    width, height, depth, colour = header[:4]
    assert depth == 8 and colour in (2, 6), f"unexpected PNG format {header}"
    bpp = 3 if colour == 2 else 4
    raw = zlib.decompress(idat)
    stride = width * bpp
    prev = bytearray(stride)
    colours = set()
    for y in range(height):
        f = raw[y * (stride + 1)]
        line = bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b = prev[i]
            c = prev[i - bpp] if i >= bpp else 0
            if f == 1:
                line[i] = (line[i] + a) & 255
            elif f == 2:
                line[i] = (line[i] + b) & 255
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        if y % 4 == 0:  # a sample of rows is plenty to tell a page from a blank
            colours.update(bytes(line[x:x + 3]) for x in range(0, stride, bpp * 2))
        prev = line
    return width, height, len(colours)


def save_screenshot(driver, tmp_path: Path, name: str) -> Path:
    path = tmp_path / name
    assert driver.save_screenshot(str(path)), "screenshot failed"
    width, height, colours = png_pixels(path.read_bytes())
    assert (width, height) >= (1000, 600), (width, height)
    assert colours > 20, f"the screenshot looks blank: {colours} distinct colours"
    shots = os.environ.get("DASHBOARD_SCREENSHOT_DIR")
    if shots:
        Path(shots).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(shots) / name)
    return path


def test_dashboard_shows_a_tripped_session_and_resets_it(backstop, browser, tmp_path):
    from selenium.webdriver.common.by import By

    driver = browser
    driver.get(f"{backstop.url}/admin/ui")

    # A wrong token: the admin API's own refusal, on the page, and no dashboard.
    login(driver, "not-the-token")
    error = wait_for("the error", lambda: driver.find_element(By.ID, "error").text if driver.find_element(By.ID, "error").is_displayed() else None)
    assert "refused the token" in error and "HTTP 401" in error and "invalid admin token" in error, error
    assert not driver.find_element(By.ID, "dashboard").is_displayed()
    assert driver.execute_script("return sessionStorage.getItem('backstop.admin.token')") is None
    save_screenshot(driver, tmp_path, "dashboard-wrong-token.png")

    login(driver, ADMIN_TOKEN)
    wait_for("the dashboard", lambda: driver.find_element(By.ID, "dashboard").is_displayed())
    assert not driver.find_element(By.ID, "error").is_displayed()
    assert "config v1" in driver.find_element(By.ID, "config").text
    assert "survives a restart" in driver.find_element(By.ID, "memory").text
    # The token is in the tab's session storage, and in no URL the page used.
    assert driver.execute_script("return sessionStorage.getItem('backstop.admin.token')") == ADMIN_TOKEN
    urls = driver.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    assert urls and not any(ADMIN_TOKEN in u for u in urls + [driver.current_url]), urls

    # An agent stuck on a compaction that fails every time: tripped by the guard.
    session = f"dash-{uuid.uuid4().hex[:8]}"
    headers = {"x-session-id": session, "x-mock-scenario": session,
               "x-mock-fault": "status=400;code=context_length_exceeded"}
    client = openai.OpenAI(api_key=GUARDED_KEY, base_url=backstop.openai_base_url, max_retries=0, timeout=20)
    retrying = openai.OpenAI(api_key=GUARDED_KEY, base_url=backstop.openai_base_url, max_retries=0, timeout=20)
    try:
        # One request that recovery saves (503, 503, ok) in a healthy session.
        retrying.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}], extra_headers={
            "x-session-id": session + "-ok", "x-mock-scenario": session + "-ok",
            "x-mock-fault": "status=503,status=503,ok"})
        tripped = False
        for i in range(10):
            try:
                client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": f"compact {i}"}], extra_headers=headers)
            except openai.RateLimitError as err:
                assert err.code == "session_tripped"
                tripped = True
                break
            except openai.BadRequestError:
                continue
        assert tripped, "the loop was never tripped"
    finally:
        client.close()
        retrying.close()

    # The page shows it, state as text, with the rule's evidence.
    wait_for("the tripped session", lambda: state_text(driver, session) == "tripped")
    evidence = wait_for("the trip evidence", lambda: session_row(driver, session).text)
    assert "session_tripped (unrecoverable)" in evidence, evidence
    assert "3 times in a row" in evidence, evidence
    wait_for("the retries counted", lambda: int(driver.find_element(By.CSS_SELECTOR, "#total-retries b").text) >= 2)
    refused = driver.find_element(By.ID, "total-refused").text
    assert "session_tripped" in refused, refused

    # The restart record, beside the fleet prediction: the trip failed the session fast.
    restarts = wait_for("the guarded tenant's restarts", lambda: next(
        (t for t in driver.find_elements(By.CSS_SELECTOR, "#restarts [data-tenant='guarded']")
         if "unrecoverable" in t.text), None))
    assert driver.find_element(By.ID, "restarts-panel").is_displayed()
    strategies = [r.get_attribute("data-strategy") for r in restarts.find_elements(By.CSS_SELECTOR, "tr[data-strategy]")]
    assert strategies == ["guide", "wait", "total"], strategies
    text = restarts.text
    assert "trips by rule: unrecoverable" in text and "saved by trips" in text, text
    assert "failed fast " in text and "failed fast 0 " not in text, text

    # Its trace: the failures and the refusal, newest first.
    click_in_row(driver, session, "button.trace")
    wait_for("the trace", lambda: driver.find_element(By.ID, "trace-panel").is_displayed())
    assert session in driver.find_element(By.ID, "trace-title").text
    trace = wait_for("trace rows", lambda: driver.find_elements(By.CSS_SELECTOR, "#trace tbody tr"))
    assert len(trace) == 4, len(trace)
    texts = wait_for("the trace's text", lambda: [r.text for r in driver.find_elements(By.CSS_SELECTOR, "#trace tbody tr")])
    assert "refused:session_tripped" in texts[0], texts
    assert all("400" in t for t in texts[1:]), texts
    save_screenshot(driver, tmp_path, "dashboard.png")

    # Reset from the page, after the confirm dialog: the session is active again.
    click_in_row(driver, session, "button.reset")
    alert = wait_for("the confirm dialog", lambda: driver.switch_to.alert)
    assert "Reset session" in alert.text and session in alert.text
    alert.accept()
    wait_for("the reset state", lambda: state_text(driver, session) == "active")
    wait_for("the trace's new state", lambda: "state active" in driver.find_element(By.ID, "trace-signals").text)
    body = backstop.http.get(f"{backstop.url}/admin/tenants/guarded/sessions/{session}",
                             headers={"authorization": f"Bearer {ADMIN_TOKEN}"}).json()
    assert body["guard"]["signals"]["state"] == "active"

    # The state filter narrows the table to what is asked for.
    from selenium.webdriver.support.ui import Select

    Select(driver.find_element(By.ID, "filter-state")).select_by_visible_text("tripped")
    wait_for("the filtered table", lambda: session_row(driver, session) is None)
    Select(driver.find_element(By.ID, "filter-state")).select_by_visible_text("all")
    wait_for("the unfiltered table", lambda: session_row(driver, session) is not None)


def test_dashboard_shows_a_hot_failure_signature(backstop, browser, tmp_path):
    """Three sessions of the `fleet` tenant fail the same compaction twice each: the fleet
    panel shows the hot signature with its sessions and record, and a fourth session's
    request is refused before its first attempt."""
    from selenium.webdriver.common.by import By

    run = uuid.uuid4().hex[:8]
    client = openai.OpenAI(api_key=FLEET_KEY, base_url=backstop.openai_base_url, max_retries=0, timeout=20)
    scenario = f"fleet-{run}"
    try:
        def compact(session, attempt):
            return client.chat.completions.create(model="gpt-4o", messages=[
                {"role": "system", "content": "You are a coding agent."},
                {"role": "user", "content": f"Summarize the conversation of run {session} in under {1000 + attempt} tokens."},
            ], extra_headers={"x-session-id": session, "x-mock-scenario": scenario,
                              "x-mock-fault": "status=400;code=context_length_exceeded"})

        for k in range(3):
            for attempt in range(2):
                with pytest.raises(openai.BadRequestError):
                    compact(f"{run}-{k}", attempt)
        with pytest.raises(openai.RateLimitError) as refused:
            compact(f"{run}-new", 0)
        assert refused.value.code == "session_tripped"
        assert "refused before its first attempt" in str(refused.value)
    finally:
        client.close()
    assert backstop.attempts(scenario) == 6

    driver = browser
    driver.get(f"{backstop.url}/admin/ui")
    login(driver, ADMIN_TOKEN)
    wait_for("the fleet panel", lambda: driver.find_element(By.ID, "fleet-panel").is_displayed())
    row = wait_for("the hot signature", lambda: next(
        (r for r in driver.find_elements(By.CSS_SELECTOR, "#fleet tbody tr") if r.get_attribute("data-state") == "hot"), None))
    text = row.text
    assert "context_length_exceeded" in text and "summarize the conversation of run #" in text, text
    assert "hot" in row.find_element(By.CSS_SELECTOR, ".state").text
    summary = driver.find_element(By.CSS_SELECTOR, "[data-fleet-tenant='fleet']").text
    assert "fleet_pattern" in summary and "preempt" in summary, summary
    driver.execute_script("document.getElementById('fleet-panel').scrollIntoView()")
    save_screenshot(driver, tmp_path, "dashboard-fleet.png")


def test_dashboard_shows_a_sessions_committed_side_effects(backstop, browser):
    """A session of the `effects` tenant commits one email and its model proposes it again
    (corrected): the session's trace panel lists the committed call, its result and the
    repeat."""
    import json

    from selenium.webdriver.common.by import By

    session = f"effects-{uuid.uuid4().hex[:8]}"
    client = openai.OpenAI(api_key=EFFECTS_KEY, base_url=backstop.openai_base_url, max_retries=0, timeout=20)
    args = json.dumps({"to": "bob@example.com"})
    try:
        client.chat.completions.create(model="gpt-4o", messages=[
            {"role": "user", "content": "mail bob"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_dash", "type": "function", "function": {"name": "send_email", "arguments": args}}]},
            {"role": "tool", "tool_call_id": "call_dash", "content": "sent"},
        ], extra_headers={"x-session-id": session, "x-mock-scenario": session + "-1"})
        import base64

        proposes = "tool=send_email;tool_args_b64=" + base64.b64encode(args.encode()).decode()
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "mail bob"}],
                                       extra_headers={"x-session-id": session, "x-mock-scenario": session + "-2",
                                                      "x-mock-fault": proposes + ",content=done"})
    finally:
        client.close()
    driver = browser
    driver.get(f"{backstop.url}/admin/ui")
    login(driver, ADMIN_TOKEN)
    click_in_row(driver, session, "button.trace")
    effects = wait_for("the committed side effects", lambda: driver.find_element(By.ID, "trace-effects").text)
    assert "send_email" in effects and "call_dash" in effects and "→ sent" in effects, effects
    assert "proposed again 1×" in effects, effects

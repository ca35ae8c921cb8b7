"""The console in a real browser (Debian's headless Chromium, driven by
Selenium): log in, see the drives and the figures /metrics has, create a
bucket, upload and download a file, create and revoke a user, and a session
that is gone sends the page back to its login. A screenshot of each step is
kept as a test artifact (TARN_TEST_ARTIFACTS, default
~/.cache/tarn-target/test-artifacts)."""

import os
import re
import shutil

import pytest

from conftest import data
from tarnproc import ACCESS_KEY, SECRET_KEY, admin, metric

CHROMIUM = shutil.which("chromium")
DRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(not (CHROMIUM and DRIVER), reason="chromium and chromium-driver (Debian) are not installed; scripts/test installs them")

ARTIFACTS = os.environ.get("TARN_TEST_ARTIFACTS") or os.path.join(
    os.environ.get("CARGO_TARGET_DIR") or os.path.expanduser("~/.cache/tarn-target"), "test-artifacts")


def human(n):
    """The console's (and `tarn admin`'s) way of writing a byte count."""
    units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"]
    i, v = 0, float(n)
    while v >= 1024 and i < len(units) - 1:
        v /= 1024
        i += 1
    return f"{n} B" if i == 0 else f"{v:.1f} {units[i]}"


@pytest.fixture
def browser(tmp_path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    os.environ["SE_OFFLINE"] = "true"  # never let Selenium fetch a driver
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for a in ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1280,900",
              f"--user-data-dir={tmp_path / 'chromium'}"]:
        opts.add_argument(a)
    d = webdriver.Chrome(service=Service(DRIVER), options=opts)
    d.set_script_timeout(30)
    yield d
    d.quit()


def wait(d, what, cond, timeout=20):
    """Polls `cond` until it gives something true. The console draws a view
    again when its data arrives (and some views every few seconds), so an
    element found a moment ago may be gone: that poll is tried again."""
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(d, timeout, poll_frequency=0.2,
                             ignored_exceptions=(NoSuchElementException, StaleElementReferenceException)).until(lambda _: cond())
    except Exception as e:
        raise AssertionError(f"timed out waiting for {what}: {d.find_element('id', 'status-line').text!r}") from e


def act(d, what, action):
    """Finds an element and acts on it in one step, again if the view was
    drawn anew in between."""
    return wait(d, what, lambda: action() or True)


def shot(d, name):
    os.makedirs(ARTIFACTS, exist_ok=True)
    path = os.path.join(ARTIFACTS, f"console-{name}.png")
    d.save_screenshot(path)
    return path


def test_console_in_chromium(server, browser, tmp_path):
    from selenium.webdriver.common.by import By

    d = browser
    d.get(server.admin + "/console")
    wait(d, "the login form", lambda: d.find_element(By.ID, "login").is_displayed())
    form = d.find_element(By.ID, "login-form")
    form.find_element(By.NAME, "access_key").send_keys(ACCESS_KEY)
    form.find_element(By.NAME, "secret_key").send_keys("wrong")
    form.find_element(By.TAG_NAME, "button").click()
    wait(d, "the refusal", lambda: "wrong access key" in d.find_element(By.ID, "login-error").text)
    form.find_element(By.NAME, "secret_key").clear()
    form.find_element(By.NAME, "secret_key").send_keys(SECRET_KEY)
    form.find_element(By.TAG_NAME, "button").click()
    wait(d, "the overview", lambda: d.find_elements(By.ID, "health") and d.find_element(By.ID, "health").text == "ready")
    # The cookie is out of the page's reach (HttpOnly): the script sees none.
    assert d.execute_script("return document.cookie") == ""
    shot(d, "overview")

    # Drives: the states and sizes /metrics has.
    d.find_element(By.CSS_SELECTOR, '[data-tab="drives"]').click()
    # Read in one script call: a snapshot of one drawing of the table.
    rows = wait(d, "the drive table", lambda: d.execute_script(
        "return [...document.querySelectorAll('#drives tr')].slice(1)"
        ".map(r => [...r.querySelectorAll('td')].map(c => c.innerText))"))
    assert len(rows) == 4
    for cells in rows:
        assert cells[1] == "online", cells
        assert cells[5] == human(metric(server, "tarn_drive_total_bytes", drive=cells[2])), cells
    shot(d, "drives")

    # Buckets: create one, upload a file into it, download it back.
    d.find_element(By.CSS_SELECTOR, '[data-tab="buckets"]').click()
    wait(d, "the bucket form", lambda: d.find_elements(By.ID, "new-bucket"))
    d.find_element(By.ID, "new-bucket").send_keys("from-the-browser")
    d.find_element(By.ID, "create-bucket").click()
    act(d, "the new bucket", lambda: d.find_element(By.CSS_SELECTOR, '[data-bucket="from-the-browser"]').click())
    wait(d, "the upload form", lambda: d.find_elements(By.ID, "upload-file"))
    body = data("browser", 300_000)
    upload = tmp_path / "weights part 1.bin"
    upload.write_bytes(body)
    d.find_element(By.ID, "upload-file").send_keys(str(upload))
    d.find_element(By.ID, "upload").click()
    href = wait(d, "the uploaded object", lambda: d.find_element(By.CSS_SELECTOR, '[data-key="weights part 1.bin"]').get_attribute("href"))
    assert server.client().get_object(Bucket="from-the-browser", Key="weights part 1.bin")["Body"].read() == body
    # The download link, fetched as the browser would follow it.
    got = d.execute_async_script(
        "const done = arguments[1];"
        "fetch(arguments[0], {credentials: 'same-origin'}).then(r => r.arrayBuffer())"
        ".then(b => done(Array.from(new Uint8Array(b)))).catch(e => done(String(e)));", href)
    assert bytes(got) == body
    shot(d, "bucket")

    # Users: create one (its secret shown once), then revoke its key.
    d.find_element(By.CSS_SELECTOR, '[data-tab="users"]').click()
    wait(d, "the user form", lambda: d.find_elements(By.ID, "new-user"))
    d.find_element(By.ID, "new-user").send_keys("carol")
    d.find_element(By.ID, "add-user").click()
    secret = wait(d, "the new key", lambda: re.search(r"access key (TK\w+), secret key (\S+)", d.find_element(By.ID, "new-secret").text))
    access_key = secret.group(1)
    assert access_key in admin(server, "user", "list").stdout
    shot(d, "users")
    act(d, "the revoke button", lambda: d.find_element(By.CSS_SELECTOR, f'[data-revoke="{access_key}"]').click())
    d.switch_to.alert.accept()
    wait(d, "the key gone", lambda: not d.find_elements(By.CSS_SELECTOR, f'[data-revoke="{access_key}"]'))
    assert access_key not in admin(server, "user", "list").stdout

    # Cache buckets: one over the bucket made above (this server as its own
    # upstream), added from the console's form, read through, prefetched.
    d.find_element(By.CSS_SELECTOR, '[data-tab="cache"]').click()
    wait(d, "the cache form", lambda: d.find_elements(By.ID, "cache-new-bucket"))
    for field, value in [("bucket", "cached-copy"), ("upstream", "s3://from-the-browser"), ("endpoint", server.endpoint),
                         ("access_key", ACCESS_KEY), ("secret_key", SECRET_KEY)]:
        act(d, f"the {field} field", lambda f=field, v=value: d.find_element(By.ID, f"cache-new-{f}").send_keys(v))
    act(d, "the add button", lambda: d.find_element(By.ID, "cache-add").click())
    wait(d, "the cache bucket", lambda: d.find_elements(By.CSS_SELECTOR, '[data-cache="cached-copy"]'))
    assert server.client().get_object(Bucket="cached-copy", Key="weights part 1.bin")["Body"].read() == body
    act(d, "the prefetch button", lambda: d.find_element(By.CSS_SELECTOR, '[data-prefetch="cached-copy"]').click())
    wait(d, "the prefetch job", lambda: "prefetch" in d.find_element(By.ID, "cache-jobs").text, timeout=30)
    wait(d, "the figures", lambda: "in 1 objects" in d.find_element(By.ID, "view").text)
    shot(d, "cache")

    # Activity charts render (three of them).
    d.find_element(By.CSS_SELECTOR, '[data-tab="activity"]').click()
    wait(d, "the charts", lambda: len(d.find_elements(By.CSS_SELECTOR, "#charts svg")) == 3)
    shot(d, "activity")

    # Without its session (cookies gone) the page asks for a login again.
    d.delete_all_cookies()
    d.find_element(By.CSS_SELECTOR, '[data-tab="overview"]').click()
    wait(d, "the login form again", lambda: d.find_element(By.ID, "login").is_displayed())
    assert "log in again" in d.find_element(By.ID, "login-error").text

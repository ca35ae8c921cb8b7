"""The web console on the admin port (issue 43), over HTTP as a browser
speaks it: the page and its assets (no external ones, a strict CSP), login
and the session cookie, CSRF, the admin API for root's sessions only, the
S3 API signed as the session's own key (a user's policies apply), and the
ways a request without a live session is refused."""

import http.cookiejar
import json
import re
import urllib.error
import urllib.request

from tarnproc import ACCESS_KEY, SECRET_KEY, add_user, admin, wait_for


class Browser:
    """A cookie jar and the requests a page's script makes."""

    def __init__(self, base):
        self.base = base
        self.jar = http.cookiejar.CookieJar()
        self.opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(self.jar))
        self.csrf = None

    def request(self, method, path, body=None, headers=None, csrf=True):
        h = dict(headers or {})
        if csrf and self.csrf and method not in ("GET", "HEAD"):
            h.setdefault("X-Tarn-CSRF", self.csrf)
        r = urllib.request.Request(self.base + path, data=body, method=method, headers=h)
        try:
            with self.opener.open(r, timeout=30) as x:
                return x.status, x.headers, x.read()
        except urllib.error.HTTPError as e:
            return e.code, e.headers, e.read()

    def login(self, access_key, secret_key):
        status, headers, body = self.request(
            "POST", "/console/login", json.dumps({"access_key": access_key, "secret_key": secret_key}).encode(),
            {"Content-Type": "application/json"})
        if status == 200:
            self.csrf = json.loads(body)["csrf"]
        return status, headers, body

    def cookie(self):
        return next((c.value for c in self.jar if c.name == "tarn_console"), None)


def test_page_assets_and_headers(server):
    b = Browser(server.admin)
    for path, ctype in [("/console", "text/html"), ("/console/app.js", "text/javascript"), ("/console/app.css", "text/css")]:
        status, h, body = b.request("GET", path)
        assert status == 200 and h["Content-Type"].startswith(ctype), (path, status)
        csp = h["Content-Security-Policy"]
        assert "default-src 'none'" in csp and "script-src 'self'" in csp and "frame-ancestors 'none'" in csp
        assert h["X-Frame-Options"] == "DENY" and h["X-Content-Type-Options"] == "nosniff"
        assert h["Cache-Control"] == "no-store"
        text = body.decode()
        # Nothing is loaded from elsewhere: every src/href is the console's own.
        for ref in re.findall(r'(?:src|href)="([^"]+)"', text):
            assert ref.startswith(("/console", "#")), ref
        assert "<script>" not in text and " onclick=" not in text  # no inline script (the CSP forbids it)
    assert b.request("GET", "/console/nope")[0] == 404


def test_login_session_csrf_and_the_admin_api(server):
    b = Browser(server.admin)
    # Nothing without a session.
    for path in ["/console/api/admin/status", "/console/api/s3/", "/console/api/series", "/console/session"]:
        assert b.request("GET", path)[0] == 401, path
    status, _, body = b.login(ACCESS_KEY, "not-the-secret")
    assert status == 401 and b"wrong access key or secret" in body and b.cookie() is None
    assert b.login("TKNOSUCHKEY000000000", SECRET_KEY)[0] == 401
    status, headers, body = b.login(ACCESS_KEY, SECRET_KEY)
    assert status == 200
    s = json.loads(body)
    assert s["user"] == "root" and s["root"] is True and len(s["csrf"]) == 64
    cookie = headers["Set-Cookie"]
    for attr in ["HttpOnly", "SameSite=Strict", "Path=/console", "Max-Age=3600"]:
        assert attr in cookie, cookie
    assert SECRET_KEY not in body.decode() and SECRET_KEY not in cookie
    # The session answers for itself (a reload), with the same CSRF token.
    status, _, body = b.request("GET", "/console/session")
    assert status == 200 and json.loads(body)["csrf"] == s["csrf"]

    # The admin API through the session: what the token gets.
    status, _, body = b.request("GET", "/console/api/admin/status")
    st = json.loads(body)
    assert status == 200 and st["health"] == "ready" and st["drives"]["total"] == 4
    assert b.request("GET", "/console/api/admin/drives")[0] == 200
    status, _, body = b.request("GET", "/console/api/admin/metrics")
    assert status == 200 and b"tarn_drive_free_bytes" in body
    # Changes need the CSRF token, and an Origin (if sent) of this console.
    assert b.request("POST", "/console/api/admin/heal/jobs", csrf=False)[0] == 403
    assert b.request("POST", "/console/api/admin/heal/jobs", headers={"X-Tarn-CSRF": "0" * 64})[0] == 403
    assert b.request("POST", "/console/api/admin/heal/jobs", headers={"Origin": "http://evil.example"})[0] == 403
    host = server.admin.removeprefix("http://")
    status, _, body = b.request("POST", "/console/api/admin/heal/jobs", headers={"Origin": f"http://{host}"})
    assert status == 202 and json.loads(body)["kind"] == "heal"
    status, _, body = b.request("POST", "/console/api/admin/users/alice")
    assert status == 200 and json.loads(body)["user"] == "alice"
    assert "alice" in admin(server, "user", "list").stdout

    # A forged or foreign cookie is no session.
    forged = Browser(server.admin)
    forged.opener.addheaders = [("Cookie", "tarn_console=" + "ab" * 32)]
    assert forged.request("GET", "/console/api/admin/status")[0] == 401
    stolen_csrf = Browser(server.admin)
    stolen_csrf.csrf = s["csrf"]  # the token alone is nothing without the cookie
    assert stolen_csrf.request("POST", "/console/api/admin/heal/jobs")[0] == 401
    # The same cookie from another client works (it is the session), and
    # logging out ends it for everyone.
    other = Browser(server.admin)
    other.opener.addheaders = [("Cookie", f"tarn_console={b.cookie()}")]
    assert other.request("GET", "/console/api/admin/status")[0] == 200
    assert b.request("POST", "/console/logout", csrf=False)[0] == 403
    assert b.request("POST", "/console/logout")[0] == 200
    assert other.request("GET", "/console/api/admin/status")[0] == 401
    assert b.request("GET", "/console/session")[0] == 401


def test_s3_through_the_console_is_signed_as_the_sessions_key(server):
    root = Browser(server.admin)
    assert root.login(ACCESS_KEY, SECRET_KEY)[0] == 200
    assert root.request("PUT", "/console/api/s3/console-bucket")[0] == 200
    body = b"weights " * 1000
    status, _, _ = root.request("PUT", "/console/api/s3/console-bucket/models/a%20b.bin", body,
                                {"Content-Type": "application/octet-stream"})
    assert status == 200
    status, h, got = root.request("GET", "/console/api/s3/console-bucket/models/a%20b.bin")
    assert status == 200 and got == body and h["ETag"]
    status, h, got = root.request("GET", "/console/api/s3/console-bucket/models/a%20b.bin", headers={"Range": "bytes=8-15"})
    assert status == 206 and got == body[8:16] and h["Content-Range"] == f"bytes 8-15/{len(body)}"
    status, _, listing = root.request("GET", "/console/api/s3/console-bucket?list-type=2&prefix=models%2F&delimiter=%2F")
    assert status == 200 and b"<Key>models/a b.bin</Key>" in listing
    versioning = b'<VersioningConfiguration xmlns="http://s3.amazonaws.com/doc/2006-03-01/"><Status>Enabled</Status></VersioningConfiguration>'
    assert root.request("PUT", "/console/api/s3/console-bucket?versioning", versioning)[0] == 200
    assert server.client().get_bucket_versioning(Bucket="console-bucket")["Status"] == "Enabled"
    # What S3 refuses comes back as S3 said it.
    status, _, err = root.request("GET", "/console/api/s3/console-bucket/missing")
    assert status == 404 and b"<Code>NoSuchKey</Code>" in err
    # No CSRF token, no change (S3 included).
    assert root.request("DELETE", "/console/api/s3/console-bucket/models/a%20b.bin", csrf=False)[0] == 403

    # A user's console: the S3 the user's policies allow, no admin API.
    key = add_user(server, "bob")
    bob = Browser(server.admin)
    status, _, s = bob.login(key["access_key"], key["secret_key"])
    assert status == 200 and json.loads(s)["root"] is False and json.loads(s)["user"] == "bob"
    status, _, err = bob.request("GET", "/console/api/admin/status")
    assert status == 403 and b"root" in err
    assert bob.request("GET", "/console/api/series")[0] == 403
    status, _, err = bob.request("GET", "/console/api/s3/console-bucket/models/a%20b.bin")
    assert status == 403 and b"AccessDenied" in err
    assert bob.request("PUT", "/console/api/s3/bobs-bucket")[0] == 200
    owned = server.client().list_buckets()["Buckets"]
    assert "bobs-bucket" in [x["Name"] for x in owned]
    # Revoking the key ends the user's sessions at once.
    admin(server, "user", "key", "remove", "bob", key["access_key"])
    assert bob.request("GET", "/console/api/s3/")[0] == 401
    assert bob.request("GET", "/console/session")[0] == 401


def test_series_and_login_throttling(make_server):
    server = make_server(expected_errors=())
    b = Browser(server.admin)
    assert b.login(ACCESS_KEY, SECRET_KEY)[0] == 200
    s3 = server.client()
    s3.create_bucket(Bucket="traffic")
    for i in range(20):
        s3.put_object(Bucket="traffic", Key=f"k{i}", Body=b"x" * 100_000)

    def points():
        status, _, body = b.request("GET", "/console/api/series")
        assert status == 200
        v = json.loads(body)
        return [p for p in v["points"] if p["requests_per_s"] > 0] or None

    p = wait_for("a sample with requests", points, timeout=20)[-1]
    assert p["bytes_in_per_s"] > 0 and p["latency_p50_s"] is not None and p["latency_p99_s"] >= p["latency_p50_s"]
    # Five wrong secrets a minute from one address, then even the right one
    # waits (guessing is slow); the live session is not affected.
    for _ in range(5):
        assert Browser(server.admin).login(ACCESS_KEY, "guess")[0] == 401
    assert Browser(server.admin).login(ACCESS_KEY, SECRET_KEY)[0] == 429
    assert b.request("GET", "/console/api/admin/status")[0] == 200

"""Hints to a Tarn server's cache buckets (docs/cache.md): prefetch, drop,
pin, unpin and status, the same as ``tarn admin cache``.

They go to the server's admin port: its URL from ``endpoint=`` or
``TARN_ADMIN_ENDPOINT`` (default ``http://127.0.0.1:9001``), its token from
``token=`` or ``TARN_ADMIN_TOKEN``. Objects are named ``s3://BUCKET/PREFIX``
(the cache bucket's keys, not the upstream's)::

    job = tarn.cache.prefetch("s3://models/llama-3-8b/", wait=False)
    while not job.done:
        print(job.progress()["bytes_done"])
    job.wait()
"""

import json
import os
import time
import urllib.error
import urllib.request

from .errors import TarnError

__all__ = ["CacheError", "Job", "prefetch", "drop", "pin", "unpin", "status", "jobs"]


class CacheError(TarnError):
    """The server refused a cache request, could not be reached, or a
    prefetch failed; ``status`` is the HTTP status (None when unreachable)
    and ``job`` the job's last state for a failed prefetch."""

    status = None
    job = None


def _split(url):
    if not url.startswith("s3://"):
        raise ValueError(f"{url!r}: expected s3://BUCKET[/PREFIX]")
    bucket, _, prefix = url[len("s3://"):].partition("/")
    if not bucket:
        raise ValueError(f"{url!r} names no bucket")
    return bucket, prefix


class _Admin:
    def __init__(self, endpoint=None, token=None, timeout=60):
        self.endpoint = (endpoint or os.environ.get("TARN_ADMIN_ENDPOINT") or "http://127.0.0.1:9001").rstrip("/")
        self.token = token if token is not None else os.environ.get("TARN_ADMIN_TOKEN")
        if not self.token:
            raise CacheError("no admin token: pass token= or set TARN_ADMIN_TOKEN")
        self.timeout = timeout

    def call(self, method, path, body=None):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.endpoint + path, data=data, method=method,
                                     headers={"Authorization": f"Bearer {self.token}",
                                              "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                text = r.read().decode()
        except urllib.error.HTTPError as e:
            text = e.read().decode(errors="replace")
            try:
                msg = json.loads(text).get("error", text)
            except ValueError:
                msg = text.strip()
            err = CacheError(f"{method} {path}: {e.code}: {msg}")
            err.status = e.code
            raise err from None
        except OSError as e:
            raise CacheError(f"{method} {path}: cannot reach {self.endpoint}: {e}") from e
        return json.loads(text) if text.strip() else None


class Job:
    """A prefetch job on the server. ``progress()`` asks for its state (a
    dict: ``state``, ``objects_total``, ``objects_done``, ``bytes_total``,
    ``bytes_done``, ``bytes_from_upstream``, ``failures``, ``failed``...);
    ``wait()`` returns the final state or raises ``CacheError``."""

    def __init__(self, admin, state):
        self._admin = admin
        self.id = state["id"]
        self.bucket = state["bucket"]
        self._state = state

    def progress(self):
        if self._state["state"] == "running":
            self._state = self._admin.call("GET", f"/admin/cache/jobs/{self.id}")
        return dict(self._state)

    @property
    def done(self):
        return self.progress()["state"] != "running"

    def wait(self, timeout=None, poll=0.25):
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            s = self.progress()
            if s["state"] != "running":
                break
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"prefetch {self.id} still running after {timeout} s")
            time.sleep(poll)
        if s.get("error") or s.get("failures"):
            err = CacheError(f"prefetch {self.id} {s['state']}: "
                             + (s.get("error") or f"{s['failures']} object(s) failed: {s.get('failed')}"))
            err.job = s
            raise err
        return s

    def __repr__(self):
        return f"<tarn.cache.Job {self.id} {self._state['state']}>"


def prefetch(url, keys=None, wait=False, endpoint=None, token=None):
    """Fills a cache bucket ahead of its readers: every object under the
    URL's prefix (``s3://bucket/`` for all of it), or, with ``keys``, those
    keys under it only (a ``*.safetensors.index.json`` brings every file it
    names). Returns a ``Job``; with ``wait=True`` waits for it first."""
    bucket, prefix = _split(url)
    if isinstance(keys, str):
        raise TypeError("keys: a list of keys, not one string")
    admin = _Admin(endpoint, token)
    if keys is None:
        body = {"prefix": prefix}
    else:
        body = {"keys": [prefix + k for k in keys]}
    job = Job(admin, admin.call("POST", f"/admin/cache/buckets/{bucket}/prefetch", body))
    if wait:
        job.wait()
    return job


def drop(url, endpoint=None, token=None):
    """Drops what is cached under the URL's prefix; it is fetched again when
    read. Returns ``{"objects_dropped", "bytes_dropped", ...}``."""
    bucket, prefix = _split(url)
    return _Admin(endpoint, token).call("POST", f"/admin/cache/buckets/{bucket}/drop", {"prefix": prefix})


def pin(url, ttl=None, endpoint=None, token=None):
    """Pins the URL's prefix (for ``ttl`` seconds, or until ``unpin``): its
    cached objects are never evicted. Returns the bucket's pins."""
    bucket, prefix = _split(url)
    return _Admin(endpoint, token).call("POST", f"/admin/cache/buckets/{bucket}/pin",
                                        {"prefix": prefix, "ttl": ttl})["pins"]


def unpin(url, endpoint=None, token=None):
    bucket, prefix = _split(url)
    return _Admin(endpoint, token).call("POST", f"/admin/cache/buckets/{bucket}/unpin",
                                        {"prefix": prefix})["pins"]


def status(bucket=None, endpoint=None, token=None):
    """Each cache bucket's counters on that server (hits, misses, bytes
    cached by prefix, bytes from the upstream, evictions); one bucket's
    when named."""
    all_ = _Admin(endpoint, token).call("GET", "/admin/cache/status")
    if bucket is None:
        return all_
    for b in all_:
        if b["bucket"] == bucket:
            return b
    raise CacheError(f"no cache bucket {bucket}")


def jobs(endpoint=None, token=None):
    """The server's prefetch jobs, as dicts."""
    return _Admin(endpoint, token).call("GET", "/admin/cache/jobs")

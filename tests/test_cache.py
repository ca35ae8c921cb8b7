"""Cache buckets (issue 41): a Tarn bucket in front of an upstream S3 bucket,
here a second real Tarn server, with a fault proxy between them where the
upstream must misbehave."""

import concurrent.futures
import json
import os
import select
import socket
import ssl
import subprocess
import threading
import time

import botocore.exceptions
import pytest

from conftest import data
from faultproxy import FaultProxy
from tarnproc import ACCESS_KEY, BIN, SECRET_KEY, metric

MiB = 1 << 20
CHUNK = 8 * MiB


def cache_admin(server, *args, check=True, env=None):
    """`tarn admin cache ...` with the upstream's keys in the environment."""
    e = dict(os.environ)
    e.update({"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY})
    e.update(env or {})
    r = subprocess.run(
        [BIN, "admin", "--endpoint", server.admin, "--token", getattr(server, "secret_key", SECRET_KEY),
         "cache", *args],
        capture_output=True, text=True, timeout=60, env=e,
    )
    if check:
        assert r.returncode == 0, f"tarn admin cache {args}: {r.stderr}"
    return r


def upstream_gets(up):
    try:
        return metric(up, "tarn_requests_total", op="GetObject")
    except AssertionError:
        return 0


def upstream_heads(up):
    try:
        return metric(up, "tarn_requests_total", op="HeadObject")
    except AssertionError:
        return 0


def status(cache, bucket="cached"):
    out = json.loads(cache_admin(cache, "status", "--json").stdout)
    return next(b for b in out if b["bucket"] == bucket)


@pytest.fixture
def pair(make_server):
    """(upstream server, its client, cache server, its client); the
    upstream bucket `up` with objects under `models/`."""
    up = make_server(drives=1, name="upstream")
    cache = make_server(drives=4, name="cache")
    u = up.client()
    u.create_bucket(Bucket="origin")
    return up, u, cache, cache.client()


def add(cache, up_endpoint, validate="never", prefix="models/", bucket="cached", *extra):
    return cache_admin(cache, "add", bucket, "--upstream", f"s3://origin/{prefix}",
                       "--upstream-endpoint", up_endpoint, "--validate", validate, *extra)


def test_miss_streams_then_hits_and_ranges_fetch_only_their_chunks(pair):
    up, u, cache, c = pair
    big = data(1, 20 * MiB + 5)
    u.put_object(Bucket="origin", Key="models/big.bin", Body=big, ContentType="application/x-weights",
                 Metadata={"run": "7"})
    u.put_object(Bucket="origin", Key="models/small.json", Body=b'{"a": 1}')
    u.put_object(Bucket="origin", Key="models/empty", Body=b"")
    u.put_object(Bucket="origin", Key="other/outside", Body=b"not in the cache's prefix")
    add(cache, up.endpoint)

    before = upstream_gets(up)
    got = c.get_object(Bucket="cached", Key="big.bin")
    assert got["ContentLength"] == len(big)
    assert got["ETag"] == u.head_object(Bucket="origin", Key="models/big.bin")["ETag"]
    assert got["ContentType"] == "application/x-weights"
    assert got["Metadata"] == {"run": "7"}
    assert got["Body"].read() == big
    # Three chunks, each fetched once.
    assert upstream_gets(up) - before == 3
    st = status(cache)
    assert st["misses"] == 1 and st["bytes_from_upstream"] == len(big)
    assert metric(cache, "tarn_cache_misses_total") == 1
    assert metric(cache, "tarn_cache_upstream_bytes_total") == len(big)

    # A hit: no upstream GET.
    before = upstream_gets(up)
    assert c.get_object(Bucket="cached", Key="big.bin")["Body"].read() == big
    r = c.get_object(Bucket="cached", Key="big.bin", Range="bytes=8388600-8388700")
    assert r["ContentRange"] == f"bytes 8388600-8388700/{len(big)}"
    assert r["Body"].read() == big[8388600:8388701]
    assert c.get_object(Bucket="cached", Key="big.bin", Range="bytes=-10")["Body"].read() == big[-10:]
    assert upstream_gets(up) == before
    assert status(cache)["hits"] == 3

    assert c.get_object(Bucket="cached", Key="small.json")["Body"].read() == b'{"a": 1}'
    assert c.get_object(Bucket="cached", Key="empty")["Body"].read() == b""
    h = c.head_object(Bucket="cached", Key="big.bin")
    assert h["ContentLength"] == len(big) and h["Metadata"] == {"run": "7"}
    with pytest.raises(botocore.exceptions.ClientError) as e:
        c.get_object(Bucket="cached", Key="../other/outside")
    assert e.value.response["Error"]["Code"] in ("NoSuchKey", "InvalidArgument", "KeyTooLongError")
    with pytest.raises(botocore.exceptions.ClientError) as e:
        c.get_object(Bucket="cached", Key="missing")
    assert e.value.response["Error"]["Code"] == "NoSuchKey"

    # A ranged miss of a large object fetches its chunk and one more, not
    # the whole object.
    huge = data(2, 64 * MiB)
    u.put_object(Bucket="origin", Key="models/huge.bin", Body=huge)
    before, from_up = upstream_gets(up), status(cache)["bytes_from_upstream"]
    r = c.get_object(Bucket="cached", Key="huge.bin", Range=f"bytes={CHUNK + 100}-{CHUNK + 1100}")
    assert r["Body"].read() == huge[CHUNK + 100:CHUNK + 1101]
    time.sleep(0.5)
    assert upstream_gets(up) - before == 2
    assert status(cache)["bytes_from_upstream"] - from_up == 2 * CHUNK
    # Conditions are the upstream object's.
    etag = h["ETag"]
    with pytest.raises(botocore.exceptions.ClientError) as e:
        c.get_object(Bucket="cached", Key="big.bin", IfNoneMatch=etag)
    assert e.value.response["Error"]["Code"] in ("304", "NotModified")


def test_concurrent_misses_fetch_each_chunk_once(pair):
    up, u, cache, c = pair
    body = data(3, 3 * CHUNK - 7)
    u.put_object(Bucket="origin", Key="models/shared.bin", Body=body)
    add(cache, up.endpoint)
    before = upstream_gets(up)

    def read(_):
        return cache.client().get_object(Bucket="cached", Key="shared.bin")["Body"].read() == body

    with concurrent.futures.ThreadPoolExecutor(12) as ex:
        assert all(ex.map(read, range(12)))
    assert upstream_gets(up) - before == 3
    assert status(cache)["bytes_from_upstream"] == len(body)


@pytest.mark.parametrize("mode", ["always", "ttl=2", "never"])
def test_an_upstream_change_is_never_served_mixed(pair, mode):
    up, u, cache, c = pair
    v1, v2 = data(4, 3 * CHUNK), data(5, 3 * CHUNK + 11)
    u.put_object(Bucket="origin", Key="models/w.bin", Body=v1)
    add(cache, up.endpoint, mode)
    # The first chunk (and one ahead) cached, the last not.
    assert c.get_object(Bucket="cached", Key="w.bin", Range="bytes=0-99")["Body"].read() == v1[:100]
    time.sleep(0.5)
    u.put_object(Bucket="origin", Key="models/w.bin", Body=v2)

    def whole():
        try:
            return c.get_object(Bucket="cached", Key="w.bin")["Body"].read()
        except (botocore.exceptions.ClientError, botocore.exceptions.ResponseStreamingError,
                botocore.exceptions.IncompleteReadError, ConnectionError) as e:
            return e

    got = whole()
    if mode == "always":
        assert got == v2
    else:
        # Cached v1 chunks, then a chunk the upstream no longer has: the
        # read is cut off, never completed with v2's bytes.
        assert isinstance(got, Exception), "a read that mixed versions or served a stale tail"
        got = whole()
        if mode.startswith("ttl"):
            assert got == v2
        else:
            # The change was seen: the next read is the new object.
            assert got == v2
    assert c.head_object(Bucket="cached", Key="w.bin")["ContentLength"] == len(v2)


def test_ttl_serves_the_cached_copy_until_it_expires(pair):
    up, u, cache, c = pair
    u.put_object(Bucket="origin", Key="models/cfg.json", Body=b"one")
    add(cache, up.endpoint, "ttl=2")
    assert c.get_object(Bucket="cached", Key="cfg.json")["Body"].read() == b"one"
    u.put_object(Bucket="origin", Key="models/cfg.json", Body=b"two!")
    assert c.get_object(Bucket="cached", Key="cfg.json")["Body"].read() == b"one"
    time.sleep(2.5)
    assert c.get_object(Bucket="cached", Key="cfg.json")["Body"].read() == b"two!"


def test_upstream_deletes_and_negative_lookups(pair):
    up, u, cache, c = pair
    u.put_object(Bucket="origin", Key="models/gone.bin", Body=b"x" * 1000)
    add(cache, up.endpoint, "always")
    assert c.get_object(Bucket="cached", Key="gone.bin")["Body"].read() == b"x" * 1000
    u.delete_object(Bucket="origin", Key="models/gone.bin")
    for op in (lambda: c.get_object(Bucket="cached", Key="gone.bin"),
               lambda: c.head_object(Bucket="cached", Key="gone.bin")):
        with pytest.raises(botocore.exceptions.ClientError) as e:
            op()
        assert e.value.response["Error"]["Code"] in ("NoSuchKey", "404")
    # A missing key is asked of the upstream once in a short while.
    before = upstream_heads(up)
    for _ in range(5):
        with pytest.raises(botocore.exceptions.ClientError):
            c.get_object(Bucket="cached", Key="never-there")
    assert upstream_heads(up) - before == 1


def test_upstream_failing_mid_object_resumes_or_fails_the_read_and_caches_nothing_torn(pair):
    up, u, cache, c = pair
    body = data(6, 2 * CHUNK + 3)
    u.put_object(Bucket="origin", Key="models/flaky.bin", Body=body)
    proxy = FaultProxy("127.0.0.1", int(up.endpoint.rsplit(":", 1)[1]))
    try:
        add(cache, proxy.endpoint)
        # Every connection is cut after 3 MiB: fills resume where they stopped.
        proxy.always(("reset", 3 * MiB))
        before = upstream_gets(up)
        assert c.get_object(Bucket="cached", Key="flaky.bin")["Body"].read() == body
        assert upstream_gets(up) - before > 3

        # The object known (its HEAD passed), then its GET broken off after
        # 2 MiB and every later try refused: the read fails, cut off.
        u.put_object(Bucket="origin", Key="models/broken.bin", Body=body)
        proxy.always(("pass",))
        assert c.head_object(Bucket="cached", Key="broken.bin")["ContentLength"] == len(body)
        proxy.drop_all()
        proxy.script(("reset", 2 * MiB))
        proxy.always(("status", 503))
        with pytest.raises((botocore.exceptions.ResponseStreamingError,
                            botocore.exceptions.IncompleteReadError, ConnectionError)):
            c.get_object(Bucket="cached", Key="broken.bin")["Body"].read()
        assert status(cache)["fills_failed"] >= 1
        # Nothing torn was kept: with the upstream back, the object is whole.
        proxy.always(("pass",))
        assert c.get_object(Bucket="cached", Key="broken.bin")["Body"].read() == body
    finally:
        proxy.close()


class TlsFront:
    """A TLS terminator in front of a plain HTTP server: an https upstream
    whose certificate a test CA signed."""

    def __init__(self, target_port, cert, key):
        self.target = target_port
        self.ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.ctx.load_cert_chain(cert, key)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.endpoint = f"https://127.0.0.1:{self.sock.getsockname()[1]}"
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while not self.closed:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(c,), daemon=True).start()

    def _serve(self, c):
        try:
            s = self.ctx.wrap_socket(c, server_side=True)
        except (OSError, ssl.SSLError):
            c.close()
            return
        u = socket.create_connection(("127.0.0.1", self.target))
        try:
            while not self.closed:
                ready = [s] if s.pending() else select.select([s, u], [], [], 60)[0]
                if not ready:
                    return
                for x in ready:
                    got = x.recv(65536)
                    if not got:
                        return
                    (u if x is s else s).sendall(got)
        except (OSError, ssl.SSLError):
            pass
        finally:
            s.close()
            u.close()

    def close(self):
        self.closed = True
        self.sock.close()


def test_an_https_upstream(pair, tmp_path):
    """An https:// upstream is reached over TLS, its certificate checked
    against the CA given with --upstream-ca (kept with the settings) or the
    system's; an unknown certificate is refused when the bucket is added."""
    up, u, cache, c = pair
    d = str(tmp_path)
    run = lambda *a: subprocess.run(a, cwd=d, check=True, capture_output=True)  # noqa: E731
    run("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
        "-days", "1", "-subj", "/CN=tarn test CA")
    run("openssl", "req", "-newkey", "rsa:2048", "-nodes", "-keyout", "srv.key", "-out", "srv.csr",
        "-subj", "/CN=127.0.0.1")
    (tmp_path / "ext").write_text("subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\n")
    run("openssl", "x509", "-req", "-in", "srv.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "srv.pem", "-days", "1", "-extfile", "ext")
    body = data(50, CHUNK + 5)
    u.put_object(Bucket="origin", Key="models/w.bin", Body=body)
    front = TlsFront(int(up.endpoint.rsplit(":", 1)[1]), f"{d}/srv.pem", f"{d}/srv.key")
    try:
        r = cache_admin(cache, "add", "cached", "--upstream", "s3://origin/models/", "--upstream-endpoint",
                        front.endpoint, check=False)
        assert r.returncode != 0 and "cannot be listed" in r.stderr and "TLS" in r.stderr, r.stderr
        r = cache_admin(cache, "add", "cached", "--upstream", "s3://origin/models/", "--upstream-endpoint",
                        up.endpoint, "--upstream-ca", f"{d}/ca.pem", check=False)
        assert r.returncode != 0 and "https" in r.stderr, r.stderr
        cache_admin(cache, "add", "cached", "--upstream", "s3://origin/models/", "--upstream-endpoint",
                    front.endpoint, "--upstream-ca", f"{d}/ca.pem", "--validate", "always")
        assert c.get_object(Bucket="cached", Key="w.bin")["Body"].read() == body
        assert [o["Key"] for o in c.list_objects_v2(Bucket="cached")["Contents"]] == ["w.bin"]
        # The CA is kept with the settings.
        wait_until("the chunks stored", lambda: status(cache)["chunks_stored"] == 2)
        cache.restart()
        c = cache.client()
        gets = upstream_gets(up)
        assert c.get_object(Bucket="cached", Key="w.bin")["Body"].read() == body
        assert upstream_gets(up) == gets  # validated over TLS, served from the cache
        assert c.head_object(Bucket="cached", Key="w.bin")["ContentLength"] == len(body)
    finally:
        front.close()


def test_writes_are_refused_clearly(pair):
    up, u, cache, c = pair
    u.put_object(Bucket="origin", Key="models/a", Body=b"a")
    add(cache, up.endpoint)
    for op in (lambda: c.put_object(Bucket="cached", Key="a", Body=b"b"),
               lambda: c.delete_object(Bucket="cached", Key="a"),
               lambda: c.create_multipart_upload(Bucket="cached", Key="m"),
               lambda: c.copy_object(Bucket="cached", Key="c", CopySource={"Bucket": "cached", "Key": "a"}),
               lambda: c.delete_bucket(Bucket="cached")):
        with pytest.raises(botocore.exceptions.ClientError) as e:
            op()
        assert e.value.response["Error"]["Code"] == "MethodNotAllowed", e.value.response
    c.create_bucket(Bucket="plain")
    with pytest.raises(botocore.exceptions.ClientError) as e:
        c.copy_object(Bucket="plain", Key="c", CopySource={"Bucket": "cached", "Key": "a"})
    assert e.value.response["Error"]["Code"] == "NotImplemented"
    assert u.get_object(Bucket="origin", Key="models/a")["Body"].read() == b"a"


def test_listings_come_from_the_upstream(pair):
    up, u, cache, c = pair
    keys = ["a/1", "a/2", "b/1", "c", "d/x/y"]
    for k in keys:
        u.put_object(Bucket="origin", Key="models/" + k, Body=k.encode())
    u.put_object(Bucket="origin", Key="modelsX", Body=b"outside")
    add(cache, up.endpoint)
    r = c.list_objects_v2(Bucket="cached")
    assert [o["Key"] for o in r["Contents"]] == keys
    assert [o["Size"] for o in r["Contents"]] == [len(k) for k in keys]
    r = c.list_objects_v2(Bucket="cached", Delimiter="/")
    assert [o["Key"] for o in r.get("Contents", [])] == ["c"]
    assert [p["Prefix"] for p in r["CommonPrefixes"]] == ["a/", "b/", "d/"]
    # Pages, V2 and V1, with and without a delimiter.
    seen, token = [], None
    while True:
        kw = {"ContinuationToken": token} if token else {}
        r = c.list_objects_v2(Bucket="cached", MaxKeys=2, Delimiter="/", **kw)
        seen += [o["Key"] for o in r.get("Contents", [])] + [p["Prefix"] for p in r.get("CommonPrefixes", [])]
        if not r["IsTruncated"]:
            break
        token = r["NextContinuationToken"]
    assert seen == ["a/", "b/", "c", "d/"]
    seen, marker = [], ""
    while True:
        r = c.list_objects(Bucket="cached", MaxKeys=2, Marker=marker)
        seen += [o["Key"] for o in r.get("Contents", [])]
        if not r["IsTruncated"]:
            break
        marker = seen[-1]
    assert seen == keys
    assert [o["Key"] for o in c.list_objects_v2(Bucket="cached", Prefix="a/")["Contents"]] == ["a/1", "a/2"]
    # The cache bucket is listed; its internal bucket is not.
    assert [b["Name"] for b in c.list_buckets()["Buckets"]] == ["cached"]


def listed(c, bucket="cached", page=1000, **kw):
    """Every row of a paged ListObjectsV2: [(key or prefix, size, etag)]."""
    rows, token = [], None
    while True:
        more = {"ContinuationToken": token} if token else {}
        r = c.list_objects_v2(Bucket=bucket, MaxKeys=page, **kw, **more)
        rows += [(o["Key"], o["Size"], o["ETag"].strip('"')) for o in r.get("Contents", [])]
        rows += [(p["Prefix"], None, None) for p in r.get("CommonPrefixes", [])]
        if not r["IsTruncated"]:
            return sorted(rows)
        token = r["NextContinuationToken"]


@pytest.mark.parametrize("mode", ["never", "ttl=3", "always"])
def test_listings_merge_what_the_cache_would_serve(pair, mode):
    """A listing agrees with GETs: where the cache serves an object without
    asking the upstream (never, ttl while fresh), its cached ETag and size
    are listed even after the upstream changed or deleted it; otherwise the
    upstream's rows are."""
    up, u, cache, c = pair
    for k, v in [("a", b"aa"), ("b", b"bb"), ("c", b"cc"), ("dir/x", b"xx")]:
        u.put_object(Bucket="origin", Key="models/" + k, Body=v)
    add(cache, up.endpoint, mode)
    cached = {k: c.get_object(Bucket="cached", Key=k) for k in ("a", "b", "dir/x")}
    etag = {k: r["ETag"].strip('"') for k, r in cached.items()}
    u.delete_object(Bucket="origin", Key="models/a")
    u.delete_object(Bucket="origin", Key="models/dir/x")
    new_b = u.put_object(Bucket="origin", Key="models/b", Body=b"bbbb")["ETag"].strip('"')
    new_d = u.put_object(Bucket="origin", Key="models/d", Body=b"d")["ETag"].strip('"')
    c_etag = u.head_object(Bucket="origin", Key="models/c")["ETag"].strip('"')

    def check(serves_cached):
        if serves_cached:
            want = [("a", 2, etag["a"]), ("b", 2, etag["b"]), ("c", 2, c_etag), ("d", 1, new_d),
                    ("dir/x", 2, etag["dir/x"])]
            prefixes = [("a", 2, etag["a"]), ("b", 2, etag["b"]), ("c", 2, c_etag), ("d", 1, new_d),
                        ("dir/", None, None)]
        else:
            want = [("b", 4, new_b), ("c", 2, c_etag), ("d", 1, new_d)]
            prefixes = want
        for page in (1, 2, 1000):
            assert listed(c, page=page) == want, (mode, page)
            assert listed(c, page=page, Delimiter="/") == prefixes, (mode, page)
        # ... and what is listed is what a GET serves.
        for key, size, tag in want:
            r = c.get_object(Bucket="cached", Key=key)
            assert (len(r["Body"].read()), r["ETag"].strip('"')) == (size, tag)
        if not serves_cached:
            with pytest.raises(botocore.exceptions.ClientError):
                c.get_object(Bucket="cached", Key="a")

    check(mode != "always")
    if mode.startswith("ttl"):
        time.sleep(3.5)
        check(False)


def test_get_object_attributes_of_a_cache_bucket(pair):
    up, u, cache, c = pair
    u.put_object(Bucket="origin", Key="models/w.bin", Body=b"w" * 1000)
    add(cache, up.endpoint)
    a = c.get_object_attributes(Bucket="cached", Key="w.bin",
                                ObjectAttributes=["ETag", "ObjectSize", "StorageClass", "ObjectParts"])
    want = u.head_object(Bucket="origin", Key="models/w.bin")
    assert a["ETag"].strip('"') == want["ETag"].strip('"') and a["ObjectSize"] == 1000
    assert a["StorageClass"] == "STANDARD" and "ObjectParts" not in a
    with pytest.raises(botocore.exceptions.ClientError) as e:
        c.get_object_attributes(Bucket="cached", Key="nope", ObjectAttributes=["ETag"])
    assert e.value.response["Error"]["Code"] == "NoSuchKey"


def test_admin_add_list_remove(pair):
    up, u, cache, c = pair
    u.put_object(Bucket="origin", Key="models/a", Body=b"a")
    r = cache_admin(cache, "add", "cached", "--upstream", "s3://origin/models/", "--upstream-endpoint", up.endpoint,
                    "--replicas", "2", "--validate", "ttl=30", "--json")
    assert json.loads(r.stdout)["validate"] == "ttl=30"
    listed = json.loads(cache_admin(cache, "list", "--json").stdout)
    assert [b["bucket"] for b in listed] == ["cached"] and listed[0]["replicas"] == 2
    assert SECRET_KEY not in cache_admin(cache, "list", "--json").stdout
    assert "cached" in cache_admin(cache, "list").stdout
    # Refused with clear errors.
    for args, words in [
        (["add", "cached", "--upstream", "s3://origin", "--upstream-endpoint", up.endpoint], "already"),
        (["add", "cache-x1", "--upstream", "origin", "--upstream-endpoint", up.endpoint], "s3://"),
        (["add", "cache-x2", "--upstream", "s3://origin", "--upstream-endpoint", "http://127.0.0.1:1"], "cannot be listed"),
        (["add", "cache-x3", "--upstream", "s3://nope", "--upstream-endpoint", up.endpoint], "cannot be listed"),
        (["add", "cache-x4", "--upstream", "s3://origin", "--upstream-endpoint", up.endpoint, "--validate", "sometimes"], "validate"),
        (["add", "Bad_Name", "--upstream", "s3://origin", "--upstream-endpoint", up.endpoint], "name"),
        (["remove", "nosuch"], "no cache bucket"),
    ]:
        r = cache_admin(cache, *args, check=False)
        assert r.returncode != 0 and words in r.stderr, (args, r.stderr)
    r = cache_admin(cache, "add", "cache-x5", "--upstream", "s3://origin", "--upstream-endpoint", up.endpoint,
                    check=False, env={"AWS_SECRET_ACCESS_KEY": "wrong"})
    assert r.returncode != 0 and "cannot be listed" in r.stderr
    assert c.get_object(Bucket="cached", Key="a")["Body"].read() == b"a"
    # The settings survive a restart (the secret decrypts).
    cache.restart()
    c = cache.client()
    assert c.get_object(Bucket="cached", Key="a")["Body"].read() == b"a"
    out = cache_admin(cache, "remove", "cached").stdout
    assert "removed cache bucket cached" in out
    assert c.list_buckets()["Buckets"] == []
    assert json.loads(cache_admin(cache, "list", "--json").stdout) == []
    assert u.get_object(Bucket="origin", Key="models/a")["Body"].read() == b"a"


def wait_until(what, cond, timeout=30):
    deadline = time.time() + timeout
    while not (v := cond()):
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)
    return v


def test_eviction_under_a_small_size_keeps_pins_hot_objects_and_metadata(pair):
    up, u, cache, c = pair
    names = ["hot", "pinned/p1", "cold1", "cold2", "cold3", "cold4"]
    bodies = {n: data(10 + i, 4 * MiB) for i, n in enumerate(names)}
    for n, b in bodies.items():
        u.put_object(Bucket="origin", Key="models/" + n, Body=b)
    add(cache, up.endpoint, "never", "models/", "cached", "--size", "20MiB")
    cache_admin(cache, "pin", "cached", "--prefix", "pinned/")

    def read(n):
        assert c.get_object(Bucket="cached", Key=n)["Body"].read() == bodies[n]

    read("pinned/p1")
    read("hot")
    read("hot")
    for n in ["cold1", "cold2", "cold3", "cold4"]:
        read(n)
        time.sleep(0.2)
    # 24 MiB read into a 20 MiB cache: down to the low watermark (16 MiB),
    # the oldest objects read once first.
    wait_until("eviction", lambda: status(cache)["evictions"] >= 2)
    st = status(cache)
    assert st["usage"]["bytes_cached"] <= 16 * MiB, st
    gets, heads = upstream_gets(up), upstream_heads(up)
    read("hot")
    read("pinned/p1")
    read("cold4")
    assert upstream_gets(up) == gets, "a pinned, a protected or the newest object was evicted"
    # Evicted objects keep their metadata: a HEAD asks nothing upstream.
    assert c.head_object(Bucket="cached", Key="cold1")["ContentLength"] == 4 * MiB
    assert upstream_heads(up) == heads
    read("cold1")
    assert upstream_gets(up) == gets + 1
    out = cache_admin(cache, "status").stdout
    assert "cached" in out and "EVICTIONS" in out
    cache_admin(cache, "unpin", "cached", "--prefix", "pinned/")
    r = cache_admin(cache, "unpin", "cached", "--prefix", "pinned/", check=False)
    assert r.returncode != 0 and "no pin" in r.stderr


def test_prefetch_jobs_with_progress_a_model_index_and_drop(pair, tmp_path):
    up, u, cache, c = pair
    w1, w2 = data(20, 10 * MiB), data(21, 6 * MiB + 1)
    index = {"metadata": {"total_size": len(w1) + len(w2)},
             "weight_map": {"a.weight": "model-00001-of-00002.safetensors",
                            "b.weight": "model-00002-of-00002.safetensors",
                            "c.weight": "model-00001-of-00002.safetensors"}}
    files = {
        "llama/model.safetensors.index.json": json.dumps(index).encode(),
        "llama/model-00001-of-00002.safetensors": w1,
        "llama/model-00002-of-00002.safetensors": w2,
        "llama/config.json": b"{}",
        "data/0": data(22, 3 * MiB), "data/1": data(23, 9 * MiB), "data/2": b"",
    }
    for k, b in files.items():
        u.put_object(Bucket="origin", Key="models/" + k, Body=b)
    add(cache, up.endpoint)
    keys = tmp_path / "keys"
    keys.write_text("llama/model.safetensors.index.json\n# a comment\nllama/config.json\n")
    r = cache_admin(cache, "prefetch", "cached", "--keys-from", str(keys), "--wait")
    assert "done" in r.stdout, r.stdout
    r = cache_admin(cache, "prefetch", "cached", "--prefix", "data/", "--wait", "--json")
    job = json.loads(r.stdout)
    assert job["state"] == "done" and job["objects_total"] == 3
    assert job["bytes_done"] == job["bytes_total"] == 12 * MiB
    jobs = json.loads(cache_admin(cache, "jobs", "--json").stdout)
    assert len(jobs) == 2 and all(j["state"] == "done" for j in jobs)
    first = next(j for j in jobs if j["id"] != job["id"])
    assert first["objects_total"] == 4 and first["bytes_done"] == sum(len(files[k]) for k in files if k.startswith("llama/"))
    assert "prefix" in cache_admin(cache, "jobs").stdout
    # Everything is a hit now.
    gets = upstream_gets(up)
    for k, b in files.items():
        assert c.get_object(Bucket="cached", Key=k)["Body"].read() == b
    assert upstream_gets(up) == gets
    # A prefetch of what is cached reads nothing from the upstream.
    r = json.loads(cache_admin(cache, "prefetch", "cached", "--prefix", "llama/", "--wait", "--json").stdout)
    assert r["bytes_from_upstream"] == 0 and upstream_gets(up) == gets
    # Drop: the prefix is fetched again when read.
    out = cache_admin(cache, "drop", "cached", "--prefix", "data/").stdout
    assert "dropped 2 object(s)" in out, out
    assert c.get_object(Bucket="cached", Key="data/1")["Body"].read() == files["data/1"]
    assert upstream_gets(up) == gets + 2
    # Any S3 client can ask for a prefetch: a GET of .tarn-prefetch/PREFIX.
    doc = json.loads(c.get_object(Bucket="cached", Key=".tarn-prefetch/data/")["Body"].read())
    assert doc["kind"] == "prefetch" and doc["what"] == 'prefix "data/"'
    wait_until("the S3-asked prefetch", lambda: next(
        j for j in json.loads(cache_admin(cache, "jobs", "--json").stdout) if j["id"] == doc["id"])["state"] == "done")
    gets = upstream_gets(up)
    assert c.get_object(Bucket="cached", Key="data/0")["Body"].read() == files["data/0"]
    assert upstream_gets(up) == gets
    # A job that cannot list its prefix fails and says why.
    r = cache_admin(cache, "prefetch", "nosuch", "--prefix", "x", check=False)
    assert r.returncode != 0 and "no cache bucket" in r.stderr


def test_a_prefetch_goes_on_after_a_restart(pair):
    """A prefetch job's record is kept while it runs: a server killed
    mid-job runs it again when it starts (same id), fetching only what it
    had not stored, and the record goes once the job is done."""
    up, u, cache, c = pair
    files = {f"ds/{i}": data(40 + i, 3 * CHUNK) for i in range(4)}
    for k, b in files.items():
        u.put_object(Bucket="origin", Key="models/" + k, Body=b)
    proxy = FaultProxy("127.0.0.1", int(up.endpoint.rsplit(":", 1)[1]))
    try:
        add(cache, proxy.endpoint)
        proxy.limit(16 * MiB)  # ~6 s for the 96 MiB
        job = json.loads(cache_admin(cache, "prefetch", "cached", "--prefix", "ds/", "--json").stdout)
        wait_until("some of the prefetch", lambda: json.loads(
            cache_admin(cache, "jobs", "--json").stdout)[0]["bytes_done"] >= CHUNK)
        cache.kill()
        before = upstream_gets(up)
        cache.start()
        proxy.limit(None)
        jobs = json.loads(cache_admin(cache, "jobs", "--json").stdout)
        assert [j["id"] for j in jobs] == [job["id"]], jobs
        done = wait_until("the resumed prefetch", lambda: next(
            (j for j in json.loads(cache_admin(cache, "jobs", "--json").stdout) if j["state"] != "running"), None))
        assert done["state"] == "done" and done["objects_done"] == 4, done
        # What was stored before the kill was not fetched again.
        assert upstream_gets(up) - before < 4 * 3
        gets = upstream_gets(up)
        c = cache.client()
        for k, b in files.items():
            assert c.get_object(Bucket="cached", Key=k)["Body"].read() == b
        assert upstream_gets(up) == gets
        # Done: no record left, so a restart runs nothing.
        cache.restart()
        assert json.loads(cache_admin(cache, "jobs", "--json").stdout) == []
    finally:
        proxy.close()


def test_write_through_goes_upstream_first_then_serves_from_the_cache(pair):
    import base64
    import hashlib
    import io

    import boto3.s3.transfer

    up, u, cache, c = pair
    add(cache, up.endpoint, "never", "models/", "cached", "--writes", "through")
    body = data(30, 20 * MiB + 3)
    r = c.put_object(Bucket="cached", Key="ckpt/step1.bin", Body=body, ContentType="application/x-ckpt",
                     Metadata={"step": "1"})
    h = u.head_object(Bucket="origin", Key="models/ckpt/step1.bin")
    assert r["ETag"] == h["ETag"] and h["ContentLength"] == len(body)
    assert h["ContentType"] == "application/x-ckpt" and h["Metadata"] == {"step": "1"}
    gets = upstream_gets(up)
    got = c.get_object(Bucket="cached", Key="ckpt/step1.bin")
    assert got["Body"].read() == body and got["Metadata"] == {"step": "1"}
    assert upstream_gets(up) == gets, "a written object was fetched back from the upstream"
    # An overwrite is served at once, whatever the validation.
    body2 = data(31, 9 * MiB)
    c.put_object(Bucket="cached", Key="ckpt/step1.bin", Body=body2)
    assert c.get_object(Bucket="cached", Key="ckpt/step1.bin")["Body"].read() == body2
    assert u.get_object(Bucket="origin", Key="models/ckpt/step1.bin")["Body"].read() == body2
    # Conditions are the upstream's to honour, never dropped.
    with pytest.raises(botocore.exceptions.ClientError) as e:
        c.put_object(Bucket="cached", Key="ckpt/step1.bin", Body=b"late", IfNoneMatch="*")
    assert e.value.response["Error"]["Code"] == "PreconditionFailed"
    assert u.get_object(Bucket="origin", Key="models/ckpt/step1.bin")["Body"].read() == body2
    # A body that fails its digest reaches neither.
    bad = base64.b64encode(hashlib.md5(b"other").digest()).decode()
    with pytest.raises(botocore.exceptions.ClientError) as e:
        c.put_object(Bucket="cached", Key="ckpt/bad.bin", Body=b"x" * 1000, ContentMD5=bad)
    assert e.value.response["Error"]["Code"] in ("BadDigest", "InvalidDigest")
    with pytest.raises(botocore.exceptions.ClientError):
        u.head_object(Bucket="origin", Key="models/ckpt/bad.bin")
    # Multipart through.
    big = data(32, 13 * MiB)
    cfg = boto3.s3.transfer.TransferConfig(multipart_threshold=5 * MiB, multipart_chunksize=5 * MiB)
    c.upload_fileobj(io.BytesIO(big), "cached", "ckpt/step2.bin", Config=cfg)
    assert u.get_object(Bucket="origin", Key="models/ckpt/step2.bin")["Body"].read() == big
    assert c.get_object(Bucket="cached", Key="ckpt/step2.bin")["Body"].read() == big
    up_id = c.create_multipart_upload(Bucket="cached", Key="ckpt/aborted")["UploadId"]
    c.upload_part(Bucket="cached", Key="ckpt/aborted", UploadId=up_id, PartNumber=1, Body=b"p" * 100)
    c.abort_multipart_upload(Bucket="cached", Key="ckpt/aborted", UploadId=up_id)
    assert u.list_multipart_uploads(Bucket="origin").get("Uploads", []) == []
    # Deletes: the upstream first, then the cache.
    c.delete_object(Bucket="cached", Key="ckpt/step1.bin")
    with pytest.raises(botocore.exceptions.ClientError):
        u.head_object(Bucket="origin", Key="models/ckpt/step1.bin")
    with pytest.raises(botocore.exceptions.ClientError) as e:
        c.get_object(Bucket="cached", Key="ckpt/step1.bin")
    assert e.value.response["Error"]["Code"] == "NoSuchKey"
    r = c.delete_objects(Bucket="cached", Delete={"Objects": [{"Key": "ckpt/step2.bin"}]})
    assert [d["Key"] for d in r["Deleted"]] == ["ckpt/step2.bin"]
    assert u.list_objects_v2(Bucket="origin").get("KeyCount") == 0
    # What a cache bucket cannot write through is refused clearly.
    with pytest.raises(botocore.exceptions.ClientError) as e:
        c.copy_object(Bucket="cached", Key="c", CopySource={"Bucket": "cached", "Key": "x"})
    assert e.value.response["Error"]["Code"] == "NotImplemented"


def test_a_cluster_caches_once_and_every_node_serves_hits(make_server, formed_cluster, tmp_path):
    _, nodes = formed_cluster
    up = make_server(drives=1, name="upstream")
    u = up.client()
    u.create_bucket(Bucket="origin")
    shards = {"model-00001-of-00002.safetensors": data(40, 10 * MiB),
              "model-00002-of-00002.safetensors": data(41, 7 * MiB + 5)}
    index = {"weight_map": {"w1": "model-00001-of-00002.safetensors", "w2": "model-00002-of-00002.safetensors"}}
    files = {"m/model.safetensors.index.json": json.dumps(index).encode(), "m/config.json": b"{}"}
    files.update({"m/" + k: v for k, v in shards.items()})
    for k, v in files.items():
        u.put_object(Bucket="origin", Key="hub/" + k, Body=v)
    cache_admin(nodes[0], "add", "shared", "--upstream", "s3://origin/hub/", "--upstream-endpoint", up.endpoint,
                "--validate", "never")
    for n in nodes:
        assert "shared" in cache_admin(n, "list").stdout
    keys = tmp_path / "keys"
    keys.write_text("m/model.safetensors.index.json\nm/config.json\n")
    r = json.loads(cache_admin(nodes[1], "prefetch", "shared", "--keys-from", str(keys), "--wait", "--json").stdout)
    assert r["state"] == "done" and r["objects_total"] == 4, r
    gets = upstream_gets(up)
    assert gets == 5  # one per chunk: 2 + 1, the index and the config
    for n in nodes:
        c = n.client()
        for k, v in files.items():
            assert c.get_object(Bucket="shared", Key=k)["Body"].read() == v
    assert upstream_gets(up) == gets, "a node read the upstream after the prefetch"
    for n in nodes:
        st = status(n, "shared")
        assert st["misses"] == 0 and st["hits"] == len(files), st


def test_a_cluster_keeps_a_cache_bucket_under_its_size(make_server, formed_cluster):
    """--size bounds what the cluster holds, not each node: every node
    counts what all of them filled, and one node at a time evicts (after a
    fresh count), so nodes that each filled less than the size still evict,
    and never all for the same excess."""
    _, nodes = formed_cluster
    up = make_server(drives=1, name="upstream")
    u = up.client()
    u.create_bucket(Bucket="origin")
    bodies = {f"o{i}": data(60 + i, 4 * MiB) for i in range(8)}
    for k, v in bodies.items():
        u.put_object(Bucket="origin", Key="set/" + k, Body=v)
    cache_admin(nodes[0], "add", "small", "--upstream", "s3://origin/set/", "--upstream-endpoint", up.endpoint,
                "--validate", "never", "--size", "24MiB")
    # 32 MiB read, 8 MiB through each node: no node alone passes 90% of 24 MiB.
    for i, (k, v) in enumerate(bodies.items()):
        c = nodes[i % len(nodes)].client()
        assert c.get_object(Bucket="small", Key=k)["Body"].read() == v
        time.sleep(0.1)

    def held():
        return [status(n, "small")["usage"]["bytes_cached"] for n in nodes]

    def evictions():
        return sum(status(n, "small")["evictions"] for n in nodes)

    # Down to the low watermark (19.2 MiB: 4 objects), counted alike by all.
    wait_until("the cluster's eviction", lambda: evictions() >= 4, timeout=60)
    wait_until("every node's count", lambda: all(h <= 19.2 * MiB for h in held()), timeout=60)
    time.sleep(1)
    assert evictions() == 4, "nodes evicted for the same excess"
    assert all(h == 16 * MiB for h in held()), held()
    # The oldest went; what is left is served from the cache by any node.
    gets = upstream_gets(up)
    for i, k in enumerate(["o4", "o5", "o6", "o7"]):
        c = nodes[(i + 1) % len(nodes)].client()
        assert c.get_object(Bucket="small", Key=k)["Body"].read() == bodies[k]
    assert upstream_gets(up) == gets
    assert nodes[0].client().get_object(Bucket="small", Key="o0")["Body"].read() == bodies["o0"]
    assert upstream_gets(up) == gets + 1


def test_tarn_clients_read_a_cache_bucket(pair, tmp_path):
    """tarn.objects, the loader and the checkpoint reader read a cache
    bucket as they read any bucket: a model and a DCP checkpoint the
    upstream holds load equal, the second time without the upstream."""
    import safetensors.torch as st
    import torch
    import torch.distributed.checkpoint as dcp

    import tarn.checkpoint as ckpt
    import tarn.loader as loader
    import tarn.objects as objects

    up, u, cache, c = pair
    g = torch.Generator().manual_seed(7)
    weights, index = {}, {"metadata": {}, "weight_map": {}}
    for s in range(2):
        part = {f"layers.{s}.w{t}": torch.randn(300_000 + 37 * t, generator=g).to(torch.bfloat16)
                for t in range(6)}
        name = f"model-{s + 1:05}-of-00002.safetensors"
        st.save_file(part, str(tmp_path / name))
        u.put_object(Bucket="origin", Key="models/llama/" + name, Body=(tmp_path / name).read_bytes())
        index["weight_map"].update({k: name for k in part})
        weights.update(part)
    u.put_object(Bucket="origin", Key="models/llama/model.safetensors.index.json", Body=json.dumps(index).encode())
    state = {"w": torch.randn(1 << 20, generator=g), "b": torch.arange(1000), "step": 7}
    upc = objects.Client(up.endpoint, access_key=ACCESS_KEY, secret_key=SECRET_KEY)
    dcp.save(state, storage_writer=ckpt.StorageWriter("s3://origin/models/ckpt/step-7", client=upc))
    add(cache, up.endpoint, "never")
    cc = objects.Client(cache.endpoint, access_key=ACCESS_KEY, secret_key=SECRET_KEY)

    assert sorted(o.key for o in cc.list("cached", "llama/")) == sorted(
        ["llama/model.safetensors.index.json", "llama/model-00001-of-00002.safetensors",
         "llama/model-00002-of-00002.safetensors"])
    assert cc.get("cached", "llama/model.safetensors.index.json") == json.dumps(index).encode()
    assert cc.head("cached", "llama/model-00001-of-00002.safetensors").size == (
        tmp_path / "model-00001-of-00002.safetensors").stat().st_size

    def load_both():
        got = loader.load("s3://cached/llama/", client=cc)
        assert got.keys() == weights.keys()
        for k in weights:
            assert torch.equal(got[k], weights[k]), k
        back = {"w": torch.zeros(1 << 20), "b": torch.zeros(1000, dtype=torch.int64), "step": 0}
        dcp.load(back, storage_reader=ckpt.StorageReader("s3://cached/ckpt/step-7", client=cc))
        assert torch.equal(back["w"], state["w"]) and torch.equal(back["b"], state["b"])
        assert back["step"] == 7

    load_both()
    gets = upstream_gets(up)
    load_both()
    assert upstream_gets(up) == gets, "the second loads read the upstream"


def test_python_prefetch_pin_drop_status(pair, monkeypatch):
    import tarn
    import tarn.cache

    up, u, cache, c = pair
    objs = {f"ds/{i}": data(50 + i, (i + 1) * MiB) for i in range(4)}
    for k, v in objs.items():
        u.put_object(Bucket="origin", Key="models/" + k, Body=v)
    add(cache, up.endpoint)
    monkeypatch.setenv("TARN_ADMIN_ENDPOINT", cache.admin)
    monkeypatch.setenv("TARN_ADMIN_TOKEN", SECRET_KEY)
    job = tarn.cache.prefetch("s3://cached/ds/", wait=False)
    final = job.wait(timeout=60)
    assert final["state"] == "done" and final["objects_done"] == 4
    assert final["bytes_done"] == sum(len(v) for v in objs.values())
    assert job.done and job.progress()["bytes_from_upstream"] == final["bytes_done"]
    st = tarn.cache.status("cached")
    assert st["usage"]["bytes_cached"] == final["bytes_done"]
    assert [p["prefix"] for p in st["usage"]["prefixes"]] == ["ds/"]
    job = tarn.cache.prefetch("s3://cached/ds/", keys=["0", "1"], wait=True)
    assert job.progress()["objects_total"] == 2
    assert [p["prefix"] for p in tarn.cache.pin("s3://cached/ds/", ttl=60)] == ["ds/"]
    assert tarn.cache.unpin("s3://cached/ds/") == []
    assert tarn.cache.drop("s3://cached/ds/")["objects_dropped"] == 4
    with pytest.raises(tarn.cache.CacheError) as e:
        tarn.cache.prefetch("s3://nosuch/x", wait=True)
    assert e.value.status == 404
    # A prefetch whose objects fail says so.
    with pytest.raises(tarn.cache.CacheError) as e:
        tarn.cache.prefetch("s3://cached/", keys=["ds/0", "missing"], wait=True)
    assert e.value.job["failures"] == 1 and e.value.job["failed"][0]["key"] == "missing"
    with pytest.raises(tarn.cache.CacheError):
        tarn.cache.status("nosuch")


def test_a_cluster_prefetch_runs_on_every_node_and_survives_the_loss_of_the_one_asked(make_server, formed_cluster):
    import signal

    _, nodes = formed_cluster
    up = make_server(drives=1, name="upstream")
    u = up.client()
    u.create_bucket(Bucket="origin")
    files = {f"ds/{i}": data(60 + i, 12 * MiB) for i in range(4)}
    for k, v in files.items():
        u.put_object(Bucket="origin", Key=k, Body=v)
    proxy = FaultProxy("127.0.0.1", int(up.endpoint.rsplit(":", 1)[1]))
    try:
        cache_admin(nodes[0], "add", "shared", "--upstream", "s3://origin", "--upstream-endpoint", proxy.endpoint,
                    "--validate", "never")
        # A slow upstream: the job takes seconds.
        proxy.limit(12 * MiB)
        job = json.loads(cache_admin(nodes[0], "prefetch", "shared", "--prefix", "ds/", "--json").stdout)
        # Every node runs it (the record in etcd), sharing chunks by claims.
        for n in nodes[1:]:
            wait_until("the job on every node", lambda n=n: any(
                j["id"] == job["id"] for j in json.loads(cache_admin(n, "jobs", "--json").stdout)), timeout=20)
        time.sleep(1)
        nodes[0].signal(signal.SIGKILL)
        proxy.limit(None)

        def done_on(n):
            j = next(j for j in json.loads(cache_admin(n, "jobs", "--json").stdout) if j["id"] == job["id"])
            return j["state"] != "running" and j

        for n in nodes[1:]:
            final = None

            def finished(n=n):
                nonlocal final
                final = done_on(n)
                return final

            wait_until("the job's end on a surviving node", finished, timeout=120)
            assert final["state"] == "done", final
        gets = upstream_gets(up)
        # Each chunk was read once, or twice when the killed node held its claim.
        assert gets <= 2 * 8, gets
        for n in nodes[1:]:
            c = n.client()
            for k, v in files.items():
                assert c.get_object(Bucket="shared", Key=k)["Body"].read() == v
        assert upstream_gets(up) == gets
    finally:
        proxy.close()

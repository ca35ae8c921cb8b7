"""Short-circuit reads (docs/local-reads.md): a client on the node's host
reads shard files through descriptors the node passes after checking its
credentials and the policy. Reads equal HTTP reads in every geometry; a
hostile local process (wrong or no credentials, a key that may not read the
object, forged or malformed requests, another uid) gets nothing; a corrupt
shard or a changed object is read over HTTP or fails cleanly, never as wrong
bytes; a cluster node serves its own shards and the rest goes over HTTP."""

import glob
import json
import os
import random
import struct
import subprocess
import sys
import time

import numpy as np
import pytest

import tarn.objects as objects
from conftest import data, footer_shard_index
import localraw
from localraw import Raw, proof
from tarnproc import ACCESS_KEY, SECRET_KEY, add_user

MIB = 1 << 20
HEADER = "x-tarn-local-read"


def client_for(endpoint, key=None, **kw):
    ak, sk = (key["access_key"], key["secret_key"]) if key else (ACCESS_KEY, SECRET_KEY)
    return objects.Client(endpoint, access_key=ak, secret_key=sk, **kw)


def socket_name(server, bucket, key):
    """The local-read socket a node names to a client on its host."""
    r = server.client().head_object(Bucket=bucket, Key=key)
    return r["ResponseMetadata"]["HTTPHeaders"][HEADER]


def read_all(c, bucket, key, size, pieces):
    """Reads `pieces` (offset, length) into one buffer; the bytes per piece."""
    total = sum(n for _, n in pieces)
    buf = np.zeros(max(total, 1), dtype=np.uint8)
    batch, at = [], 0
    for off, n in pieces:
        batch.append((bucket, key, off, n, buf, at))
        at += n
    assert c.read(batch) == [n for _, n in pieces]
    out, at = [], 0
    for _, n in pieces:
        out.append(buf[at : at + n].tobytes())
        at += n
    return out


def ranges_for(size, rng, stripe):
    """Whole object, edges of stripes and blocks, odd offsets."""
    out = [(0, size), (0, 1), (size - 1, 1), (1, size - 1)]
    for j in range(1, size // stripe + 1):
        b = j * stripe
        if b < size:
            out += [(b - 1, 2), (b - 3, min(7, size - b + 3))]
    for _ in range(12):
        n = rng.randrange(1, min(size, 3 * MIB) + 1)
        out.append((rng.randrange(0, size - n + 1), n))
    return out


# (drives, extra args, stripe) — 2+2 (the default), one drive, 4+2, 3
# copies (k = 1), a 3+1 set whose blocks are not a multiple of 4 KiB
# (buffered reads, padded blocks), and 5+1 with 20 KiB stripes (4 KiB
# blocks, many stripes per read).
GEOMETRIES = [
    (4, [], MIB),
    (1, [], MIB),
    (6, ["--data-shards", "4", "--parity-shards", "2"], MIB),
    (3, ["--data-shards", "1", "--parity-shards", "2"], MIB),
    (4, ["--data-shards", "3", "--parity-shards", "1"], MIB),
    (6, ["--data-shards", "5", "--parity-shards", "1", "--stripe-size", "20KiB"], 20 << 10),
]


@pytest.mark.parametrize("drives,args,stripe", GEOMETRIES, ids=["2+2", "1", "4+2", "1+2", "3+1", "5+1-20K"])
def test_local_reads_equal_http_reads(make_server, drives, args, stripe):
    server = make_server(drives=drives, extra_args=args)
    s3 = server.client()
    s3.create_bucket(Bucket="geo")
    objs = {
        "small": data("s", 200_000),  # past the inline threshold: shard files
        "stripe": data("st", stripe),
        "stripe1": data("st1", stripe + 1),
        "big": data("b", 5 * MIB + 12345),
    }
    for k, v in objs.items():
        s3.put_object(Bucket="geo", Key=k, Body=v)
    # A multipart object: parts of 5 MiB and a tail.
    mp = data("mp", 2 * 5 * MIB + 777)
    up = s3.create_multipart_upload(Bucket="geo", Key="multi")["UploadId"]
    parts = []
    for i, a in enumerate(range(0, len(mp), 5 * MIB)):
        r = s3.upload_part(Bucket="geo", Key="multi", UploadId=up, PartNumber=i + 1, Body=mp[a : a + 5 * MIB])
        parts.append({"PartNumber": i + 1, "ETag": r["ETag"]})
    s3.complete_multipart_upload(Bucket="geo", Key="multi", UploadId=up, MultipartUpload={"Parts": parts})
    objs["multi"] = mp
    local = client_for(server.endpoint, chunk_size=2 * MIB)
    http = client_for(server.endpoint, chunk_size=2 * MIB, local_reads=False)
    rng = random.Random(drives * 1000 + stripe)
    inline_bytes = 0
    for key, want in objs.items():
        local.head("geo", key)
        pieces = ranges_for(len(want), rng, stripe)
        if key == "multi":
            pieces += [(5 * MIB - 3, 6), (10 * MIB - 1, 778)]
        got_local = read_all(local, "geo", key, len(want), pieces)
        got_http = read_all(http, "geo", key, len(want), pieces)
        for (off, n), a, b in zip(pieces, got_local, got_http):
            assert a == want[off : off + n] == b, (key, off, n)
        if len(want) <= 128 << 10:
            # Kept inline with the metadata: no shard files, read over HTTP.
            inline_bytes += sum(n for _, n in pieces)
    st = local.stats()
    assert st["local_bytes"] > 0 and st["local_grants"] > 0, st
    assert st["local_fallback_bytes"] == 0, st
    # Only HEADs and inline objects went over HTTP.
    assert st["bytes_received"] == inline_bytes, st
    hs = http.stats()
    assert hs["local_bytes"] == 0 and hs["bytes_received"] > 0, hs


def test_a_lease_out_of_range_is_refused_at_start(tmp_path):
    from tarnproc import BIN
    for secs in ("0", "3601"):
        r = subprocess.run([BIN, "server", "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0",
                            "--drive", str(tmp_path), "--local-read-lease-secs", secs],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode != 0 and "between 1 and 3600" in r.stderr, (secs, r.stderr)


def test_off_by_environment_and_by_the_server(make_server):
    server = make_server(drives=1)
    s3 = server.client()
    s3.create_bucket(Bucket="off")
    body = data("o", 3 * MIB)
    s3.put_object(Bucket="off", Key="k", Body=body)
    os.environ["TARN_LOCAL_READS"] = "0"
    try:
        c = client_for(server.endpoint)
    finally:
        del os.environ["TARN_LOCAL_READS"]
    c.head("off", "k")
    assert read_all(c, "off", "k", len(body), [(0, len(body))]) == [body]
    assert c.stats()["local_bytes"] == 0
    # A server started without local reads names no socket.
    plain = make_server(drives=1, extra_args=["--no-local-reads"], name="plain")
    p3 = plain.client()
    p3.create_bucket(Bucket="off")
    p3.put_object(Bucket="off", Key="k", Body=body)
    assert HEADER not in p3.head_object(Bucket="off", Key="k")["ResponseMetadata"]["HTTPHeaders"]
    c = client_for(plain.endpoint)
    c.head("off", "k")
    assert read_all(c, "off", "k", len(body), [(0, len(body))]) == [body]
    assert c.stats()["local_bytes"] == 0


def test_hostile_local_processes_get_nothing(make_server):
    server = make_server()
    s3 = server.client()
    s3.create_bucket(Bucket="open")
    s3.create_bucket(Bucket="closed")
    obj = data("h", 3 * MIB)
    for b in ("open", "closed"):
        s3.put_object(Bucket=b, Key="k", Body=obj)
    alice = add_user(server, "alice")
    policy = {"Version": "2012-10-17", "Statement": [{
        "Effect": "Allow", "Principal": {"AWS": ["arn:aws:iam::000000000000:user/alice"]},
        "Action": ["s3:GetObject"], "Resource": ["arn:aws:s3:::open/*"]}]}
    s3.put_bucket_policy(Bucket="open", Policy=json.dumps(policy))
    name = socket_name(server, "open", "k")

    # No credentials: anything but HELLO first ends the connection.
    r = Raw(name)
    r.send(5, b"\0" * 20)
    typ, _, fds = r.recv()
    assert typ == 10 and not fds
    assert r.recv()[0] is None
    # A wrong secret, an unknown key, a forged proof: refused, no descriptors.
    for ak, sk in [(ACCESS_KEY, "wrong"), ("AKNOBODY", SECRET_KEY), (alice["access_key"], SECRET_KEY)]:
        typ, body, fds = Raw(name).auth(ak, sk)
        assert typ == 10 and body[0] == 2 and not fds, (ak, typ, body)
    typ, body, fds = Raw(name).auth(ACCESS_KEY, "", given=b"\0" * 32)
    assert typ == 10 and not fds
    # A replayed proof (another connection's nonce) fails.
    r1 = Raw(name)
    n1 = r1.hello()
    r2 = Raw(name)
    r2.hello()
    nonce = os.urandom(32)
    r2.send(3, Raw.s16(ACCESS_KEY) + nonce + proof(SECRET_KEY, n1, nonce, ACCESS_KEY))
    typ, body, fds = r2.recv()
    assert typ == 10 and not fds

    # Alice may read open/k: granted. closed/k: refused (Denied), nothing
    # attached. A missing key of a bucket she cannot list: Denied too.
    r = Raw(name)
    assert r.auth(alice["access_key"], alice["secret_key"])[0] == 4
    typ, body, fds = r.layout("open", "k", 0, len(obj))
    assert typ == 6 and len(fds) >= 1, (typ, body)
    for fd in fds:
        # Read-only: the descriptor cannot write.
        with pytest.raises(OSError):
            os.write(fd, b"x")
        os.close(fd)
    for bucket, key in [("closed", "k"), ("open", "missing"), ("nosuchbucket", "k")]:
        typ, body, fds = r.layout(bucket, key, 0, 1)
        assert typ == 8 and body[4] in (1, 2) and not fds, (bucket, key, typ, body)
    typ, body, fds = r.layout("open", "k", 0, 10 * MIB)
    assert typ == 8 and body[4] == 4 and not fds
    typ, body, fds = r.layout("open", "k", 0, 5, if_match='"not-the-etag"')
    assert typ == 8 and body[4] == 3 and not fds
    # A malformed frame ends the connection with an error, nothing more.
    r.send(5, b"\xff" * 7)
    typ, body, fds = r.recv()
    assert typ == 10 and not fds
    assert r.recv()[0] is None
    # A frame announcing more than the limit.
    r = Raw(name)
    r.s.sendall(struct.pack("<I", 1 << 30))
    typ, _, fds = r.recv()
    assert typ is None or typ == 10
    assert not fds

    # Through the client: alice's read of closed/k is refused over HTTP too
    # (the local refusal falls back; HTTP has the last word), with no grant.
    c = client_for(server.endpoint, key=alice)
    from tarn.errors import ObjectPermissionError
    c.head("open", "k")
    buf = bytearray(10)
    with pytest.raises(ObjectPermissionError):
        c.read([("closed", "k", 0, 10, buf, 0)])
    assert c.stats()["local_grants"] == 0
    assert c.read([("open", "k", 5, 10, buf, 0)]) == [10] and bytes(buf) == obj[5:15]
    assert c.stats()["local_grants"] == 1

    # The server counts it all.
    import urllib.request
    req = urllib.request.Request(server.admin + "/metrics", headers={"Authorization": f"Bearer {SECRET_KEY}"})
    m = urllib.request.urlopen(req).read().decode()
    assert 'tarn_local_read_answers_total{answer="granted"} 2' in m
    assert "tarn_local_read_handshakes_refused_total 6" in m


OTHER_UID = 65534  # nobody

OTHER_UID_SCRIPT = r"""
import json, os, sys
name, drive, bucket, size, ak, sk = sys.argv[1:7]
out = {}
# The drive's files are closed to other users.
for what, path in [("list", os.path.join(drive, "data")), ("meta", os.path.join(drive, ".tarn", "meta"))]:
    try:
        os.listdir(path)
        out[what] = "listed"
    except PermissionError:
        out[what] = "denied"
# Without the secret: nothing.
typ, body, fds = Raw(name).auth(ak, "wrong-secret")
out["wrong"] = [typ, len(fds)]
# With it: the descriptors read, but cannot be reopened for writing, and
# lead nowhere else.
r = Raw(name)
assert r.auth(ak, sk)[0] == 4
typ, body, fds = r.layout(bucket, "k", 0, int(size))
out["granted"] = [typ, len(fds)]
reopen = []
for fd in fds:
    try:
        os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
        reopen.append("opened")
    except PermissionError:
        reopen.append("denied")
    target = os.readlink(f"/proc/self/fd/{fd}")
    try:
        os.open(os.path.join(os.path.dirname(target), "x"), os.O_RDONLY)
        reopen.append("sibling")
    except (PermissionError, FileNotFoundError) as e:
        reopen.append(type(e).__name__)
    out["read"] = len(os.pread(fd, 16, 0))
out["reopen"] = reopen
print(json.dumps(out))
"""


def test_another_uid_reads_only_what_it_is_granted(make_server, tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to run a process as another user")
    # Every directory above the drive open to all: only the drive's own
    # modes keep the other user out.
    for d in [tmp_path, *tmp_path.parents]:
        if str(d).startswith("/tmp/"):
            os.chmod(d, 0o755)
    server = make_server(drives=1)
    s3 = server.client()
    s3.create_bucket(Bucket="uid")
    body = data("u", 2 * MIB)
    s3.put_object(Bucket="uid", Key="k", Body=body)
    name = socket_name(server, "uid", "k")

    def as_nobody():
        os.setgid(OTHER_UID)
        os.setuid(OTHER_UID)

    r = subprocess.run(
        # The helper's source travels in the command: the other user may not
        # be able to read this checkout (a fresh clone under a 0700 directory).
        ["/usr/bin/python3", "-c", open(localraw.__file__).read() + OTHER_UID_SCRIPT, name, server.drives[0], "uid",
         str(len(body)), ACCESS_KEY, SECRET_KEY],
        capture_output=True, text=True, timeout=60, preexec_fn=as_nobody, cwd="/",
        env={"PATH": "/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1"},
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["list"] == "denied" and out["meta"] == "denied", out
    assert oct(os.stat(server.drives[0]).st_mode & 0o777) != "0o700", "the test must reach the drive"
    assert os.stat(os.path.join(server.drives[0], "data")).st_mode & 0o777 == 0o700
    assert out["wrong"] == [10, 0], out
    assert out["granted"][0] == 6 and out["granted"][1] >= 1, out
    assert out["read"] == 16
    assert "opened" not in out["reopen"] and "sibling" not in out["reopen"], out


def shard_files(server):
    return [f for d in server.drives for f in glob.glob(os.path.join(d, "data", "*", "*"))]


def test_a_corrupt_shard_is_read_over_http_and_counted(make_server):
    server = make_server()
    s3 = server.client()
    s3.create_bucket(Bucket="bad")
    body = data("c", 4 * MIB)
    s3.put_object(Bucket="bad", Key="k", Body=body)
    files = shard_files(server)
    assert len(files) == 4
    victim = next(f for f in files if footer_shard_index(f) == 0)
    with open(victim, "r+b") as f:
        f.seek(1000)
        b = f.read(1)
        f.seek(1000)
        f.write(bytes([b[0] ^ 0xFF]))
    c = client_for(server.endpoint)
    c.head("bad", "k")
    assert read_all(c, "bad", "k", len(body), [(0, len(body))]) == [body]
    st = c.stats()
    assert st["local_fallback_bytes"] > 0 and st["bytes_received"] >= st["local_fallback_bytes"], st
    assert st["local_bytes"] + st["local_fallback_bytes"] == len(body), st
    # A truncated shard file: its length gives it away before any read.
    other = next(f for f in files if footer_shard_index(f) == 1)
    with open(other, "r+b") as f:
        f.truncate(os.path.getsize(other) - 1)
    c2 = client_for(server.endpoint)
    c2.head("bad", "k")
    assert read_all(c2, "bad", "k", len(body), [(0, len(body))]) == [body]
    st = c2.stats()
    # All of shard 1 (half the object) over HTTP; shard 0 local where it
    # checks out (the read above had its bad block healed, maybe already).
    assert st["local_fallback_bytes"] >= len(body) // 2, st
    assert st["local_bytes"] + st["local_fallback_bytes"] == len(body), st


def test_a_version_read_while_it_is_replaced_or_deleted(make_server):
    server = make_server()
    s3 = server.client()
    s3.create_bucket(Bucket="chg")
    old = data("old", 3 * MIB)
    s3.put_object(Bucket="chg", Key="k", Body=old)
    name = socket_name(server, "chg", "k")
    r = Raw(name)
    assert r.auth(ACCESS_KEY, SECRET_KEY)[0] == 4
    typ, body, fds = r.layout("chg", "k", 0, len(old))
    assert typ == 6 and len(fds) == 2
    before = set(shard_files(server))
    # Overwritten, then deleted: the pinned shard files stay until released.
    new = data("new", 3 * MIB)
    s3.put_object(Bucket="chg", Key="k", Body=new)
    s3.delete_object(Bucket="chg", Key="k")
    time.sleep(0.5)
    assert before <= set(shard_files(server)), "a pinned version's files were removed"
    # The descriptors still read the old version's blocks, which check out
    # against their table (block 0 of shard 0 is the object's first bytes).
    first = os.pread(fds[0], 1024, 0)
    assert first == old[:1024]
    pin = struct.unpack("<Q", body[4:12])[0]
    r.send(9, struct.pack("<Q", pin))
    deadline = time.time() + 10
    while time.time() < deadline and before & set(shard_files(server)):
        time.sleep(0.1)
    assert not before & set(shard_files(server)), "released shard files were kept"
    for fd in fds:
        os.close(fd)
    # A read that names the old ETag now fails as changed, never old bytes
    # from a cached grant or a mix; a read without one sees the newest.
    s3.put_object(Bucket="chg", Key="k", Body=new)
    c = client_for(server.endpoint)
    info = c.head("chg", "k")
    assert read_all(c, "chg", "k", len(new), [(0, len(new))]) == [new]
    s3.put_object(Bucket="chg", Key="k", Body=old)
    from tarn.errors import ObjectError
    buf = bytearray(100)
    with pytest.raises(ObjectError):
        c.read([("chg", "k", 0, 100, buf, 0, None, info.etag)])
    assert read_all(c, "chg", "k", len(old), [(0, len(old))]) == [old]


def test_the_lease_lapses_and_the_connection_closing_releases(make_server):
    server = make_server(extra_args=["--local-read-lease-secs", "1"])
    s3 = server.client()
    s3.create_bucket(Bucket="lease")
    body = data("l", 2 * MIB)
    s3.put_object(Bucket="lease", Key="k", Body=body)
    name = socket_name(server, "lease", "k")
    for ending in ("lapse", "close"):
        r = Raw(name)
        assert r.auth(ACCESS_KEY, SECRET_KEY)[0] == 4
        typ, _, fds = r.layout("lease", "k", 0, len(body))
        assert typ == 6
        for fd in fds:
            os.close(fd)
        before = set(shard_files(server))
        s3.put_object(Bucket="lease", Key="k", Body=data(ending, 2 * MIB))
        if ending == "close":
            r.s.close()
        deadline = time.time() + 10
        while time.time() < deadline and before & set(shard_files(server)):
            time.sleep(0.1)
        assert not before & set(shard_files(server)), ending


def test_inline_and_encrypted_versions_are_read_over_http(make_server):
    server = make_server()
    s3 = server.client()
    s3.create_bucket(Bucket="else")
    small = b"tiny object"
    s3.put_object(Bucket="else", Key="tiny", Body=small)
    c = client_for(server.endpoint)
    c.head("else", "tiny")
    assert read_all(c, "else", "tiny", len(small), [(0, len(small))]) == [small]
    assert c.stats()["local_bytes"] == 0


def test_a_cluster_node_serves_its_own_shards_and_http_the_rest(formed_cluster):
    etcd, nodes = formed_cluster
    n1 = nodes[0]
    s3 = n1.client()
    s3.create_bucket(Bucket="spread")
    want = {}
    for i in range(8):
        want[f"k{i}"] = data(f"c{i}", 3 * MIB + i)
        s3.put_object(Bucket="spread", Key=f"k{i}", Body=want[f"k{i}"])
    c = client_for(n1.endpoint)
    for k, v in want.items():
        c.head("spread", k)
        assert read_all(c, "spread", k, len(v), [(0, len(v)), (MIB - 5, 11)]) == [v, v[MIB - 5 : MIB + 6]]
    st = c.stats()
    # Node 1 holds some data shards (it has two of the eight drives).
    assert st["local_bytes"] > 0 and st["bytes_received"] > 0, st
    assert st["local_bytes"] + st["bytes_received"] >= sum(len(v) for v in want.values())

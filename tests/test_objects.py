"""The object client (`tarn.objects`, crates/tarn-client's object module)
against a live `tarn server`: batched reads equal to boto3's, parallel
multipart uploads the server checks, endpoint and credentials read the way
the AWS tools read them, and faults (503s, resets, a stalled body, the
server stopped) that give retries or a clear error naming the object and
the bytes. The same client against a scripted server, fault by fault:
crates/tarn-client/tests/object.rs."""

import os
import random
import threading
import time

import numpy as np
import pytest

import tarn.objects as objects
from conftest import data
from faultproxy import FaultProxy
from tarn.errors import ObjectConnectionError, ObjectError, ObjectNotFoundError, ObjectPermissionError
from tarnproc import ACCESS_KEY, SECRET_KEY

MIB = 1 << 20


@pytest.fixture
def stored(server):
    """A bucket with a 21 MiB object and a small one."""
    s3 = server.client()
    s3.create_bucket(Bucket="objs")
    big = data("big", 21 * MIB + 12345)
    s3.put_object(Bucket="objs", Key="big.bin", Body=big)
    s3.put_object(Bucket="objs", Key="dir/small.txt", Body=b"hello, tarn")
    return server, big


def client_for(endpoint, **kw):
    return objects.Client(endpoint, access_key=ACCESS_KEY, secret_key=SECRET_KEY, **kw)


def test_batched_reads_equal_ranged_gets(stored):
    server, big = stored
    c = client_for(server.endpoint, chunk_size=2 * MIB)
    rng = random.Random(7)
    reads, want = [], []
    total = 0
    for i in range(200):
        n = rng.choice([0, 1, 17, 4096, 100_000, 3 * MIB + 5])
        off = rng.randrange(0, len(big) - n + 1)
        reads.append((off, n))
        want.append(big[off : off + n])
        total += n
    buf = np.zeros(total, dtype=np.uint8)
    batch, at = [], 0
    for off, n in reads:
        batch.append(("objs", "big.bin", off, n, buf, at))
        at += n
    got = c.read(batch)
    assert got == [n for _, n in reads]
    at = 0
    for i, (off, n) in enumerate(reads):
        assert buf[at : at + n].tobytes() == want[i], f"read {i}"
        at += n
    # One GET per read would be at least 200 requests, plus the splits.
    assert c.stats()["requests"] < 200, c.stats()
    # Each kind of buffer: bytearray, memoryview, numpy.
    ba = bytearray(11)
    assert c.read([("objs", "dir/small.txt", 0, 11, ba, 0)]) == [11]
    assert bytes(ba) == b"hello, tarn"
    mv = memoryview(bytearray(4))
    assert c.get_into("objs", "dir/small.txt", mv, offset=7) == 4
    assert bytes(mv) == b"tarn"


def test_ring_completions_carry_user_data(stored):
    server, big = stored
    c = client_for(server.endpoint)
    ring = c.ring()
    bufs = [bytearray(MIB) for _ in range(8)]
    ring.submit([("objs", "big.bin", i * MIB, MIB, bufs[i], 0, ("tensor", i)) for i in range(8)])
    seen = {}
    while ring.pending:
        for user, res in ring.wait(min=1, timeout=30):
            seen[user] = res
    assert seen == {("tensor", i): MIB for i in range(8)}
    for i in range(8):
        assert bytes(bufs[i]) == big[i * MIB : (i + 1) * MIB]
    # A failed read is a completion with the exception, not a raise.
    ring.submit([("objs", "nope", 0, 10, bytearray(10), 0, "missing")])
    [(user, res)] = ring.wait(min=1, timeout=30)
    assert user == "missing" and isinstance(res, ObjectNotFoundError)
    assert res.bucket == "objs" and res.key == "nope" and res.status == 404


def test_head_list_get_put(stored):
    server, big = stored
    s3 = server.client()
    c = client_for(server.endpoint, part_size=5 * MIB)
    info = c.head("objs", "big.bin")
    assert info.size == len(big)
    assert info.etag == s3.head_object(Bucket="objs", Key="big.bin")["ETag"]
    assert {o.key for o in c.list("objs", "dir/")} == {"dir/small.txt"}
    assert c.get("objs", "dir/small.txt") == b"hello, tarn"
    # A multipart upload from a numpy array: the server checks each part's
    # CRC32C and the result reads back whole.
    payload = np.frombuffer(data("up", 17 * MIB + 3), dtype=np.uint8)
    etag = c.put("objs", "up.bin", payload)
    assert etag.strip('"').endswith("-4")
    assert s3.get_object(Bucket="objs", Key="up.bin")["Body"].read() == payload.tobytes()
    # A small one: one PUT.
    assert c.put("objs", "tiny", b"abc", content_type="text/plain") == s3.head_object(Bucket="objs", Key="tiny")["ETag"]
    assert s3.head_object(Bucket="objs", Key="tiny")["ContentType"] == "text/plain"
    # Conditional create: refused when the key exists, nothing replaced.
    with pytest.raises(ObjectError) as e:
        c.put("objs", "tiny", b"xyz", if_none_match=True)
    assert e.value.status == 412
    assert c.get("objs", "tiny") == b"abc"
    c.put("objs", "fresh", b"new", if_none_match=True)
    assert c.get("objs", "fresh") == b"new"
    # A bucket made by the client; making it again is not an error.
    c.create_bucket("made-here")
    c.create_bucket("made-here")
    c.put("made-here", "k", b"v")
    assert s3.get_object(Bucket="made-here", Key="k")["Body"].read() == b"v"


def test_errors_name_the_object_and_the_bytes(stored):
    server, big = stored
    c = client_for(server.endpoint)
    buf = bytearray(100)
    with pytest.raises(ObjectNotFoundError) as e:
        c.read([("objs", "missing.bin", 0, 100, buf, 0)])
    assert isinstance(e.value, FileNotFoundError)
    assert str(e.value).startswith("s3://objs/missing.bin bytes 0-99: not found")
    # Past the end: a clear error with the object's size.
    with pytest.raises(ObjectError) as e:
        c.read([("objs", "big.bin", len(big) - 10, 100, buf, 0)])
    assert f"which is {len(big)} bytes" in str(e.value)
    # A version that changed under the read.
    with pytest.raises(ObjectError) as e:
        c.read([("objs", "big.bin", 0, 10, buf, 0, None, '"0123"')])
    assert e.value.status == 412 and "changed" in str(e.value)
    # Wrong secret: a permission error, at once.
    bad = objects.Client(server.endpoint, access_key=ACCESS_KEY, secret_key="wrong")
    with pytest.raises(ObjectPermissionError):
        bad.read([("objs", "big.bin", 0, 10, buf, 0)])
    # Calls that cannot be made are refused before anything is sent.
    with pytest.raises(ValueError, match="do not fit"):
        c.read([("objs", "big.bin", 0, 101, buf, 0)])
    with pytest.raises(ValueError, match="overlapping"):
        c.read([("objs", "big.bin", 0, 50, buf, 0), ("objs", "big.bin", 0, 50, buf, 40)])
    with pytest.raises(BufferError):
        c.read([("objs", "big.bin", 0, 3, b"abc", 0)])
    with pytest.raises(ValueError, match="expected http"):
        objects.Client("ftp://s3.amazonaws.com")
    with pytest.raises(ValueError, match="CA bundle"):
        objects.Client("https://127.0.0.1:9", ca_bundle="/nonexistent/ca.pem")


def test_endpoint_and_credentials_from_the_environment(stored, tmp_path, monkeypatch):
    server, big = stored
    for k in list(os.environ):
        if k.startswith("AWS_"):
            monkeypatch.delenv(k)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("AWS_ENDPOINT_URL", server.endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    t0 = time.monotonic()
    assert objects.Client().get("objs", "dir/small.txt") == b"hello, tarn"
    # No metadata-service probing: nothing waits on a timeout.
    assert time.monotonic() - t0 < 5
    # A named profile in ~/.aws, with its endpoint in the s3 block.
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    (tmp_path / ".aws").mkdir()
    (tmp_path / ".aws" / "credentials").write_text(
        f"[train]\naws_access_key_id = {ACCESS_KEY}\naws_secret_access_key = {SECRET_KEY}\n"
    )
    (tmp_path / ".aws" / "config").write_text(f"[profile train]\nregion = us-east-1\ns3 =\n  endpoint_url = {server.endpoint}\n")
    monkeypatch.setenv("AWS_PROFILE", "train")
    c = objects.Client()
    assert c.endpoints == [server.endpoint]
    assert c.get("objs", "dir/small.txt") == b"hello, tarn"
    assert objects.Client(profile="train").head("objs", "big.bin").size == len(big)
    with pytest.raises(ValueError, match="nope"):
        objects.Client(profile="nope")


def test_retries_and_hedges_through_faults(stored):
    """503s, resets mid-body and a stalled body between client and server:
    every read still returns the right bytes."""
    server, big = stored
    host, port = server.endpoint[len("http://") :].split(":")
    proxy = FaultProxy(host, int(port))
    try:
        c = client_for(proxy.endpoint, connections=4, chunk_size=MIB, io_timeout=10)
        proxy.script(("status", 503), ("reset", 300_000), ("status", 500), ("reset", 10))
        buf = np.zeros(len(big), dtype=np.uint8)
        assert c.read([("objs", "big.bin", 0, len(big), buf, 0)]) == [len(big)]
        assert buf.tobytes() == big
        assert c.stats()["retries"] >= 4
        # A body that stalls far longer than reads take (the first new
        # connection's): hedged on another connection, not waited out.
        c2 = client_for(proxy.endpoint, connections=4, chunk_size=MIB, io_timeout=30)
        proxy.script(("stall", 1000, 20))
        t0 = time.monotonic()
        buf[:] = 0
        assert c2.read([("objs", "big.bin", 0, 4 * MIB, buf, 0)]) == [4 * MIB]
        assert buf[: 4 * MIB].tobytes() == big[: 4 * MIB]
        s = c2.stats()
        assert s["hedges_won"] >= 1, s
        assert time.monotonic() - t0 < 20
    finally:
        proxy.close()


def test_a_server_that_stops_mid_read_gives_a_clear_error(stored):
    server, big = stored
    host, port = server.endpoint[len("http://") :].split(":")
    proxy = FaultProxy(host, int(port))
    try:
        # A short I/O timeout: the proxy's closed side can leave a connection
        # silent rather than reset, and each attempt then waits it out.
        c = client_for(proxy.endpoint, connections=2, chunk_size=MIB, retries=2, hedge=False, connect_timeout=1.0,
                       io_timeout=5.0)
        proxy.always(("stall", 1000, 2))
        buf = np.zeros(len(big), dtype=np.uint8)
        errors = []

        def read():
            try:
                c.read([("objs", "big.bin", 0, len(big), buf, 0)])
            except Exception as e:  # noqa: BLE001
                errors.append(e)

        t = threading.Thread(target=read)
        t.start()
        time.sleep(0.5)
        proxy.close()
        server.kill()
        t.join(timeout=60)
        assert not t.is_alive(), "the read hung"
        assert len(errors) == 1
        e = errors[0]
        assert isinstance(e, ObjectConnectionError), repr(e)
        assert str(e).startswith("s3://objs/big.bin bytes "), str(e)
        assert e.attempts == 3
    finally:
        proxy.close()


def test_reads_into_gpu_memory(stored):
    """CUDA tensors as buffers: pieces through pinned staging slots, copied
    on a stream of the ring's own; odd offsets, reads longer than the pool,
    several reads into one tensor, and a failed read among good ones."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (run on a GPU host)")
    server, big = stored
    c = client_for(server.endpoint, chunk_size=MIB)
    dst = torch.zeros(len(big) + 3, dtype=torch.uint8, device="cuda")
    ring = c.ring(staging_bytes=4 * MIB)  # four 1 MiB slots for 21 MiB
    half = len(big) // 2 + 1
    ring.submit([("objs", "big.bin", 0, half, dst, 3, "a"), ("objs", "big.bin", half, len(big) - half, dst, 3 + half, "b")])
    done = {}
    while ring.pending:
        for u, r in ring.wait(min=1):
            done[u] = r
    assert done == {"a": half, "b": len(big) - half}
    assert dst[3:].cpu().numpy().tobytes() == big
    # A missing object among good reads: its error, the others complete.
    small = torch.zeros(11, dtype=torch.uint8, device="cuda")
    with pytest.raises(ObjectNotFoundError, match="s3://objs/missing"):
        c.read([("objs", "dir/small.txt", 0, 11, small, 0), ("objs", "missing", 0, 5, dst, 0)])
    assert small.cpu().numpy().tobytes() == b"hello, tarn"
    # A float tensor filled at a byte offset that is not a multiple of 4.
    f = torch.zeros(1000, dtype=torch.float32, device="cuda")
    c.read([("objs", "big.bin", 10, 3998, f, 2)])
    assert f.view(torch.uint8)[2:4000].cpu().numpy().tobytes() == big[10:4008]

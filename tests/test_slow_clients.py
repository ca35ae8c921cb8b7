"""A few slow clients cannot stop the service (issue 12, item 2).

Before: ~100 PUTs whose bodies stalled after 128 KiB, or ~250 GETs of a
20 MiB object whose bodies were never read, held the buffer pool: every large
PUT then got 503, GETs answered 200 with truncated bodies, and RSS grew to
1.5 GB and stayed. Now a request holds pool buffers only while it works on a
stripe (never while it waits for its client), a body that sends nothing for
the idle timeout fails with 400 RequestTimeout, a response the client does
not read for the send timeout is reset, freed memory goes back to the
kernel, and an answer sent before the body was read closes the connection
cleanly (Connection: close, the rest of the body drained) instead of with a
reset the client could lose the answer to.
"""

import os
import socket
import time

import pytest

from sigv4 import raw_head, sign

MiB = 1 << 20
IDLE = 4  # seconds, both timeouts, set in the configuration below

CONFIG = f"""
buffers_per_core = 32
request_body_idle_timeout_secs = {IDLE}
response_send_idle_timeout_secs = {IDLE}
"""


@pytest.fixture
def slow_server(make_server, tmp_path):
    cfg = tmp_path / "slow.toml"
    cfg.write_text(CONFIG)
    s = make_server(drives=4, extra_args=["--config", str(cfg)], name="slow")
    return s


def rss_mib(server):
    for line in open(f"/proc/{server.proc.pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) // 1024
    raise AssertionError("no VmRSS")


def host_port(server):
    host, port = server.endpoint.replace("http://", "").split(":")
    return host, int(port)


def connect(server, rcvbuf=None):
    s = socket.socket()
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.connect(host_port(server))
    return s


def read_response(s, timeout):
    """Reads until the server closes; returns (bytes, how it ended)."""
    s.settimeout(timeout)
    data = b""
    try:
        while True:
            b = s.recv(1 << 16)
            if not b:
                return data, "eof"
            data += b
    except ConnectionResetError:
        return data, "reset"
    except socket.timeout:
        return data, "timeout"


def test_stalled_uploads_do_not_starve_other_clients(slow_server):
    s3 = slow_server.client()
    s3.create_bucket(Bucket="slow")
    body = os.urandom(8 * MiB)
    before = rss_mib(slow_server)
    # 100 PUTs of 8 MiB that stop after 256 KiB (past the inline threshold,
    # so each has started its data write).
    stalled = []
    for i in range(100):
        c = connect(slow_server)
        c.sendall(raw_head(slow_server.endpoint, "PUT", f"/slow/stalled-{i}", headers={"content-length": str(len(body))}))
        c.sendall(body[: 256 << 10])
        stalled.append(c)
    time.sleep(1)
    # Another client is served normally meanwhile: big PUTs and GETs.
    for i in range(3):
        s3.put_object(Bucket="slow", Key=f"normal-{i}", Body=body)
        assert s3.get_object(Bucket="slow", Key=f"normal-{i}")["Body"].read() == body
    # What they sent (256 KiB each) and nothing more: ~45 MiB.
    assert rss_mib(slow_server) - before < 150, (before, rss_mib(slow_server))
    # Past the idle timeout every stalled upload gets 400 RequestTimeout and
    # a clean close; nothing of theirs is stored.
    for c in stalled:
        data, how = read_response(c, IDLE + 10)
        assert data.startswith(b"HTTP/1.1 400"), data[:200]
        assert b"<Code>RequestTimeout</Code>" in data
        assert b"connection: close" in data.lower()
        assert how in ("eof", "reset"), how
        c.close()
    names = [o["Key"] for o in s3.list_objects_v2(Bucket="slow")["Contents"]]
    assert names == ["normal-0", "normal-1", "normal-2"]


def test_unread_downloads_do_not_starve_other_clients_and_are_reset(slow_server):
    s3 = slow_server.client()
    s3.create_bucket(Bucket="slow")
    body = os.urandom(20 * MiB)
    s3.put_object(Bucket="slow", Key="big", Body=body)
    before = rss_mib(slow_server)
    # 250 GETs whose bodies are never read (small receive buffers, so that
    # the data waits on the server's side).
    stalled = []
    head = raw_head(slow_server.endpoint, "GET", "/slow/big")
    for _ in range(250):
        c = connect(slow_server, rcvbuf=64 << 10)
        c.sendall(head)
        stalled.append(c)
    time.sleep(1.5)
    held = rss_mib(slow_server) - before
    # Another client is served normally meanwhile.
    for i in range(3):
        assert s3.get_object(Bucket="slow", Key="big")["Body"].read() == body
        s3.put_object(Bucket="slow", Key=f"normal-{i}", Body=body[: 8 * MiB])
    # Each unread GET holds what is queued for it (two stripes, 2 MiB: the
    # read-ahead that keeps large GETs fast) and the piece being written
    # (256 KiB), not pool buffers: ~570 MiB for 250 (1.5 GB before).
    assert held < 750, (before, held)
    # Past the send timeout each is cut off with a reset: a client can never
    # mistake the truncated body for a whole one.
    time.sleep(IDLE + 2)
    for c in stalled:
        data, how = read_response(c, 10)
        assert data.startswith(b"HTTP/1.1 200") or how == "reset", data[:100]
        assert how == "reset", (how, len(data))
        assert len(data) < len(body)
        c.close()
    # With the clients gone the memory goes back to the kernel.
    deadline = time.time() + 20
    while rss_mib(slow_server) - before > 100 and time.time() < deadline:
        time.sleep(1)
    assert rss_mib(slow_server) - before <= 100, (before, rss_mib(slow_server))


def test_early_refusals_close_cleanly(slow_server):
    s3 = slow_server.client()
    s3.create_bucket(Bucket="slow")
    body = os.urandom(2 * MiB)
    # A wrong signature is refused before the body is read: the answer must
    # reach the client whole (Connection: close, the body drained), where
    # it used to be lost in a reset.
    hs, target = sign(slow_server.endpoint, "PUT", "/slow/k", headers={"content-length": str(len(body))})
    hs["Authorization"] = hs["Authorization"][:-4] + "0000"
    c = connect(slow_server)
    c.sendall(("\r\n".join([f"PUT {target} HTTP/1.1"] + [f"{k}: {v}" for k, v in hs.items()]) + "\r\n\r\n").encode())
    c.sendall(body)
    data, how = read_response(c, 10)
    assert data.startswith(b"HTTP/1.1 403"), data[:200]
    assert b"SignatureDoesNotMatch" in data
    assert b"connection: close" in data.lower()
    assert how == "eof", how
    c.close()
    # The server is fine and the key was not written.
    assert "Contents" not in s3.list_objects_v2(Bucket="slow")


def test_a_flood_of_idle_connections_takes_no_drive_out(tmp_path):
    """Issue 40, item 4: 1,100 idle unauthenticated connections against a
    soft limit of 1,024 open files left the drives no descriptor: every
    drive was marked faulty ("Too many open files"), GETs answered 500 and
    PUTs 503. Here the server starts under a soft limit of 256 (hard 640,
    which it raises to) and one client address opens 700 idle connections:
    the server caps them (16 per client address by default at that limit),
    counts the refusals, keeps every drive online, and serves another
    client."""
    import resource

    import requests

    from tarnproc import SECRET_KEY, Server, metric

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2048:
        pytest.skip("the test process needs 2048 open files")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2048), hard))
    root = tmp_path / "srv"
    root.mkdir()
    s = Server(str(root), drives=4, nofile=(256, 640))
    idle = []
    try:
        host, port = s.endpoint.removeprefix("http://").rsplit(":", 1)
        for _ in range(700):
            c = socket.socket()
            c.bind(("127.0.0.2", 0))  # another client address than boto3's
            try:
                c.connect((host, int(port)))
            except OSError:
                c.close()
                continue
            idle.append(c)
        time.sleep(1)
        cl = s.client()
        cl.create_bucket(Bucket="flood")
        for i in range(8):
            cl.put_object(Bucket="flood", Key=f"k{i}", Body=os.urandom(300_000))
            assert len(cl.get_object(Bucket="flood", Key=f"k{i}")["Body"].read()) == 300_000
        d = requests.get(f"{s.admin}/admin/drives", headers={"Authorization": f"Bearer {SECRET_KEY}"}).json()
        assert all(x["online"] and x["state"] == "online" for x in d), d
        assert metric(s, "tarn_connections_refused_total") > 500
        assert metric(s, "tarn_connections_max") > 0
        assert metric(s, "tarn_fd_exhaustion_total") == 0
    finally:
        for c in idle:
            c.close()
        s.stop()
    assert not s.unexpected_errors()


SHARE_CONFIG = """
inflight_requests_max = 64
request_body_min_rate_bytes = 1024
response_min_rate_bytes = 65536
min_rate_window_secs = 3
"""


def test_one_user_cannot_deny_service_to_another(make_server, tmp_path):
    # Issue 40, item 5. Before: user bob held 1,100 PUTs sending one byte
    # every 10 s (inside the idle timeout) and every PUT of user alice got
    # 503 while he did. Now each access key has a share of the in-flight
    # slots (a quarter here: 16 of 64), and a body slower than the minimum
    # rate over a window fails with 400 RequestTimeout.
    import threading

    import boto3
    import botocore.config
    import botocore.exceptions

    from tarnproc import add_user

    cfg = tmp_path / "share.toml"
    cfg.write_text(SHARE_CONFIG)
    server = make_server(drives=4, extra_args=["--config", str(cfg)], name="share")
    bob, alice = add_user(server, "bob"), add_user(server, "alice")

    def client(key):
        return boto3.client("s3", endpoint_url=server.endpoint, aws_access_key_id=key["access_key"],
                            aws_secret_access_key=key["secret_key"], region_name="us-east-1",
                            config=botocore.config.Config(retries={"max_attempts": 1}))  # fmt: skip

    client(bob).create_bucket(Bucket="bobs")
    client(alice).create_bucket(Bucket="alices")
    held, refused = [], 0
    for i in range(64):
        c = connect(server)
        c.sendall(raw_head(server.endpoint, "PUT", f"/bobs/slow-{i}", headers={"content-length": "1000000"},
                           access_key=bob["access_key"], secret_key=bob["secret_key"]))  # fmt: skip
        c.sendall(b"x")
        c.settimeout(0.3)
        try:
            answer = c.recv(4096)
            assert answer.startswith(b"HTTP/1.1 503") and b"SlowDown" in answer, answer[:200]
            refused += 1
            c.close()
        except socket.timeout:
            held.append(c)
    assert len(held) == 16 and refused == 48, (len(held), refused)
    stop = threading.Event()

    def trickle():
        while not stop.is_set():
            for c in held:
                try:
                    c.sendall(b"x")
                except OSError:
                    pass
            stop.wait(1)

    t = threading.Thread(target=trickle, daemon=True)
    t.start()
    try:
        a = client(alice)
        for i in range(10):
            a.put_object(Bucket="alices", Key=f"k{i}", Body=os.urandom(300_000))
        assert len(a.list_objects_v2(Bucket="alices")["Contents"]) == 10
        # Past a window at one byte a second, bob's bodies are cut off.
        for c in held:
            data, how = read_response(c, 15)
            assert data.startswith(b"HTTP/1.1 400") and b"RequestTimeout" in data, (data[:300], how)
    finally:
        stop.set()
        t.join()
        for c in held:
            c.close()
    # Nothing of bob's slow bodies is stored, and his next requests work.
    assert "Contents" not in client(bob).list_objects_v2(Bucket="bobs")
    client(bob).put_object(Bucket="bobs", Key="fast", Body=b"ok")


def test_a_response_read_slower_than_the_minimum_is_reset(make_server, tmp_path):
    # Issue 40, item 5: a client reading a byte now and then (inside the send
    # idle timeout) held its response, and what it buffers, for as long as
    # it liked. Under the minimum rate over a window, it is reset.
    cfg = tmp_path / "rate.toml"
    cfg.write_text(SHARE_CONFIG)
    server = make_server(drives=4, extra_args=["--config", str(cfg)], name="rate")
    s3 = server.client()
    s3.create_bucket(Bucket="rate")
    s3.put_object(Bucket="rate", Key="big", Body=os.urandom(32 * MiB))
    c = connect(server, rcvbuf=4096)
    c.sendall(raw_head(server.endpoint, "GET", "/rate/big"))
    c.settimeout(1)
    got, how, start = 0, "open", time.time()
    try:
        while time.time() - start < 30:
            b = c.recv(1024)
            if not b:
                how = "eof"
                break
            got += len(b)
            time.sleep(0.2)
    except ConnectionResetError:
        how = "reset"
    assert how == "reset", (how, got)
    assert time.time() - start < 15
    # A client that reads at speed is served whole meanwhile and after.
    assert len(s3.get_object(Bucket="rate", Key="big")["Body"].read()) == 32 * MiB


def test_memory_of_slow_clients_is_bounded_and_given_back(make_server, tmp_path):
    # Issue 40, item 7. Before: 300 unread GETs and 300 silent PUT bodies
    # took RSS from 30 MB to 1.1 GB, still 410-500 MB 30 s after they left
    # (the stripe buffers of the burst stayed in the pool for good). Now GET
    # read-ahead has a budget in all and per access key
    # (response_buffer_max_bytes, response_buffer_per_key_max_bytes), and
    # buffers a burst took go back once idle.
    import boto3
    import botocore.config

    from tarnproc import add_user

    cfg = tmp_path / "mem.toml"
    cfg.write_text("inflight_requests_max = 4096\nresponse_buffer_max_bytes = 67108864\n")
    server = make_server(drives=4, extra_args=["--config", str(cfg)], name="mem")
    s3 = server.client()
    s3.create_bucket(Bucket="mem")
    s3.put_object(Bucket="mem", Key="big", Body=os.urandom(16 * MiB))
    assert len(s3.get_object(Bucket="mem", Key="big")["Body"].read()) == 16 * MiB
    alice = add_user(server, "alice")
    other = boto3.client("s3", endpoint_url=server.endpoint, aws_access_key_id=alice["access_key"],
                         aws_secret_access_key=alice["secret_key"], region_name="us-east-1",
                         config=botocore.config.Config(retries={"max_attempts": 1}, read_timeout=10))  # fmt: skip
    other.create_bucket(Bucket="alices")
    other.put_object(Bucket="alices", Key="big", Body=os.urandom(8 * MiB))
    time.sleep(6)
    idle = rss_mib(server)
    clients = []
    try:
        for i in range(300):
            c = connect(server, rcvbuf=4096)
            c.sendall(raw_head(server.endpoint, "GET", "/mem/big"))
            clients.append(c)
            p = connect(server)
            p.sendall(raw_head(server.endpoint, "PUT", f"/mem/silent-{i}", headers={"content-length": str(8 * MiB)}))
            p.sendall(os.urandom(64 << 10))
            clients.append(p)
        time.sleep(4)
        peak = rss_mib(server)
        # The budget (64 MiB), what the PUTs sent (19 MiB), and per
        # connection buffers: far from 1.1 GB.
        assert peak - idle < 400, (idle, peak)
        # Another user is served meanwhile: the slow clients' key holds
        # half of the read-ahead budget at most.
        for i in range(3):
            assert len(other.get_object(Bucket="alices", Key="big")["Body"].read()) == 8 * MiB
        other.put_object(Bucket="alices", Key="small", Body=b"x" * 300_000)
    finally:
        for c in clients:
            c.close()
    # Once they are gone, memory goes back: within a minute, at most twice
    # the idle RSS (the bound). Before, under a busy host (the full
    # suite) the burst's buffers, freed into glibc's per-thread arenas,
    # stayed resident for good: 2.1-2.4x. Pool buffers and GET pieces now
    # live in mappings of their own, unmapped when trimmed: ~1.1x.
    deadline = time.time() + 60
    while rss_mib(server) > 2 * idle:
        assert time.time() < deadline, (idle, peak, rss_mib(server))
        time.sleep(1)

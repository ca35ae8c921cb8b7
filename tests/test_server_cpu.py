"""Fewer server cycles per byte for remote readers (issue 44), the parts
beyond sending from the files (test_get_sendfile.py):

* a GET whose blocks of this node's shard files are not in the page cache
  reads them in in large folios first (`tarn_io::pagecache`), and the bytes
  are right whatever the size, range, geometry and state of the cache, a
  block corrupted on the drive included; `--no-large-folios` leaves them to
  the kernel's readahead;
* connections from clients on this host leave a pacing congestion control
  (BBR) for one that does not pace, unless `--pace-local-clients`;
* `tarn bench s3 --server-pid` reports the server's CPU per GB.
"""

import glob
import json
import os
import random
import re
import subprocess

import pytest

from conftest import data
from tarnproc import ACCESS_KEY, BIN, SECRET_KEY, metric
from test_get_sendfile import bucket_of_sizes, check_gets, data_shard_files, flip_in_shard_0


def shard_files(s):
    return [p for p in glob.glob(os.path.join(s.root, "d*", "data", "*", "*")) if os.path.isfile(p)]


def on_tmpfs(path):
    """tmpfs keeps its pages whatever the advice: nothing to evict there."""
    return subprocess.run(["stat", "-f", "-c", "%T", path], capture_output=True, text=True).stdout.strip() == "tmpfs"


def evict(paths):
    """Drops the files' pages from the page cache (clean pages go at once)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


@pytest.mark.parametrize("drives", [1, 4, 6])
def test_cold_gets_fill_the_page_cache_and_read_right(make_server, drives):
    s = make_server(drives=drives)
    if on_tmpfs(s.root):
        pytest.skip("the drives are on tmpfs: the page cache cannot be dropped under the server")
    c, objs = bucket_of_sizes(s, f"cold-{drives}")
    rng = random.Random(drives)
    # Cold: shard data is written with O_DIRECT (where it can be), and
    # what is in the page cache is dropped.
    evict(shard_files(s))
    before = metric(s, "tarn_get_large_folio_fill_bytes_total")
    check_gets(c, "bkt", objs, rng)
    filled = metric(s, "tarn_get_large_folio_fill_bytes_total") - before
    # At least the first window of most objects (the kernel's own readahead
    # of a long sequential read may bring in later windows itself).
    assert filled >= 4 << 20, filled
    # In the cache now: reading it all again fills nothing.
    warm = metric(s, "tarn_get_large_folio_fill_bytes_total")
    check_gets(c, "bkt", objs, rng)
    assert metric(s, "tarn_get_large_folio_fill_bytes_total") == warm
    # Evicted under the server: filled again, bytes still right.
    evict(shard_files(s))
    check_gets(c, "bkt", objs, rng)
    assert metric(s, "tarn_get_large_folio_fill_bytes_total") > warm
    assert metric(s, "tarn_get_large_folio_fill_failures_total") == 0


def test_a_cold_corrupt_block_is_rebuilt(make_server):
    """A block corrupted on the drive and not in the page cache: the fill
    reads it in, the checksum catches it, parity rebuilds it."""
    s = make_server(drives=4, expected_errors=("failed its checksum", "corrupt", "reconstruct"))
    if on_tmpfs(s.root):
        pytest.skip("the drives are on tmpfs: the page cache cannot be dropped under the server")
    c = s.client()
    c.create_bucket(Bucket="bkt")
    body = data("cold-corrupt", 8 << 20)
    c.put_object(Bucket="bkt", Key="k", Body=body)
    files = data_shard_files(s, 2)
    flip_in_shard_0(files, (512 << 10) + 4321, 0x5A)
    evict(files)
    assert c.get_object(Bucket="bkt", Key="k")["Body"].read() == body
    assert metric(s, "tarn_get_large_folio_fill_bytes_total") > 0
    assert metric(s, "tarn_shards_reconstructed_total") >= 1
    evict(files)
    got = c.get_object(Bucket="bkt", Key="k", Range="bytes=400000-1700000")["Body"].read()
    assert got == body[400000:1700001]


def test_no_large_folios_leaves_the_cache_to_readahead(make_server):
    s = make_server(drives=4, extra_args=["--no-large-folios"])
    c, objs = bucket_of_sizes(s, "nofill")
    check_gets(c, "bkt", objs, random.Random(3))
    assert metric(s, "tarn_get_large_folio_fill_bytes_total") == 0


def default_congestion_control():
    with open("/proc/sys/net/ipv4/tcp_congestion_control") as f:
        return f.read().strip()


def server_side_cc(s, client_port):
    """The congestion control of the server's end of the connection whose
    client end has `client_port` (`ss -ti`)."""
    out = subprocess.run(
        ["ss", "-tinH", "state", "established", f"( dport = :{client_port} )"],
        capture_output=True, text=True, check=True,
    ).stdout
    names = re.findall(r"\b(bbr\d*|cubic|reno)\b", out)
    assert names, out
    return names[0]


@pytest.mark.parametrize("pace", [False, True])
def test_local_clients_are_not_paced(make_server, pace):
    if default_congestion_control() != "bbr":
        pytest.skip("the host's congestion control does not pace (not bbr): nothing to switch")
    import socket

    s = make_server(drives=1, extra_args=["--pace-local-clients"] if pace else [])
    host, port = s.endpoint.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)))
    try:
        sock.sendall(f"GET / HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        sock.recv(4096)
        cc = server_side_cc(s, sock.getsockname()[1])
    finally:
        sock.close()
    if pace:
        assert cc == "bbr"
        assert metric(s, "tarn_s3_connections_unpaced_total") == 0
    else:
        assert cc in ("cubic", "reno"), cc
        assert metric(s, "tarn_s3_connections_unpaced_total") >= 1
    # Whatever the congestion control, a large GET is whole.
    c = s.client()
    c.create_bucket(Bucket="bkt")
    body = data(f"paced-{pace}", 9 << 20)
    c.put_object(Bucket="bkt", Key="k", Body=body)
    assert c.get_object(Bucket="bkt", Key="k")["Body"].read() == body


def test_tarn_bench_reports_the_servers_cpu(make_server):
    s = make_server(drives=4)
    env = dict(os.environ, AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY)
    args = [BIN, "bench", "s3", "--endpoint", s.endpoint, "--op", "get", "--size", "4MiB",
            "--concurrency", "4", "--count", "40", "--objects", "4", "--verify", "--json"]
    r = subprocess.run(args + ["--server-pid", str(s.proc.pid)], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr + r.stdout
    got = json.loads(r.stdout)
    assert got["ops"] == 40 and got["verify_failures"] == 0
    # 160 MiB went out: the server used some CPU for it, and so did the bench.
    assert got["server_cpu_s_per_gb"] > 0 and got["client_cpu_s_per_gb"] > 0, got
    r = subprocess.run(args, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0 and json.loads(r.stdout)["server_cpu_s_per_gb"] is None
    # A process that is not there, and more pids than endpoints, are refused.
    for bad in (["--server-pid", "999999999"], ["--server-pid", str(s.proc.pid)] * 2):
        r = subprocess.run(args + bad, capture_output=True, text=True, env=env, timeout=60)
        assert r.returncode != 0 and "--server-pid" in r.stderr, r.stderr

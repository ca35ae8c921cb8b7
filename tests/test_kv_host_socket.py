"""The KV store's shared-memory socket as a file (`--kv-shm-dir`): what a
Kubernetes node's pods share through a host path. A client in another
network namespace (a pod of its own, reaching the server's KV port over a
veth link, as pods reach each other) cannot reach the default abstract
socket and uses TCP; with the socket in a directory both see, it uses
shared memory. The file is the server's alone to remove: it goes at
shutdown, and one a dead server left is cleared at the next start."""

import os
import pathlib
import shutil
import socket
import stat
import subprocess
import sys
import tempfile

import pytest

from clusterproc import Link
from tarnproc import Server

CLIENT = r"""
import sys
import numpy as np
import tarn.kv as kv

c = kv.Client(sys.argv[1], namespace="pods")
src = [np.full(64 << 10, 7, dtype=np.uint8)]
assert c.put_from([kv.key("weights", 1)], src) == [0]
dst = [np.zeros(64 << 10, dtype=np.uint8)]
assert c.get_into([kv.key("weights", 1)], dst) == [64 << 10] and (dst[0] == 7).all()
print(c.transport)
"""


@pytest.fixture
def link():
    link = Link.create()
    if link is None:
        pytest.skip("needs root, `ip` and network namespaces (veth links)")
    yield link
    link.remove()


# Beyond loopback the server refuses its built-in credentials.
CREDS = {"TARN_ACCESS_KEY": "kvpods", "TARN_SECRET_KEY": "kvpods-secret-for-tests-0123"}


def transport_from_the_namespace(link, endpoint):
    r = subprocess.run(["ip", "netns", "exec", link.ns, sys.executable, "-c", CLIENT, endpoint],
                       capture_output=True, text=True, timeout=60, env=dict(os.environ, **CREDS))
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def kv_sockets(d):
    return sorted(n for n in os.listdir(d) if n.startswith("tarn-kv.") and n.endswith(".sock"))


def test_a_pod_on_the_same_node_uses_shared_memory_through_the_host_socket_dir(tmp_path, link, request):
    host = link.host_ip(1)
    # A short path, as a host's /run/tarn-kv is: a Unix socket's path holds
    # 107 bytes, which pytest's tmp_path may already take.
    shared = pathlib.Path(tempfile.mkdtemp(prefix="tkv-", dir="/tmp"))
    request.addfinalizer(lambda: shutil.rmtree(shared, ignore_errors=True))
    os.chmod(shared, 0o1777)
    # A socket file a dead server left behind: nothing accepts on it.
    stale = shared / "tarn-kv.1.9400.00000000deadbeef.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(stale))
    s.close()
    # Another program's file in the directory is none of Tarn's business.
    (shared / "other.sock").write_text("")

    root = tmp_path / "with"
    root.mkdir()
    server = Server(str(root), drives=1, env=CREDS, extra_args=[
        "--kv", "--kv-memory", "64MiB", "--kv-listen", f"{host}:0", "--kv-shm-dir", str(shared), "--allow-plain-http"])
    try:
        (sock,) = kv_sockets(shared)
        assert not stale.exists() and (shared / "other.sock").exists()
        mode = os.stat(shared / sock).st_mode
        assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o666
        assert transport_from_the_namespace(link, server.kv_endpoint) == "shm"
    finally:
        server.stop()
    assert not server.unexpected_errors()
    assert kv_sockets(shared) == [], "removed at shutdown"

    # The default (an abstract socket, in the server's network namespace
    # only): the same client works over TCP.
    root = tmp_path / "without"
    root.mkdir()
    server = Server(str(root), drives=1, env=CREDS, extra_args=[
        "--kv", "--kv-memory", "64MiB", "--kv-listen", f"{host}:0", "--allow-plain-http"])
    try:
        assert transport_from_the_namespace(link, server.kv_endpoint) == "tcp"
    finally:
        server.stop()
    assert not server.unexpected_errors()


def test_a_socket_dir_that_cannot_be_used_is_refused_at_start(tmp_path):
    root = tmp_path / "srv"
    root.mkdir()
    long = tmp_path / ("d" * 100)
    long.mkdir()
    for extra, words in [
        (["--kv-shm-dir", str(tmp_path / "missing")], "the KV shared-memory directory"),
        (["--kv-shm-dir", str(long)], "too long a path for a Unix socket"),
    ]:
        with pytest.raises(RuntimeError) as e:
            Server(str(root), drives=1, extra_args=["--kv", "--kv-memory", "64MiB", *extra])
        assert words in str(e.value), e.value

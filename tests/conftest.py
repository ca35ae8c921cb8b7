"""Fixtures that run the real `tarn` binary on loopback and drive it with real
clients. Every server is started on ephemeral ports and stopped by its PID.
A test fails if the server log holds an ERROR line it did not expect."""

import hashlib
import os

import pytest

from tarnproc import ACCESS_KEY, BIN, SECRET_KEY, Server  # noqa: F401


@pytest.fixture
def make_server(tmp_path):
    servers = []

    def make(drives=4, extra_args=(), env=None, expected_errors=(), name="srv", ca=None):
        root = tmp_path / f"{name}{len(servers)}"
        root.mkdir()
        s = Server(str(root), drives=drives, extra_args=extra_args, env=env, expected_errors=expected_errors, ca=ca)
        servers.append(s)
        return s

    yield make
    problems = []
    for s in servers:
        try:
            s.stop()
        except AssertionError as e:
            problems.append(str(e))
        problems += s.unexpected_errors()
    assert not problems, "server problems:\n" + "\n".join(problems)


@pytest.fixture
def formed_cluster(tmp_path):
    """etcd and four nodes (two drives each) formed into 2+2 sets: (etcd,
    nodes); the test may append nodes it starts, all are stopped after."""
    from clusterproc import form, stop_all
    etcd, nodes = form(str(tmp_path))
    try:
        yield etcd, nodes
    finally:
        stop_all(etcd, nodes)


@pytest.fixture
def server(make_server):
    return make_server()


@pytest.fixture
def s3(server):
    return server.client()


def data(seed, n):
    """Deterministic pseudo-random bytes."""
    out = bytearray()
    block = hashlib.sha256(str(seed).encode()).digest()
    while len(out) < n:
        block = hashlib.sha256(block).digest()
        out += block * 32
    return bytes(out[:n])


def footer_shard_index(path):
    """The shard index a shard file's footer names."""
    with open(path, "rb") as f:
        f.seek(-32, os.SEEK_END)
        footer = f.read(32)
    assert footer[:4] == b"TRNS"
    return footer[6]


def md5hex(b):
    return hashlib.md5(b).hexdigest()

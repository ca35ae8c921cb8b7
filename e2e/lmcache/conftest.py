"""Fixtures for the LMCache plugin tests: a Tarn server with the KV store
(RAM and an NVMe tier, so a clean restart keeps it) on a loopback ephemeral
port, stopped by PID."""

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests"))

from tarnproc import Server  # noqa: E402

KV_ARGS = ["--kv", "--kv-listen", "127.0.0.1:0", "--kv-memory", "256MiB", "--kv-disk-size", "512MiB"]


@pytest.fixture
def tarn_server(tmp_path):
    root = tmp_path / "tarn"
    root.mkdir()
    disk = tmp_path / "kv-nvme"
    disk.mkdir()
    s = Server(str(root), drives=1, extra_args=KV_ARGS + ["--kv-disk", str(disk)])
    yield s
    s.stop()
    assert not s.unexpected_errors()

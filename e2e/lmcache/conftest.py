"""Fixtures for the LMCache plugin tests: a Tarn server with the KV store
(RAM and an NVMe tier, so a clean restart keeps it) on a loopback ephemeral
port, stopped by PID."""

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests"))

from tarnproc import kv_server  # noqa: E402

KV_ARGS = ["--kv", "--kv-listen", "127.0.0.1:0", "--kv-memory", "256MiB", "--kv-disk-size", "512MiB"]


@pytest.fixture
def tarn_server(tmp_path):
    disk = tmp_path / "kv-nvme"
    disk.mkdir()
    yield from kv_server(tmp_path, KV_ARGS + ["--kv-disk", str(disk)])

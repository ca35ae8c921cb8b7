"""Fixtures for the SGLang HiCache backend tests: a Tarn server with the KV
store on a loopback ephemeral port, stopped by PID, and SGLang host pools
(CPU) of the kinds SGLang builds."""

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests"))

from tarnproc import kv_server  # noqa: E402

KV_ARGS = ["--kv", "--kv-listen", "127.0.0.1:0", "--kv-memory", "256MiB"]


@pytest.fixture
def tarn_server(tmp_path):
    yield from kv_server(tmp_path, KV_ARGS)

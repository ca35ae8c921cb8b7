"""Measures the Python client against a running `tarn server --kv`:

    python -m tarn.bench --endpoint 127.0.0.1:9400 --block-size 256KiB --batch 32

Puts a working set once, then times batched get_into (GB/s), put_from of
fresh keys and single-key exists round trips, from Python, with numpy
buffers. Compare with `tarn bench kv` (the Rust client) on the same server
to see what the Python layer costs.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from . import kv


def size(s: str) -> int:
    units = {"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "B": 1}
    u = s.upper()
    for suffix, mult in units.items():
        if u.endswith(suffix):
            return int(float(u[: -len(suffix)]) * mult)
    return int(s)


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m tarn.bench")
    ap.add_argument("--endpoint", default=kv.DEFAULT_ENDPOINT)
    ap.add_argument("--transport", default="auto", choices=["auto", "shm", "tcp"])
    ap.add_argument("--block-size", default="256KiB", type=size)
    ap.add_argument("--batch", default=32, type=int)
    ap.add_argument("--seconds", default=3.0, type=float)
    a = ap.parse_args()
    if a.block_size <= 0 or a.batch <= 0 or a.seconds <= 0:
        ap.error("--block-size, --batch and --seconds must be positive")

    c = kv.Client(a.endpoint, namespace=f"pybench-{os.getpid()}", transport=a.transport)
    keys = [kv.key("pybench", i) for i in range(a.batch)]
    src = [np.random.default_rng(i).integers(0, 256, a.block_size, dtype=np.uint8) for i in range(a.batch)]
    if not all(s.stored for s in c.put_from(keys, src)):
        raise SystemExit("the server did not store the working set (too small --kv-memory?)")
    dst = [np.empty(a.block_size, np.uint8) for _ in keys]
    print(f"transport {c.transport}, {a.batch} × {a.block_size} B blocks per call")

    def run(name, fn, nbytes):
        n, t0 = 0, time.perf_counter()
        while (dt := time.perf_counter() - t0) < a.seconds:
            fn()
            n += 1
        rate = f", {n * nbytes / dt / 1e9:.2f} GB/s" if nbytes else ""
        print(f"{name:>10}: {n / dt:9.0f} calls/s, {dt / n * 1e6:8.1f} µs per call{rate}")

    def get():
        got = c.get_into(keys, dst)
        assert got[0] == a.block_size

    fresh = [0]

    def put():
        fresh[0] += 1
        c.put_from([kv.key("pybench-put", fresh[0], i) for i in range(a.batch)], src)

    run("get_into", get, a.batch * a.block_size)
    run("put_from", put, a.batch * a.block_size)
    run("exists(1)", lambda: c.exists(keys[:1]), 0)
    assert all(np.array_equal(s, d) for s, d in zip(src, dst)), "read back different bytes"
    c.delete(keys)
    c.close()


if __name__ == "__main__":
    main()

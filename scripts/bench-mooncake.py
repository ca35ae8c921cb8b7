#!/usr/bin/env python3
"""Mooncake Store's put/get throughput with its segment in this process, the
shape `scripts/bench-kv-fresh` compares Tarn's shared memory with: batches of
32 blocks through registered buffers, N threads, one store.

    mooncake_master --enable_http_metadata_server=true &
    python scripts/bench-mooncake.py --block-size 2097152 --concurrency 4 --op put

Needs `pip install mooncake-transfer-engine-non-cuda numpy` (and libibverbs1,
librdmacm1, libnuma1 from Debian). Prints one JSON object.
"""

import argparse
import json
import os
import threading
import time

import numpy as np
from mooncake.store import MooncakeDistributedStore

p = argparse.ArgumentParser()
p.add_argument("--block-size", type=int, default=256 << 10)
p.add_argument("--batch", type=int, default=32)
p.add_argument("--concurrency", type=int, default=1)
p.add_argument("--op", choices=["put", "get"], default="put")
p.add_argument("--seconds", type=float, default=3.0)
p.add_argument("--segment", type=int, default=1 << 30)
p.add_argument("--master", default="127.0.0.1:50051")
p.add_argument("--metadata", default="http://127.0.0.1:8080/metadata")
a = p.parse_args()

store = MooncakeDistributedStore()
buf_bytes = a.batch * a.block_size
rc = store.setup("127.0.0.1", a.metadata, a.segment, buf_bytes * a.concurrency + (64 << 20), "tcp", "", a.master)
assert rc == 0, f"setup: {rc}"
run = os.urandom(4).hex()
bufs = []
for t in range(a.concurrency):
    b = np.full(buf_bytes, t + 1, dtype=np.uint8)
    assert store.register_buffer(b.ctypes.data, b.nbytes) == 0
    bufs.append(b)
# Warm-up: touch the whole segment once (it is this process's fresh memory,
# and a first touch is a page fault per 4 KiB), then empty it.
warm = 0
while warm < a.segment * 0.9:
    keys = [f"{run}-w{warm}-{i}" for i in range(a.batch)]
    ptrs = [bufs[0].ctypes.data + i * a.block_size for i in range(a.batch)]
    store.batch_put_from(keys, ptrs, [a.block_size] * a.batch)
    warm += buf_bytes
store.remove_all()
# Blocks the gets read: one batch per thread, stored first.
for t in range(a.concurrency):
    keys = [f"{run}-g{t}-{i}" for i in range(a.batch)]
    ptrs = [bufs[t].ctypes.data + i * a.block_size for i in range(a.batch)]
    res = store.batch_put_from(keys, ptrs, [a.block_size] * a.batch)
    assert all(r == 0 for r in res), res

done = [0] * a.concurrency
failed = [0] * a.concurrency
lat = [[] for _ in range(a.concurrency)]
stop = time.perf_counter() + a.seconds


def worker(t):
    base = bufs[t].ctypes.data
    ptrs = [base + i * a.block_size for i in range(a.batch)]
    sizes = [a.block_size] * a.batch
    n = 0
    while time.perf_counter() < stop:
        t0 = time.perf_counter()
        if a.op == "put":
            # New keys every batch, removed after (untimed) so that the
            # segment never fills: only the puts are measured.
            keys = [f"{run}-p{t}-{n}-{i}" for i in range(a.batch)]
            res = store.batch_put_from(keys, ptrs, sizes)
            lat[t].append(time.perf_counter() - t0)
            failed[t] += sum(r != 0 for r in res)
            store.batch_remove(keys)
            n += 1
            continue
        else:
            keys = [f"{run}-g{t}-{i}" for i in range(a.batch)]
            res = store.batch_get_into(keys, ptrs, sizes)
            assert all(r == a.block_size for r in res), res
        lat[t].append(time.perf_counter() - t0)
        n += 1
    done[t] = n


start = time.perf_counter()
threads = [threading.Thread(target=worker, args=(t,)) for t in range(a.concurrency)]
for th in threads:
    th.start()
for th in threads:
    th.join()
secs = time.perf_counter() - start
all_lat = sorted(x for l in lat for x in l)
# Each thread's bytes over its time inside the timed calls, summed.
rate = sum(done[t] * a.batch * a.block_size / sum(lat[t]) for t in range(a.concurrency) if lat[t])
print(json.dumps({
    "store": "mooncake", "op": a.op, "block_bytes": a.block_size, "batch": a.batch,
    "concurrency": a.concurrency, "seconds": round(secs, 3),
    "gb_per_sec": round(rate / 1e9, 2),
    "batch_p50_ms": round(all_lat[len(all_lat) // 2] * 1e3, 3),
    "failed_puts": sum(failed),
}))
store.close()

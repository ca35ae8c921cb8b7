"""Times the vLLM connector's block mover (tarn.kv_blocks) against a running
`tarn server --kv`: a paged cache shaped like Llama-3.1-8B's in bf16 (32
layers, 8 KV heads, head size 128, block 16: 2 MiB per block value), loads
and saves of a batch of blocks, end to end (store ↔ staging ↔ paged cache).

    python bench_blocks.py --endpoint 127.0.0.1:9400 --blocks 32 --seconds 3
"""

import argparse
import time

import torch

import tarn.kv as kv
from tarn.kv_blocks import PagedBlocks, Store


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--endpoint", default="127.0.0.1:9400")
    ap.add_argument("--blocks", type=int, default=32)
    ap.add_argument("--cache-blocks", type=int, default=256)
    ap.add_argument("--seconds", type=float, default=3.0)
    a = ap.parse_args()
    torch.set_num_threads(1)
    layers = [(f"l{i}", torch.randn(a.cache_blocks, 2, 8, 16, 128).to(torch.bfloat16)) for i in range(32)]
    blocks = PagedBlocks(layers)
    store = Store(a.endpoint, ["bench-blocks"])
    keys = [kv.key("bench-blocks", i) for i in range(a.blocks)]
    ids = list(range(a.blocks))
    mib = a.blocks * blocks.value_bytes / (1 << 20)
    assert blocks.save(store, keys, blocks.gather(ids)) == a.blocks
    print(f"{a.blocks} blocks × {blocks.value_bytes >> 10} KiB = {mib:.0f} MiB per call, transport {store.clients()[0].transport}")

    def run(name, fn):
        n, t0 = 0, time.perf_counter()
        while (dt := time.perf_counter() - t0) < a.seconds:
            fn()
            n += 1
        print(f"{name:>22}: {dt / n * 1e3:7.1f} ms per call, {n * mib / 1024 / dt:5.2f} GiB/s")

    dst = list(range(a.cache_blocks - a.blocks, a.cache_blocks))
    run("load (get + scatter)", lambda: blocks.load(store, keys, dst))
    run("gather (copy out)", lambda: blocks.release(blocks.gather(ids)))
    buf = blocks.gather(ids)
    run("scatter (copy in)", lambda: blocks.scatter(buf, dst))
    fresh = [0]

    def save():
        fresh[0] += 1
        new = [kv.key("bench-blocks", fresh[0], i) for i in range(a.blocks)]
        blocks.save(store, new, blocks.gather(ids))

    run("save (gather + put)", save)
    store.clients()[0].delete(keys)


if __name__ == "__main__":
    main()

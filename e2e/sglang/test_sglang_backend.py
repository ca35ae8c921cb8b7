"""Tarn as SGLang's HiCache storage backend (`tarn.sglang.TarnHiCacheStorage`),
built by SGLang's own backend factory from the extra config a user passes,
moving pages of SGLang's own host pools (MHA and MLA, the layouts SGLang
offers) through a real Tarn KV server: round trips, leading hits, what
separates ranks, models and layouts, MLA's single writer, the older
whole-page calls, and a store that is down or holds bad values (misses,
never exceptions)."""

import logging
import socket

import pytest
import torch
from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo, MLABufferInfo
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

import tarn.kv
from tarn.sglang import TarnHiCacheStorage

LAYERS, TOKENS, PAGE = 3, 64, 4
LAYOUTS = ["layer_first", "page_first", "page_first_direct"]


def mha_pool(layout="page_first", dtype=torch.float32, heads=2, dim=8):
    """An MHA host pool as SGLang builds it from a device pool's buffers
    (here on CPU)."""
    k = tuple(torch.zeros(TOKENS, heads, dim, dtype=dtype) for _ in range(LAYERS))
    v = tuple(torch.zeros(TOKENS, heads, dim, dtype=dtype) for _ in range(LAYERS))
    ptrs = [torch.tensor([t.data_ptr() for t in x], dtype=torch.uint64) for x in (k, v)]
    info = MHABufferInfo(
        buffers=KVBuffers(k=k, v=v, k_data_ptrs=ptrs[0], v_data_ptrs=ptrs[1], layout=KVBufferLayout.NHD),
        page_size=PAGE, head_num=heads, head_dim=dim, v_head_dim=dim, dtype=dtype, device=torch.device("cpu"),
    )  # fmt: skip
    return MHATokenToKVPoolHost(
        info, 2.0, 0, PAGE, layout, pin_memory=False, device="cpu",
        device_capacity_tokens=TOKENS, start_layer=0, end_layer=LAYERS,
    )  # fmt: skip


def mla_pool(layout="page_first", lora=16, rope=8):
    bufs = tuple(torch.zeros(TOKENS, 1, lora + rope) for _ in range(LAYERS))
    info = MLABufferInfo(
        buffers=bufs, data_ptrs=torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64),
        layer_indices=tuple(range(LAYERS)), device_layer_num=LAYERS, page_size=PAGE, kv_lora_rank=lora,
        qk_rope_head_dim=rope, kv_cache_dim=lora + rope, dtype=torch.float32, device=torch.device("cpu"),
    )  # fmt: skip
    return MLATokenToKVPoolHost(
        info, 2.0, 0, PAGE, layout, pin_memory=False, device="cpu",
        device_capacity_tokens=TOKENS, start_layer=0, end_layer=LAYERS, target_layer_num=LAYERS,
    )  # fmt: skip


def config(endpoint, tp_rank=0, tp_size=1, mla=False, model="org/tiny-llama", metrics=False, **extra):
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=mla, enable_storage_metrics=metrics, is_page_first_layout=True, model_name=model,
        extra_config={
            "backend_name": "tarn", "module_path": "tarn.sglang", "class_name": "TarnHiCacheStorage",
            "interface_v1": 1, "endpoint": endpoint, "call_timeout_seconds": 5, **extra,
        },
    )  # fmt: skip


def attach(cfg, pool):
    """What SGLang's cache controller does: the factory builds the backend
    from the extra config, then the host pool is registered."""
    backend = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    assert isinstance(backend, TarnHiCacheStorage)
    backend.register_mem_pool_host(pool)
    backend.on_host_pools_registered()
    return backend


def page_hashes(n, seed=0):
    return [f"{seed:08x}{i:056x}" for i in range(n)]


def fill(pool, indices, seed):
    """Random bytes into the pages at `indices`; what each page holds."""
    g = torch.Generator().manual_seed(seed)
    pages = []
    for i in range(0, len(indices), PAGE):
        page = pool.get_data_page(int(indices[i]), flat=True)
        data = torch.randn(page.shape, generator=g).to(page.dtype)
        pool.set_from_flat_data_page(int(indices[i]), data)
        pages.append(data)
    return pages


def read(pool, indices):
    return [pool.get_data_page(int(indices[i]), flat=True).clone() for i in range(0, len(indices), PAGE)]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_factory_builds_tarn_and_pages_round_trip_through_host_pools(tarn_server, layout):
    ep = tarn_server.kv_endpoint
    writer_pool = mha_pool(layout)
    writer = attach(config(ep), writer_pool)
    keys = page_hashes(6)
    src = writer_pool.alloc(6 * PAGE)
    pages = fill(writer_pool, src, seed=1)
    assert writer.batch_exists(keys) == 0
    # Pages 0-3 stored: the leading hits stop at the first page missing.
    assert writer.batch_set_v1(keys[:4], src[: 4 * PAGE]) == [True] * 4
    assert writer.batch_exists(keys) == 4
    assert writer.batch_exists(keys[2:]) == 2
    assert writer.batch_set_v1(keys[4:], src[4 * PAGE :]) == [True, True]
    assert writer.batch_exists(keys) == 6
    # Another engine (another host pool, same model and layout) reads them
    # into pages at other indices.
    reader_pool = mha_pool(layout)
    reader = attach(config(ep), reader_pool)
    reader_pool.alloc(2 * PAGE)
    dst = reader_pool.alloc(6 * PAGE)
    assert reader.batch_get_v1(keys, dst) == [True] * 6
    for got, want in zip(read(reader_pool, dst), pages):
        assert torch.equal(got, want)
    # A page never stored is a miss; the pages around it still load.
    mixed = [keys[0], "f" * 64, keys[2]]
    assert reader.batch_get_v1(mixed, dst[: 3 * PAGE]) == [True, False, True]
    # Storing again is answered stored and writes nothing new.
    before = tarn.kv.Client(ep).stats()["blocks"]
    assert writer.batch_set_v1(keys, src) == [True] * 6
    assert tarn.kv.Client(ep).stats()["blocks"] == before


def test_ranks_models_dtypes_and_layouts_never_read_each_others_pages(tarn_server):
    ep = tarn_server.kv_endpoint
    pool = mha_pool()
    keys = page_hashes(3)
    idx = pool.alloc(3 * PAGE)
    fill(pool, idx, seed=2)
    b = attach(config(ep, tp_rank=0, tp_size=2), pool)
    assert b.batch_set_v1(keys, idx) == [True] * 3
    assert b.batch_exists(keys) == 3
    others = {
        "TP rank 1": (config(ep, tp_rank=1, tp_size=2), mha_pool()),
        "TP size 1": (config(ep), mha_pool()),
        "another model": (config(ep, tp_size=2, model="org/other"), mha_pool()),
        "bfloat16": (config(ep, tp_size=2), mha_pool(dtype=torch.bfloat16)),
        "layer_first": (config(ep, tp_size=2), mha_pool("layer_first")),
        "more heads": (config(ep, tp_size=2), mha_pool(heads=4)),
        "another namespace": (config(ep, tp_size=2, namespace="team-b"), mha_pool()),
    }
    for what, (cfg, p) in others.items():
        other = attach(cfg, p)
        assert other.namespace != b.namespace, what
        assert other.batch_exists(keys) == 0, what
        assert other.batch_get_v1(keys, p.alloc(3 * PAGE)) == [False] * 3, what


@pytest.mark.parametrize("layout", LAYOUTS)
def test_mla_pages_are_stored_once_by_the_writer_rank_and_read_by_every_rank(tarn_server, layout):
    ep = tarn_server.kv_endpoint
    keys = page_hashes(4, seed=3)
    ranks = []
    for r in range(2):
        p = mla_pool(layout)
        ranks.append((p, attach(config(ep, tp_rank=r, tp_size=2, mla=True), p)))
    (p0, b0), (p1, b1) = ranks
    assert b0.namespace == b1.namespace
    i1 = p1.alloc(4 * PAGE)
    fill(p1, i1, seed=4)
    # Rank 1 is not the storage writer: it stores nothing (rank 0 does).
    assert b1.batch_set_v1(keys, i1) == [True] * 4
    assert b1.batch_exists(keys) == 0
    i0 = p0.alloc(4 * PAGE)
    pages = fill(p0, i0, seed=5)
    assert b0.batch_set_v1(keys, i0) == [True] * 4
    assert b1.batch_exists(keys) == 4
    dst = p1.alloc(4 * PAGE)
    assert b1.batch_get_v1(keys, dst) == [True] * 4
    for got, want in zip(read(p1, dst), pages):
        assert torch.equal(got, want)


def test_the_older_whole_page_calls(tarn_server):
    ep = tarn_server.kv_endpoint
    pool = mha_pool()
    b = attach(config(ep, interface_v1=0), pool)
    keys = page_hashes(3, seed=6)
    idx = pool.alloc(3 * PAGE)
    pages = fill(pool, idx, seed=7)
    data = [pool.get_data_page(int(idx[i * PAGE]), flat=True) for i in range(3)]
    assert b.batch_set(keys[:2], data[:2]) is True
    assert b.exists(keys[0]) and b.exists(keys[1]) and not b.exists(keys[2])
    assert b.batch_exists(keys) == 2
    # The address-and-size form zero-copy callers use.
    t = data[2].contiguous()
    assert b.set(keys[2], target_location=t.data_ptr(), target_sizes=t.numel() * t.element_size()) is True
    assert b.batch_exists(keys) == 3
    dummies = [pool.get_dummy_flat_data_page() for _ in keys]
    got = b.batch_get(keys + ["e" * 64], dummies + [pool.get_dummy_flat_data_page()])
    assert got[3] is None
    for g, want in zip(got[:3], pages):
        assert torch.equal(g, want)
    one = pool.get_dummy_flat_data_page()
    assert b.get(keys[1], one) is one and torch.equal(one, pages[1])
    # A target of the wrong size is a miss, not an exception.
    assert b.get(keys[1], torch.zeros(3)) is None
    # The zero-copy form's keys are another thing: nothing is shared.
    v1 = attach(config(ep), mha_pool())
    assert v1.batch_exists(keys) == 0
    assert b.clear() is False


def test_values_of_the_wrong_size_are_misses(tarn_server):
    """A value under a page's key that is not the part's size (written by a
    foreign client into the namespace) loads as a miss."""
    ep = tarn_server.kv_endpoint
    pool = mha_pool()
    b = attach(config(ep), pool)
    keys = page_hashes(3, seed=8)
    idx = pool.alloc(3 * PAGE)
    fill(pool, idx, seed=9)
    assert b.batch_set_v1(keys[:2], idx[: 2 * PAGE]) == [True, True]
    with tarn.kv.Client(ep, b.namespace) as c:
        assert c.put_from([TarnHiCacheStorage._key(keys[2], "0"), TarnHiCacheStorage._key(keys[2], "1")],
                          [bytearray(10), bytearray(10)]) == [tarn.kv.Status.OK] * 2  # fmt: skip
    dst = pool.alloc(3 * PAGE)
    assert b.batch_get_v1(keys, dst) == [True, True, False]


def closed_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def test_a_store_that_is_down_is_a_miss_and_sglang_keeps_serving(tarn_server, caplog):
    caplog.set_level(logging.WARNING, "sglang.tarn")
    keys = page_hashes(2, seed=10)
    # Never reachable: the backend attaches, every call answers a miss.
    pool = mha_pool()
    idx = pool.alloc(2 * PAGE)
    down = attach(config(closed_port()), pool)
    assert down.batch_exists(keys) == 0
    assert down.batch_set_v1(keys, idx) == [False, False]
    assert down.batch_get_v1(keys, idx) == [False, False]
    assert down.batch_set(keys, [pool.get_data_page(int(idx[0]))] * 2) is False
    assert "unavailable" in caplog.text
    # Reachable, then the server goes away mid-run.
    up = attach(config(tarn_server.kv_endpoint, retry_seconds=60), pool)
    assert up.batch_set_v1(keys, idx) == [True, True]
    tarn_server.stop()
    assert up.batch_get_v1(keys, idx) == [False, False]
    assert up.batch_exists(keys) == 0
    assert up.batch_set_v1(keys, idx) == [False, False]


def test_storage_metrics(tarn_server):
    pool = mha_pool()
    b = attach(config(tarn_server.kv_endpoint, metrics=True), pool)
    keys = page_hashes(5, seed=11)
    idx = pool.alloc(5 * PAGE)
    fill(pool, idx, seed=12)
    b.batch_set_v1(keys[:3], idx[: 3 * PAGE])
    b.batch_set_v1(keys, idx)
    b.batch_get_v1(keys, idx)
    m = b.get_stats()
    assert m.backup_pgs == [3, 2] and m.prefetch_pgs == [5]
    assert all(x > 0 for x in m.backup_bandwidth + m.prefetch_bandwidth)
    assert b.get_stats().backup_pgs == []


def test_a_config_it_cannot_honour_is_refused(tarn_server):
    cfg = config(tarn_server.kv_endpoint, access_key="only-half")
    with pytest.raises(Exception, match="both access_key and secret_key"):
        StorageBackendFactory.create_backend("dynamic", cfg, mha_pool())

"""tarn.kv with torch tensors, and tarn.kv_blocks (the connector's block
mover) against a live Tarn server: no vLLM engine needed."""

import pytest
import torch

import tarn.kv as kv
from tarn.kv_blocks import PagedBlocks, Store


def test_torch_tensors_are_buffers(tarn_server):
    c = kv.Client(tarn_server.kv_endpoint, namespace="torch")
    ks = [kv.key("t", i) for i in range(3)]
    src = [torch.randn(1024), torch.randn(64, 16).to(torch.bfloat16), torch.arange(100, dtype=torch.int64)]
    assert all(s.stored for s in c.put_from(ks, src))
    dst = [torch.empty(1024), torch.empty(64, 16, dtype=torch.bfloat16), torch.empty(100, dtype=torch.int64)]
    assert c.get_into(ks, dst) == [4096, 2048, 800]
    for a, b in zip(src, dst):
        assert torch.equal(a, b)
    # a float tensor read as raw bytes into a uint8 one: the same bytes
    raw = torch.empty(4096, dtype=torch.uint8)
    assert c.get_into(ks[:1], [raw]) == [4096]
    assert torch.equal(raw.view(torch.float32), src[0])
    with pytest.raises(BufferError, match="not contiguous"):
        c.get_into(ks[:1], [torch.empty(64, 64).t()])
    c.close()


def cache(num_blocks, seed):
    """Two layers shaped like vLLM's CPU cache (blocks, kv heads, tokens,
    k|v head dims) and one with K and V apart (2, blocks, ...), seen with
    the block index first: strided, not contiguous per block."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(num_blocks, 2, 32, 128, generator=g)
    b = torch.randn(num_blocks, 2, 32, 128, generator=g)
    kv_apart = torch.randn(2, num_blocks, 2, 32, 64, generator=g).transpose(0, 1)
    return [("l0", a), ("l1", b), ("l2", kv_apart)]


def test_blocks_round_trip(tarn_server):
    store = Store(tarn_server.kv_endpoint, ["blocks"])
    src = PagedBlocks(cache(16, 1))
    assert src.value_bytes == 3 * 2 * 32 * 128 * 4
    keys = [kv.key("b", i) for i in range(4)]
    ids = [3, 7, 0, 15]
    assert src.save(store, keys, src.gather(ids)) == 4
    layers = cache(16, 2)
    dst = PagedBlocks(layers)
    before = [t.clone() for _, t in layers]
    into = [1, 2, 5, 9]
    assert dst.load(store, keys, into) == set()
    for (_, s), (_, d), old in zip(cache(16, 1), layers, before):
        assert torch.equal(d[into], s[ids])
        untouched = [i for i in range(16) if i not in into]
        assert torch.equal(d[untouched], old[untouched])
    store.close()


def test_missing_and_wrong_sized_blocks_fail_from_the_first(tarn_server):
    store = Store(tarn_server.kv_endpoint, ["blocks"])
    blocks = PagedBlocks(cache(8, 1))
    keys = [kv.key("m", i) for i in range(5)]
    blocks.save(store, keys, blocks.gather([0, 1, 2, 3, 4]))
    c = store.clients()[0]
    c.delete(keys[2:3])
    layers = cache(8, 3)
    dst = PagedBlocks(layers)
    before = [t.clone() for _, t in layers]
    # block 2 is gone: 2, 3 and 4 fail (a prefix is usable only whole)
    assert dst.load(store, keys, [0, 1, 2, 3, 4]) == {2, 3, 4}
    for (_, d), old in zip(layers, before):
        assert torch.equal(d[2:5], old[2:5]), "nothing is written to a failed block"
        assert not torch.equal(d[0:2], old[0:2])
    # a value of another size (another layout) under the key is a failure too
    c.delete(keys[:1])
    c.put_from(keys[:1], [bytes(100)])
    assert dst.load(store, keys[:2], [6, 7]) == {6, 7}
    store.close()


def test_store_down_means_no_hits_and_failed_loads(tarn_server):
    store = Store(tarn_server.kv_endpoint, ["down"], retry_s=3600)
    blocks = PagedBlocks(cache(4, 1))
    keys = [kv.key("d", i) for i in range(2)]
    assert blocks.save(store, keys, blocks.gather([0, 1])) == 2
    assert store.stored(keys) == [True, True]
    tarn_server.stop()
    assert store.stored(keys) is None
    assert blocks.load(store, keys, [2, 3]) == {2, 3}
    assert blocks.save(store, keys, blocks.gather([0, 1])) == 0
    tarn_server.start()
    # backing off: the restarted server is not tried until retry_s passes
    assert store.stored(keys) is None
    fresh = Store(tarn_server.kv_endpoint, ["down"])
    assert fresh.stored(keys) == [False, False]


def test_store_reconnects_in_the_background(tarn_server):
    import time

    store = Store(tarn_server.kv_endpoint, ["bg"], retry_s=0.2)
    keys = [kv.key("bg", 0)]
    assert store.stored(keys) == [False]
    tarn_server.stop()
    assert store.stored(keys) is None  # the call that finds it gone
    tarn_server.start()
    deadline = time.monotonic() + 30
    while (got := store.stored(keys)) is None:
        # never blocks: None until the background connection is up
        assert time.monotonic() < deadline, "did not reconnect"
        time.sleep(0.05)
    assert got == [False]
    store.close()


def test_pins_are_taken_and_released_on_one_connection(tarn_server):
    store = Store(tarn_server.kv_endpoint, ["pins"], max_connections=1)
    keys = [kv.key("p", i) for i in range(3)]
    c = store.clients()[0]
    c.put_from(keys[:2], [b"a", b"b"])
    store.pin(keys, 30)
    assert c.unpin(keys) == [True, True, False], "the store's connection holds the pins"
    store.pin(keys, 30)
    store.unpin(keys)
    assert c.unpin(keys) == [False, False, False], "and released them"
    store.close()


def test_staging_buffers_are_reused_never_shared():
    blocks = PagedBlocks(cache(8, 1))
    a = blocks.gather([0, 1, 2])
    b = blocks.gather([0, 1, 2])
    assert a.data_ptr() != b.data_ptr() and torch.equal(a, b)
    blocks.release(a)
    blocks.release(a)  # a second release must not hand the memory out twice
    c = blocks.staging(4)  # 3 and 4 rows round up to the same size
    d = blocks.staging(4)
    assert c.data_ptr() == a.data_ptr()
    assert d.data_ptr() not in (a.data_ptr(), b.data_ptr())

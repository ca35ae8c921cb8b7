"""Tensor-parallel independent KV blocks (tarn.kv_blocks.HeadSplit) against
a live `tarn server --kv`: a block's value holds every KV head of the model,
head by head; each rank of any TP layout puts and reads only the byte range
of its heads (tarn.kv put_parts and ranged get_into). Engines of TP=1, 2, 4,
8 and 16 (heads shared by two ranks) read what TP=2 ranks stored, and TP=4
ranks what TP=1 stored; a block whose heads are not all in is a miss. The
caches are shaped like vLLM 0.32's: [blocks, (kernel blocks,) heads, tokens,
bytes]."""

import pytest
import torch

import tarn.kv as kv
from tarn.kv_blocks import HeadSplit, PagedBlocks, Store
from tarnproc import kv_server

KV_ARGS = ["--kv", "--kv-listen", "127.0.0.1:0", "--kv-memory", "64MiB", "--kv-value-max", "1MiB"]
HEADS = 8
BLOCKS = 12


@pytest.fixture
def server(tmp_path):
    yield from kv_server(tmp_path, KV_ARGS)


def model_cache(seed):
    """Every head of a 3-layer model: one layer with its blocks split in
    two kernel blocks, K and V of a head side by side in the last dim."""
    g = torch.Generator().manual_seed(seed)
    return [
        ("l0", torch.randn(BLOCKS, HEADS, 16, 2 * 32, generator=g)),
        ("l1", torch.randn(BLOCKS, 2, HEADS, 8, 2 * 32, generator=g)),
        ("l2", torch.randn(BLOCKS, HEADS, 16, 2 * 32, generator=g).to(torch.bfloat16)),
    ]


def rank_cache(model, split):
    """The heads a rank holds, in memory of its own (as a TP engine's)."""
    out = []
    for name, t in model:
        dim = t.dim() - 3
        out.append((name, t.narrow(dim, split.first, split.count).contiguous()))
    return out


def empty_like(layers):
    return [(n, torch.zeros_like(t)) for n, t in layers]


def engine(model, tp, endpoint, ns="tp-free"):
    """A TP engine's ranks: (split, cache, blocks mover, store) each."""
    ranks = []
    for r in range(tp):
        split = HeadSplit(HEADS, tp, r)
        cache = rank_cache(model, split)
        ranks.append((split, cache, PagedBlocks(cache, heads=split), Store(endpoint, [ns])))
    return ranks


def close(ranks):
    for *_, store in ranks:
        store.close()


def test_every_tp_layout_reads_what_another_stored(server):
    model = model_cache(1)
    keys = [kv.key("prefix", i) for i in range(4)]
    ids = [5, 0, 11, 7]
    writers = engine(model, 2, server.kv_endpoint)
    for _, _, blocks, store in writers:
        assert blocks.save(store, keys, blocks.gather(ids)) == 4
    # One value per block, holding all heads: not one per rank.
    c = kv.Client(server.kv_endpoint, "tp-free")
    assert c.stats()["namespace.blocks"] == 4
    value_len = writers[0][2].value_len
    assert value_len == 2 * writers[0][2].value_bytes
    for tp in (1, 2, 4, 8, 16):
        readers = engine(empty_like(model), tp, server.kv_endpoint)
        into = [1, 2, 3, 4]
        for split, cache, blocks, store in readers:
            assert blocks.load(store, keys, into) == set(), (tp, split)
            for (name, got), (_, full) in zip(cache, model):
                dim = full.dim() - 3
                want = full.narrow(dim, split.first, split.count)[ids]
                assert torch.equal(got[into], want), (tp, split, name)
                assert not got[[0, 5]].any(), "blocks not loaded stay untouched"
        close(readers)
    # The whole value read by a plain client is the heads in order, each
    # head's bytes of every layer together.
    buf = bytearray(value_len)
    assert c.get_into(keys[:1], [buf]) == [value_len]
    head0 = torch.cat([t[ids[0]].view(torch.uint8).narrow(t.dim() - 4, 0, 1).movedim(t.dim() - 4, 0).reshape(-1)
                       for _, t in model])
    assert bytes(buf[: len(head0)]) == head0.numpy().tobytes()
    close(writers)
    c.close()


def test_tp1_writes_and_tp4_reads_quarters(server):
    model = model_cache(2)
    keys = [kv.key("other", i) for i in range(3)]
    [(_, _, blocks, store)] = engine(model, 1, server.kv_endpoint)
    assert blocks.part_offset == 0 and blocks.value_len == blocks.value_bytes
    assert blocks.save(store, keys, blocks.gather([1, 2, 3])) == 3
    readers = engine(empty_like(model), 4, server.kv_endpoint)
    for split, cache, b, st in readers:
        assert b.value_bytes == blocks.value_bytes // 4
        assert b.part_offset == split.first * b.head_bytes
        assert b.load(st, keys, [4, 5, 6]) == set()
        for (_, got), (_, full) in zip(cache, model):
            dim = full.dim() - 3
            assert torch.equal(got[[4, 5, 6]], full.narrow(dim, split.first, split.count)[[1, 2, 3]])
    close(readers)
    store.close()


def test_a_block_missing_some_heads_is_a_miss(server):
    model = model_cache(3)
    keys = [kv.key("half", i) for i in range(2)]
    writers = engine(model, 2, server.kv_endpoint)
    # Only rank 0 of the TP=2 engine saved (rank 1 died before its save).
    _, _, blocks, store = writers[0]
    assert blocks.save(store, keys, blocks.gather([0, 1])) == 2
    c = kv.Client(server.kv_endpoint, "tp-free")
    assert c.exists(keys) == [False, False]
    [(_, _, whole, st)] = engine(empty_like(model), 1, server.kv_endpoint)
    assert whole.load(st, keys, [0, 1]) == {0, 1}
    # Rank 1's saves complete them.
    _, _, blocks1, store1 = writers[1]
    assert blocks1.save(store1, keys, blocks1.gather([0, 1])) == 2
    assert c.exists(keys) == [True, True]
    assert whole.load(st, keys, [0, 1]) == set()
    st.close()
    close(writers)
    c.close()


def test_shared_heads_and_mla():
    # 16 ranks over 8 heads: pairs share a head, the first of each writes.
    splits = [HeadSplit(8, 16, r) for r in range(16)]
    assert [s.first for s in splits] == [r // 2 for r in range(16)]
    assert [s.writer for s in splits] == [r % 2 == 0 for r in range(16)]
    # MLA: one latent every rank holds; rank 0 writes, all read it whole.
    mla = [HeadSplit(1, 4, r) for r in range(4)]
    assert all(s.first == 0 and s.count == 1 for s in mla)
    assert [s.writer for s in mla] == [True, False, False, False]
    with pytest.raises(ValueError):
        HeadSplit(6, 4, 0)
    with pytest.raises(ValueError):
        PagedBlocks([("l", torch.zeros(4, 3, 16, 64))], heads=HeadSplit(8, 4, 0))


def test_ranges_and_parts_through_the_client(server):
    c = kv.Client(server.kv_endpoint, "parts")
    k = kv.key("v")
    whole = bytes(range(256)) * 64
    assert c.put_parts([k], [whole[:4096]], [len(whole)], [0]) == [kv.Status.OK]
    assert c.get_into([k], [bytearray(len(whole))]) == [None]
    assert c.put_parts([k], [whole[4096:]], [len(whole)], [4096]) == [kv.Status.OK]
    out = bytearray(100)
    assert c.get_into([k], [out], offsets=[5000]) == [100]
    assert bytes(out) == whole[5000:5100]
    # A range past the end is not the layout asked for: None, like a miss.
    assert c.get_into([k], [bytearray(100)], offsets=[len(whole) - 10]) == [None]
    with pytest.raises(ValueError):
        c.put_parts([k], [b"x" * 10], [8], [0])
    c.close()

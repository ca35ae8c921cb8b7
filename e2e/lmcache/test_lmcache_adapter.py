"""Tarn as LMCache's L2 tier (`tarn.lmcache.TarnL2Adapter`, a native
plugin): LMCache's own `lmcache bench l2` storing, looking up, loading and
verifying through it; a clean restart of Tarn keeping the hits; LMCache's
adapter wrapper accounting usage per cache_salt while Tarn counts each
salt in its own namespace; and batches that cannot be served completing as
failures, never as exceptions."""

import hashlib
import json
import os
import re
import select
import socket
import subprocess
import sys
import time

import pytest
import torch
from lmcache.cli.commands.bench.l2_adapter_bench.data import create_l1_memory_desc, make_memory_objects
from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.distributed.l2_adapters import create_l2_adapter
from lmcache.v1.distributed.l2_adapters.config import parse_args_to_l2_adapters_config
from lmcache.v1.distributed.l2_adapters.native_connector_l2_adapter import _object_key_to_string

import tarn.kv
from tarn.lmcache import TarnL2Adapter

LMCACHE = os.path.join(os.path.dirname(sys.executable), "lmcache")


def spec(endpoint, **params):
    return {
        "type": "native_plugin",
        "module_path": "tarn.lmcache",
        "class_name": "TarnL2Adapter",
        "adapter_params": {"endpoint": endpoint, "namespace": "lmcache-bench", "retry_seconds": 0.2, **params},
    }


def bench(endpoint, *args):
    """`lmcache bench l2` through Tarn's adapter: its report, by operation."""
    cmd = [LMCACHE, "bench", "l2", "--l2-adapter", json.dumps(spec(endpoint)), "--num-keys", "16",
           "--in-flight", "2", "--data-size-kb", "256", "--rounds", "2", *args]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = {}
    for name, body in re.findall(r"-+ (\w+) -+\n(.*?)(?=\n-+ \w+ -+|\n=+)", r.stdout, re.S):
        fields = dict(re.findall(r"^([A-Za-z /]+):\s+(\S+)$", body, re.M))
        report[name.lower()] = fields
    return r.stdout, report


def test_lmcache_bench_l2_verifies_through_tarn_and_a_restart_keeps_the_hits(tarn_server):
    ep = tarn_server.kv_endpoint
    out, rep = bench(ep, "--no-skip-verify", "--lookup-max-hit-rate", "0.5")
    assert re.search(r"All \d+ keys data verified OK", out), out[-2000:]
    # 2 rounds x 2 submits x 16 keys, measured; lookups half hits.
    assert rep["store"]["Total success"] == rep["store"]["Total keys"] == "64"
    assert rep["load"]["Total success"] == "64"
    assert rep["lookup"]["Total success"] == "32"
    stats = tarn.kv.Client(ep, "lmcache-bench").stats()
    assert stats["namespace.puts_stored"] >= 64
    tarn_server.restart()
    _, rep = bench(tarn_server.kv_endpoint, "--only", "lookup", "--lookup-max-hit-rate", "1.0")
    assert rep["lookup"]["Total success"] == "64", rep
    _, rep = bench(tarn_server.kv_endpoint, "--only", "load")
    assert rep["load"]["Total success"] == "64", rep


def wait_done(pop, task, timeout=30.0):
    """Polls for a NativeConnectorL2Adapter result until it is there."""
    deadline = time.monotonic() + timeout
    while (got := pop(task)) is None:
        assert time.monotonic() < deadline, "no completion"
        time.sleep(0.01)
    return got


def test_usage_per_cache_salt_through_lmcaches_wrapper(tarn_server):
    ep = tarn_server.kv_endpoint
    size = 64 << 10
    buf = torch.zeros(8 * size, dtype=torch.uint8)
    cfg = parse_args_to_l2_adapters_config(type("A", (), {"l2_adapter": [json.dumps(spec(ep))]})())
    wrapper = create_l2_adapter(cfg.adapters[0], l1_memory_desc=create_l1_memory_desc(buf))
    try:
        salts = ["alice", "alice", "alice", "bob", "bob", "", "", ""]
        keys = [ObjectKey(chunk_hash=bytes([i]) * 16, model_name="m", kv_rank=0, cache_salt=s)
                for i, s in enumerate(salts)]  # fmt: skip
        objs = make_memory_objects(buf, 8, size, 0)
        task = wrapper.submit_store_task(keys, objs)
        result = wait_done(lambda t: wrapper.pop_completed_store_tasks().get(t), task)
        assert result == 8 * size  # L2StoreResult: the bytes stored (-1: failed)
        usage = wrapper.get_usage()
        assert dict(usage.bytes_by_cache_salt) == {"alice": 3 * size, "bob": 2 * size, "": 3 * size}
        # Tarn keeps each salt apart: its own namespace and counters.
        for ns, n in [("lmcache-bench/salt/alice", 3), ("lmcache-bench/salt/bob", 2), ("lmcache-bench", 3)]:
            st = tarn.kv.Client(ep, ns).stats()
            assert st["namespace.puts_stored"] == n, (ns, st)
        # The same chunk under another salt is another object.
        other = [ObjectKey(chunk_hash=bytes([0]) * 16, model_name="m", kv_rank=0, cache_salt="carol")]
        task = wrapper.submit_lookup_and_lock_task(keys + other, {})
        bitmap = wait_done(wrapper.query_lookup_and_lock_result, task)
        assert [bitmap.test(i) for i in range(9)] == [True] * 8 + [False]
        loaded = make_memory_objects(buf, 8, size, 0, fill_offset=7)
        task = wrapper.submit_load_task(keys, loaded)
        bitmap = wait_done(wrapper.query_load_result, task)
        assert [bitmap.test(i) for i in range(8)] == [True] * 8
        assert all(int(o.tensor.view(torch.uint8)[0]) == i % 256 for i, o in enumerate(loaded))
        wrapper.delete(keys[:2])
        assert dict(wrapper.get_usage().bytes_by_cache_salt)["alice"] == size
        alice = [hashlib.sha256(_object_key_to_string(k).encode()).digest() for k in keys[:3]]
        assert tarn.kv.Client(ep, "lmcache-bench/salt/alice").exists(alice) == [False, False, True]
    finally:
        wrapper.close()


def drain(adapter, want, timeout=30.0):
    """Completions of the batches `want`, as LMCache's demux thread takes
    them: on the adapter's eventfd, through drain_completions."""
    got = {}
    deadline = time.monotonic() + timeout
    while not want <= set(got):
        assert time.monotonic() < deadline, f"completions {sorted(got)} of {sorted(want)}"
        select.select([adapter.event_fd()], [], [], 0.1)
        for fid, ok, err, bools in adapter.drain_completions():
            got[fid] = (ok, err, bools)
    return got


def closed_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def test_batches_that_cannot_be_served_complete_as_failures(tarn_server):
    keys = [f"m@{i:08x}@0@{i:032x}" for i in range(4)]
    bufs = [bytearray(4096) for _ in keys]
    # Never reachable: every batch completes, failed, with the reason.
    down = TarnL2Adapter(endpoint=closed_port(), retry_seconds=60)
    try:
        ids = {down.submit_batch_set(keys, [memoryview(b) for b in bufs]), down.submit_batch_exists(keys),
               down.submit_batch_get(keys, [memoryview(b) for b in bufs]), down.submit_batch_delete(keys)}  # fmt: skip
        for ok, err, bools in drain(down, ids).values():
            assert not ok and "unavailable" in err and bools == [False] * 4
    finally:
        down.close()
    # A value of another size than the buffer is a failed load.
    a = TarnL2Adapter(endpoint=tarn_server.kv_endpoint, namespace="sizes")
    try:
        f = a.submit_batch_set(keys[:2], [memoryview(bytearray(b"v" * 4096)), memoryview(bytearray(b"w" * 1000))])
        assert drain(a, {f})[f][0] is True
        small = [memoryview(bytearray(4096)), memoryview(bytearray(4096))]
        f = a.submit_batch_get(keys[:2], small)
        ok, err, bools = drain(a, {f})[f]
        assert bools == [True, False]
        assert bytes(small[0]) == b"v" * 4096
        # The server goes away mid-run: failures, then hits again once back.
        tarn_server.stop()
        f = a.submit_batch_exists(keys[:1])
        ok, err, bools = drain(a, {f})[f]
        assert not ok and bools == [False]
        tarn_server.start()
        for _ in range(100):
            f = a.submit_batch_exists(keys[:1])
            if drain(a, {f})[f][2] == [True]:
                break
            time.sleep(0.1)
        else:
            raise AssertionError("no hit after the server came back")
    finally:
        a.close()
    with pytest.raises(RuntimeError, match="closed"):
        a.submit_batch_exists(keys)


def test_parameters_it_cannot_honour_are_refused():
    with pytest.raises(ValueError, match="both access_key and secret_key"):
        TarnL2Adapter(access_key="half")
    with pytest.raises(ValueError, match="workers"):
        TarnL2Adapter(workers=0)


CHUNK = 16


class InProcess:
    """LMCache's own RemoteBackend (the in-process path: LMCache inside an
    engine) with Tarn as its `remote_storage_plugins` entry, on CPU."""

    def __init__(self, endpoint, **extra):
        import asyncio
        import threading

        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.memory_management import MemoryFormat
        from lmcache.v1.metadata import LMCacheMetadata
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
        from lmcache.v1.storage_backend.remote_backend import RemoteBackend

        plugin = {f"remote_storage_plugin.tarn.{k}": v for k, v in extra.items() if k != "save_chunk_meta"}
        config = LMCacheEngineConfig.from_defaults(
            chunk_size=CHUNK, local_cpu=True, max_local_cpu_size=0.05, remote_serde="naive",
            remote_storage_plugins=["tarn"],
            extra_config={"remote_storage_plugin.tarn.module_path": "tarn.lmcache",
                          "remote_storage_plugin.tarn.class_name": "TarnConnectorAdapter",
                          "remote_storage_plugin.tarn.endpoint": endpoint,
                          "save_chunk_meta": extra.get("save_chunk_meta", True), **plugin},
        )  # fmt: skip
        self.meta = LMCacheMetadata(model_name="tiny", world_size=1, local_world_size=1, worker_id=0,
                                    local_worker_id=0, kv_dtype=torch.float32, kv_shape=(2, 2, CHUNK, 4, 8))  # fmt: skip
        self.fmt = MemoryFormat.KV_2LTD
        self.local = LocalCPUBackend(config, self.meta, dst_device="cpu")
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.remote = RemoteBackend(config, self.meta, self.loop, self.local, "cpu", plugin_name="tarn")

    def chunk(self, value, tokens=CHUNK):
        shapes = self.meta.get_shapes()
        if tokens != CHUNK:
            shapes = [torch.Size([*s[:2], tokens, *s[3:]]) for s in shapes]
        o = self.local.allocate(shapes, self.meta.get_dtypes(), self.fmt)
        o.tensor.fill_(value)
        return o

    def put(self, keys, objs):
        """LMCache's batched put, which runs in the background (and keeps
        no record of its keys in flight): until they are all stored."""
        self.remote.batched_submit_put_task(keys, objs)
        deadline = time.monotonic() + 30
        while self.remote.batched_contains(keys) < len(keys):
            assert time.monotonic() < deadline, "puts not finished"
            time.sleep(0.01)

    def close(self):
        self.remote.close()
        self.loop.call_soon_threadsafe(self.loop.stop)


def engine_key(i):
    from lmcache.utils import CacheEngineKey

    return CacheEngineKey("tiny", 1, 0, i, torch.float32)


def values(objs):
    """Each chunk's fill value (None for a miss); the objects are released."""
    out = []
    for o in objs:
        out.append(None if o is None else float(o.tensor.flatten()[0]))
        if o is not None:
            assert torch.all(o.tensor == out[-1])
            o.ref_count_down()
    return out


@pytest.mark.parametrize("save_chunk_meta", [True, False])
def test_lmcache_in_process_remote_plugin(tarn_server, save_chunk_meta):
    lm = InProcess(tarn_server.kv_endpoint, namespace="inproc", save_chunk_meta=save_chunk_meta)
    try:
        keys = [engine_key(i) for i in range(5)]
        objs = [lm.chunk(i + 1) for i in range(4)]
        lm.put(keys[:4], objs)
        for o in objs:
            o.ref_count_down()
        assert lm.remote.put_failed_count == 0
        assert [lm.remote.contains(k) for k in keys] == [True] * 4 + [False]
        assert lm.remote.batched_contains(keys) == 4
        assert lm.remote.batched_contains([keys[4]] + keys[:4]) == 0
        assert values([lm.remote.get_blocking(keys[2])]) == [3.0]
        assert values(lm.remote.batched_get_blocking([keys[0], keys[4], keys[3]])) == [1.0, None, 4.0]
        # A partial last chunk comes back with its own length.
        part = lm.chunk(9.0, tokens=CHUNK // 2)
        lm.put([engine_key(100)], [part])
        part.ref_count_down()
        got = lm.remote.get_blocking(engine_key(100))
        assert got is not None and got.tensor.shape[2] == CHUNK // 2
        assert values([got]) == [9.0]
        lm.remote.remove(keys[0])
        assert not lm.remote.contains(keys[0])
        assert lm.remote.get_blocking(keys[0]) is None
        with pytest.raises(NotImplementedError, match="does not list"):
            __import__("asyncio").run_coroutine_threadsafe(lm.remote.connection.list(), lm.loop).result(10)
    finally:
        lm.close()
    # Its chunks are in their namespace, with their metadata when saved.
    st = tarn.kv.Client(tarn_server.kv_endpoint, "inproc").stats()
    assert st["namespace.puts_stored"] == 5 * (2 if save_chunk_meta else 1)


def test_lmcache_in_process_plugin_with_the_store_down(tarn_server):
    down = InProcess(closed_port(), retry_seconds=60)
    try:
        obj = down.chunk(1.0)
        # One chunk's put goes through LMCache's per-key path, which counts
        # failed puts (its batched path only logs them).
        down.remote.submit_put_task(engine_key(1), obj)
        deadline = time.monotonic() + 30
        while down.remote.put_failed_count == 0:
            assert time.monotonic() < deadline, "the failed put was not counted"
            time.sleep(0.01)
        obj.ref_count_down()
        assert not down.remote.contains(engine_key(1))
        assert down.remote.batched_contains([engine_key(1)]) == 0
        assert down.remote.get_blocking(engine_key(1)) is None
    finally:
        down.close()


def test_lmcache_in_process_non_blocking_gets_stop_at_the_first_miss(tarn_server):
    import asyncio

    lm = InProcess(tarn_server.kv_endpoint, namespace="nb")
    try:
        objs = [lm.chunk(i + 1) for i in range(3)]
        keys = [engine_key(i) for i in range(4)]
        lm.put([keys[0], keys[1], keys[3]], objs)
        for o in objs:
            o.ref_count_down()
        got = asyncio.run_coroutine_threadsafe(lm.remote.batched_get_non_blocking("l1", keys), lm.loop).result(30)
        assert values(got) == [1.0, 2.0]
    finally:
        lm.close()

"""Tarn as a secondary tier of vLLM's tiered KV offloading (`TarnTier`),
inside vLLM's own TieringOffloadingManager built by TieringOffloadingSpec
from the config a user writes, with host memory as the primary tier: one
engine's chunks cascade to Tarn and another engine promotes them into its
own primary tier; models never share chunks; a load that cannot be served
is reported failed and turns the lookup into a miss; a store that is down
fails its jobs and lookups miss."""

import gc
import socket
import time

import numpy as np
import pytest
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.base import TransferJob
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

import tarn.kv
from tarn.vllm import TarnTier

CHUNK_BYTES = 4096
STEP = ScheduleEndContext((), ())


class Engine:
    """vLLM's offloading manager of one engine: a CPU primary tier (shared
    memory region of its own) and Tarn behind it."""

    def __init__(self, endpoint, engine_id, model="org/tiny", **tier):
        config = OffloadingConfig(
            groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0", "l1"), group_id=0),),
            worker_kv_bytes_per_block=CHUNK_BYTES,
            enable_kv_cache_events=False,
            extra_config={
                "cpu_bytes_to_use": 64 * CHUNK_BYTES,
                "secondary_tiers": [{"type": "TarnTier", "module_path": "tarn.vllm", "endpoint": endpoint,
                                     "namespace": "offload-test", "call_timeout_seconds": 5, **tier}],
            },  # fmt: skip
            engine_id=engine_id,
            model=OffloadingModelConfig(name=model, dtype="float32"),
            cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
            parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                              data_parallel_index=0, data_parallel_size=1,
                                              data_parallel_rank_local=None, is_parallelism_agnostic=True),
        )  # fmt: skip
        self.manager = TieringOffloadingSpec(config).get_manager()
        self.tier = self.manager.secondary_tiers[0]
        assert isinstance(self.tier, TarnTier)
        view = self.manager.primary_tier.get_kv_memoryview()
        self.chunks = np.frombuffer(view.cast("B") if view.ndim > 1 else view, dtype=np.uint8).reshape(len(view), -1)

    def store(self, req, keys, fills):
        """What the worker does for a request's new chunks: into the primary
        tier, then complete (which cascades them to Tarn)."""
        ctx = ReqContext(req)
        self.manager.on_new_request(ctx)
        out = self.manager.prepare_store(keys, ctx)
        fill_of = dict(zip(keys, fills))
        for cid, k in zip(out.store_spec.chunk_ids, out.keys_to_store):
            self.chunks[cid, :] = fill_of[k]
        if out.keys_to_store:
            self.manager.complete_store(out.keys_to_store, ctx)
        self.manager.on_request_finished(ctx)
        self.settle()

    def settle(self, timeout=30.0):
        deadline = time.monotonic() + timeout
        while self.manager.has_pending_work():
            assert time.monotonic() < deadline, "transfers did not finish"
            self.manager.on_schedule_end(STEP)
            time.sleep(0.01)

    def lookups(self, ctx, keys, timeout=30.0):
        """Looks keys up step by step until no answer is RETRY or pending."""
        deadline = time.monotonic() + timeout
        while True:
            res = [self.manager.lookup(k, ctx) for k in keys]
            if not any(r in (LookupResult.RETRY, LookupResult.HIT_PENDING) for r in res):
                return res
            assert time.monotonic() < deadline, f"lookups still pending: {res}"
            self.manager.on_schedule_end(STEP)
            time.sleep(0.01)

    def close(self):
        self.chunks = None
        gc.collect()
        self.manager.shutdown()


def run_job(tier, load, job_id, ks, chunk_ids):
    """One store or load job straight on the tier, to its result."""
    job = TransferJob(job_id=job_id, keys=ks, chunk_ids=np.array(chunk_ids, dtype=np.int32), is_promotion=load,
                      req_context=ReqContext(f"job-{job_id}"))  # fmt: skip
    (tier.submit_load if load else tier.submit_store)(job)
    tier.drain_jobs()
    (result,) = list(tier.get_finished_jobs())
    assert result.job_id == job_id
    return result


def keys(n, tag):
    return [make_offload_key(bytes([tag, i]) * 16, 0) for i in range(n)]


def test_one_engines_chunks_cascade_to_tarn_and_another_promotes_them(tarn_server):
    ep = tarn_server.kv_endpoint
    a = Engine(ep, "engine-a")
    try:
        ks = keys(4, 1)
        a.store("r1", ks, [10, 11, 12, 13])
        st = tarn.kv.Client(ep, "offload-test").stats()
        assert st["namespace.puts_stored"] == 4
    finally:
        a.close()
    b = Engine(ep, "engine-b")
    try:
        ctx = ReqContext("r2")
        b.manager.on_new_request(ctx)
        assert b.lookups(ctx, ks + keys(1, 2)) == [LookupResult.HIT] * 4 + [LookupResult.MISS]
        spec = b.manager.prepare_load(ks, ctx)
        for cid, fill in zip(spec.chunk_ids, [10, 11, 12, 13]):
            assert (b.chunks[cid] == fill).all()
        b.manager.complete_load(ks, ctx)
        b.manager.on_request_finished(ctx)
        # Another engine storing chunks Tarn has already writes nothing new.
        again = Engine(ep, "engine-g")
        try:
            again.store("r3", ks[:2], [10, 11])
        finally:
            again.close()
        st = tarn.kv.Client(ep, "offload-test").stats()
        assert st["namespace.puts_stored"] == 4 and st["namespace.puts_existing"] == 0
        # Another model never sees them.
        other = Engine(ep, "engine-c", model="org/other")
        try:
            ctx = ReqContext("r4")
            other.manager.on_new_request(ctx)
            assert other.lookups(ctx, ks) == [LookupResult.MISS] * 4
        finally:
            other.close()
    finally:
        b.close()


def test_a_load_that_cannot_be_served_fails_and_the_chunk_becomes_a_miss(tarn_server):
    ep = tarn_server.kv_endpoint
    e = Engine(ep, "engine-d")
    try:
        ks = keys(2, 3)
        # A value of another size under the first chunk's key.
        with tarn.kv.Client(ep, "offload-test") as c:
            assert c.put_from([e.tier._digest(ks[0])], [b"x" * 100]) == [tarn.kv.Status.OK]
        e.store("w", ks[1:], [5])
        result = run_job(e.tier, True, 10_001, ks, [60, 61])
        assert not result.success
        assert list(result.successful_keys) == [ks[1]]
        assert (e.chunks[61] == 5).all()
    finally:
        e.close()


def closed_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def test_a_store_that_is_down_fails_its_jobs_and_lookups_miss(tarn_server):
    e = Engine(closed_port(), "engine-e", retry_seconds=60)
    try:
        ks = keys(2, 4)
        assert not run_job(e.tier, False, 1, ks, [0, 1]).success
        ctx = ReqContext("r")
        e.manager.on_new_request(ctx)
        assert e.lookups(ctx, ks) == [LookupResult.MISS] * 2
    finally:
        e.close()


def test_a_config_it_cannot_honour_is_refused(tarn_server):
    with pytest.raises(ValueError, match="both access_key and secret_key"):
        Engine(tarn_server.kv_endpoint, "engine-f", access_key="half")

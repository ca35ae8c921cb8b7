"""Checkpoints (`tarn.checkpoint`) against a live `tarn server`: PyTorch
distributed checkpoints saved and loaded equal (every dtype, odd shapes,
empty and non-contiguous tensors, Python values), resharded on load (four
ranks save, two load), async_save with staging reused, the commit as one
conditional PUT of .metadata (no copy, no delete), a rank killed mid-save
leaving nothing committed and `latest` unchanged, leftovers found and
removed, `latest` moved by compare-and-swap under a race, torch.save and
torch.load streams, and failures that name the object."""

import concurrent.futures
import json
import os
import re
import subprocess
import sys
import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp

import tarn.checkpoint as ckpt
import tarn.objects as objects
from faultproxy import FaultProxy
from tarn.errors import ObjectConnectionError, ObjectError, ObjectNotFoundError
from tarnproc import ACCESS_KEY, SECRET_KEY, metric

HERE = os.path.dirname(os.path.abspath(__file__))
MIB = 1 << 20


def client_for(endpoint, **kw):
    return objects.Client(endpoint, access_key=ACCESS_KEY, secret_key=SECRET_KEY, **kw)


@pytest.fixture
def store(server):
    c = client_for(server.endpoint)
    c.create_bucket("ckpt")
    return server, c


def dcp_error(cls, match, fn, *args, **kw):
    """Runs a dcp call that must fail; DCP wraps a rank's error in a
    CheckpointException (a BaseException): the error under it is `cls`
    and matches. Returns it."""
    with pytest.raises(BaseException) as e:
        fn(*args, **kw)
    errors = [x for x, _ in e.value.failures.values()] if hasattr(e.value, "failures") else [e.value]
    for x in errors:
        while x is not None:  # the error, or one it was raised in handling
            if isinstance(x, cls) and re.search(match, str(x)):
                return x
            x = x.__cause__ or x.__context__
    raise AssertionError(f"expected {cls.__name__} matching {match!r}, got {e.value}")


def dcp_message(match, fn, *args, **kw):
    """Runs a dcp call that must fail with `match` in its message (dcp.load
    reports a failed metadata read in words, not as the error)."""
    with pytest.raises(BaseException) as e:
        fn(*args, **kw)
    assert re.search(match, str(e.value)), e.value


def ops(server, op):
    try:
        return metric(server, "tarn_requests_total", op=op)
    except AssertionError:  # no request of that kind yet
        return 0


def every_dtype_state():
    g = torch.Generator().manual_seed(3)
    sd = {}
    for dt in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
               torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64,
               torch.float8_e4m3fn, torch.float8_e5m2):
        x = torch.randn(17, 13, generator=g) * 50
        if dt == torch.bool:
            x = x > 0
        elif dt == torch.complex64:
            x = torch.complex(x, -x)
        sd[str(dt).removeprefix("torch.")] = x.to(dt)
    sd["scalar"] = torch.tensor(3.5)
    sd["empty"] = torch.empty(0, 5)
    sd["transposed"] = torch.randn(9, 31, generator=g).t()  # not contiguous
    sd["big"] = torch.randn(3 * MIB + 11, generator=g)  # 12 MiB and change: parts from its own memory
    sd["nested"] = {"odd": torch.randn(3, 5, 7, generator=g).to(torch.float16), "list": [torch.arange(5), 2]}
    sd["extra"] = {"step": 1234, "name": "run1", "lr": 3e-4}
    return sd


def blank_like(sd):
    if isinstance(sd, dict):
        return {k: blank_like(v) for k, v in sd.items()}
    if isinstance(sd, list):
        return [blank_like(v) for v in sd]
    if isinstance(sd, torch.Tensor):
        return torch.zeros_like(sd.contiguous())
    return None


def assert_same(got, want, path=""):
    if isinstance(want, dict):
        assert set(got) == set(want), path
        for k in want:
            assert_same(got[k], want[k], f"{path}.{k}")
    elif isinstance(want, list):
        assert len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{path}[{i}]")
    elif isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape, path
        assert torch.equal(got.view(torch.uint8) if got.dtype.is_floating_point and got.element_size() == 1 else got,
                           want.view(torch.uint8) if want.dtype.is_floating_point and want.element_size() == 1 else want), path
    else:
        assert got == want, path


def test_save_and_load_equal_and_commit_is_one_conditional_put(store):
    server, c = store
    sd = every_dtype_state()
    uri = "s3://ckpt/run1/step-100"
    copies, deletes = ops(server, "CopyObject"), ops(server, "DeleteObject")
    # Two 5 MiB slots: the upload streams through them, parts in flight.
    dcp.save(sd, storage_writer=ckpt.StorageWriter(uri, client=c, part_size=5 * MIB, upload_memory=10 * MIB))
    got = blank_like(sd)
    before = c.stats()
    dcp.load(got, storage_reader=ckpt.StorageReader(uri, client=c))
    assert_same(got, sd)
    # The server is on this host: the reader took the shard files' bytes
    # itself (short-circuit reads), none over HTTP but the small ones.
    after = c.stats()
    assert after["local_bytes"] > before["local_bytes"], after
    # The checkpoint: one object for the rank and .metadata, nothing copied
    # or deleted on the way.
    keys = sorted(o.key for o in c.list("ckpt", "run1/step-100/"))
    assert keys[0] == "run1/step-100/.metadata" and len(keys) == 2, keys
    assert keys[1].startswith("run1/step-100/__0_") and keys[1].endswith(".distcp")
    assert c.list_uploads("ckpt", "run1/") == []
    assert (ops(server, "CopyObject"), ops(server, "DeleteObject")) == (copies, deletes)
    assert ckpt.leftovers(uri, client=c, older_than=0) == ckpt.Leftovers([], [])

    # A checkpoint that is there is not replaced unless asked.
    dcp_error(ckpt.CheckpointExistsError, "a committed checkpoint is there already",
              dcp.save, sd, storage_writer=ckpt.StorageWriter(uri, client=c))
    # The documented way through DCP's wrapping (a BaseException).
    try:
        dcp.save(sd, storage_writer=ckpt.StorageWriter(uri, client=c))
        raise AssertionError("the save succeeded")
    except BaseException as e:
        assert not isinstance(e, Exception), type(e)  # why `except Exception` misses it
        errors = ckpt.tarn_errors(e)
        assert len(errors) == 1 and isinstance(errors[0], ckpt.CheckpointExistsError), errors
    assert ckpt.tarn_errors(ValueError("not ours")) == []
    assert ckpt.tarn_errors(ckpt.CheckpointError("direct")) != []
    sd2 = {"only": torch.ones(4)}
    dcp.save(sd2, storage_writer=ckpt.StorageWriter(uri, client=c, overwrite=True))
    got = {"only": torch.zeros(4)}
    dcp.load(got, storage_reader=ckpt.StorageReader(uri, client=c))
    assert torch.equal(got["only"], sd2["only"])
    # The replaced checkpoint's object is a leftover now, and goes.
    left = ckpt.leftovers(uri, client=c, older_than=0)
    assert left.objects == [keys[1]] and left.uploads == []
    assert ckpt.leftovers(uri, client=c) == ckpt.Leftovers([], [])  # too young by default
    assert ckpt.remove_leftovers(uri, client=c, older_than=0).objects == [keys[1]]
    assert len(c.list("ckpt", "run1/step-100/")) == 2
    dcp.load(got, storage_reader=ckpt.StorageReader(uri, client=c))
    assert torch.equal(got["only"], sd2["only"])


def test_a_commit_another_writer_beat_is_refused(store):
    _, c = store
    uri = "s3://ckpt/race/step-1"
    dcp.save({"x": torch.zeros(3)}, storage_writer=ckpt.StorageWriter(uri, client=c))
    # A began overwriting (it read the old .metadata's ETag), B overwrote
    # and committed first: A's commit must fail, B's checkpoint stays.
    a = ckpt.StorageWriter(uri, client=c, overwrite=True)
    a.set_up_storage_writer(True)
    dcp.save({"x": torch.full((3,), 2.0)}, storage_writer=ckpt.StorageWriter(uri, client=c, overwrite=True))
    from torch.distributed.checkpoint.metadata import Metadata

    with pytest.raises(ckpt.CheckpointExistsError, match="another writer committed"):
        a.finish(Metadata(state_dict_metadata={}), [])
    got = {"x": torch.zeros(3)}
    dcp.load(got, storage_reader=ckpt.StorageReader(uri, client=c))
    assert torch.equal(got["x"], torch.full((3,), 2.0))
    # Two fresh writers of one new checkpoint: only the first commits.
    first = ckpt.StorageWriter("s3://ckpt/race/step-2", client=c)
    second = ckpt.StorageWriter("s3://ckpt/race/step-2", client=c)
    first.set_up_storage_writer(True)
    second.set_up_storage_writer(True)
    first.finish(Metadata(state_dict_metadata={}), [])
    with pytest.raises(ckpt.CheckpointExistsError):
        second.finish(Metadata(state_dict_metadata={}), [])


def test_a_writer_used_again_never_writes_over_the_committed_checkpoint(store):
    _, c = store
    uri = "s3://ckpt/again/step-1"
    w = ckpt.StorageWriter(uri, client=c, overwrite=True)
    dcp.save({"x": torch.zeros(3)}, storage_writer=w)
    first = {o.key for o in c.list("ckpt", "again/step-1/")}
    dcp.save({"x": torch.ones(3)}, storage_writer=w)  # same writer, no new checkpoint_id
    second = {o.key for o in c.list("ckpt", "again/step-1/")}
    # The second save's object is a new one; the first stays until removed.
    assert len(second - first) == 1 and first <= second, (first, second)
    got = {"x": torch.zeros(3)}
    dcp.load(got, storage_reader=ckpt.StorageReader(uri, client=c))
    assert torch.equal(got["x"], torch.ones(3))


def test_a_prefix_without_metadata_is_refused(store):
    _, c = store
    c.put("ckpt", "half/step-5/__0_abc.distcp", b"x" * 100)
    dcp_message(r"s3://ckpt/half/step-5: no committed checkpoint \(no \.metadata\)",
                dcp.load, {"x": torch.zeros(3)}, storage_reader=ckpt.StorageReader("s3://ckpt/half/step-5", client=c))
    c.put("ckpt", "junk/step-5/.metadata", b"not a pickle")
    dcp_message(r"\.metadata does not parse",
                dcp.load, {"x": torch.zeros(3)}, storage_reader=ckpt.StorageReader("s3://ckpt/junk/step-5", client=c))
    # Nor is anything under it taken for a leftover.
    with pytest.raises(ckpt.CheckpointError, match="not written by tarn.checkpoint"):
        ckpt.remove_leftovers("s3://ckpt/junk/step-5", client=c, older_than=0)
    # Without collectives each rank would commit alone: refused.
    with pytest.raises(ckpt.CheckpointError, match="without collectives is not supported"):
        ckpt.StorageWriter("s3://ckpt/nc/1", client=c).set_up_storage_writer(True, use_collectives=False)


def run_ranks(mode, world, server, uri, tmp_path, timeout=240):
    init = tmp_path / f"init-{mode}"
    procs = []
    for rank in range(world):
        out = tmp_path / f"{mode}-{rank}.json"
        procs.append((rank, out, subprocess.Popen(
            [sys.executable, os.path.join(HERE, "checkpoint_rank.py"), mode, str(rank), str(world), str(init),
             server.endpoint, uri, str(out)],
            cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)))
    results = {}
    for rank, out, p in procs:
        try:
            log, _ = p.communicate(timeout=timeout)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        results[rank] = (p.returncode, json.load(open(out)) if os.path.exists(out) else None, log)
    return results


def test_four_ranks_save_and_two_load_resharded(store, tmp_path):
    server, c = store
    uri = "s3://ckpt/dist/step-10"
    copies, deletes = ops(server, "CopyObject"), ops(server, "DeleteObject")
    for rank, (rc, res, log) in run_ranks("save", 4, server, uri, tmp_path).items():
        assert rc == 0, f"rank {rank}: {log}"
    names = sorted(o.key.rsplit("/", 1)[1] for o in c.list("ckpt", "dist/step-10/"))
    assert names[0] == ".metadata" and [n[:4] for n in names[1:]] == ["__0_", "__1_", "__2_", "__3_"], names
    assert (ops(server, "CopyObject"), ops(server, "DeleteObject")) == (copies, deletes)
    for rank, (rc, res, log) in run_ranks("load", 2, server, uri, tmp_path).items():
        assert rc == 0, f"rank {rank}: {log}"
        assert res["mismatch"] == [], res
        assert res["extra"] == {"step": 7, "name": "run1", "ranks": [1, 2, 3]}


def test_async_save_stages_and_reuses_its_buffers(store, tmp_path):
    server, _ = store
    for rank, (rc, res, log) in run_ranks("async", 2, server, "s3://ckpt/async", tmp_path).items():
        assert rc == 0, f"rank {rank}: {log}"
        assert res["mismatch_a"] == [] and res["mismatch_b"] == [], res
        assert res["reused"] is True, res


def test_a_rank_killed_mid_save_leaves_nothing_committed(store, tmp_path):
    server, c = store
    root = "s3://ckpt/crash"
    dcp.save({"x": torch.ones(3)}, storage_writer=ckpt.StorageWriter(root + "/step-1", client=c))
    etag = ckpt.set_latest(root, "step-1", expected=None, client=c)
    results = run_ranks("die", 4, server, root + "/step-2", tmp_path, timeout=180)
    assert results[2][0] == 17, results[2][2]
    for rank in (0, 1, 3):
        rc, res, log = results[rank]
        # An error, not a hang and not a success.
        assert rc == 3 and res and "error" in res and not res.get("saved"), f"rank {rank}: {rc} {res} {log}"
    with pytest.raises(ObjectNotFoundError):
        c.head("ckpt", "crash/step-2/.metadata")
    dcp_message(r"s3://ckpt/crash/step-2: no committed checkpoint",
                dcp.load, {"x": torch.zeros(3)}, storage_reader=ckpt.StorageReader(root + "/step-2", client=c))
    assert ckpt.read_latest(root, client=c) == ckpt.Latest("step-1", etag)
    # What it left: the objects of the ranks that finished, and the dead
    # rank's upload; removed, the prefix is empty.
    left = ckpt.leftovers(root + "/step-2", client=c, older_than=0)
    assert len(left.uploads) == 1 and "__2_" in left.uploads[0].key, left
    assert all(k.endswith(".distcp") for k in left.objects), left
    ckpt.remove_leftovers(root + "/step-2", client=c, older_than=0)
    assert c.list("ckpt", "crash/step-2/") == [] and c.list_uploads("ckpt", "crash/step-2/") == []
    got = {"x": torch.zeros(3)}
    dcp.load(got, storage_reader=ckpt.StorageReader(root + "/step-1", client=c))
    assert torch.equal(got["x"], torch.ones(3))


def test_latest_moves_by_compare_and_swap(store):
    server, c = store
    root = "s3://ckpt/cas"
    assert ckpt.read_latest(root, client=c) is None
    etag = ckpt.set_latest(root, "step-0", expected=None, client=c)
    with pytest.raises(ckpt.LatestConflictError):
        ckpt.set_latest(root, "step-x", expected=None, client=c)
    # Rounds of two writers that read the same pointer and both try to
    # move it: exactly one wins each round, and the pointer names it.
    for r in range(1, 16):
        seen = ckpt.read_latest(root, client=c)
        assert seen.etag == etag
        barrier = threading.Barrier(2)

        def move(name):
            barrier.wait()
            try:
                return ckpt.set_latest(root, name, expected=seen.etag, client=c)
            except ckpt.LatestConflictError:
                return None

        with concurrent.futures.ThreadPoolExecutor(2) as ex:
            outcomes = list(ex.map(move, [f"step-{r}-a", f"step-{r}-b"]))
        winners = [i for i, o in enumerate(outcomes) if o is not None]
        assert len(winners) == 1, outcomes
        now = ckpt.read_latest(root, client=c)
        assert now.checkpoint == f"step-{r}-{'ab'[winners[0]]}"
        etag = now.etag
    # A pointer deleted meanwhile is a conflict too (S3 answers If-Match
    # on a missing key 404, not 412).
    server.client().delete_object(Bucket="ckpt", Key="cas/latest")
    with pytest.raises(ckpt.LatestConflictError):
        ckpt.set_latest(root, "step-late", expected=etag, client=c)
    assert ckpt.read_latest(root, client=c) is None


def test_torch_save_and_load_streams(store):
    _, c = store
    obj = {"w": torch.randn(3 * MIB + 5), "small": torch.arange(10), "meta": {"epoch": 3}}
    for key, part in (("streams/big.pt", 5 * MIB), ("streams/small.pt", 64 * MIB)):
        uri = f"s3://ckpt/{key}"
        with ckpt.open_write(uri, client=c, part_size=part) as f:
            torch.save(obj, f)
        assert f.etag
        got = torch.load(ckpt.open_read(uri, client=c), weights_only=True)
        assert torch.equal(got["w"], obj["w"]) and torch.equal(got["small"], obj["small"]) and got["meta"] == obj["meta"]
    # An error inside the block: nothing appears.
    with pytest.raises(RuntimeError, match="boom"):
        with ckpt.open_write("s3://ckpt/streams/never.pt", client=c, part_size=5 * MIB) as f:
            torch.save(obj, f)
            raise RuntimeError("boom")
    with pytest.raises(ObjectNotFoundError):
        c.head("ckpt", "streams/never.pt")
    assert c.list_uploads("ckpt", "streams/") == []
    with pytest.raises(ObjectNotFoundError, match="streams/missing.pt"):
        ckpt.open_read("s3://ckpt/streams/missing.pt", client=c)
    # Seeks and reads of every size give the object's bytes.
    r = ckpt.open_read("s3://ckpt/streams/big.pt", client=c, window=64 << 10)
    whole = c.get("ckpt", "streams/big.pt")
    assert r.read(10) == whole[:10]
    r.seek(-100, os.SEEK_END)
    assert r.read() == whole[-100:]
    r.seek(5)
    assert r.read(300_000) == whole[5:300_005]
    assert r.read(0) == b"" and r.tell() == 300_005


def test_failures_name_the_object(store):
    server, c = store
    host, port = server.endpoint.rsplit("//", 1)[1].split(":")
    proxy = FaultProxy(host, int(port))
    try:
        proxy.always(("status", 503))
        bad = client_for(proxy.endpoint, retries=1)
        e = dcp_error(ObjectError, r"s3://ckpt/flaky/1/\S+: .*503",
                      dcp.save, {"x": torch.ones(2 * MIB)}, storage_writer=ckpt.StorageWriter("s3://ckpt/flaky/1", client=bad))
        assert e.status == 503
        assert not [o for o in c.list("ckpt", "flaky/") if o.key.endswith(".metadata")]
        with pytest.raises(ObjectError, match=r"s3://ckpt/flaky/x\.pt"):
            with ckpt.open_write("s3://ckpt/flaky/x.pt", client=bad) as f:
                f.write(b"abc")
    finally:
        proxy.close()


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on a GPU host)")


@cuda
def test_gpu_state_saves_and_loads_through_pinned_staging(store):
    """GPU tensors go out through pinned slots copied on a side stream, and
    come back into CUDA tensors through the ring's staging; async_save
    stages into pinned host buffers reused by the next save."""
    _, c = store
    g = torch.Generator().manual_seed(5)
    sd = {
        "w": torch.randn(1000, 1027, generator=g).cuda(),
        "b": torch.randn(3 * MIB + 1, generator=g).to(torch.bfloat16).cuda(),
        "odd": torch.randn(7, 9, generator=g).cuda().t(),
        "host": torch.arange(100),
    }
    uri = "s3://ckpt/gpu/step-1"
    dcp.save(sd, storage_writer=ckpt.StorageWriter(uri, client=c, part_size=5 * MIB, upload_memory=10 * MIB))
    got = {k: torch.zeros(v.shape, dtype=v.dtype, device=v.device) for k, v in sd.items()}
    dcp.load(got, storage_reader=ckpt.StorageReader(uri, client=c))
    for k in sd:
        assert torch.equal(got[k].cpu(), sd[k].cpu()), k
    w = ckpt.StorageWriter("s3://ckpt/gpu/a", client=c)
    dcp.async_save(sd, storage_writer=w).result()
    first = w._staged
    assert all(t.is_pinned() for t in first.buffers.values() if isinstance(t, torch.Tensor) and t.numel())
    sd["w"].add_(1)
    dcp.async_save(sd, storage_writer=w, checkpoint_id="s3://ckpt/gpu/b").result()
    assert w._staged is first
    got = {k: torch.zeros(v.shape, dtype=v.dtype, device=v.device) for k, v in sd.items()}
    dcp.load(got, storage_reader=ckpt.StorageReader("s3://ckpt/gpu/b", client=c))
    assert torch.equal(got["w"], sd["w"])


def test_a_full_server_and_lost_connections_name_the_object(make_server, tmp_path):
    cfg = tmp_path / "full.toml"
    cfg.write_text("drive_reserve_bytes = 1125899906842624\n")  # 1 PiB: no drive has room for shard data
    server = make_server(drives=1, extra_args=["--config", str(cfg)],
                         expected_errors=[r"drive full", r"quorum", r"shard write"])
    c = client_for(server.endpoint, retries=1)
    c.create_bucket("ckpt")
    e = dcp_error(ObjectError, r"s3://ckpt/full/1/__0_\S+\.distcp",
                  dcp.save, {"x": torch.ones(2 * MIB)}, storage_writer=ckpt.StorageWriter("s3://ckpt/full/1", client=c))
    # The server's 503 when its answer arrives before it closes the
    # connection the body was still coming on; else the broken connection.
    assert (e.status or 0) >= 500 or isinstance(e, ObjectConnectionError), e
    assert [o.key for o in c.list("ckpt", "full/")] == []
    # A server gone silent on every connection: a connection error naming
    # the object once the client's I/O timeout passes, not a hang.
    host, port = server.endpoint.rsplit("//", 1)[1].split(":")
    proxy = FaultProxy(host, int(port))
    try:
        proxy.always(("stall", 1, 20))
        bad = client_for(proxy.endpoint, retries=1, io_timeout=1.0)
        with pytest.raises(ObjectConnectionError, match=r"s3://ckpt/cut\.pt") as e:
            with ckpt.open_write("s3://ckpt/cut.pt", client=bad) as f:
                torch.save({"x": torch.ones(10)}, f)
        assert e.value.status is None
    finally:
        proxy.close()

"""Mapped short-circuit reads (docs/local-reads.md, "Mapped reads"): reads
into `tarn._native.HostMemory` (the loader's host tensors) put the shard
files' page-cache pages there, locked and checked, instead of copying. The
bytes equal HTTP reads at every offset and geometry; a block that fails its
checksum in the page cache is read over HTTP, never served; a write to a
mapped tensor copies its page and never reaches the stored object; a version
deleted or overwritten after a load leaves the loaded tensors as they were;
the mappings go with the tensors; a process that may not lock memory
copies."""

import gc
import hashlib
import json
import os
import random
import subprocess
import sys

import pytest
import safetensors.torch as st
import torch

import tarn.loader as loader
import tarn.objects as objects
from tarn import _native
from conftest import data, footer_shard_index
from tarnproc import ACCESS_KEY, SECRET_KEY

MIB = 1 << 20
PAGE = 4096
HERE = os.path.dirname(os.path.abspath(__file__))


def client(endpoint, **kw):
    return objects.Client(endpoint, access_key=ACCESS_KEY, secret_key=SECRET_KEY, **kw)


def drive_maps(server):
    """This process's mappings of files on the server's drives: (lines,
    kB locked in them)."""
    lines, locked, current = [], 0, None
    with open("/proc/self/smaps") as f:
        for line in f:
            parts = line.split()
            if "-" in parts[0] and len(parts) >= 5:
                path = parts[5] if len(parts) > 5 else ""
                current = any(path.startswith(d) for d in server.drives)
                if current:
                    lines.append(line)
            elif current and parts[0] == "Locked:":
                locked += int(parts[1])
    return lines, locked


def read_mapped(c, bucket, key, off, n):
    """Object bytes [off, off + n) read into HostMemory placed as the loader
    places a tensor (as far into a page as the bytes are into the object's)."""
    pad = off % PAGE
    mem = _native.HostMemory(pad + n)
    view = memoryview(mem)
    assert c.read([(bucket, key, off, n, view[pad:], 0)]) == [n]
    return mem, bytes(view[pad : pad + n])


GEOMETRIES = [
    (4, [], MIB),
    (1, [], MIB),
    (6, ["--data-shards", "4", "--parity-shards", "2"], MIB),
    (4, ["--data-shards", "3", "--parity-shards", "1"], MIB),
]


@pytest.mark.parametrize("drives,args,stripe", GEOMETRIES, ids=["2+2", "1", "4+2", "3+1"])
def test_mapped_reads_equal_http_reads(make_server, drives, args, stripe):
    server = make_server(drives=drives, extra_args=args)
    s3 = server.client()
    s3.create_bucket(Bucket="mapped")
    body = data("m", 7 * MIB + 12345)
    s3.put_object(Bucket="mapped", Key="k", Body=body)
    c = client(server.endpoint, chunk_size=2 * MIB)
    c.head("mapped", "k")
    rng = random.Random(drives)
    pieces = [(0, len(body)), (1, len(body) - 1), (stripe - 1, 3 * stripe + 2), (5000, MIB), (len(body) - MIB - 3, MIB + 3)]
    for _ in range(8):
        n = rng.randrange(1, 3 * MIB)
        pieces.append((rng.randrange(0, len(body) - n), n))
    kept = []
    for off, n in pieces:
        mem, got = read_mapped(c, "mapped", "k", off, n)
        assert got == body[off : off + n], (off, n)
        kept.append(mem)
    st_ = c.stats()
    assert st_["local_fallback_bytes"] == 0, st_
    assert 0 < st_["local_mapped_bytes"] <= st_["local_bytes"], st_
    assert sum(m.mapped_runs for m in kept) > 0
    lines, locked = drive_maps(server)
    assert lines and locked > 0, (lines, locked)
    # Memory that is not HostMemory is copied into, as before.
    buf = bytearray(len(body))
    before = c.stats()["local_mapped_bytes"]
    assert c.read([("mapped", "k", 0, len(body), buf, 0)]) == [len(body)]
    assert bytes(buf) == body and c.stats()["local_mapped_bytes"] == before
    del kept, mem
    gc.collect()
    assert drive_maps(server) == ([], 0)


def make_model(tmp_path, s3, key="model.safetensors", n=6, mib=3):
    g = torch.Generator().manual_seed(5)
    # Odd sizes put most tensors at offsets that are not page-aligned.
    tensors = {f"w{i}": torch.randn(mib * MIB // 4 + 7 * i + 1, generator=g) for i in range(n)}
    tensors["small"] = torch.arange(10, dtype=torch.int16)
    path = tmp_path / key
    st.save_file(tensors, str(path))
    s3.put_object(Bucket="models", Key=key, Body=path.read_bytes())
    return tensors


def shard_digest(server):
    h = hashlib.sha256()
    for d in server.drives:
        for root, _, files in sorted(os.walk(os.path.join(d, "data"))):
            for f in sorted(files):
                with open(os.path.join(root, f), "rb") as fh:
                    h.update(fh.read())
    return h.hexdigest()


def test_loader_maps_tensors_that_stay_what_was_stored(make_server, tmp_path):
    server = make_server()
    s3 = server.client()
    s3.create_bucket(Bucket="models")
    want = make_model(tmp_path, s3)
    c = client(server.endpoint)
    L = loader.Loader("s3://models/model.safetensors", client=c)
    got = dict(L)
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k
    assert L.stats["local_mapped_bytes"] > 0.9 * L.stats["bytes_total"], L.stats
    assert L.stats["local_fallback_bytes"] == 0, L.stats
    lines, locked = drive_maps(server)
    assert lines and locked > 0
    # A write copies the page it touches: the tensor changes, the shard
    # files and what a new load reads do not.
    digest = shard_digest(server)
    got["w1"][100] = 12345.0
    got["w2"].zero_()
    assert got["w1"][100] == 12345.0 and not got["w2"].any()
    assert shard_digest(server) == digest
    again = loader.load("s3://models/model.safetensors", client=client(server.endpoint))
    for k in want:
        assert torch.equal(again[k], want[k]), k
    # Overwritten and then deleted after the load: the loaded tensors keep
    # the bytes they had (their pages are locked; the files' data stays
    # until the last mapping goes).
    s3.put_object(Bucket="models", Key="model.safetensors", Body=b"x" * (2 * MIB))
    s3.delete_object(Bucket="models", Key="model.safetensors")
    for k in want:
        assert torch.equal(again[k], want[k]), k
    del got, again
    gc.collect()
    assert drive_maps(server) == ([], 0)
    # map_local=False copies.
    make_model(tmp_path, s3)
    L = loader.Loader("s3://models/model.safetensors", client=client(server.endpoint), map_local=False)
    got = dict(L)
    assert L.stats["local_mapped_bytes"] == 0 and L.stats["local_bytes"] == L.stats["bytes_total"], L.stats
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_a_block_corrupt_in_the_page_cache_is_read_over_http(make_server, tmp_path):
    server = make_server()
    s3 = server.client()
    s3.create_bucket(Bucket="models")
    want = make_model(tmp_path, s3, n=4, mib=2)
    files = [os.path.join(r, f) for d in server.drives for r, _, fs in os.walk(os.path.join(d, "data")) for f in fs]
    # A byte flipped through the page cache in the second block of data
    # shard 0 (the first one the header's HTTP read would heal): the
    # mapped check sees it.
    victim = next(f for f in files if footer_shard_index(f) == 0)
    with open(victim, "r+b") as f:
        f.seek(512 * 1024 + 100_000)
        b = f.read(1)
        f.seek(512 * 1024 + 100_000)
        f.write(bytes([b[0] ^ 0x55]))
    L = loader.Loader("s3://models/model.safetensors", client=client(server.endpoint))
    got = dict(L)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    assert L.stats["local_fallback_bytes"] > 0, L.stats
    assert L.stats["local_mapped_bytes"] > 0, L.stats


MEMLOCK_SCRIPT = r"""
import json, resource, sys
resource.setrlimit(resource.RLIMIT_MEMLOCK, (0, 0))
import torch, tarn.loader, tarn.objects
c = tarn.objects.Client(sys.argv[1], access_key=sys.argv[2], secret_key=sys.argv[3])
L = tarn.loader.Loader("s3://models/model.safetensors", client=c)
got = dict(L)
print(json.dumps({"stats": L.stats, "sums": {k: float(v.double().sum()) for k, v in got.items()}}))
"""


def test_a_process_that_may_not_lock_memory_copies(make_server, tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to drop CAP_IPC_LOCK for the child")
    server = make_server()
    s3 = server.client()
    s3.create_bucket(Bucket="models")
    want = make_model(tmp_path, s3, n=3, mib=2)
    r = subprocess.run(
        ["setpriv", "--inh-caps=-ipc_lock", "--bounding-set=-ipc_lock", sys.executable, "-c", MEMLOCK_SCRIPT,
         server.endpoint, ACCESS_KEY, SECRET_KEY],
        capture_output=True, text=True, timeout=120, cwd=HERE,
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    stats = out["stats"]
    assert stats["local_mapped_bytes"] == 0 and stats["local_bytes"] == stats["bytes_total"], stats
    for k, v in want.items():
        assert out["sums"][k] == pytest.approx(float(v.double().sum())), k

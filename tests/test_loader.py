"""`tarn.loader` against a live `tarn server`: what it loads equals what
`safetensors.torch.load_file` loads from the same file, for every dtype
safetensors has, odd alignments, empty tensors, sharded models, a memory cap
smaller than the largest file and the GPU path's staging (run on CPU); a
broken file, a missing object or a server gone mid-load is a clear
exception; a two-rank (gloo) load reads each byte once."""

import json
import os
import struct
import subprocess
import sys
import threading
import time

import pytest
import safetensors.torch as st
import torch

import tarn.loader as loader
import tarn.objects as objects
from faultproxy import FaultProxy
from tarn.errors import ObjectConnectionError, ObjectNotFoundError
from tarnproc import ACCESS_KEY, SECRET_KEY

HERE = os.path.dirname(os.path.abspath(__file__))
MIB = 1 << 20


def client(endpoint, **kw):
    return objects.Client(endpoint, access_key=ACCESS_KEY, secret_key=SECRET_KEY, **kw)


def every_dtype():
    """A tensor per dtype safetensors can load in this torch, in shapes that
    include a scalar and empty ones, with 1- and 3-byte tensors between them
    so that most offsets are not aligned to their element size."""
    g = torch.Generator().manual_seed(1)
    out = {}
    for i, (name, dtype) in enumerate(sorted(st._TYPES.items())):
        if dtype is None:
            continue
        for j, shape in enumerate([(), (0,), (3, 0, 2), (7,), (5, 3), (2, 3, 5)]):
            if dtype.is_floating_point or dtype.is_complex:
                t = torch.randn(shape, generator=g, dtype=torch.float32)
                t = t.to(torch.complex64) * (1 + 2j) if dtype.is_complex else t.to(dtype)
            elif dtype == torch.bool:
                t = torch.rand(shape, generator=g) > 0.5
            else:
                t = torch.randint(0, 120, shape, generator=g, dtype=torch.int64).to(dtype)
            out[f"{name.lower()}.{j}"] = t
        out[f"pad.{i}"] = torch.arange(1 + i % 3, dtype=torch.uint8)
    return out


def same(a, b):
    """Equal names, dtypes, shapes and bytes."""
    assert a.keys() == b.keys()
    for k in a:
        x, y = a[k], b[k]
        assert (x.dtype, tuple(x.shape)) == (y.dtype, tuple(y.shape)), k
        bx = x.reshape(-1).view(torch.uint8) if x.numel() else torch.empty(0, dtype=torch.uint8)
        by = y.reshape(-1).view(torch.uint8) if y.numel() else torch.empty(0, dtype=torch.uint8)
        assert torch.equal(bx, by), k


def upload(s3, bucket, key, path_or_bytes):
    body = open(path_or_bytes, "rb").read() if isinstance(path_or_bytes, (str, os.PathLike)) else path_or_bytes
    s3.put_object(Bucket=bucket, Key=key, Body=body)


@pytest.fixture
def s3(server):
    c = server.client()
    c.create_bucket(Bucket="models")
    return c


def sharded(tmp_path, s3, prefix="llama/", shards=3, tensors=12, size=300_000):
    """A Hugging Face style sharded model with its index, config and
    tokenizer files, and something in a subfolder that is not the model's."""
    g = torch.Generator().manual_seed(2)
    weights = {}
    index = {"metadata": {"total_size": 0}, "weight_map": {}}
    for s in range(shards):
        part = {}
        for t in range(tensors):
            n = size // 4 + 37 * t
            part[f"model.layers.{s}.w{t}"] = torch.randn(n, generator=g).to(torch.bfloat16 if t % 2 else torch.float32)
        name = f"model-{s + 1:05}-of-{shards:05}.safetensors"
        path = tmp_path / name
        st.save_file(part, str(path), metadata={"format": "pt"})
        upload(s3, "models", prefix + name, path)
        for k in part:
            index["weight_map"][k] = name
        weights.update(part)
    upload(s3, "models", prefix + "model.safetensors.index.json", json.dumps(index).encode())
    upload(s3, "models", prefix + "config.json", b'{"architectures": ["LlamaForCausalLM"]}')
    upload(s3, "models", prefix + "tokenizer.json", b'{"version": "1.0"}')
    upload(s3, "models", prefix + "original/consolidated.pth", b"not this")
    return weights


def test_every_dtype_odd_alignments_and_empty_tensors(server, s3, tmp_path):
    tensors = every_dtype()
    path = tmp_path / "all.safetensors"
    st.save_file(tensors, str(path))
    upload(s3, "models", "all/model.safetensors", path)
    want = st.load_file(str(path))
    # Offsets that are not multiples of the element size are in the file.
    n = struct.unpack("<Q", open(path, "rb").read(8))[0]
    header = json.loads(open(path, "rb").read(8 + n)[8:])
    assert any(v["data_offsets"][0] % 8 for k, v in header.items() if k != "__metadata__")
    c = client(server.endpoint)
    got = loader.load("s3://models/all/model.safetensors", client=c)
    same(got, want)
    # The header was one request; every tensor went straight into its place.
    assert c.stats()["requests"] <= 1 + len(tensors)
    # A hand-made file whose header length is odd, so data starts unaligned.
    raw = torch.arange(10, dtype=torch.float32)
    doc = json.dumps({"x": {"dtype": "F32", "shape": [10], "data_offsets": [0, 40]}}).encode() + b" "
    doc += b" " * (1 - len(doc) % 2)  # odd total header length
    upload(s3, "models", "odd.safetensors", struct.pack("<Q", len(doc)) + doc + raw.numpy().tobytes())
    assert torch.equal(loader.load("s3://models/odd.safetensors", client=c)["x"], raw)


def test_sharded_model_prefix_index_and_files(server, s3, tmp_path):
    weights = sharded(tmp_path, s3)
    c = client(server.endpoint)
    files = tmp_path / "files"
    got = loader.load("s3://models/llama/", client=c, files_dir=str(files))
    same(got, weights)
    assert sorted(os.listdir(files)) == ["config.json", "model.safetensors.index.json", "tokenizer.json"]
    assert json.loads((files / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    # The same through the index, a list of files, and one file.
    same(loader.load("s3://models/llama/model.safetensors.index.json", client=c), weights)
    uris = [f"s3://models/llama/model-{s:05}-of-00003.safetensors" for s in (1, 2, 3)]
    same(loader.load(uris, client=c), weights)
    one = loader.load(uris[1], client=c)
    same(one, {k: v for k, v in weights.items() if k.startswith("model.layers.1.")})
    # A stream yields every tensor once.
    names = [n for n, _ in loader.stream("s3://models/llama", client=c)]
    assert sorted(names) == sorted(weights)
    assert loader.fetch_files("s3://models/llama/", str(tmp_path / "again"), client=c)


def test_memory_cap_smaller_than_the_largest_file(server, s3, tmp_path):
    weights = sharded(tmp_path, s3, prefix="capped/", shards=2, tensors=16, size=400_000)
    largest = max(os.path.getsize(tmp_path / f) for f in os.listdir(tmp_path) if f.endswith(".safetensors"))
    cap = 1 * MIB
    assert largest > 3 * cap
    c = client(server.endpoint)
    ld = loader.Loader("s3://models/capped/", client=c, memory_cap=cap)
    got = {}
    for name, t in ld:
        got[name] = t.clone()  # the caller keeps a copy; the loader's is let go
        del t
    same(got, weights)
    assert 0 < ld.stats["peak_held_bytes"] <= cap, ld.stats
    # The GPU path's staging, run on CPU: pieces through a pool of two slots.
    ld = loader.Loader("s3://models/capped/", client=client(server.endpoint, chunk_size=MIB),
                       memory_cap=2 * MIB, _stage_cpu_tensors=True)
    same(dict(ld), weights)


def test_broken_files_and_missing_objects_are_clear_errors(server, s3, tmp_path):
    c = client(server.endpoint)
    path = tmp_path / "m.safetensors"
    st.save_file({"a": torch.ones(1000), "b": torch.zeros(2000)}, str(path))
    good = open(path, "rb").read()
    with pytest.raises(ObjectNotFoundError, match="s3://models/nothing.safetensors"):
        loader.load("s3://models/nothing.safetensors", client=c)
    # Truncated: the header places a tensor past the end.
    upload(s3, "models", "short.safetensors", good[: len(good) - 100])
    with pytest.raises(loader.SafetensorsError, match="truncated"):
        loader.load("s3://models/short.safetensors", client=c)
    # Garbage where the header is.
    n = struct.unpack("<Q", good[:8])[0]
    upload(s3, "models", "garbage.safetensors", good[:8] + b"{" * n + good[8 + n :])
    with pytest.raises(loader.SafetensorsError, match="not valid JSON"):
        loader.load("s3://models/garbage.safetensors", client=c)
    upload(s3, "models", "huge.safetensors", struct.pack("<Q", 1 << 40) + good[8:])
    with pytest.raises(loader.SafetensorsError, match="header length"):
        loader.load("s3://models/huge.safetensors", client=c)
    doc = json.dumps({"a": {"dtype": "F32", "shape": [10], "data_offsets": [0, 39]}}).encode()
    upload(s3, "models", "sizes.safetensors", struct.pack("<Q", len(doc)) + doc + b"\0" * 40)
    with pytest.raises(loader.SafetensorsError, match="needs 40"):
        loader.load("s3://models/sizes.safetensors", client=c)
    doc = json.dumps({"a": {"dtype": "Q7", "shape": [1], "data_offsets": [0, 1]}}).encode()
    upload(s3, "models", "dtype.safetensors", struct.pack("<Q", len(doc)) + doc + b"\0")
    with pytest.raises(loader.SafetensorsError, match="unknown dtype 'Q7'"):
        loader.load("s3://models/dtype.safetensors", client=c)
    # An index that names a shard that is not there.
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    upload(s3, "models", "half/model.safetensors.index.json", json.dumps(index).encode())
    upload(s3, "models", "half/model-00001-of-00002.safetensors", good)
    with pytest.raises(ObjectNotFoundError, match="model-00002-of-00002"):
        loader.load("s3://models/half/", client=c)
    with pytest.raises(loader.LoaderError, match="no .safetensors"):
        loader.load("s3://models/empty/", client=c)


def test_faults_during_a_load(server, s3, tmp_path):
    weights = sharded(tmp_path, s3, prefix="faulty/", shards=2, tensors=8, size=2 * MIB)
    host, port = server.endpoint[len("http://"):].split(":")
    proxy = FaultProxy(host, int(port))
    try:
        c = client(proxy.endpoint, connections=4, chunk_size=MIB, io_timeout=5.0)
        proxy.script(("status", 503), ("reset", 500_000), ("status", 503), ("reset", 50))
        ld = loader.Loader("s3://models/faulty/", client=c)
        same(dict(ld), weights)
        assert ld.stats["retries"] >= 1, ld.stats
        # The server goes away mid-load: an error naming what failed, no hang.
        proxy.always(("stall", 100_000, 3))
        # A short I/O timeout: a connection the closed proxy leaves silent
        # (not reset) costs each attempt that long.
        c2 = client(proxy.endpoint, connections=4, chunk_size=MIB, retries=2, hedge=False, connect_timeout=1.0,
                    io_timeout=5.0)
        errors = []

        def run():
            try:
                loader.load("s3://models/faulty/", client=c2)
            except Exception as e:  # noqa: BLE001
                errors.append(e)

        t = threading.Thread(target=run)
        t.start()
        time.sleep(1.0)
        proxy.close()
        t.join(timeout=60)
        assert not t.is_alive(), "the load hung"
        assert len(errors) == 1 and isinstance(errors[0], ObjectConnectionError), errors
        assert "s3://models/faulty/model-0000" in str(errors[0])
    finally:
        proxy.close()


def test_two_ranks_each_read_their_share(server, s3, tmp_path):
    weights = sharded(tmp_path, s3, prefix="tp/", shards=2, tensors=10, size=MIB)
    total = sum(t.numel() * t.element_size() for t in weights.values())
    init = tmp_path / "init"
    procs = []
    for rank in range(2):
        out = tmp_path / f"rank{rank}.json"
        procs.append((out, subprocess.Popen(
            [sys.executable, os.path.join(HERE, "loader_rank.py"), str(rank), "2", str(init),
             server.endpoint, "s3://models/tp/", str(out)],
            cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)))
    results = []
    for out, p in procs:
        try:
            log, _ = p.communicate(timeout=240)
        finally:
            if p.poll() is None:
                p.kill()
        assert p.returncode == 0, log
        results.append(json.load(open(out)))
    import hashlib
    want = {}
    for k, t in weights.items():
        raw = t.reshape(-1).view(torch.uint8)
        want[k] = [str(t.dtype), list(t.shape), hashlib.sha256(raw.numpy().tobytes()).hexdigest()]
    fetched = []
    for r in results:
        assert r["digests"] == want
        # Over HTTP, or from the server's shard files (short-circuit reads:
        # a server on this host); the local-read fallbacks are in both.
        st = r["stats"]
        assert st["local_bytes"] > 0, st
        fetched.append(st["bytes_received"] + st["local_bytes"])
    # Each rank read about half the weights (plus the headers): the model
    # was read once between them, not twice.
    assert sum(fetched) < total * 1.1, (fetched, total)
    for f in fetched:
        assert 0.3 * total < f < 0.7 * total, (fetched, total)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on a GPU host)")


@cuda
def test_gpu_load_equals_safetensors(server, s3, tmp_path):
    """The real GPU path: tensors land in CUDA memory through pinned staging
    slots and the copy stream, every dtype and odd offset included, and with
    a memory cap smaller than the largest file (a staging pool of 2 slots)."""
    tensors = every_dtype()
    path = tmp_path / "all.safetensors"
    st.save_file(tensors, str(path))
    upload(s3, "models", "gpu/all.safetensors", path)
    c = client(server.endpoint)
    got = loader.load("s3://models/gpu/all.safetensors", device="cuda", client=c)
    assert all(t.device.type == "cuda" for t in got.values())
    same({k: v.cpu() for k, v in got.items()}, st.load_file(str(path)))
    weights = sharded(tmp_path, s3, prefix="gpucap/", shards=2, tensors=16, size=400_000)
    ld = loader.Loader("s3://models/gpucap/", device="cuda", client=client(server.endpoint, chunk_size=MIB),
                       memory_cap=2 * MIB)
    got = {name: t.cpu() for name, t in ld}
    same(got, weights)
    assert ld.stats["peak_held_bytes"] <= 2 * MIB, ld.stats

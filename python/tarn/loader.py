"""Model weights from Tarn (or any S3 endpoint) into host or GPU memory.

    import tarn.loader
    weights = tarn.loader.load("s3://models/llama-3-8b/", device="cuda:0")
    for name, tensor in tarn.loader.stream("s3://models/llama-3-8b/", device="cuda:0"):
        ...

``uri`` is one safetensors file (``s3://b/m/model.safetensors``), a list of
them, a Hugging Face style index (``.../model.safetensors.index.json``), or a
prefix (``s3://b/m/``: its index if it has one, else every ``.safetensors``
file directly under it). Each file's header is read in one request (all
headers at once); then every tensor is read straight into its final memory,
host or GPU (through pinned staging buffers), with the next file's tensors
already in flight. ``memory_cap`` bounds the bytes the loader holds that the
caller has not received yet (tensors in flight or waiting to be yielded, and
the pinned staging buffers for GPU loads); a tensor larger than the cap is
read alone.

With ``process_group`` (a ``torch.distributed`` group), each rank reads only
its share of the bytes and receives the rest from the others by broadcast:
an 8-way tensor-parallel load reads the model from the server once, not
8 times. Every rank gets every tensor.

``files_dir``: the model's other files (config, tokenizer, generation
config...: every object directly under the prefix that is not a weights
file) are written there.

Errors are exceptions, never a partly loaded model: a missing object
(``tarn.errors.ObjectNotFoundError``), a truncated file or a corrupt header
(:class:`SafetensorsError`), a failed read (``tarn.errors.ObjectError``, with
the object and the bytes).
"""

from __future__ import annotations

import json
import os
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Sequence, Union

from .errors import TarnError
from . import objects
from .objects import Client, parse_uri

__all__ = ["load", "stream", "fetch_files", "Loader", "SafetensorsError", "LoaderError", "DTYPES"]

#: Bytes of each file read first: its header, in one request (a longer
#: header takes a second).
HEADER_READ = 512 << 10
#: Longest header accepted (safetensors' own limit is 100 MB).
HEADER_MAX = 100_000_000
#: Files that are weights, not config: never copied to ``files_dir``.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt", ".onnx")
#: Bytes of tensors allocated before their reads are submitted: reads start
#: while the rest of the model is being allocated.
SUBMIT_BYTES = 64 << 20
#: Bytes broadcast between error checks in a distributed load.
ROUND_BYTES = 256 << 20
#: Host tensors at least this large are made in :class:`tarn._native.HostMemory`,
#: whose pages short-circuit reads may map from the shard files (``map_local``).
MAP_MIN_BYTES = 1 << 20
#: Page size: a mapped tensor starts as far into its first page as its bytes
#: are into a page of the file, so whole pages line up with the file's.
PAGE = 4096


class LoaderError(TarnError):
    """The model could not be loaded as asked (no weights under the URI, an
    index that names a missing file, another rank failed)."""


class SafetensorsError(LoaderError, ValueError):
    """A safetensors file is corrupt or truncated: its header does not parse,
    names an unknown dtype, or places tensors outside the file."""


def _dtypes() -> dict[str, Any]:
    import torch

    names = {
        "BOOL": "bool",
        "U8": "uint8",
        "I8": "int8",
        "I16": "int16",
        "U16": "uint16",
        "I32": "int32",
        "U32": "uint32",
        "I64": "int64",
        "U64": "uint64",
        "F16": "float16",
        "BF16": "bfloat16",
        "F32": "float32",
        "F64": "float64",
        "C64": "complex64",
        "F8_E4M3": "float8_e4m3fn",
        "F8_E5M2": "float8_e5m2",
        "F8_E4M3FNUZ": "float8_e4m3fnuz",
        "F8_E5M2FNUZ": "float8_e5m2fnuz",
        "F8_E8M0": "float8_e8m0fnu",
        "F4": "float4_e2m1fn_x2",
    }
    return {k: getattr(torch, v) for k, v in names.items() if hasattr(torch, v)}


#: safetensors dtype name -> torch dtype (those this torch has).
DTYPES: dict[str, Any] = {}


def _dtype(name: str, where: str):
    if not DTYPES:
        DTYPES.update(_dtypes())
    try:
        return DTYPES[name]
    except KeyError:
        raise SafetensorsError(f"{where}: unknown dtype {name!r}") from None


@dataclass
class TensorSpec:
    name: str
    dtype: Any
    shape: list[int]
    file: "FileSpec"
    start: int  # offset of the tensor's bytes in the file
    nbytes: int


@dataclass
class FileSpec:
    bucket: str
    key: str
    size: int
    etag: str
    tensors: list[TensorSpec] = field(default_factory=list)
    metadata: dict = field(default_factory=dict)

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.key}"


def _parse_header(f: FileSpec, head: bytes) -> None:
    where = f.uri
    try:
        (n,) = struct.unpack_from("<Q", head, 0)
    except struct.error:
        raise SafetensorsError(f"{where}: {f.size} bytes, too short for a safetensors header") from None
    if n > HEADER_MAX or 8 + n > f.size:
        raise SafetensorsError(
            f"{where}: header length {n} does not fit in the file of {f.size} bytes (truncated or not safetensors)"
        )
    try:
        doc = json.loads(head[8 : 8 + n].decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise SafetensorsError(f"{where}: the header is not valid JSON: {e}") from None
    if not isinstance(doc, dict):
        raise SafetensorsError(f"{where}: the header is not a JSON object")
    base = 8 + n
    meta = doc.pop("__metadata__", None) or {}
    if not isinstance(meta, dict):
        raise SafetensorsError(f"{where}: __metadata__ is not an object")
    f.metadata = meta
    for name, t in doc.items():
        if not isinstance(t, dict) or not {"dtype", "shape", "data_offsets"} <= t.keys():
            raise SafetensorsError(f"{where}: tensor {name!r}: expected dtype, shape and data_offsets")
        dtype = _dtype(t["dtype"], f"{where}: tensor {name!r}")
        shape, offs = t["shape"], t["data_offsets"]
        if (
            not isinstance(shape, list)
            or not all(isinstance(d, int) and d >= 0 for d in shape)
            or not isinstance(offs, list)
            or len(offs) != 2
            or not all(isinstance(o, int) for o in offs)
        ):
            raise SafetensorsError(f"{where}: tensor {name!r}: malformed shape or data_offsets")
        b, e = offs
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * dtype.itemsize
        if not 0 <= b <= e or e - b != nbytes:
            raise SafetensorsError(
                f"{where}: tensor {name!r}: data_offsets {offs} hold {e - b} bytes, its shape {shape} "
                f"of {t['dtype']} needs {nbytes}"
            )
        if base + e > f.size:
            raise SafetensorsError(
                f"{where}: tensor {name!r} ends at byte {base + e}, past the end of the file "
                f"({f.size} bytes): the file is truncated"
            )
        f.tensors.append(TensorSpec(name, dtype, shape, f, base + b, nbytes))
    f.tensors.sort(key=lambda t: t.start)
    for a, b in zip(f.tensors, f.tensors[1:]):
        if b.start < a.start + a.nbytes:
            raise SafetensorsError(f"{where}: tensors {a.name!r} and {b.name!r} overlap")


def read_header(client: Client, bucket: str, key: str) -> FileSpec:
    """A safetensors file's header, in one request (two for a header over
    :data:`HEADER_READ`)."""
    head, size, etag = client.read_prefix(bucket, key, HEADER_READ)
    f = FileSpec(bucket, key, size, etag)
    if len(head) >= 8:
        (n,) = struct.unpack_from("<Q", head, 0)
        if 8 + n > len(head) and 8 + n <= min(size, HEADER_MAX + 8):
            rest = bytearray(8 + n - len(head))
            client.read([(bucket, key, len(head), len(rest), rest, 0, None, etag or None)])
            head = head + bytes(rest)
    _parse_header(f, head)
    return f


def _split(uri: str) -> tuple[str, str]:
    return parse_uri(uri)


def resolve(client: Client, uri: Union[str, Sequence[str]]) -> tuple[list[tuple[str, str]], Optional[tuple[str, str]]]:
    """The safetensors files a URI names, and the prefix (bucket, prefix) its
    other files live under (None for files named one by one)."""
    if not isinstance(uri, str):
        files = []
        for u in uri:
            b, k = _split(u)
            if not k.endswith(".safetensors"):
                raise LoaderError(f"{u}: a list of URIs names .safetensors files")
            files.append((b, k))
        if not files:
            raise LoaderError("no files to load")
        return files, None
    bucket, key = _split(uri)
    if key.endswith(".safetensors"):
        return [(bucket, key)], (bucket, key.rpartition("/")[0] + "/" if "/" in key else "")
    if key.endswith(".json"):
        prefix = key.rpartition("/")[0] + "/" if "/" in key else ""
        return _from_index(client, bucket, key, prefix), (bucket, prefix)
    prefix = key if key.endswith("/") or not key else key + "/"
    listed = client.list(bucket, prefix)
    top = {o.key[len(prefix) :]: o.size for o in listed if "/" not in o.key[len(prefix) :]}
    if "model.safetensors.index.json" in top:
        return _from_index(client, bucket, prefix + "model.safetensors.index.json", prefix), (bucket, prefix)
    files = sorted(n for n in top if n.endswith(".safetensors"))
    if not files:
        raise LoaderError(f"no .safetensors files under s3://{bucket}/{prefix}")
    return [(bucket, prefix + n) for n in files], (bucket, prefix)


def _from_index(client: Client, bucket: str, key: str, prefix: str) -> list[tuple[str, str]]:
    try:
        doc = json.loads(client.get(bucket, key))
        wm = doc["weight_map"]
        assert isinstance(wm, dict)
    except (ValueError, KeyError, AssertionError, TypeError):
        raise LoaderError(f"s3://{bucket}/{key}: not a safetensors index (no weight_map)") from None
    files = []
    for f in wm.values():
        if f not in files:
            files.append(f)
    return [(bucket, prefix + f) for f in sorted(files)]


def fetch_files(uri: str, dest: str, client: Optional[Client] = None) -> list[str]:
    """Copies the model's other files (config, tokenizer...: every object
    directly under the URI's prefix that is not a weights file) to ``dest``;
    returns their paths."""
    client = client or Client()
    bucket, key = _split(uri)
    if key.endswith((".safetensors", ".json")):
        prefix = key.rpartition("/")[0] + "/" if "/" in key else ""
    else:
        prefix = key if key.endswith("/") or not key else key + "/"
    return _fetch_files(client, bucket, prefix, dest)


def _fetch_files(client: Client, bucket: str, prefix: str, dest: str) -> list[str]:
    os.makedirs(dest, exist_ok=True)
    names = [
        k[len(prefix) :]
        for k, *_ in client.list(bucket, prefix)
        if "/" not in k[len(prefix) :] and not k.endswith(WEIGHT_SUFFIXES) and k != prefix
    ]

    def one(name: str) -> str:
        data = client.get(bucket, prefix + name)
        path = os.path.join(dest, name)
        tmp = path + ".tarn-partial"
        with open(tmp, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
        return path

    with ThreadPoolExecutor(max_workers=8) as ex:
        return list(ex.map(one, names))


class Loader:
    """One load: resolve the URI, read the headers, stream the tensors.

    Iterating yields ``(name, tensor)`` as tensors land (in file and offset
    order for a distributed load); ``stats`` says what it took: bytes and
    requests from the server (this rank's: ``bytes_received`` over HTTP,
    ``local_bytes`` from the shard files of a node on this host), files,
    tensors, seconds, and the most bytes it held for the caller at once
    (``peak_held_bytes``).

    ``map_local`` (on by default): host tensors of :data:`MAP_MIN_BYTES` or
    more get memory of their own (:class:`tarn._native.HostMemory`, freed
    with the tensor), and short-circuit reads put the shard files' pages in
    it instead of copying them: private mappings of the page cache, locked,
    then checked against the blocks' checksums (``local_mapped_bytes`` in
    ``stats``). The weights then cost no memory beyond the page cache, which
    processes loading the same model share; a write to such a tensor copies
    the page it touches, and the stored object never changes. Such tensors
    are not resizable (``resize_``), like any made by ``torch.frombuffer``.
    Where pages cannot be locked (``RLIMIT_MEMLOCK`` without
    ``CAP_IPC_LOCK``), bytes are copied as usual.
    """

    def __init__(
        self,
        uri: Union[str, Sequence[str]],
        device: Any = "cpu",
        *,
        client: Optional[Client] = None,
        memory_cap: Optional[int] = None,
        process_group: Any = None,
        files_dir: Optional[str] = None,
        pin_memory: bool = False,
        map_local: bool = True,
        _stage_cpu_tensors: bool = False,
    ):
        import torch

        self.client = client or Client()
        self.device = torch.device(device)
        self.pin_memory = pin_memory and self.device.type == "cpu"
        self.map_local = map_local and self.device.type == "cpu" and not self.pin_memory and not _stage_cpu_tensors
        self.memory_cap = memory_cap
        self.group = process_group
        self._stage_cpu = _stage_cpu_tensors
        t0 = time.monotonic()
        s0 = self.client.stats()
        paths, prefix = resolve(self.client, uri)
        if files_dir is not None:
            if prefix is None:
                raise LoaderError("files_dir needs a model prefix or index, not a list of files")
            _fetch_files(self.client, prefix[0], prefix[1], files_dir)
        with ThreadPoolExecutor(max_workers=min(16, len(paths))) as ex:
            self.files: list[FileSpec] = list(ex.map(lambda p: read_header(self.client, *p), paths))
        self.tensors: list[TensorSpec] = [t for f in self.files for t in f.tensors]
        seen: dict[str, str] = {}
        for t in self.tensors:
            if t.name in seen:
                raise LoaderError(f"tensor {t.name!r} is in both {seen[t.name]} and {t.file.uri}")
            seen[t.name] = t.file.uri
        self.total_bytes = sum(t.nbytes for t in self.tensors)
        self.stats = {
            "files": len(self.files),
            "tensors": len(self.tensors),
            "bytes_total": self.total_bytes,
            "header_seconds": time.monotonic() - t0,
            "peak_held_bytes": 0,
        }
        self._t0, self._s0 = t0, s0

    def _cap(self) -> int:
        return self.memory_cap if self.memory_cap is not None else 1 << 62

    def _alloc(self, t: TensorSpec):
        import torch

        if self.map_local and t.nbytes >= MAP_MIN_BYTES and t.start % t.dtype.itemsize == 0:
            # Its own memory, freed with it; starting as far into a page as
            # its bytes are into a page of the object, so a short-circuit
            # read can map whole pages of the shard files into it (a tensor
            # whose bytes are not aligned to its elements in the file gets
            # aligned memory instead).
            pad = t.start % PAGE
            mem = objects.HostMemory(pad + t.nbytes)
            return torch.frombuffer(mem, dtype=t.dtype, count=t.nbytes // t.dtype.itemsize, offset=pad).view(t.shape)
        return torch.empty(t.shape, dtype=t.dtype, device=self.device, pin_memory=self.pin_memory)

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        if self.group is not None:
            import torch.distributed as dist

            if dist.get_world_size(self.group) > 1:
                yield from self._distributed()
                self._finish()
                return
        yield from self._stream(list(range(len(self.tensors))))
        self._finish()

    def _finish(self) -> None:
        s = self.client.stats()
        for k in ("bytes_received", "requests", "retries", "local_bytes", "local_fallback_bytes", "local_mapped_bytes"):
            self.stats[k] = s[k] - self._s0[k]
        self.stats["seconds"] = time.monotonic() - self._t0

    def _ring(self):
        staging = None
        if self.device.type != "cpu" or self._stage_cpu:
            staging = max(2 << 20, min(self._cap(), self.total_bytes, objects.STAGING_BYTES))
        return objects.Ring(self.client, staging_bytes=staging or (2 << 20), _stage_cpu_tensors=self._stage_cpu)

    def _stream(self, order: list[int]) -> Iterator[tuple[str, Any]]:
        """Reads the tensors ``order`` names, yielding each as it lands."""
        ring = self._ring()
        cap = self._cap()
        held = 0
        nxt = 0
        live: dict[int, Any] = {}
        try:
            while nxt < len(order) or live:
                batch, batch_bytes = [], 0
                while nxt < len(order):
                    t = self.tensors[order[nxt]]
                    if held and held + t.nbytes > cap:
                        break
                    dst = self._alloc(t)
                    held += t.nbytes
                    live[order[nxt]] = dst
                    batch.append((t.file.bucket, t.file.key, t.start, t.nbytes, dst, 0, order[nxt], t.file.etag or None))
                    batch_bytes += t.nbytes
                    nxt += 1
                    if batch_bytes >= SUBMIT_BYTES:
                        # The first reads run while the rest are allocated.
                        ring.submit(batch)
                        batch, batch_bytes = [], 0
                self.stats["peak_held_bytes"] = max(self.stats["peak_held_bytes"], held)
                if batch:
                    ring.submit(batch)
                for i, res in ring.wait(min=1):
                    if isinstance(res, BaseException):
                        raise res
                    dst = live.pop(i)
                    held -= self.tensors[i].nbytes
                    yield self.tensors[i].name, dst
        except BaseException:
            ring.cancel()
            while ring.pending:
                ring.wait(min=ring.pending)
            raise

    def _owners(self, world: int) -> list[int]:
        """Rank that reads each tensor: contiguous runs of about equal bytes."""
        owners = []
        at = 0
        share = max(1, self.total_bytes / world)
        for t in self.tensors:
            owners.append(min(world - 1, int((at + t.nbytes / 2) // share)))
            at += t.nbytes
        return owners

    def _distributed(self) -> Iterator[tuple[str, Any]]:
        import torch
        import torch.distributed as dist

        g = self.group
        world, me = dist.get_world_size(g), dist.get_rank(g)
        owners = self._owners(world)
        mine = [i for i, o in enumerate(owners) if o == me]
        reads = self._stream(mine)
        landed: dict[int, Any] = {}
        error: Optional[BaseException] = None
        flag = torch.zeros(1, dtype=torch.int32, device=self._collective_device())
        i = 0
        n = len(self.tensors)
        while i < n:
            # A round: tensors up to ROUND_BYTES; every rank checks in before
            # any of them is broadcast, so one rank's failure stops all.
            j, size = i, 0
            while j < n and (j == i or size + self.tensors[j].nbytes <= ROUND_BYTES):
                size += self.tensors[j].nbytes
                j += 1
            if error is None:
                try:
                    for k in range(i, j):
                        while owners[k] == me and k not in landed:
                            name, t = next(reads)
                            landed[self._index(name)] = t
                except BaseException as e:  # reported to the others, then raised
                    error = e
            flag.fill_(1 if error is not None else 0)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=g)
            if flag.item():
                reads.close()
                if error is not None:
                    raise error
                raise LoaderError("another rank failed to read its share of the model")
            for k in range(i, j):
                t = landed.pop(k) if owners[k] == me else self._alloc(self.tensors[k])
                if t.numel():
                    dist.broadcast(t, src=dist.get_global_rank(g, owners[k]), group=g)
                yield self.tensors[k].name, t
            i = j

    def _index(self, name: str) -> int:
        if not hasattr(self, "_by_name"):
            self._by_name = {t.name: i for i, t in enumerate(self.tensors)}
        return self._by_name[name]

    def _collective_device(self):
        import torch
        import torch.distributed as dist

        backend = dist.get_backend(self.group)
        if backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


def stream(uri: Union[str, Sequence[str]], device: Any = "cpu", **kw: Any) -> Iterator[tuple[str, Any]]:
    """Yields ``(name, tensor)`` as each tensor lands in ``device`` memory.
    Keyword arguments as :class:`Loader`."""
    return iter(Loader(uri, device, **kw))


def load(uri: Union[str, Sequence[str]], device: Any = "cpu", **kw: Any) -> dict[str, Any]:
    """Every tensor of the model, ``{name: tensor}``, in ``device`` memory.
    Keyword arguments as :class:`Loader`: ``client``, ``memory_cap``,
    ``process_group``, ``files_dir``, ``pin_memory``, ``map_local``."""
    return dict(Loader(uri, device, **kw))

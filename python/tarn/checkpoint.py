"""Checkpoints in Tarn (or any S3 endpoint): ``torch.distributed.checkpoint``
storage that commits atomically, plain ``torch.save``/``torch.load`` streams,
and a ``latest`` pointer moved by compare-and-swap.

    import torch.distributed.checkpoint as dcp
    from tarn.checkpoint import StorageWriter, StorageReader

    dcp.save(state_dict, storage_writer=StorageWriter("s3://ckpt/run1/step-100"))
    dcp.load(state_dict, storage_reader=StorageReader("s3://ckpt/run1/step-100"))
    dcp.async_save(state_dict, storage_writer=StorageWriter(uri))   # staged in reusable pinned buffers

    torch.save(obj, tarn.checkpoint.open_write("s3://ckpt/run1/extra.pt"))
    obj = torch.load(tarn.checkpoint.open_read("s3://ckpt/run1/extra.pt"))

A checkpoint is the prefix ``URI/``: one object per rank
(``__<rank>_<save id>.distcp``, the tensors' raw bytes back to back, written
by a multipart upload whose parts go out in parallel) and ``.metadata``. The
coordinator writes ``.metadata`` last, after every rank's upload completed,
with ``If-None-Match: *`` (or, with ``overwrite=True``, conditional on the
ETag the old one had when the save began): that PUT is the commit, so a
checkpoint is either whole or absent, and two writers cannot both commit one.
Nothing is copied or deleted on the way. A reader refuses a prefix without
``.metadata``. :func:`leftovers` and :func:`remove_leftovers` find and remove
what failed saves (and overwritten checkpoints) left behind.

Supported: torch 2.13 (tested; the storage interfaces as it defines them).
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import datetime
import io
import json
import os
import pickle
import uuid
from typing import Any, NamedTuple, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from .errors import ObjectError, ObjectNotFoundError, TarnError
from .objects import Client, Upload, parse_uri

__all__ = [
    "StorageWriter",
    "StorageReader",
    "open_write",
    "open_read",
    "read_latest",
    "set_latest",
    "Latest",
    "leftovers",
    "remove_leftovers",
    "Leftovers",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "LatestConflictError",
    "tarn_errors",
]

METADATA = ".metadata"
SHARD_SUFFIX = ".distcp"
LATEST = "latest"
MIB = 1 << 20
#: Parts of a rank's upload (S3 wants at least 5 MiB for all but the last).
PART_BYTES = 16 * MIB
PART_MIN = 5 * MIB
#: Host memory a rank's upload stages tensors through (GPU tensors, small ones).
UPLOAD_MEMORY = 256 * MIB


class CheckpointError(TarnError):
    """A checkpoint could not be saved, committed or read as asked."""


class CheckpointExistsError(CheckpointError, FileExistsError):
    """A committed checkpoint is already there (and ``overwrite`` was not
    asked), or another writer committed one first."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No committed checkpoint at the URI: no ``.metadata`` (the save never
    finished, or nothing was saved there)."""


class LatestConflictError(CheckpointError):
    """The ``latest`` pointer was not what the caller expected: another
    writer moved it first. Nothing was changed."""


def tarn_errors(exc: BaseException) -> list[TarnError]:
    """The Tarn errors behind an exception ``dcp.save`` or ``dcp.load``
    raised, in rank order: DCP wraps what a rank raised in a
    ``CheckpointException`` (a ``BaseException``, so ``except Exception``
    does not catch it) whose ``failures`` maps ranks to (error, traceback);
    each error and the ones it was raised from or while handling are
    searched. A Tarn error raised directly is returned as itself; an
    exception with none under it gives an empty list (re-raise it)::

        try:
            dcp.save(state_dict, storage_writer=StorageWriter(uri))
        except BaseException as e:
            errors = tarn_errors(e)
            if not any(isinstance(x, CheckpointExistsError) for x in errors):
                raise
    """
    failures = getattr(exc, "failures", None)
    roots = [x for _, (x, _tb) in sorted(failures.items())] if isinstance(failures, dict) else [exc]
    found: list[TarnError] = []
    for root in roots:
        seen = set()
        x: Optional[BaseException] = root
        while x is not None and id(x) not in seen:
            seen.add(id(x))
            if isinstance(x, TarnError):
                found.append(x)
                break
            x = x.__cause__ or x.__context__
    return found


@dataclasses.dataclass(frozen=True)
class _Stored:
    """Where one item of a checkpoint lies: object ``name`` (relative to the
    checkpoint), bytes ``[offset, offset + length)``; for a tensor, the
    stored chunk's shape and dtype (raw bytes, row-major)."""

    name: str
    offset: int
    length: int
    shape: Optional[tuple] = None
    dtype: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class _RankObject:
    """The object a rank writes, chosen by the coordinator."""

    name: str


def _prefix_of(uri: str) -> tuple[str, str]:
    bucket, key = parse_uri(str(uri))
    key = key.strip("/")
    if not key:
        raise ValueError(f"{uri!r}: a checkpoint needs a key prefix (s3://BUCKET/PATH)")
    return bucket, key + "/"


def _client(client: Optional[Client]) -> Client:
    return client if client is not None else Client()


def _condition_failed(e: BaseException, cond: dict[str, Any]) -> bool:
    """A conditional PUT lost: 412, or (as S3 answers If-Match on a key
    that has no current version) 404."""
    if not isinstance(e, ObjectError):
        return False
    return e.status == 412 or (e.status == 404 and "if_match" in cond)


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor on its device (a copy only
    when it is not contiguous)."""
    if not t.is_contiguous():
        t = t.contiguous()
    if t.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=t.device)
    return t.reshape(-1).view(torch.uint8)


def _dtype(name: str) -> torch.dtype:
    d = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(d, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in checkpoint metadata")
    return d


def _pin() -> bool:
    return torch.cuda.is_available()


class _ObjectWriter:
    """Streams one object out as a multipart upload. Bytes are copied into a
    few staging slots (pinned when CUDA is there; GPU tensors are copied on
    a side stream) and each full slot goes out as a part; large CPU tensors
    are sent as parts straight from their own memory. Slots are reused once
    their part is done, so the memory held is ``memory`` bytes at most."""

    def __init__(self, client: Client, bucket: str, key: str, *, part_bytes: int, memory: int, **conditions: Any):
        self.client, self.bucket, self.key = client, bucket, key
        self.part = max(int(part_bytes), PART_MIN)
        # Parts may be shorter than `part` (a slot sent before a large
        # tensor), never shorter than this.
        self.min_part = max(PART_MIN, self.part // 2)
        self.nslots = max(2, int(memory) // self.part)
        self.conditions = conditions
        self.slots: list[Optional[torch.Tensor]] = [None] * self.nslots
        self.free = list(range(self.nslots - 1, -1, -1))
        self.events: dict[int, Any] = {}  # slot -> CUDA event of copies into it
        self.busy: dict[int, Any] = {}  # part number -> slot index, or the tensor it was sent from
        self.cur: Optional[int] = None
        self.fill = 0
        self.pos = 0  # object bytes written so far
        self.sent_to = 0  # object bytes handed to parts so far
        self.number = 0
        self.mp = None
        self.stream = None
        self.done = False

    def _slot(self, i: int) -> torch.Tensor:
        if self.slots[i] is None:
            self.slots[i] = torch.empty(self.part, dtype=torch.uint8, pin_memory=_pin())
        return self.slots[i]

    def _reap(self, block: bool) -> None:
        for n, err in self.mp.wait(min=1 if block else 0, timeout=None if block else 0):
            if err is not None:
                raise err
            held = self.busy.pop(n)
            if isinstance(held, int):
                self.free.append(held)

    def _take_slot(self) -> None:
        while not self.free:
            self._reap(block=True)
        self.cur = self.free.pop()
        self.fill = 0

    def _multipart(self):
        if self.mp is None:
            self.mp = self.client.multipart(self.bucket, self.key, **self.conditions)
        return self.mp

    def _send_current(self) -> None:
        i = self.cur
        ev = self.events.pop(i, None)
        if ev is not None:
            ev.synchronize()
        self.number += 1
        self.busy[self.number] = i
        self._multipart().send(self.number, self._slot(i)[: self.fill], object_offset=self.sent_to)
        self.sent_to += self.fill
        self.cur = None
        self.fill = 0
        if self.free:
            self._reap(block=False)

    def _copy_in(self, src: Any) -> None:
        """Appends ``src`` (a flat uint8 tensor on any device, or a
        memoryview of bytes) through the slots."""
        host_bytes = isinstance(src, memoryview)
        n, at = (src.nbytes if host_bytes else src.numel()), 0
        while at < n:
            if self.cur is None:
                self._take_slot()
            take = min(self.part - self.fill, n - at)
            slot = self._slot(self.cur)
            if host_bytes:
                # A plain memcpy into the slot (bytes may be read-only,
                # which torch.frombuffer warns about).
                dst = (ctypes.c_ubyte * take).from_address(slot.data_ptr() + self.fill)
                memoryview(dst).cast("B")[:] = src[at : at + take]
            else:
                dst = slot[self.fill : self.fill + take]
                piece = src[at : at + take]
                if piece.device.type == "cuda":
                    if self.stream is None:
                        self.stream = torch.cuda.Stream(device=piece.device)
                    self.stream.wait_stream(torch.cuda.current_stream(piece.device))
                    with torch.cuda.stream(self.stream):
                        dst.copy_(piece, non_blocking=True)
                        ev = torch.cuda.Event()
                        ev.record(self.stream)
                    self.events[self.cur] = ev
                else:
                    dst.copy_(piece)
            self.fill += take
            at += take
            self.pos += take
            if self.fill == self.part:
                self._send_current()

    def write_tensor(self, t: torch.Tensor) -> int:
        """Appends the tensor's bytes; returns their offset in the object."""
        start = self.pos
        flat = _flat_bytes(t.detach())
        n = flat.numel()
        lo = self.min_part
        if flat.device.type == "cpu" and n >= 2 * lo:
            # A large host tensor goes out from its own memory: the slot
            # being filled is sent first (topped up to the smallest part
            # when short), then parts of the tensor, and a tail too short
            # for a part through a slot again. At most two short copies.
            at = 0
            if self.cur is not None and self.fill < lo:
                at = lo - self.fill
                self._copy_in(flat[:at])
            if self.cur is not None:
                self._send_current()
            while n - at >= lo:
                take = n - at if n - at < self.part + lo else self.part
                self.number += 1
                piece = flat[at : at + take]
                self.busy[self.number] = piece
                self._multipart().send(self.number, piece, object_offset=self.sent_to)
                self.sent_to += take
                self.pos += take
                at += take
                if self.free:
                    self._reap(block=False)
            self._copy_in(flat[at:])
        else:
            self._copy_in(flat)
        return start

    def write_bytes(self, b: Any) -> int:
        start = self.pos
        mv = memoryview(b).cast("B")
        if mv.nbytes:
            self._copy_in(mv)
        return start

    def close(self) -> str:
        """Sends what is left and makes the object appear; returns its ETag."""
        if self.done:
            raise CheckpointError(f"s3://{self.bucket}/{self.key}: closed already")
        self.done = True
        if self.mp is None:
            # It all fit in one slot (or nothing was written): one PUT.
            if self.cur is None:
                body: Any = b""
            else:
                ev = self.events.pop(self.cur, None)
                if ev is not None:
                    ev.synchronize()
                body = self._slot(self.cur)[: self.fill]
            return self.client.put(self.bucket, self.key, body, **self.conditions)
        if self.cur is not None and self.fill:
            self._send_current()
        etag = self.mp.complete()
        self.busy.clear()
        return etag

    def abort(self) -> None:
        self.done = True
        if self.mp is not None:
            try:
                self.mp.abort()
            finally:
                self.busy.clear()


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard; any other tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def _local_tensors(sd: Any):
    """The (local) tensors of a nested state dict."""
    stack = [sd]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
        elif isinstance(x, torch.Tensor):
            yield _local(x)


def _tensor_bytes(sd: Any) -> int:
    """Bytes of the tensors in a (nested) state dict, DTensors by their local shard."""
    return sum(t.numel() * t.element_size() for t in _local_tensors(sd))


def _layout(sd: Any) -> Any:
    """What must match for staged buffers to be reused: the structure, and
    each tensor's type, shape, dtype and device."""
    if isinstance(sd, dict):
        return tuple((k, _layout(v)) for k, v in sd.items())
    if isinstance(sd, (list, tuple)):
        return (type(sd).__name__, tuple(_layout(v) for v in sd))
    if isinstance(sd, torch.Tensor):
        local = _local(sd)
        return (type(sd).__name__, tuple(sd.shape), tuple(local.shape), sd.dtype, str(local.device))
    return type(sd).__name__


@dataclasses.dataclass(eq=False)
class _StagedSet:
    """Host buffers a state dict was staged into, reusable once ``free``."""

    layout: Any
    buffers: Any
    ptrs: set
    free: bool = False


def _storages(sd: Any) -> set:
    """Addresses of the storages of the (local) tensors in a state dict."""
    return {t.untyped_storage().data_ptr() for t in _local_tensors(sd)}


class StorageWriter(dcp.StorageWriter, AsyncStager):
    """``torch.distributed.checkpoint`` storage writing to ``s3://BUCKET/PATH``.

    ``StorageWriter(uri, *, client=None, overwrite=False, part_size=16 MiB,
    upload_memory=256 MiB, staging_memory=None)``: ``overwrite`` replaces a
    committed checkpoint (the commit is conditional on the ETag its
    ``.metadata`` had when this save began); without it a committed
    checkpoint there is an error. ``upload_memory`` bounds the host memory
    each rank stages its upload through. As ``dcp.async_save``'s stager it
    copies the state dict into pinned host buffers (when CUDA is there)
    that are reused by the next save of the same layout; ``staging_memory``
    caps them (a state dict larger than the cap is an error before anything
    is copied).
    """

    _synchronize_after_execute: bool = False

    def __init__(
        self,
        uri: str | os.PathLike,
        *,
        client: Optional[Client] = None,
        overwrite: bool = False,
        part_size: int = PART_BYTES,
        upload_memory: int = UPLOAD_MEMORY,
        staging_memory: Optional[int] = None,
    ) -> None:
        super().__init__()
        self.uri = str(uri)
        self.bucket, self.prefix = _prefix_of(self.uri)
        self.client = _client(client)
        self.overwrite = overwrite
        self.part_size = max(int(part_size), PART_MIN)
        self.upload_memory = int(upload_memory)
        self.staging_memory = staging_memory
        self.save_id = uuid.uuid4().hex
        self.is_coordinator = False
        self._old_etag: Optional[str] = None
        self._staged: Optional[_StagedSet] = None

    # -- StorageWriter ---------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id:
            self.uri = str(checkpoint_id)
            self.bucket, self.prefix = _prefix_of(self.uri)
        self.save_id = uuid.uuid4().hex

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("use_collectives", True) is False:
            # Without collectives every rank would commit its own metadata:
            # there would be no single commit point.
            raise CheckpointError(
                f"{self.uri}: saving without collectives is not supported (the commit is one "
                ".metadata written by the coordinator after every rank's upload)"
            )
        self.is_coordinator = is_coordinator
        # A fresh id names this save's objects even when the writer is used
        # again without a new checkpoint_id (DCP calls reset only with
        # one): never an object of a committed checkpoint written over.
        self.save_id = uuid.uuid4().hex
        if is_coordinator:
            self._old_etag = None
            try:
                self._old_etag = self.client.head(self.bucket, self.prefix + METADATA).etag
            except ObjectNotFoundError:
                pass
            if self._old_etag is not None and not self.overwrite:
                raise CheckpointExistsError(
                    f"{self.uri}: a committed checkpoint is there already (pass overwrite=True to replace it)"
                )

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [
            dataclasses.replace(p, storage_data=_RankObject(f"__{i}_{self.save_id}{SHARD_SUFFIX}"))
            for i, p in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        name = plan.storage_data.name
        # Parts big enough that the rank's bytes fit in S3's 10,000 parts
        # even when all are of the smallest size (half a part), with room
        # for the small items.
        total = sum(
            item.tensor_data.size.numel() * torch.empty(0, dtype=item.tensor_data.properties.dtype).element_size()
            for item in plan.items
            if item.tensor_data is not None
        )
        part = max(self.part_size, 2 * -(-total // (9000 * MIB)) * MIB)
        w = _ObjectWriter(
            self.client, self.bucket, self.prefix + name, part_bytes=part, memory=max(self.upload_memory, 2 * part)
        )
        results = []
        staged_ptr = None
        try:
            for item in plan.items:
                data = planner.resolve_data(item)
                if item.type == WriteItemType.BYTE_IO:
                    buf = data.getbuffer()
                    off = w.write_bytes(buf)
                    results.append(WriteResult(item.index, buf.nbytes, _Stored(name, off, buf.nbytes)))
                else:
                    t = data.detach()
                    if staged_ptr is None and t.device.type == "cpu":
                        staged_ptr = t.untyped_storage().data_ptr()
                    off = w.write_tensor(t)
                    n = t.numel() * t.element_size()
                    results.append(
                        WriteResult(item.index, n, _Stored(name, off, n, tuple(t.shape), str(t.dtype)))
                    )
            w.close()
        except BaseException:
            w.abort()
            raise
        finally:
            # The staged buffers this save read from may be reused now
            # (nothing reads them any more, whatever the outcome).
            c = self._staged
            if c is not None and staged_ptr in c.ptrs:
                c.free = True
        fut: Future = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata.storage_data = {wr.index: wr.storage_data for rs in results for wr in rs}
        metadata.storage_meta = self.storage_meta()
        body = pickle.dumps(metadata)
        key = self.prefix + METADATA
        cond: dict[str, Any] = {"if_match": self._old_etag} if self._old_etag else {"if_none_match": True}
        try:
            self.client.put(self.bucket, key, body, **cond)
        except ObjectError as e:
            if not _condition_failed(e, cond):
                raise
            # A retried PUT whose first try did commit answers 412 too:
            # ours if the committed bytes are these (they hold our save id).
            try:
                if self.client.get(self.bucket, key) == body:
                    return
            except ObjectError:
                pass
            raise CheckpointExistsError(
                f"{self.uri}: another writer committed a checkpoint here first; this save is not committed"
            ) from e

    def storage_meta(self) -> Optional[StorageMeta]:
        return StorageMeta(checkpoint_id=self.uri, save_id=self.save_id)

    @property
    def checkpoint_id(self) -> str:
        return self.uri

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return str(checkpoint_id).startswith("s3://")

    # -- AsyncStager -----------------------------------------------------

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """A copy of ``state_dict`` in host memory (pinned when CUDA is
        there), taken before training goes on. The buffers of the last
        save are reused when its upload has finished with them and the
        layout is the same; buffers a save may still read are never
        written (that save keeps them, and new ones are made)."""
        from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

        need = _tensor_bytes(state_dict)
        if self.staging_memory is not None and need > self.staging_memory:
            raise CheckpointError(
                f"{self.uri}: the state dict holds {need} bytes of tensors, more than "
                f"staging_memory={self.staging_memory}"
            )
        layout = _layout(state_dict)
        c = self._staged
        if c is None or c.layout != layout or not c.free:
            self._staged = None  # an earlier set stays alive only while a save holds it
            buffers = _create_cpu_state_dict(state_dict, pin_memory=_pin())
            c = self._staged = _StagedSet(layout, buffers, _storages(buffers))
        c.free = False
        staged = _copy_state_dict(state_dict, c.buffers, non_blocking=_pin())
        if _pin():
            torch.cuda.synchronize()
        return staged

    def synchronize_staging(self) -> None:
        """Staging is synchronous: nothing to wait for."""

    def close(self) -> None:
        """Drops the staging buffers (a save still running keeps its own)."""
        self._staged = None


def _contiguous_span(shape: tuple, offsets: Any, lengths: Any) -> Optional[tuple[int, int]]:
    """(first element, count) when the box ``offsets``/``lengths`` of a
    row-major tensor of ``shape`` is one run of memory, else None."""
    dims = len(shape)
    if dims == 0:
        return (0, 1)
    # Inner dimensions whole, then one partial one, then ones of length 1.
    i = dims - 1
    while i > 0 and lengths[i] == shape[i] and offsets[i] == 0:
        i -= 1
    if any(lengths[j] != 1 for j in range(i)):
        return None
    first = 0
    for d in range(dims):
        first = first * shape[d] + offsets[d]
    count = 1
    for d in range(dims):
        count *= lengths[d]
    return first, count


class StorageReader(dcp.StorageReader):
    """``torch.distributed.checkpoint`` storage reading from ``s3://BUCKET/PATH``:
    every tensor's bytes are read straight into the destination tensor
    (GPU ones through pinned staging) when they lie in one run, else the
    rows that hold them are read and the box copied out; one batch of reads
    per rank, close ranges merged. ``StorageReader(uri, *, client=None)``."""

    def __init__(self, uri: str | os.PathLike, *, client: Optional[Client] = None) -> None:
        super().__init__()
        self.uri = str(uri)
        self.bucket, self.prefix = _prefix_of(self.uri)
        self.client = _client(client)
        self.load_id = uuid.uuid4().hex
        self.storage_data: dict[Any, _Stored] = {}

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id:
            self.uri = str(checkpoint_id)
            self.bucket, self.prefix = _prefix_of(self.uri)
        self.storage_data = {}
        self.load_id = uuid.uuid4().hex

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        try:
            data = self.client.get(self.bucket, self.prefix + METADATA)
        except ObjectNotFoundError:
            raise CheckpointNotFoundError(
                f"{self.uri}: no committed checkpoint (no {METADATA}): the save did not finish, "
                "or nothing was saved here"
            ) from None
        try:
            md = pickle.loads(data)
        except Exception as e:
            raise CheckpointError(f"{self.uri}: {METADATA} does not parse: {e}") from e
        if not isinstance(md, Metadata) or not all(isinstance(v, _Stored) for v in (md.storage_data or {}).values()):
            raise CheckpointError(f"{self.uri}: {METADATA} was not written by tarn.checkpoint")
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        reads = []
        after: list[Any] = []
        for req in plan.items:
            st = self.storage_data[req.storage_index]
            key = self.prefix + st.name
            i = len(after)
            if req.type == LoadItemType.BYTE_IO:
                buf = bytearray(st.length)
                reads.append((self.bucket, key, st.offset, st.length, buf, 0, i))
                after.append(("bytes", req, buf))
                continue
            dtype = _dtype(st.dtype)
            es = torch.empty(0, dtype=dtype).element_size()
            shape = tuple(st.shape)
            lengths = tuple(req.lengths)
            offsets = tuple(req.storage_offsets)
            target = planner.resolve_tensor(req).detach()
            if tuple(target.shape) != lengths:
                raise CheckpointError(
                    f"{self.uri}: {req.storage_index.fqn}: destination of shape {tuple(target.shape)} "
                    f"for a stored box of {lengths}"
                )
            span = _contiguous_span(shape, offsets, lengths)
            if span is not None and target.dtype == dtype and target.is_contiguous():
                first, count = span
                if count:
                    reads.append((self.bucket, key, st.offset + first * es, count * es, target, 0, i))
                after.append(("tensor", req, target, None))
            else:
                # The rows of the first dimension that hold the box, then the box.
                row_bytes = es
                for d in shape[1:]:
                    row_bytes *= d
                if shape:
                    tmp = torch.empty((lengths[0], *shape[1:]), dtype=dtype)
                    at = st.offset + offsets[0] * row_bytes
                else:
                    tmp = torch.empty((), dtype=dtype)
                    at = st.offset
                if tmp.numel():
                    reads.append((self.bucket, key, at, tmp.numel() * es, tmp, 0, i))
                box = tmp
                for d in range(1, len(shape)):
                    box = box.narrow(d, offsets[d], lengths[d])
                after.append(("tensor", req, target, box))
        pending = collections.Counter(r[6] for r in reads)
        ring = self.client.ring()
        ring.submit(reads)
        first_error: Optional[BaseException] = None
        done = [i for i in range(len(after)) if pending[i] == 0]
        while True:
            for i in done:
                if first_error is None:
                    self._place(after[i], planner)
            done = []
            if not ring.pending:
                break
            for i, res in ring.wait(min=1):
                if isinstance(res, BaseException):
                    first_error = first_error or res
                pending[i] -= 1
                if pending[i] == 0:
                    done.append(i)
        if first_error is not None:
            raise first_error
        fut: Future = Future()
        fut.set_result(None)
        return fut

    @staticmethod
    def _place(entry: Any, planner: LoadPlanner) -> None:
        if entry[0] == "bytes":
            _, req, buf = entry
            planner.load_bytes(req, io.BytesIO(bytes(buf)))
            return
        _, req, target, box = entry
        if box is not None:
            target.copy_(box)
        planner.commit_tensor(req, target)

    @property
    def checkpoint_id(self) -> str:
        return self.uri

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return str(checkpoint_id).startswith("s3://")


# -- torch.save / torch.load streams ---------------------------------------


class ObjectWriteStream(io.RawIOBase):
    """A write-only stream to one object, for ``torch.save``: bytes go out
    as parts while it is written; the object appears at ``close()``, never
    if an error ends a ``with`` block (the upload is aborted)."""

    def __init__(self, uri: str, *, client: Optional[Client] = None, part_size: int = PART_BYTES,
                 memory: int = 4 * PART_BYTES, if_none_match: bool = False, if_match: Optional[str] = None):
        super().__init__()
        self.uri = uri
        bucket, key = parse_uri(uri)
        if not key or key.endswith("/"):
            raise ValueError(f"{uri!r}: expected s3://BUCKET/KEY")
        cond: dict[str, Any] = {}
        if if_none_match:
            cond["if_none_match"] = True
        if if_match:
            cond["if_match"] = if_match
        self._w = _ObjectWriter(_client(client), bucket, key, part_bytes=part_size, memory=memory, **cond)
        self.etag: Optional[str] = None

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        if self.closed:
            raise ValueError("write to a closed stream")
        n = memoryview(b).nbytes
        self._w.write_bytes(b)
        return n

    def tell(self) -> int:
        return self._w.pos

    def close(self) -> None:
        if self.closed:
            return
        try:
            self.etag = self._w.close()
        except BaseException:
            self._w.abort()
            raise
        finally:
            super().close()

    def abort(self) -> None:
        """Drops what was written: the object does not change."""
        if not self.closed:
            self._w.abort()
            super().close()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None:
            self.abort()
        else:
            self.close()


class ObjectReadStream(io.RawIOBase):
    """A seekable read-only stream of one object (one version: every read
    asks for the ETag it had when opened), for ``torch.load``. Large reads
    land straight in the caller's buffer; small ones come from a read-ahead
    window of ``window`` bytes."""

    def __init__(self, uri: str, *, client: Optional[Client] = None, window: int = 8 * MIB):
        super().__init__()
        self.uri = uri
        self.bucket, self.key = parse_uri(uri)
        self.client = _client(client)
        info = self.client.head(self.bucket, self.key)
        self.size, self.etag = info.size, info.etag
        self.pos = 0
        self.window = max(int(window), 64 << 10)
        self._buf = bytearray()
        self._buf_at = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset}")
        self.pos = base + offset
        return self.pos

    def _fetch(self, at: int, n: int, dst: Any, dst_off: int = 0) -> None:
        self.client.read([(self.bucket, self.key, at, n, dst, dst_off, None, self.etag)])

    def readinto(self, b: Any) -> int:
        mv = memoryview(b).cast("B")
        n = min(mv.nbytes, max(0, self.size - self.pos))
        if n == 0:
            return 0
        got = 0
        # What the window already holds.
        lo = self.pos - self._buf_at
        if 0 <= lo < len(self._buf):
            take = min(n, len(self._buf) - lo)
            mv[:take] = self._buf[lo : lo + take]
            got = take
        rest = n - got
        if rest >= self.window:
            self._fetch(self.pos + got, rest, mv, got)
            got = n
        elif rest:
            at = self.pos + got
            size = min(self.window, self.size - at)
            self._buf = bytearray(size)
            self._buf_at = at
            self._fetch(at, size, self._buf)
            mv[got:n] = self._buf[:rest]
            got = n
        self.pos += got
        return got

    def read(self, size: int = -1) -> bytes:
        if size is None or size < 0:
            size = max(0, self.size - self.pos)
        out = bytearray(min(size, max(0, self.size - self.pos)))
        n = self.readinto(out)
        return bytes(out[:n])

    def readall(self) -> bytes:
        return self.read(-1)


def open_write(uri: str, *, client: Optional[Client] = None, **kw: Any) -> ObjectWriteStream:
    """A stream for ``torch.save(obj, tarn.checkpoint.open_write(uri))``.
    Keyword arguments: ``part_size``, ``memory`` (host memory for parts in
    flight), ``if_none_match``, ``if_match``. The object appears when the
    stream is closed (``torch.save`` does not close it: use ``with``)."""
    return ObjectWriteStream(uri, client=client, **kw)


def open_read(uri: str, *, client: Optional[Client] = None, **kw: Any) -> ObjectReadStream:
    """A seekable stream for ``torch.load(tarn.checkpoint.open_read(uri))``."""
    return ObjectReadStream(uri, client=client, **kw)


# -- the latest pointer ----------------------------------------------------


class Latest(NamedTuple):
    """What ``latest`` points at, and its ETag (what :func:`set_latest`
    expects to move it on)."""

    checkpoint: str
    etag: str


def _latest_key(root: str) -> tuple[str, str]:
    bucket, key = parse_uri(str(root))
    key = key.strip("/")
    return bucket, (key + "/" if key else "") + LATEST


def read_latest(root: str, *, client: Optional[Client] = None) -> Optional[Latest]:
    """The checkpoint ``ROOT/latest`` names (None when there is none)."""
    c = _client(client)
    bucket, key = _latest_key(root)
    try:
        info = c.head(bucket, key)
        data = bytearray(info.size)
        if info.size:
            c.read([(bucket, key, 0, info.size, data, 0, None, info.etag)])
    except ObjectNotFoundError:
        return None
    try:
        doc = json.loads(bytes(data))
        return Latest(doc["checkpoint"], info.etag)
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"s3://{bucket}/{key}: not a latest pointer: {e}") from e


def set_latest(root: str, checkpoint: str, *, expected: Optional[str], client: Optional[Client] = None) -> str:
    """Points ``ROOT/latest`` at ``checkpoint`` if it is still what the
    caller read: ``expected`` is the ETag :func:`read_latest` returned, or
    None for "there is no latest yet". A compare-and-swap (a PUT with
    ``If-Match``/``If-None-Match``): of two writers that read the same
    pointer, one moves it and the other gets :class:`LatestConflictError`.
    Returns the new ETag."""
    c = _client(client)
    bucket, key = _latest_key(root)
    body = json.dumps({"checkpoint": checkpoint, "writer": uuid.uuid4().hex}).encode()
    cond: dict[str, Any] = {"if_match": expected} if expected is not None else {"if_none_match": True}
    try:
        return c.put(bucket, key, body, **cond)
    except ObjectError as e:
        if not _condition_failed(e, cond):
            raise
        # A retried PUT whose first try went through answers 412 as well.
        try:
            info = c.head(bucket, key)
            if c.get(bucket, key) == body:
                return info.etag
        except ObjectError:
            pass
        raise LatestConflictError(
            f"s3://{bucket}/{key}: moved by another writer (expected "
            f"{'none' if expected is None else expected}); not changed"
        ) from e


# -- leftovers of failed saves ---------------------------------------------


class Leftovers(NamedTuple):
    """Objects under a checkpoint its committed ``.metadata`` does not name
    (all of them when it has none), and multipart uploads in progress there."""

    objects: list[str]
    uploads: list[Upload]


def _age_seconds(stamp: str, now: datetime.datetime) -> float:
    try:
        t = datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    except ValueError:
        return float("inf")  # no date: old enough
    if t.tzinfo is None:
        t = t.replace(tzinfo=datetime.timezone.utc)
    return (now - t).total_seconds()


def leftovers(uri: str, *, client: Optional[Client] = None, older_than: float = 3600.0) -> Leftovers:
    """What failed or replaced saves left under checkpoint ``uri``, last
    written more than ``older_than`` seconds ago (a save still running
    writes objects that are not named yet: the age keeps them out)."""
    c = _client(client)
    bucket, prefix = _prefix_of(uri)
    named: set[str] = set()
    try:
        raw = c.get(bucket, prefix + METADATA)
    except ObjectNotFoundError:
        raw = None
    if raw is not None:
        try:
            md = pickle.loads(raw)
            named = {prefix + s.name for s in md.storage_data.values()} | {prefix + METADATA}
        except Exception as e:
            # Not knowing what it names, nothing under it counts as left over.
            raise CheckpointError(f"{uri}: {METADATA} was not written by tarn.checkpoint ({e}); nothing listed") from e
    now = datetime.datetime.now(datetime.timezone.utc)
    objects = [
        o.key
        for o in c.list(bucket, prefix)
        if o.key not in named and "/" not in o.key[len(prefix) :] and _age_seconds(o.last_modified, now) >= older_than
    ]
    uploads = [
        u
        for u in c.list_uploads(bucket, prefix)
        if "/" not in u.key[len(prefix) :] and _age_seconds(u.initiated, now) >= older_than
    ]
    return Leftovers(objects, uploads)


def remove_leftovers(uri: str, *, client: Optional[Client] = None, older_than: float = 3600.0) -> Leftovers:
    """Removes what :func:`leftovers` finds; returns it."""
    c = _client(client)
    bucket, _ = _prefix_of(uri)
    found = leftovers(uri, client=c, older_than=older_than)
    for key in found.objects:
        c.delete(bucket, key)
    for u in found.uploads:
        c.abort_upload(bucket, u.key, u.upload_id)
    return found

"""Object client for Tarn and any S3 endpoint, built for moving large data
into memory fast: batched reads in the style of 3FS USRBIO.

    c = tarn.objects.Client()               # AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ... or the local Tarn
    ring = c.ring()
    ring.submit([(bucket, key, offset, length, buffer, buffer_offset, user_data), ...])
    for user_data, result in ring.wait(min=1):
        ...                                  # result: bytes read, or a tarn.errors.ObjectError

    c.read([(bucket, key, offset, length, buffer, buffer_offset), ...])   # blocking, -> [nbytes]
    c.put(bucket, key, buffer)               # parallel multipart upload, -> ETag

Reads close together are merged into one ranged GET, long ones split into
stripe-aligned GETs over many keep-alive connections; each response is read
from the socket straight into the destination. Failures worth retrying are
retried per request from the byte they reached; late requests are hedged.
Buffers are anything with the buffer protocol (bytearray, memoryview, numpy
arrays, mmap), torch CPU tensors (pinned or not), and torch CUDA tensors: these
go through a pool of pinned host buffers, copied to the device asynchronously
on a stream of their own while the network fills the next ones. The GIL is
released while the client waits.

The endpoint and credentials are read as the AWS tools read them
(``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``,
``AWS_PROFILE`` and ``~/.aws``); with nothing set, the Tarn server on this host
(``http://127.0.0.1:9000``). No instance metadata service is ever probed.
"""

from __future__ import annotations

import collections
from typing import Any, Iterable, NamedTuple, Optional, Sequence

from . import _native
from .errors import (
    ObjectConnectionError,
    ObjectError,
    ObjectNotFoundError,
    ObjectPermissionError,
)

__all__ = [
    "Client",
    "Ring",
    "ObjectInfo",
    "Listed",
    "Upload",
    "ObjectError",
    "ObjectNotFoundError",
    "ObjectPermissionError",
    "ObjectConnectionError",
    "parse_uri",
    "HostMemory",
]

#: Zeroed host memory, freed with its last reference, that local reads may
#: fill by mapping the shard files' verified, locked page-cache pages
#: (``torch.frombuffer(HostMemory(n), ...)`` makes a tensor of it).
HostMemory = _native.HostMemory

#: Host memory for staging reads into GPU memory, per ring, by default.
STAGING_BYTES = 256 << 20


class ObjectInfo(NamedTuple):
    size: int
    etag: str


class Listed(NamedTuple):
    """One object of a listing; ``last_modified`` as S3 gives it (ISO 8601, UTC)."""

    key: str
    size: int
    etag: str
    last_modified: str


class Upload(NamedTuple):
    """A multipart upload in progress; ``initiated`` as S3 gives it (ISO 8601, UTC)."""

    key: str
    upload_id: str
    initiated: str


def parse_uri(uri: str) -> tuple[str, str]:
    """``s3://bucket/key`` -> ``(bucket, key)`` (the key may be empty)."""
    if not uri.startswith("s3://"):
        raise ValueError(f"{uri!r}: expected s3://BUCKET/KEY")
    bucket, _, key = uri[5:].partition("/")
    if not bucket:
        raise ValueError(f"{uri!r}: no bucket")
    return bucket, key


def _torch():
    import sys

    return sys.modules.get("torch")


def _is_device_tensor(buf: Any) -> bool:
    """A torch tensor outside host memory (CUDA, or any non-CPU device)."""
    torch = _torch()
    return torch is not None and isinstance(buf, torch.Tensor) and buf.device.type != "cpu"


class Client(_native.ObjectClient):
    """An S3 object client. Cheap to share between threads; every method
    releases the GIL while it waits.

    ``Client(endpoint=None, *, access_key=None, secret_key=None,
    session_token=None, region=None, profile=None, addressing=None,
    connections=16, chunk_size=8 MiB, merge_gap=1 MiB, max_inflight=512 MiB,
    retries=6, hedge=True, part_size=16 MiB, io_timeout=30.0,
    connect_timeout=3.0, ca_bundle=None, local_reads=True)``: ``endpoint`` is
    a URL or several (comma-separated or a list; connections are spread over
    them), ``http://`` or ``https://`` (TLS, its certificate checked against
    ``ca_bundle``, else ``AWS_CA_BUNDLE`` or the profile's ``ca_bundle``,
    else the system's trusted roots). Unset arguments come from the
    environment and the AWS profile files.

    When a Tarn node on this host holds the data, reads take the bytes from
    its shard files directly (short-circuit reads: the node checks the
    credentials and passes read-only descriptors; every block's checksum is
    checked here); ``local_reads=False`` or ``TARN_LOCAL_READS=0`` turns
    that off. ``stats()`` says how many bytes came each way
    (``local_bytes``, ``bytes_received`` over HTTP, ``local_fallback_bytes``).
    Into :class:`HostMemory` (``tarn._native.HostMemory(nbytes)``, the
    loader's host tensors), local reads map the files' verified, locked
    page-cache pages instead of copying (copy-on-write;
    ``local_mapped_bytes``; docs/local-reads.md, "Mapped reads")."""

    def head(self, bucket: str, key: str) -> ObjectInfo:
        """Size and ETag of an object."""
        return ObjectInfo(*super().head(bucket, key))

    def list(self, bucket: str, prefix: str = "") -> list[Listed]:
        """Every object under ``prefix`` (all pages)."""
        return [Listed(*o) for o in super().list(bucket, prefix)]

    def list_uploads(self, bucket: str, prefix: str = "") -> list[Upload]:
        """The multipart uploads in progress under ``prefix``."""
        return [Upload(*u) for u in super().list_uploads(bucket, prefix)]

    def read(self, reads: Iterable[Sequence[Any]]) -> list[int]:
        """Reads ``(bucket, key, offset, length, buffer, buffer_offset[,
        user_data[, etag]])`` tuples and waits for all of them; returns the
        bytes read per read, or raises the first failure once every read has
        finished. CUDA tensors are filled through the staging pool."""
        reads = list(reads)
        if not any(_is_device_tensor(r[4]) for r in reads):
            return super().read(reads)
        ring = self.ring()
        ring.submit([(*r[:6], i, *(r[7:8] if len(r) > 7 else ())) for i, r in enumerate(reads)])
        out: list[Optional[int]] = [None] * len(reads)
        first_error: Optional[BaseException] = None
        first_index = len(reads)
        while ring.pending:
            for i, res in ring.wait(min=ring.pending):
                if isinstance(res, BaseException):
                    if i < first_index:
                        first_error, first_index = res, i
                else:
                    out[i] = res
        if first_error is not None:
            raise first_error
        return out  # type: ignore[return-value]

    def get_into(
        self, bucket: str, key: str, buffer: Any, offset: int = 0, etag: Optional[str] = None
    ) -> int:
        """Fills ``buffer`` with the object's bytes from ``offset``."""
        n = _nbytes(buffer)
        return self.read([(bucket, key, offset, n, buffer, 0, None, etag)])[0]

    def get(self, bucket: str, key: str) -> bytes:
        """The whole object (HEAD, then parallel ranged GETs of that version)."""
        info = self.head(bucket, key)
        buf = bytearray(info.size)
        if info.size:
            self.read([(bucket, key, 0, info.size, buf, 0, None, info.etag)])
        return bytes(buf)

    def put(self, bucket: str, key: str, buffer: Any, **kw: Any) -> str:
        """Writes ``buffer`` (bytes-like, numpy, torch tensor) as one object:
        a PUT, or a multipart upload whose parts go out in parallel, each
        with its CRC32C. Keyword arguments: ``part_size``, ``content_type``,
        ``if_none_match`` (True: only if no object has the key), ``if_match``
        (an ETag). A CUDA tensor is copied to host memory first. Returns the
        ETag."""
        if _is_device_tensor(buffer):
            buffer = buffer.detach().contiguous().cpu()
        return super().put(bucket, key, buffer, **kw)

    def multipart(self, bucket: str, key: str, **kw: Any) -> "_native.Multipart":
        """A multipart upload sent one part at a time, from buffers reused
        once their part is done::

            up = c.multipart(bucket, key, if_none_match=True)
            up.send(1, buf1, object_offset=0)      # returns at once
            for number, error in up.wait(min=1):    # parts done: their buffers are free again
                ...
            etag = up.complete()                    # the object appears now

        Keyword arguments: ``content_type``, ``if_none_match``, ``if_match``
        (conditions the completion carries). Every part but the last must be
        at least 5 MiB. An upload neither completed nor aborted is aborted
        when dropped; nothing of it becomes visible."""
        return super().multipart(bucket, key, **kw)

    def ring(self, *, staging_bytes: int = STAGING_BYTES) -> "Ring":
        """A submission and completion queue. ``staging_bytes`` of pinned host
        memory are allocated the first time a read targets GPU memory."""
        return Ring(self, staging_bytes=staging_bytes)


def _nbytes(buffer: Any) -> int:
    torch = _torch()
    if torch is not None and isinstance(buffer, torch.Tensor):
        return buffer.numel() * buffer.element_size()
    return memoryview(buffer).nbytes


class _Staged:
    """A read into device memory: cut into pieces the size of a staging
    slot; each piece lands in a slot, then is copied to the device."""

    __slots__ = ("user", "dst", "bucket", "key", "offset", "length", "etag", "next", "copying", "error", "done")

    def __init__(self, r: Sequence[Any]):
        self.bucket, self.key, self.offset, self.length = r[0], r[1], int(r[2]), int(r[3])
        buf, boff = r[4], int(r[5])
        self.user = r[6] if len(r) > 6 else None
        self.etag = r[7] if len(r) > 7 else None
        flat = buf.view(-1).view(_torch().uint8) if buf.dim() else buf.reshape(1).view(_torch().uint8)
        if boff < 0 or boff + self.length > flat.numel():
            raise ValueError(
                f"s3://{self.bucket}/{self.key}: {self.length} bytes at buffer offset {boff} "
                f"do not fit in a tensor of {flat.numel()} bytes"
            )
        self.dst = flat[boff : boff + self.length]
        self.next = 0  # bytes handed to slots so far
        self.copying = 0  # pieces read or being read, not yet copied
        self.error: Optional[BaseException] = None
        self.done = 0  # bytes copied to the device


class _Staging:
    """Pinned host memory cut into slots, and the stream the copies to the
    device run on. Each slot is reused once the copy out of it is done."""

    def __init__(self, device: Any, total: int, slot: int, force_cpu: bool = False):
        torch = _torch()
        self.device = device
        self.slot = slot
        count = max(2, total // slot)
        self.pin = device.type == "cuda" and torch.cuda.is_available() and not force_cpu
        # Each slot is allocated (and pinned) when first used, so the first
        # reads start after one slot's allocation, not the whole pool's.
        self.host: list[Any] = [None] * count
        self.free = list(range(count - 1, -1, -1))  # popped from the end: slot 0 first
        self.stream = torch.cuda.Stream(device=device) if self.pin else None
        # (event or None, slot, staged read, piece length)
        self.copies: collections.deque = collections.deque()

    def view(self, i: int, n: int):
        if self.host[i] is None:
            self.host[i] = _torch().empty(self.slot, dtype=_torch().uint8, pin_memory=self.pin)
        return self.host[i][:n]

    def copy(self, i: int, st: _Staged, at: int, n: int) -> None:
        """Copies slot ``i`` to the read's destination at ``at``, asynchronously."""
        torch = _torch()
        src = self.view(i, n)
        if self.stream is not None:
            with torch.cuda.stream(self.stream):
                st.dst[at : at + n].copy_(src, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(self.stream)
        else:
            st.dst[at : at + n].copy_(src)
            ev = None
        self.copies.append((ev, i, st, n))

    def reap(self, block: bool) -> list[_Staged]:
        """Frees the slots of finished copies (waiting for the oldest when
        ``block``); returns the reads whose last copy finished."""
        finished = []
        while self.copies:
            ev, i, st, n = self.copies[0]
            if ev is not None and not ev.query():
                if not block:
                    break
                ev.synchronize()
            self.copies.popleft()
            block = False
            self.free.append(i)
            st.copying -= 1
            st.done += n
            if st.copying == 0 and (st.done == st.length or st.error is not None) and st.next >= st.length:
                finished.append(st)
        return finished


class Ring:
    """Submission and completion queue of a :class:`Client`.

    ``submit`` queues reads ``(bucket, key, offset, length, buffer,
    buffer_offset, user_data[, etag])`` and returns at once; ``wait`` returns
    ``[(user_data, nbytes or exception)]``. When a completion is returned,
    nothing writes its buffer any more. Reads into CUDA tensors are cut into
    pieces that land in pinned host slots and are copied to the device on a
    stream of their own, overlapping the network; their completion comes once
    the copy is done.
    """

    def __init__(self, client: Client, *, staging_bytes: int = STAGING_BYTES, _stage_cpu_tensors: bool = False):
        self._client = client
        self._native = _native.ObjectClient.ring(client)
        self._staging_bytes = max(int(staging_bytes), 2 << 20)
        self._staging: Optional[_Staging] = None
        self._waiting: collections.deque[_Staged] = collections.deque()  # pieces left to hand out
        self._active = 0  # staged reads not yet completed
        self._ready: list[tuple[Any, Any]] = []
        self._in_native_pieces = 0  # pieces submitted to the native ring, not yet returned
        # Tests: send CPU tensors through the staging path too, so that the
        # GPU path's logic runs on machines without one.
        self._stage_cpu = _stage_cpu_tensors

    @property
    def pending(self) -> int:
        """Reads submitted whose completion ``wait`` has not returned."""
        return self._native.pending - self._in_native_pieces + self._active + len(self._ready)

    def _staged(self, buf: Any) -> bool:
        if _is_device_tensor(buf):
            return True
        torch = _torch()
        return self._stage_cpu and torch is not None and isinstance(buf, torch.Tensor)

    def submit(self, reads: Iterable[Sequence[Any]]) -> None:
        direct = []
        staged = []
        for r in reads:
            if len(r) < 6 or not self._staged(r[4]):
                direct.append(r)
            else:
                staged.append(_Staged(r))
        if direct:
            self._native.submit(direct)
        for st in staged:
            if self._staging is None:
                dev = st.dst.device
                slot = min(self._client.chunk_size, self._staging_bytes // 2)
                self._staging = _Staging(dev, self._staging_bytes, slot, force_cpu=self._stage_cpu)
            self._active += 1
            if st.length == 0:
                self._active -= 1
                self._ready.append((st.user, 0))
            else:
                self._waiting.append(st)
        self._pump()

    def _pump(self) -> None:
        """Hands free slots to the pieces waiting for one."""
        s = self._staging
        if s is None:
            return
        batch = []
        while s.free and self._waiting:
            st = self._waiting[0]
            n = min(s.slot, st.length - st.next)
            i = s.free.pop()
            if s.host[i] is None and batch:
                # The pieces planned so far start before this slot is allocated.
                self._in_native_pieces += len(batch)
                self._native.submit(batch)
                batch = []
            batch.append(
                (st.bucket, st.key, st.offset + st.next, n, s.view(i, n), 0, (_PIECE, i, st, st.next, n), st.etag)
            )
            st.copying += 1
            st.next += n
            if st.next >= st.length:
                self._waiting.popleft()
        if batch:
            self._in_native_pieces += len(batch)
            self._native.submit(batch)

    def wait(self, min: int = 1, timeout: Optional[float] = None) -> list[tuple[Any, Any]]:
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        out, self._ready = self._ready, []
        while True:
            want = min if min <= self.pending + len(out) else self.pending + len(out)
            if len(out) >= want:
                return out
            s = self._staging
            if s is not None:
                out.extend(self._finish(s.reap(block=False)))
                self._pump()  # slots whose copies finished take the next pieces at once
                if len(out) >= want:
                    return out
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            staged_busy = s is not None and (s.copies or self._in_native_pieces)
            if staged_busy:
                # Copies to finish as well as reads: look at both often.
                step = 0.002 if left is None else min(left, 0.002)
                got = self._native.wait(1, step)
            else:
                got = self._native.wait(want - len(out), left)
            for user, res in got:
                if isinstance(user, tuple) and len(user) == 5 and user[0] is _PIECE:
                    self._in_native_pieces -= 1
                    _, i, st, at, n = user
                    if isinstance(res, BaseException):
                        if st.error is None:
                            st.error = res
                        if st.next < st.length:
                            # No more pieces for a read that has failed.
                            self._waiting.remove(st)
                            st.next = st.length
                        s.free.append(i)
                        st.copying -= 1
                        if st.copying == 0 and st.next >= st.length:
                            out.extend(self._finish([st]))
                    else:
                        s.copy(i, st, at, n)
                else:
                    out.append((user, res))
            if s is not None:
                if not s.free and s.copies:
                    out.extend(self._finish(s.reap(block=True)))
                self._pump()
            if deadline is not None and time.monotonic() >= deadline:
                return out

    def _finish(self, sts: list[_Staged]) -> list[tuple[Any, Any]]:
        done = []
        for st in sts:
            self._active -= 1
            done.append((st.user, st.error if st.error is not None else st.length))
        return done

    def cancel(self) -> None:
        """Stops what is queued and cuts what runs; such reads complete with
        an error."""
        self._native.cancel()


_PIECE = object()

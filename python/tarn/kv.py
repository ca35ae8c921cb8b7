"""Client for Tarn's KV-cache store (``tarn server --kv``).

Keys are 32-byte digests (``key()`` hashes anything else into one); values
are blocks of bytes. Every call takes a batch. Buffers are anything exporting
the buffer protocol (bytearray, memoryview, numpy arrays, mmap) or contiguous
CPU torch tensors; they are read and written in place, with no copy in
Python, and the GIL is released while the call waits on the server.

On the same host the client uses shared memory (a get is one copy out of the
server's memory, checksummed as it is copied); elsewhere TCP.

    kv = Client("127.0.0.1:9400", namespace="llama-3-8b/bf16/bs16")
    kv.put_from(keys, buffers)          # -> [Status.OK, Status.ALREADY_EXISTS, ...]
    kv.get_into(keys, buffers)          # -> [4096, None, ...]   None = miss
    kv.prefix_hits(keys)                # -> leading keys all stored

A miss (never stored, evicted, or dropped because it failed its checksum) is
a normal result, never an exception. Exceptions (``tarn.errors``) mean the
call could not be made or answered.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import hashlib
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable, Optional

from . import _native
from .errors import KvConnectionError, KvPermissionError, KvProtocolError, KvServerError, TarnError

__all__ = [
    "Client",
    "AsyncClient",
    "Status",
    "key",
    "DIGEST_BYTES",
    "TarnError",
    "KvConnectionError",
    "KvServerError",
    "KvPermissionError",
    "KvProtocolError",
]

DIGEST_BYTES: int = _native.DIGEST_BYTES
DEFAULT_ENDPOINT = "127.0.0.1:9400"


class Status(enum.IntEnum):
    """Outcome of one key of a put (the protocol's status byte)."""

    OK = 0
    NOT_FOUND = 1
    ALREADY_EXISTS = 2
    TOO_LARGE = 3
    NO_SPACE = 4
    CORRUPT = 5
    BAD_RANGE = 6
    CHECKSUM_MISMATCH = 7
    BAD_WINDOW = 8
    BUFFER_TOO_SMALL = 9

    @property
    def stored(self) -> bool:
        """The value is stored: by this call (OK) or already (ALREADY_EXISTS)."""
        return self in (Status.OK, Status.ALREADY_EXISTS)


_STATUS = list(Status)


def key(*parts: bytes | bytearray | memoryview | str | int) -> bytes:
    """A 32-byte key from any parts (SHA-256 over length-prefixed parts, so
    ``key(b"ab", b"c") != key(b"a", b"bc")``)."""
    h = hashlib.sha256()
    for p in parts:
        if isinstance(p, str):
            p = p.encode()
        elif isinstance(p, int):
            p = p.to_bytes(8, "little", signed=True)
        b = memoryview(p).cast("B")
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.digest()


Keys = Iterable[bytes]
Buffers = Iterable[Any]

_log = logging.getLogger("tarn.kv")


def _on_device(b: Any) -> bool:
    """A torch tensor in device memory (CUDA)."""
    dev = getattr(b, "device", None)
    return getattr(dev, "type", "cpu") not in ("cpu", None) and hasattr(b, "data_ptr")


def _bytes_of(t: Any) -> Any:
    """A contiguous tensor's bytes, as a flat uint8 view."""
    import torch

    if not t.is_contiguous():
        raise BufferError("tensor is not contiguous")
    return t.reshape(-1).view(torch.uint8)


def _nbytes(t: Any) -> int:
    return t.numel() * t.element_size()


def _to_host(b: Any) -> Any:
    """A device tensor's bytes in pinned host memory."""
    import torch

    if not _on_device(b):
        return b
    host = torch.empty(_nbytes(b), dtype=torch.uint8, pin_memory=True)
    host.copy_(_bytes_of(b))
    return host


def _register_with_cuda(base: int, size: int) -> Optional[str]:
    """Registers the read-only arena mapping at ``base`` with the CUDA
    driver (cudaHostRegisterPortable | cudaHostRegisterReadOnly: any
    context may copy from it, and the driver never asks to write it). None
    when it did, else why not, in words."""
    import torch

    try:
        rt = torch.cuda.cudart()
        rc = rt.cudaHostRegister(base, size, 1 | 8)
        code = int(rc)
        if code == 0:
            return None
        try:
            name = rt.cudaGetErrorString(rc)
        except Exception:
            name = "error"
        _clear_cuda_error(rt)
        return f"the CUDA driver refused to register the arena mapping (cudaHostRegister: {name}, {code})"
    except Exception as e:  # no runtime API in this torch, or no driver
        return f"cannot register the arena mapping with the CUDA driver: {e}"


def _clear_cuda_error(rt: Any) -> None:
    """Resets the CUDA runtime's last error after a refused registration,
    which is handled here: left set, torch's next kernel-launch check would
    raise it as its own."""
    clear = getattr(rt, "cudaGetLastError", None)
    if clear is not None:
        clear()
        return
    import ctypes

    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "libcudart.so" in line}
    for path in paths:
        ctypes.CDLL(path).cudaGetLastError()


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


class Client(_native.Client):
    """Blocking client. Safe to share between threads: it keeps up to
    ``max_connections`` connections and each call uses one of its own.

    ``Client(endpoint="127.0.0.1:9400", namespace=None, *, transport="auto",
    connect_timeout=5.0, timeout=None, max_connections=4, shm_mailbox=True,
    access_key=None, secret_key=None, cluster=True, ca_bundle=None)``

    Credentials are ``access_key``/``secret_key``, else the environment's
    ``TARN_ACCESS_KEY``/``TARN_SECRET_KEY``, else the built-in ones a server
    accepts on loopback. Refused credentials, or a namespace not granted to
    them, raise ``KvPermissionError``.

    The namespace (str or bytes, at most 512 bytes) scopes every key: the
    same key in two namespaces names two values. ``transport`` is "auto"
    (shared memory on the same host, else TCP), "shm" or "tcp". The first
    connection is made by the constructor, so a wrong endpoint fails here.
    ``timeout`` (seconds) bounds every call: a server that stops answering
    raises ``KvConnectionError`` then instead of blocking forever.
    A call on a connection the server dropped (say it restarted) is retried
    once on a new connection.

    TLS: a server started with ``--tls-cert`` serves its KV TCP port over
    TLS; connect with ``ca_bundle`` (the PEM file of the CA that signed its
    certificate) or with a ``tls://host:port`` endpoint, which trusts the
    system's roots. The certificate must name the host connected to.

    When the endpoint is a node of a cluster whose nodes run the KV store
    (and ``cluster`` is true), the client routes: each key goes to the
    member that ranks first for it (weighted rendezvous hashing over the
    members the node names, ``members``), one batch per member, sent
    concurrently. A miss there is asked of the next-ranked member (a node
    that restarted empty owns few keys at first and ramps up), and found
    blocks are written back; a block the server reports hot gets a second
    copy and its reads alternate between the two. A member whose view of
    the cluster is newer refuses a batch routed by the old one, and the
    client refreshes and routes again; a member it cannot reach is left out
    for a moment. ``owners(keys)`` and ``routing_stats()`` show the routing.
    """

    def exists(self, keys: Keys) -> list[bool]:
        """Which keys are stored."""
        return super().exists(keys)

    def prefix_hits(self, keys: Keys) -> int:
        """How many leading keys are all stored: a prompt's cached prefix."""
        return super().prefix_hits(keys)

    def get_into(self, keys: Keys, buffers: Buffers, offsets: Optional[list[int]] = None) -> list[Optional[int]]:
        """Reads each key's whole value into the front of its (writable)
        buffer. Per key: bytes read, or None for a miss. A buffer smaller
        than its value raises ValueError; buffers must not overlap.

        With ``offsets`` (one per key) each buffer is filled with the
        value's bytes from its offset on (a tensor-parallel rank's heads);
        a value too short for that range is None, like a miss.

        Buffers may be CUDA tensors (contiguous). On the server's host the
        bytes go from the server's memory straight to the device: its arena
        is registered with the CUDA driver once, the copies run on a stream
        of their own, and each value is checked against its checksum in
        the arena while they run (no host copy). Elsewhere, with ranges, or
        when the driver refuses the registration, through pinned host
        staging."""
        buffers = list(buffers)
        if any(_on_device(b) for b in buffers):
            return self._get_into_device(list(keys), buffers, offsets)
        return super().get_into(keys, buffers, offsets)

    def put_from(self, keys: Keys, buffers: Buffers) -> list[Status]:
        """Stores each buffer under its key. Per key a ``Status``:
        ``OK`` or ``ALREADY_EXISTS`` (both ``.stored``), ``NO_SPACE`` when
        everything evictable is pinned, ``CHECKSUM_MISMATCH`` if the bytes
        changed in flight. A value over ``value_max_bytes`` raises.
        CUDA tensors are copied to pinned host memory first."""
        buffers = list(buffers)
        if any(_on_device(b) for b in buffers):
            buffers = [_to_host(b) for b in buffers]
        return [_STATUS[s] for s in super().put_from(keys, buffers)]

    # ------------------------------------------------------------------
    # Device memory
    # ------------------------------------------------------------------

    def _get_into_device(self, keys: list, buffers: list, offsets: Optional[list[int]]) -> list[Optional[int]]:
        import torch

        devices = {b.device for b in buffers if _on_device(b)}
        if len(devices) != 1 or not all(_on_device(b) for b in buffers):
            raise ValueError("a get into device memory takes tensors on one device, all of them")
        device = devices.pop()
        if offsets is None and self._arena_for(device) is not None:
            return self._get_into_via_arena(keys, buffers)
        # Through pinned host staging, then one copy each to the device.
        host = [torch.empty(_nbytes(b), dtype=torch.uint8, pin_memory=True) for b in buffers]
        got = super().get_into(keys, host, offsets)
        stream = torch.cuda.current_stream(device)
        for b, h, n in zip(buffers, host, got):
            if n:
                _bytes_of(b)[:n].copy_(h[:n], non_blocking=True)
        stream.synchronize()  # the staging buffers go when this returns
        return got

    def device_path(self, device: Any = "cuda") -> tuple[str, Optional[str]]:
        """How ``get_into`` fills whole values into tensors on ``device``:
        ``("arena", None)`` when it copies straight from the server's arena
        (this client maps it, and for a GPU the CUDA driver registered the
        mapping), else ``("staged", why)``: through pinned host memory, with
        the reason (over TCP, routed over a cluster, or the driver refused
        the registration). Opens the reader connection if needed."""
        import torch

        if self._arena_for(torch.device(device)) is not None:
            return ("arena", None)
        return ("staged", self.__dict__["_device_state"]["why"])

    def _arena_for(self, device: Any) -> Optional[Any]:
        """The server's arena as a uint8 tensor over this process's
        read-only mapping of it, registered with the CUDA driver for
        ``device``'s copies; None (and the reason in the state's ``why``)
        when the client has no such mapping or the driver refuses it."""
        state = self.__dict__.setdefault("_device_state", {})
        if "arena" not in state:
            import torch

            from .kv_blocks import host_memory

            info = self._reader_arena()
            if info is None:
                state["arena"] = None
                state["why"] = "no mapping of the server's arena: over TCP, or routed over a cluster's members"
                return None
            base, size = info
            state["base"], state["size"] = base, size
            state["arena"] = torch.frombuffer(host_memory(base, size), dtype=torch.uint8)
        if state["arena"] is None or getattr(device, "type", "cpu") != "cuda" or "registered" in state:
            return state["arena"]
        if "refused" in state:
            return None
        why = _register_with_cuda(state["base"], state["size"])
        if why is not None:
            state["refused"] = state["why"] = why
            _log.warning("KV gets into GPU memory go through pinned host staging: %s", why)
            return None
        state["registered"] = state["base"]
        return state["arena"]

    def _get_into_via_arena(self, keys: list, tensors: list) -> list[Optional[int]]:
        """Copies each key's value from the server's arena straight into
        its tensor (a device copy for CUDA tensors, on a stream of its own),
        checking every value against its checksum in the arena while the
        copies run and its slot after: a block evicted meanwhile is a miss.
        Any device's tensors, CPU included (the tests' path). A reader
        whose server went away (a restart) is replaced once."""
        import torch

        device = tensors[0].device if tensors else torch.device("cpu")
        try:
            return self._copy_from_arena(keys, tensors, device)
        except KvConnectionError:
            self._drop_reader()
        return self._copy_from_arena(keys, tensors, device)

    def _copy_from_arena(self, keys: list, tensors: list, device: Any) -> list[Optional[int]]:
        import torch

        arena = self._arena_for(device)
        if arena is None:
            raise ValueError("no arena mapping: the client is not on the server's shared memory")
        base = self.__dict__["_device_state"]["base"]
        located = self._locate(keys)
        entries = located.entries
        dsts = [_bytes_of(t) for t in tensors]
        for i, (d, e) in enumerate(zip(dsts, entries)):
            if e is not None and e[1] > d.numel():
                raise ValueError(f"buffer {i} holds {d.numel()} bytes but key {i}'s value is {e[1]} bytes")
        cuda = getattr(device, "type", "cpu") == "cuda"
        stream = torch.cuda.Stream(device) if cuda else None
        ctx = torch.cuda.stream(stream) if cuda else _nothing()
        with ctx:
            for d, e in zip(dsts, entries):
                if e is not None:
                    addr, n = e
                    d[:n].copy_(arena[addr - base : addr - base + n], non_blocking=cuda)
        # Checksums from the arena while the copies run; then the slots.
        intact = self._verify(located, True)
        if stream is not None:
            stream.synchronize()
        current = self._verify(located, False)
        return [e[1] if e is not None and ok and cur else None for e, ok, cur in zip(entries, intact, current)]

    def put_parts(
        self, keys: Keys, buffers: Buffers, value_lens: list[int], offsets: list[int]
    ) -> list[Status]:
        """Stores parts of values: buffer i holds bytes ``offsets[i] ..
        offsets[i] + len`` of key i's value of ``value_lens[i]`` bytes.
        Several clients (one per tensor-parallel rank) put the parts of one
        value; it becomes visible, checksummed whole, once every byte is in,
        and is a miss until then (one still missing parts 60 s after its
        first is dropped). Per part a ``Status``: ``OK`` (the part is in),
        ``ALREADY_EXISTS`` (the value is complete), ``BAD_RANGE`` (another
        writer gave the value another length)."""
        return [_STATUS[s] for s in super().put_parts(keys, buffers, list(value_lens), list(offsets))]

    def touch(self, keys: Keys) -> list[bool]:
        """Marks blocks recently used. Per key: whether it is stored."""
        return super().touch(keys)

    def pin(self, keys: Keys, lease: float = 60.0) -> list[bool]:
        """Protects blocks from eviction for ``lease`` seconds (capped by the
        server), until unpinned or the connection that took the pin closes.
        Per key: whether it is stored (and now pinned)."""
        return super().pin(keys, lease)

    def unpin(self, keys: Keys) -> list[bool]:
        """Releases a pin this client's connection holds. Per key: whether
        one was held. A pin belongs to the connection that took it: with
        ``max_connections=1`` pin and unpin always meet; with more, an unpin
        may reach another connection (False) and the lease ends the pin."""
        return super().unpin(keys)

    def delete(self, keys: Keys) -> list[bool]:
        """Deletes blocks. Per key: whether it was stored."""
        return super().delete(keys)

    def stats(self) -> dict[str, int]:
        """Server counters, and this namespace's (keys ``namespace.*``): of
        the endpoint given, in a cluster too."""
        return super().stats()

    @property
    def members(self) -> list[dict[str, Any]]:
        """The cluster's KV members routed over: ``id``, ``endpoint``,
        ``weight`` (per mille of a full share). Empty outside a cluster."""
        return super().members

    @property
    def cluster_epoch(self) -> int:
        """Epoch of the cluster view routed by (0 outside a cluster)."""
        return super().cluster_epoch

    def owners(self, keys: Keys) -> list[Optional[str]]:
        """Each key's first-ranked member id (None outside a cluster)."""
        return super().owners(keys)

    def routing_stats(self) -> dict[str, int]:
        """What routing did: ``refreshes`` (views asked again after a
        ``NotOwner``), ``fallback_gets``/``fallback_hits``,
        ``copies_written`` (fallback hits written back, hot copies),
        ``hot_copies``, ``member_failures``. Empty outside a cluster."""
        return super().routing_stats()

    def _drop_reader(self) -> None:
        """Unregisters the reader's arena mapping from the CUDA driver, then
        closes the reader (the next device get opens another)."""
        state = self.__dict__.get("_device_state", {})
        if "registered" in state:
            import torch

            torch.cuda.cudart().cudaHostUnregister(state.pop("registered"))
        state.clear()
        self._reader_close()

    def close(self) -> None:
        """Closes the connections; calls after this raise."""
        self._drop_reader()
        super().close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"tarn.kv.Client(endpoint={self.endpoint!r}, "
            f"namespace={self.namespace!r}, transport={self.transport!r})"
        )


class AsyncClient:
    """The same calls as ``Client``, awaitable. Each call runs on a small
    thread pool (one thread per connection) with the GIL released, so the
    event loop keeps running and up to ``max_connections`` calls overlap.

        kv = await AsyncClient.connect("127.0.0.1:9400", namespace="m")
        hits = await kv.get_into(keys, buffers)

    The buffers passed to a call are held until it finishes, even if the
    awaiting task is cancelled: do not reuse them before then.
    """

    def __init__(self, endpoint: str = DEFAULT_ENDPOINT, namespace: Any = None, **options: Any):
        self._client = Client(endpoint, namespace, **options)
        self._pool = ThreadPoolExecutor(
            max_workers=options.get("max_connections", 4), thread_name_prefix="tarn-kv"
        )

    @classmethod
    async def connect(
        cls, endpoint: str = DEFAULT_ENDPOINT, namespace: Any = None, **options: Any
    ) -> "AsyncClient":
        """Connects without blocking the event loop."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            None, functools.partial(cls, endpoint, namespace, **options)
        )

    @property
    def client(self) -> Client:
        """The blocking client underneath (same connections)."""
        return self._client

    @property
    def transport(self) -> str:
        return self._client.transport

    @property
    def namespace(self) -> bytes:
        return self._client.namespace

    @property
    def value_max_bytes(self) -> int:
        return self._client.value_max_bytes

    async def _run(self, fn: Any, *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, fn, *args)

    async def exists(self, keys: Keys) -> list[bool]:
        return await self._run(self._client.exists, list(keys))

    async def prefix_hits(self, keys: Keys) -> int:
        return await self._run(self._client.prefix_hits, list(keys))

    async def get_into(self, keys: Keys, buffers: Buffers, offsets: Optional[list[int]] = None) -> list[Optional[int]]:
        return await self._run(self._client.get_into, list(keys), list(buffers), offsets)

    async def put_from(self, keys: Keys, buffers: Buffers) -> list[Status]:
        return await self._run(self._client.put_from, list(keys), list(buffers))

    async def put_parts(
        self, keys: Keys, buffers: Buffers, value_lens: list[int], offsets: list[int]
    ) -> list[Status]:
        return await self._run(self._client.put_parts, list(keys), list(buffers), value_lens, offsets)

    async def touch(self, keys: Keys) -> list[bool]:
        return await self._run(self._client.touch, list(keys))

    async def pin(self, keys: Keys, lease: float = 60.0) -> list[bool]:
        return await self._run(self._client.pin, list(keys), lease)

    async def unpin(self, keys: Keys) -> list[bool]:
        return await self._run(self._client.unpin, list(keys))

    async def delete(self, keys: Keys) -> list[bool]:
        return await self._run(self._client.delete, list(keys))

    async def stats(self) -> dict[str, int]:
        return await self._run(self._client.stats)

    async def close(self) -> None:
        """Waits for calls in flight, then closes the connections."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._pool.shutdown, True)
        self._client.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

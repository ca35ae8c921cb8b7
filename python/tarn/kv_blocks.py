"""Paged KV-cache blocks to and from Tarn, for inference-engine connectors.

``Store`` is a lazily connected client that an engine can run without: a
server that cannot be reached is retried only every few seconds, and until
then lookups find nothing and saves are skipped. ``PagedBlocks`` moves
blocks of a paged KV cache (one tensor per layer, block index first) as one
value per block holding every layer: gathered into host staging memory for a
put, read into staging (each value checked against its checksum by the
client) and scattered for a load. Only torch is needed, not the engine.

With a ``HeadSplit`` the value does not depend on tensor parallelism: it
holds every KV head of the model, head by head (each head's bytes of every
layer together), and each rank puts and reads only the byte range of the
heads it holds. A value put by two TP=2 ranks is read whole by a TP=1
engine and by quarters by TP=4 ranks; it becomes visible only once every
head is in.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
import time
from typing import Any, Callable, Optional, Sequence

import torch

from . import kv as tarn_kv

_log = logging.getLogger(__name__)


@functools.cache
def _bytes_type(n: int) -> type:
    # ctypes makes a new array type per `c_ubyte * n` it is asked for; one
    # per size is enough (a plugin sees a few sizes, over and over).
    return ctypes.c_ubyte * n


def host_memory(address: int, nbytes: int) -> Any:
    """``nbytes`` of host memory at ``address`` as a writable buffer, without
    a copy (the caller keeps the memory alive while it is used)."""
    return _bytes_type(int(nbytes)).from_address(int(address))


def credentials(access_key: Optional[object], secret_key: Optional[object], who: str) -> Optional[tuple[str, str]]:
    """A plugin's configured credentials: both keys, or None for the
    environment's (``TARN_ACCESS_KEY``/``TARN_SECRET_KEY``) or the loopback
    defaults. One without the other is refused (``who`` names the plugin)."""
    if (access_key is None) != (secret_key is None):
        raise ValueError(f"{who}: give both access_key and secret_key, or neither")
    return None if access_key is None else (str(access_key), str(secret_key))


class Store:
    """Clients (one per namespace) opened on first use. After a failure to
    reach the server, none is attempted for ``retry_s`` seconds, and then
    in the background. Every call is bounded by ``timeout_s``: a server that
    stops answering counts as down."""

    def __init__(
        self,
        endpoint: str,
        namespaces: Sequence[str],
        transport: str = "auto",
        retry_s: float = 5.0,
        log: logging.Logger = _log,
        max_connections: int = 4,
        timeout_s: Optional[float] = 30.0,
        credentials: Optional[tuple[str, str]] = None,
    ):
        self.endpoint = endpoint
        self.namespaces = list(namespaces)
        self.transport = transport
        self.retry_s = retry_s
        self.log = log
        self.max_connections = max_connections
        self.timeout_s = timeout_s
        # (access key, secret key); None: the environment's or the defaults.
        self.credentials = credentials
        self._clients: Optional[list[tarn_kv.Client]] = None
        self._down_until = 0.0
        self._lock = threading.Lock()
        self._warned = False
        self._connecting = False
        self._tried = False

    def clients(self) -> Optional[list[tarn_kv.Client]]:
        """One client per namespace, or None while the server is unreachable.

        The first connection is made here; a reconnection after a failure
        runs on a background thread, so a caller (vLLM's scheduler loop)
        never waits on a server that does not answer."""
        with self._lock:
            if self._clients is not None or self._connecting:
                return self._clients
            if time.monotonic() < self._down_until:
                return None
            self._connecting = True
            first = not self._tried
            self._tried = True
        if first:
            self._connect()
            return self._clients
        threading.Thread(target=self._connect, name="tarn-reconnect", daemon=True).start()
        return None

    def _connect(self) -> None:
        try:
            clients = [
                tarn_kv.Client(
                    self.endpoint,
                    ns,
                    transport=self.transport,
                    connect_timeout=2.0,
                    timeout=self.timeout_s,
                    max_connections=self.max_connections,
                    **(
                        {"access_key": self.credentials[0], "secret_key": self.credentials[1]}
                        if self.credentials
                        else {}
                    ),
                )
                for ns in self.namespaces
            ]
        except tarn_kv.TarnError as e:
            with self._lock:
                self._connecting = False
                self._down_until = time.monotonic() + self.retry_s
                warn = not self._warned
                self._warned = True
            if warn:
                self.log.warning("Tarn KV store unavailable, running without it: %s", e)
            return
        with self._lock:
            self._connecting = False
            self._clients = clients
            self._warned = False
        self.log.info(
            "Tarn KV store at %s (%s), namespace %s",
            self.endpoint,
            clients[0].transport,
            self.namespaces[0],
        )

    def failed(self, e: Exception) -> None:
        """A call failed. A lost connection backs off like a failed connect,
        so a server that is down costs requests nothing."""
        with self._lock:
            if isinstance(e, tarn_kv.KvConnectionError):
                self._down_until = time.monotonic() + self.retry_s
                for c in self._clients or ():
                    c.close()
                self._clients = None
            if not self._warned:
                self.log.warning("Tarn KV store call failed: %s", e)
                self._warned = True

    def stored(self, keys: Sequence[bytes]) -> Optional[list[bool]]:
        """Per key: stored in every namespace. None when the store is down."""
        clients = self.clients()
        if clients is None:
            return None
        present = [True] * len(keys)
        try:
            for c in clients:
                present = [a and b for a, b in zip(present, c.exists(keys))]
        except tarn_kv.TarnError as e:
            self.failed(e)
            return None
        return present

    def pin(self, keys: Sequence[bytes], lease_s: float) -> None:
        """Protects blocks from eviction (in every namespace) until unpinned,
        the lease ends or the connection closes. Best effort: a block that is
        already gone simply fails its load later."""
        if keys:
            self._each(lambda c: c.pin(keys, lease_s))

    def unpin(self, keys: Sequence[bytes]) -> None:
        if keys:
            self._each(lambda c: c.unpin(keys))

    def _each(self, call: Callable[[tarn_kv.Client], object]) -> None:
        with self._lock:
            clients = self._clients
        if clients is None:
            return
        try:
            for c in clients:
                call(c)
        except tarn_kv.TarnError as e:
            self.failed(e)

    def close(self) -> None:
        with self._lock:
            for c in self._clients or ():
                c.close()
            self._clients = None


def _rows(buf: torch.Tensor) -> list[memoryview]:
    mv = memoryview(buf.numpy()).cast("B")
    w = buf.shape[1]
    return [mv[i * w : (i + 1) * w] for i in range(buf.shape[0])]


class HeadSplit:
    """Which of a model's ``total`` KV heads a rank holds, and whether it
    writes them: ranks are given heads in order, ``tp // total`` ranks
    sharing each head when there are fewer heads than ranks (then only the
    first of them writes it). MLA models have one latent "head" every rank
    holds (``total=1``): rank 0 writes the value, every rank reads it."""

    def __init__(self, total: int, tp_size: int, tp_rank: int):
        if total < 1 or tp_size < 1 or not 0 <= tp_rank < tp_size:
            raise ValueError(f"no head split for {total} heads, rank {tp_rank} of {tp_size}")
        if total >= tp_size:
            if total % tp_size:
                raise ValueError(f"{total} KV heads do not divide among {tp_size} ranks")
            self.count = total // tp_size
            self.first = tp_rank * self.count
            self.writer = True
        else:
            if tp_size % total:
                raise ValueError(f"{tp_size} ranks do not share {total} KV heads evenly")
            replicas = tp_size // total
            self.count = 1
            self.first = tp_rank // replicas
            self.writer = tp_rank % replicas == 0
        self.total = total

    def __repr__(self) -> str:
        return f"HeadSplit(heads {self.first}..{self.first + self.count} of {self.total}, writer={self.writer})"


_WORDS = ((8, torch.int64), (4, torch.int32), (2, torch.int16))

#: Staging memory kept for reuse per PagedBlocks.
STAGING_KEEP_BYTES = 512 << 20


class _Layer:
    """One layer's cache as blocks. ``rows`` is a (blocks, page / word) view
    in the widest integer word that fits when each block is one run of
    memory (copies in 8-byte words run several times faster than in bytes);
    otherwise the byte view, copied block by block with its own strides."""

    def __init__(self, name: str, t: torch.Tensor, offset: int, value_bytes_hint: int):
        if t.stride(-1) != 1:
            raise ValueError(f"layer {name}'s KV cache is not contiguous in its last dimension")
        self.name = name
        self.u8 = t.view(torch.uint8)
        self.page = self.u8[0].numel()
        self.offset = offset
        # With a head split (PagedBlocks): the heads' dim, and where this
        # layer's bytes of one head sit among every layer's.
        self.head_dim = 0
        self.head_offset = 0
        self.head_bytes = 0
        self.word = 1
        self.rows: Optional[torch.Tensor] = None
        if self.u8[0].is_contiguous():
            stride = self.u8.stride(0)
            start = self.u8.storage_offset()
            rows = self.u8.as_strided((self.u8.shape[0], self.page), (stride, 1))
            self.rows = rows
            for w, dtype in _WORDS:
                if all(x % w == 0 for x in (self.page, stride, start, offset, value_bytes_hint)):
                    self.rows = rows.view(dtype)
                    self.word = w
                    break

    def staging_view(self, buf: torch.Tensor, n: int) -> torch.Tensor:
        """This layer's columns of the staging rows, in the layer's word."""
        cols = buf[:n, self.offset : self.offset + self.page]
        if self.word == 1:
            return cols
        return buf[:n].view(self.rows.dtype)[:, self.offset // self.word : (self.offset + self.page) // self.word]


class PagedBlocks:
    """A paged KV cache seen as blocks: ``layers`` are (name, tensor) with
    the block index as dim 0. A block's value is each layer's block bytes,
    in layer order.

    With ``heads`` each layer's tensor has its KV heads at dim
    ``tensor.dim() - 3`` (vLLM's ``[blocks, (kernel blocks,) heads, tokens,
    bytes]``), ``heads.count`` of them: the value holds all ``heads.total``
    heads, each head's bytes of every layer together, and this rank moves
    bytes ``part_offset .. part_offset + value_bytes`` of it."""

    def __init__(
        self,
        layers: Sequence[tuple[str, torch.Tensor]],
        log: logging.Logger = _log,
        heads: Optional[HeadSplit] = None,
    ):
        self.log = log
        if not layers:
            raise ValueError("no KV-cache layers")
        pages = [t.view(torch.uint8)[0].numel() for _, t in layers]
        self.value_bytes = sum(pages)
        self.heads = heads
        #: Where this rank's bytes start in the value, and the value's length.
        self.part_offset, self.value_len = 0, self.value_bytes
        self.layers: list[_Layer] = []
        off = 0
        for (name, t), page in zip(layers, pages):
            self.layers.append(_Layer(name, t, off, self.value_bytes))
            off += page
        if heads is not None:
            off = 0
            for layer, (name, t) in zip(self.layers, layers):
                dim = t.dim() - 3
                if dim < 1 or t.shape[dim] != heads.count:
                    raise ValueError(
                        f"layer {name}'s KV cache {tuple(t.shape)} does not hold "
                        f"{heads.count} heads at dim {dim}"
                    )
                layer.head_dim = dim
                layer.head_offset = off
                layer.head_bytes = layer.page // heads.count
                off += layer.head_bytes
            #: Bytes of one head across every layer.
            self.head_bytes = off
            self.part_offset = heads.first * off
            self.value_len = heads.total * off

        self.device = self.layers[0].u8.device
        # Staging buffers are reused: fresh host memory costs a page fault per
        # 4 KiB, as much as the copy itself.
        self._free: list[torch.Tensor] = []
        self._free_lock = threading.Lock()

    @property
    def whole(self) -> bool:
        """This rank moves whole values (no TP split, or TP=1): plain puts,
        and gets the client checksums itself."""
        return self.part_offset == 0 and self.value_bytes == self.value_len

    def staging(self, n: int) -> torch.Tensor:
        """Host memory for n values (pinned when a GPU will copy from it);
        give it back with ``release`` when done."""
        rows = 1 << max(0, n - 1).bit_length()
        with self._free_lock:
            for i, b in enumerate(self._free):
                if b.shape[0] == rows:
                    return self._free.pop(i)[:n]
        pin = self.device.type == "cuda"
        return torch.empty((rows, self.value_bytes), dtype=torch.uint8, pin_memory=pin)[:n]

    def release(self, buf: torch.Tensor) -> None:
        """Returns a staging buffer (up to STAGING_KEEP_BYTES are kept)."""
        base = buf._base if buf._base is not None else buf
        with self._free_lock:
            kept = sum(b.numel() for b in self._free)
            if all(b is not base for b in self._free) and kept + base.numel() <= STAGING_KEEP_BYTES:
                self._free.append(base)

    def gather(self, block_ids: Sequence[int]) -> torch.Tensor:
        """Copies blocks out of the cache: one row per block."""
        n = len(block_ids)
        buf = self.staging(n)
        idx = torch.tensor(list(block_ids), dtype=torch.long, device=self.device)
        if self.heads is not None:
            rows = buf.view(n, self.heads.count, self.head_bytes)
            for layer in self.layers:
                src = layer.u8.index_select(0, idx).movedim(layer.head_dim, 1)
                dst = rows[:, :, layer.head_offset : layer.head_offset + layer.head_bytes]
                dst.copy_(src.reshape(n, self.heads.count, layer.head_bytes))
            return buf
        for layer in self.layers:
            dst = layer.staging_view(buf, n)
            if layer.rows is not None:
                dst.copy_(layer.rows.index_select(0, idx))
            else:
                dst.copy_(layer.u8.index_select(0, idx).reshape(n, layer.page))
        return buf

    def scatter(self, buf: torch.Tensor, block_ids: Sequence[int]) -> None:
        """Copies rows of ``buf`` into the cache's blocks."""
        n = len(block_ids)
        idx = torch.tensor(list(block_ids), dtype=torch.long, device=self.device)
        if self.heads is not None:
            rows = buf[:n].view(n, self.heads.count, self.head_bytes)
            for layer in self.layers:
                part = rows[:, :, layer.head_offset : layer.head_offset + layer.head_bytes]
                shape = list(layer.u8.shape[1:])
                head_first = [shape[layer.head_dim - 1]] + shape[: layer.head_dim - 1] + shape[layer.head_dim :]
                src = part.reshape(n, *head_first).movedim(1, layer.head_dim).to(self.device)
                layer.u8.index_copy_(0, idx, src)
            return
        for layer in self.layers:
            src = layer.staging_view(buf, n).to(self.device)
            if layer.rows is not None:
                layer.rows.index_copy_(0, idx, src)
            else:
                layer.u8.index_copy_(0, idx, src.reshape(n, *layer.u8.shape[1:]))

    def load(self, store: Store, keys: Sequence[bytes], block_ids: Sequence[int]) -> set[int]:
        """Reads values into blocks. Returns the block ids that were not
        loaded: from the first block that is missing, of the wrong size or
        unreadable on (a prefix is only usable whole). Nothing is written to
        a block that fails."""
        clients = store.clients()
        if clients is None:
            return set(block_ids)
        buf = self.staging(len(keys))
        t0 = time.perf_counter()
        offsets = None if self.whole else [self.part_offset] * len(keys)
        try:
            got = clients[0].get_into(keys, _rows(buf), offsets)
        except (tarn_kv.TarnError, ValueError) as e:
            store.failed(e)
            self.release(buf)
            return set(block_ids)
        good = 0
        while good < len(got) and got[good] == self.value_bytes:
            good += 1
        try:
            if good:
                self.scatter(buf, block_ids[:good])
        finally:
            self.release(buf)
        self.log.debug(
            "Tarn: loaded %d of %d blocks (%.1f MiB) in %.2f ms",
            good,
            len(block_ids),
            good * self.value_bytes / (1 << 20),
            (time.perf_counter() - t0) * 1e3,
        )
        failed = set(block_ids[good:])
        if failed:
            self.log.info(
                "Tarn: %d of %d blocks not loadable (missing or wrong size); recomputing them",
                len(failed),
                len(block_ids),
            )
        return failed

    def save(self, store: Store, keys: Sequence[bytes], buf: torch.Tensor) -> int:
        """Stores gathered rows under keys; ``buf`` (from ``gather``) is taken
        over and reused once stored. Returns how
        many are stored (now or already); a store that is down stores none."""
        clients = store.clients()
        if clients is None:
            self.release(buf)
            return 0
        if self.heads is not None and not self.heads.writer:
            # Another rank holding the same heads writes them.
            self.release(buf)
            return len(keys)
        try:
            if self.whole:
                statuses = clients[0].put_from(keys, _rows(buf))
            else:
                n = len(keys)
                statuses = clients[0].put_parts(keys, _rows(buf), [self.value_len] * n, [self.part_offset] * n)
        except (tarn_kv.TarnError, ValueError) as e:
            store.failed(e)
            return 0
        finally:
            self.release(buf)
        stored = sum(1 for s in statuses if s.stored)
        if stored < len(statuses):
            bad = next(s for s in statuses if not s.stored)
            self.log.warning("Tarn: %d of %d blocks not stored (%s)", len(statuses) - stored, len(statuses), bad.name)
        return stored

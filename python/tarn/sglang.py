"""SGLang HiCache storage backend: KV pages in Tarn's KV-cache store.

Load it with::

    python -m sglang.launch_server --model-path MODEL --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "tarn",
            "module_path": "tarn.sglang", "class_name": "TarnHiCacheStorage",
            "interface_v1": 1, "endpoint": "127.0.0.1:9400"}'

With ``"interface_v1": 1`` SGLang moves pages zero-copy: a get reads each
value straight into the host pool's page (checksummed by the client as it
lands), a set writes from it. Each part of a page the host pool hands out
(K and V in the page-first layouts, one per layer and K/V in layer-first,
one for MLA) is one value, under a key made of SGLang's page hash and the
part's index. Without ``interface_v1`` SGLang's older calls move whole flat
pages (one value per page); the two forms are stored under different keys.

The namespace fingerprints what changes the bytes: model, dtype, host pool
class and layout, page size, the per-part sizes, and the rank suffix SGLang
needs (TP rank and size for MHA; none for MLA, whose KV every rank shares
and only the storage writer stores; PP, attention-CP and DCP ranks). A
different model, dtype or layout never reads another's pages.

The data path never raises: a page that cannot be read (never stored,
evicted, failed its checksum, server down) is a miss, one that cannot be
written reports False, and SGLang recomputes. A server that cannot be
reached is retried only every few seconds, so SGLang keeps serving.

Tested with SGLang 0.5.23 (MHA and MLA host pools, layouts layer_first,
page_first and page_first_direct). The v2 calls for hybrid models (Mamba,
SWA side pools) are not supported: SGLang's base class raises for them.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, List, Optional, Sequence

try:
    import torch
    from sglang.srt.mem_cache.hicache_storage import (
        HiCacheStorage,
        HiCacheStorageConfig,
        HiCacheStorageExtraInfo,
    )
except ImportError as e:  # pragma: no cover - only without SGLang
    raise ImportError(f"tarn.sglang is SGLang's HiCache backend and needs SGLang (0.5.23) installed: {e}") from e

from . import kv as tarn_kv
from .kv_blocks import Store, credentials, host_memory

if TYPE_CHECKING:
    from sglang.srt.mem_cache.pool_host import HostKVCache

logger = logging.getLogger("sglang.tarn")

#: Version of the stored page layout (bumped when the bytes of a value change).
VALUE_FORMAT = 1

#: This backend's keys in ``--hicache-storage-backend-extra-config`` (the
#: rest are SGLang's own).
EXTRA_KEYS = (
    "endpoint",
    "namespace",
    "transport",
    "access_key",
    "secret_key",
    "retry_seconds",
    "call_timeout_seconds",
    "max_connections",
)


@dataclass
class _Counters:
    """What the data path did since the last ``get_stats``."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    prefetch_pages: List[int] = field(default_factory=list)
    backup_pages: List[int] = field(default_factory=list)
    prefetch_gbps: List[float] = field(default_factory=list)
    backup_gbps: List[float] = field(default_factory=list)

    def add(self, pages: List[int], gbps: List[float], n: int, nbytes: int, seconds: float) -> None:
        with self.lock:
            pages.append(n)
            gbps.append(nbytes / max(seconds, 1e-9) / 1e9)


def _flat(items: Sequence[Any]) -> list:
    """Pointer or size lists, flattened where a page hands out several
    buffers per part (SGLang's multi-buffer form)."""
    out: list = []
    for x in items:
        if isinstance(x, (list, tuple)):
            out.extend(x)
        else:
            out.append(x)
    return out


def _memory(ptrs: Sequence[int], sizes: Sequence[int]) -> list:
    """Host memory at each address as a buffer, without a copy."""
    return [host_memory(p, n) for p, n in zip(ptrs, sizes)]


def _tensor_memory(t: "torch.Tensor") -> Any:
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("a page must be a contiguous tensor in host memory")
    return host_memory(t.data_ptr(), t.numel() * t.element_size())


class TarnHiCacheStorage(HiCacheStorage):
    """``HiCacheStorage`` backed by Tarn's KV-cache store.

    Built by SGLang's backend factory as ``TarnHiCacheStorage(storage_config,
    kwargs)``. Extra-config keys (besides SGLang's ``backend_name``,
    ``module_path``, ``class_name``, ``interface_v1``):

    - ``endpoint``: KV endpoint, default ``127.0.0.1:9400``
    - ``namespace``: prefix of the namespace, default ``sglang``
    - ``transport``: ``auto`` (shared memory on the same host), ``shm``, ``tcp``
    - ``access_key`` / ``secret_key``: credentials, else the environment's
      ``TARN_ACCESS_KEY`` / ``TARN_SECRET_KEY``, else the loopback defaults
    - ``retry_seconds``: after a failure to reach the store, how long to run
      without it before trying again (default 5)
    - ``call_timeout_seconds``: longest any call may take (default 30)
    - ``max_connections``: connections per rank (default 4)
    """

    def __init__(self, storage_config: Optional[HiCacheStorageConfig] = None, kwargs: Optional[dict] = None):
        self.storage_config = storage_config
        extra = dict((storage_config.extra_config if storage_config else None) or {})
        if storage_config is not None and storage_config.should_split_heads:
            raise ValueError(
                "TarnHiCacheStorage: heterogeneous TP (tp_lcm_size with the page_head layout) is not "
                "supported; each TP size stores its own pages"
            )
        self._credentials = credentials(extra.get("access_key"), extra.get("secret_key"), "TarnHiCacheStorage")
        self._prefix = str(extra.get("namespace", "sglang"))
        self._endpoint = str(extra.get("endpoint", tarn_kv.DEFAULT_ENDPOINT))
        self._transport = str(extra.get("transport", "auto"))
        self._retry = float(extra.get("retry_seconds", 5.0))
        self._timeout = float(extra.get("call_timeout_seconds", 30.0))
        self._max_connections = int(extra.get("max_connections", 4))
        self._zero_copy = bool(extra.get("interface_v1", 0))
        self._writer = storage_config.is_storage_writer if storage_config is not None else True
        self._metrics = bool(storage_config.enable_storage_metrics) if storage_config is not None else False
        self._counters = _Counters()
        self._store: Optional[Store] = None
        self._parts = 0
        self._part_sizes: list[int] = []
        self._page_bytes = 0
        self.namespace: Optional[str] = None
        self.mem_pool_host = None

    # -- set-up ---------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: "HostKVCache") -> None:
        """Learns the page geometry from the host pool and connects: the
        namespace is only known once the pool is."""
        super().register_mem_pool_host(mem_pool_host)
        if getattr(mem_pool_host, "kv_buffer", None) is None:
            raise ValueError("TarnHiCacheStorage: this host pool has no KV buffer (hybrid models are not supported)")
        page = mem_pool_host.page_size
        ptrs, sizes = mem_pool_host.get_page_buffer_meta(torch.arange(page, dtype=torch.int64))
        self._part_sizes = [int(s) for s in _flat(sizes)]
        self._parts = len(self._part_sizes)
        if self._parts == 0 or len(_flat(ptrs)) != self._parts:
            raise ValueError(f"TarnHiCacheStorage: the host pool describes a page as {ptrs!r}, {sizes!r}")
        self._page_bytes = sum(self._part_sizes)
        self.namespace = self._namespace(mem_pool_host)
        self._store = Store(
            self._endpoint,
            [self.namespace],
            self._transport,
            self._retry,
            logger,
            max_connections=self._max_connections,
            timeout_s=self._timeout,
            credentials=self._credentials,
        )
        self._store.clients()  # connect at start, not on the first request

    def _namespace(self, pool: "HostKVCache") -> str:
        import sglang

        c = self.storage_config
        mla = bool(c.is_mla_model) if c is not None else False
        model = (c.model_name if c is not None else None) or "model"
        model = "-".join(str(model).rstrip("/").split("/"))[-128:]
        dtype = str(pool.dtype).removeprefix("torch.")
        layout = str(pool.layout)
        # The rank suffix: MLA KV is the same on every TP rank (one shared
        # copy); MHA holds this rank's heads.
        rank = "mla" if mla else f"tp{c.tp_rank}of{c.tp_size}" if c is not None else "tp0of1"
        if c is not None:
            if c.pp_size > 1:
                rank += f"-pp{c.pp_rank}of{c.pp_size}"
            if c.attn_cp_size > 1:
                rank += f"-cp{c.attn_cp_rank}of{c.attn_cp_size}"
            if c.dcp_size > 1:
                rank += f"-dcp{c.dcp_rank}of{c.dcp_size}-page{c.logical_page_size}"
        geometry = [
            VALUE_FORMAT,
            sglang.__version__,
            type(pool).__name__,
            layout,
            dtype,
            pool.page_size,
            getattr(pool, "layer_num", None),
            getattr(pool, "head_num", None),
            getattr(pool, "head_dim", None),
            getattr(pool, "kv_lora_rank", None),
            getattr(pool, "qk_rope_head_dim", None),
            self._part_sizes,
        ]
        fp = hashlib.sha256(repr(geometry).encode()).hexdigest()[:16]
        ns = f"{self._prefix}/{model}/{layout}-{dtype}-p{pool.page_size}-{fp}/{rank}"
        if len(ns.encode()) > 512:
            raise ValueError(f"TarnHiCacheStorage: namespace {ns!r} is too long (at most 512 bytes)")
        return ns

    # -- keys -----------------------------------------------------------------

    @staticmethod
    def _key(page_hash: str, part: str) -> bytes:
        return hashlib.sha256(f"{page_hash}\0{part}".encode()).digest()

    def _part_keys(self, keys: Sequence[str]) -> list[bytes]:
        """The keys of every part of every page, page by page."""
        return [self._key(k, str(p)) for k in keys for p in range(self._parts)]

    def _client(self) -> Optional[tarn_kv.Client]:
        if self._store is None:
            return None
        clients = self._store.clients()
        return clients[0] if clients else None

    def _call(self, what: str, fn: Any) -> Any:
        """Runs ``fn(client)``; None when the store is down or the call
        failed (logged once until the store answers again)."""
        client = self._client()
        if client is None:
            return None
        try:
            return fn(client)
        except tarn_kv.TarnError as e:
            self._store.failed(e)
        except (ValueError, TypeError, BufferError) as e:
            logger.warning("Tarn HiCache %s failed: %s", what, e)
        return None

    # -- the zero-copy interface (interface_v1) -------------------------------

    def _page_memory(self, keys: Sequence[str], host_indices: "torch.Tensor") -> Optional[list]:
        page = self.mem_pool_host.page_size
        if len(host_indices) != len(keys) * page:
            logger.error("Tarn HiCache: %d host indices for %d pages of %d tokens", len(host_indices), len(keys), page)
            return None
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        ptrs, sizes = _flat(ptrs), _flat(sizes)
        if len(ptrs) != len(keys) * self._parts or list(sizes[: self._parts]) != self._part_sizes:
            logger.error("Tarn HiCache: the host pool's pages changed shape")
            return None
        return _memory(ptrs, sizes)

    def batch_exists(self, keys: List[str], extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        """How many leading pages are stored (every part of each)."""
        if not keys:
            return 0
        if self._zero_copy:
            parts, tkeys = self._parts, self._part_keys(keys)
        else:
            parts, tkeys = 1, [self._key(k, "page") for k in keys]
        hits = self._call("exists", lambda c: c.prefix_hits(tkeys))
        return (hits or 0) // max(parts, 1)

    def batch_get_v1(
        self,
        keys: List[str],
        host_indices: "torch.Tensor",
        extra_info: Optional[HiCacheStorageExtraInfo] = None,
    ) -> List[bool]:
        """Reads each page into the host pool at its indices; per page,
        whether every part arrived whole."""
        if not keys:
            return []
        bufs = self._page_memory(keys, host_indices)
        if bufs is None:
            return [False] * len(keys)
        tkeys = self._part_keys(keys)
        t0 = time.perf_counter()
        got = self._call("get", lambda c: c.get_into(tkeys, bufs))
        if got is None:
            return [False] * len(keys)
        ok = [
            all(got[i * self._parts + p] == self._part_sizes[p] for p in range(self._parts))
            for i in range(len(keys))
        ]
        if self._metrics:
            n = sum(ok)
            self._counters.add(
                self._counters.prefetch_pages,
                self._counters.prefetch_gbps,
                n,
                n * self._page_bytes,
                time.perf_counter() - t0,
            )
        return ok

    def batch_set_v1(
        self,
        keys: List[str],
        host_indices: "torch.Tensor",
        extra_info: Optional[HiCacheStorageExtraInfo] = None,
    ) -> List[bool]:
        """Stores each page from the host pool; per page, whether it is
        stored (by this call or before). An MLA rank that is not the storage
        writer stores nothing: the writer rank stores the same pages."""
        if not keys:
            return []
        if not self._writer:
            return [True] * len(keys)
        bufs = self._page_memory(keys, host_indices)
        if bufs is None:
            return [False] * len(keys)
        tkeys = self._part_keys(keys)
        t0 = time.perf_counter()
        stored = self._call("exists", lambda c: c.exists(tkeys))
        if stored is None:
            return [False] * len(keys)
        todo = [i for i, s in enumerate(stored) if not s]
        if todo:
            put = self._call("put", lambda c: c.put_from([tkeys[i] for i in todo], [bufs[i] for i in todo]))
            if put is None:
                put = [tarn_kv.Status.NO_SPACE] * len(todo)
            for i, s in zip(todo, put):
                stored[i] = s.stored
        ok = [all(stored[i * self._parts : (i + 1) * self._parts]) for i in range(len(keys))]
        if self._metrics:
            self._counters.add(
                self._counters.backup_pages,
                self._counters.backup_gbps,
                len({i // self._parts for i in todo}),
                sum(self._part_sizes[i % self._parts] for i in todo),
                time.perf_counter() - t0,
            )
        return ok

    # -- the older interface: whole flat pages --------------------------------

    @staticmethod
    def _target(target: Any, size: Any) -> Any:
        """A page's memory: a contiguous CPU tensor, or an address with its
        size in bytes (the form zero-copy backends are handed)."""
        if isinstance(target, torch.Tensor):
            return _tensor_memory(target)
        if isinstance(target, int) and isinstance(size, int):
            return host_memory(target, size)
        raise ValueError(f"a page target must be a tensor or an address and a size, not {type(target).__name__}")

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Optional["torch.Tensor"]:
        """Reads one flat page into ``target_location``; it, or None on a miss."""
        got = self.batch_get([key], [target_location], [target_sizes])
        return got[0]

    def batch_get(
        self, keys: List[str], target_locations: Any = None, target_sizes: Any = None
    ) -> List[Optional["torch.Tensor"]]:
        """Reads flat pages into their targets; per key the target (filled
        whole) or None."""
        if not keys:
            return []
        sizes = target_sizes if target_sizes is not None else [None] * len(keys)
        if target_locations is None or len(target_locations) != len(keys):
            logger.error("Tarn HiCache: batch_get needs one target per key")
            return [None] * len(keys)
        try:
            bufs = [self._target(t, s) for t, s in zip(target_locations, sizes)]
        except ValueError as e:
            logger.error("Tarn HiCache: %s", e)
            return [None] * len(keys)
        tkeys = [self._key(k, "page") for k in keys]
        t0 = time.perf_counter()
        got = self._call("get", lambda c: c.get_into(tkeys, bufs))
        if got is None:
            return [None] * len(keys)
        out = [t if n == len(b) else None for t, b, n in zip(target_locations, bufs, got)]
        if self._metrics:
            whole = [b for b, o in zip(bufs, out) if o is not None]
            self._counters.add(
                self._counters.prefetch_pages,
                self._counters.prefetch_gbps,
                len(whole),
                sum(len(b) for b in whole),
                time.perf_counter() - t0,
            )
        return out

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        """Stores one flat page (a tensor, or an address and size)."""
        return self.batch_set([key], [value], [target_location], [target_sizes])

    def batch_set(
        self, keys: List[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        """Stores flat pages; whether every one is stored."""
        if not keys:
            return True
        if not self._writer:
            return True
        n = len(keys)
        values = list(values) if values is not None else [None] * n
        locations = list(target_locations) if target_locations is not None else [None] * n
        sizes = list(target_sizes) if target_sizes is not None else [None] * n
        if not len(values) == len(locations) == len(sizes) == n:
            logger.error("Tarn HiCache: batch_set needs one value per key")
            return False
        try:
            bufs = [self._target(v, None) if v is not None else self._target(t, s) for v, t, s in zip(values, locations, sizes)]
        except ValueError as e:
            logger.error("Tarn HiCache: %s", e)
            return False
        tkeys = [self._key(k, "page") for k in keys]
        t0 = time.perf_counter()
        put = self._call("put", lambda c: c.put_from(tkeys, bufs))
        if put is None:
            return False
        if self._metrics:
            self._counters.add(
                self._counters.backup_pages,
                self._counters.backup_gbps,
                n,
                sum(len(b) for b in bufs),
                time.perf_counter() - t0,
            )
        return all(s.stored for s in put)

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # -- the rest -------------------------------------------------------------

    def clear(self) -> bool:
        """Not something Tarn's KV store does per namespace: pages age out
        by LRU. Logged and answered False, never a pretended success."""
        logger.error(
            "Tarn HiCache: clearing is not supported (namespace %s); stored pages are evicted "
            "least recently used first",
            self.namespace,
        )
        return False

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` since the last call (pages and GB/s
        per prefetch and backup batch), when storage metrics are on."""
        from sglang.srt.observability.metrics_collector import StorageMetrics

        m = StorageMetrics()
        c = self._counters
        with c.lock:
            m.prefetch_pgs.extend(c.prefetch_pages)
            m.backup_pgs.extend(c.backup_pages)
            m.prefetch_bandwidth.extend(c.prefetch_gbps)
            m.backup_bandwidth.extend(c.backup_gbps)
            c.prefetch_pages.clear()
            c.backup_pages.clear()
            c.prefetch_gbps.clear()
            c.backup_gbps.clear()
        return m

    def close(self) -> None:
        if self._store is not None:
            self._store.close()

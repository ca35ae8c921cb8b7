"""LMCache's in-process remote storage plugin backed by Tarn's KV store
(LMCache inside the inference engine, without its multi-process server).

LMCache configuration::

    remote_storage_plugins: ["tarn"]
    extra_config:
      remote_storage_plugin.tarn.module_path: tarn.lmcache
      remote_storage_plugin.tarn.class_name: TarnConnectorAdapter
      remote_storage_plugin.tarn.endpoint: "127.0.0.1:9400"     # optional
      remote_storage_plugin.tarn.namespace: "lmcache"           # optional

(``tarn.lmcache`` hands these classes out; they live here because they
subclass LMCache's own.) Other keys under ``remote_storage_plugin.tarn.``:
``transport``, ``access_key``/``secret_key``, ``workers``,
``call_timeout_seconds``, ``retry_seconds`` (as for ``TarnL2Adapter``).

Each chunk is one value (its bytes, read straight into the memory object
LMCache allocates) and, when LMCache saves chunk metadata (its default), a
second small value with LMCache's ``RemoteMetadata`` header, stored in the
same call; both keys derive from the chunk key's string.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, List, Optional

from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.protocol import RemoteMetadata
from lmcache.v1.storage_backend.connector import ConnectorAdapter, ConnectorContext, extract_plugin_type
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

from . import kv as tarn_kv
from .kv_blocks import Store, credentials

logger = logging.getLogger("lmcache.tarn")

PLUGIN_TYPE = "tarn"


class TarnConnectorAdapter(ConnectorAdapter):
    """Builds ``TarnRemoteConnector`` for ``plugin://tarn[.instance]`` (the
    ``remote_storage_plugins`` entry) and ``tarn://HOST:PORT`` URLs."""

    def __init__(self) -> None:
        super().__init__("tarn://")

    def can_parse(self, url: str) -> bool:
        if url.startswith(self.schema):
            return True
        return url.startswith("plugin://") and extract_plugin_type(url[len("plugin://") :]) == PLUGIN_TYPE

    def create_connector(self, context: ConnectorContext) -> RemoteConnector:
        endpoint = context.url[len(self.schema) :] if context.url.startswith(self.schema) else None
        return TarnRemoteConnector(
            loop=context.loop,
            local_cpu_backend=context.local_cpu_backend,
            config=context.config,
            plugin_name=context.plugin_name or PLUGIN_TYPE,
            endpoint=endpoint,
        )


class TarnRemoteConnector(RemoteConnector):
    """``RemoteConnector`` over Tarn's KV-cache store. Every call runs on a
    small thread pool with the GIL released while Tarn answers, so LMCache's
    event loop keeps going."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        local_cpu_backend: Any,
        config: Any,
        plugin_name: str = PLUGIN_TYPE,
        endpoint: Optional[str] = None,
    ):
        super().__init__(local_cpu_backend.config, local_cpu_backend.metadata)
        extra = (config.extra_config if config is not None else None) or {}
        prefix = f"remote_storage_plugin.{plugin_name}."

        def opt(name: str, default: Any) -> Any:
            return extra.get(prefix + name, default)

        creds = credentials(opt("access_key", None), opt("secret_key", None), f"{prefix}*")
        workers = int(opt("workers", 4))
        if workers < 1:
            raise ValueError(f"{prefix}workers must be at least 1")
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        self.endpoint = str(endpoint or opt("endpoint", tarn_kv.DEFAULT_ENDPOINT))
        self.namespace = str(opt("namespace", "lmcache"))
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="tarn-lmcache")
        self._store = Store(
            self.endpoint,
            [self.namespace],
            str(opt("transport", "auto")),
            float(opt("retry_seconds", 5.0)),
            logger,
            max_connections=workers,
            timeout_s=float(opt("call_timeout_seconds", 30.0)),
            credentials=creds,
        )
        self._store.clients()  # connect at start: a wrong endpoint is logged now

    # -- keys and calls -------------------------------------------------------

    @staticmethod
    def _digest(key: CacheEngineKey, part: str) -> bytes:
        return hashlib.sha256(f"{key.to_string()}\0{part}".encode()).digest()

    def _keys(self, keys: List[CacheEngineKey]) -> list[bytes]:
        """Per chunk: its metadata key (when saved) then its data key."""
        parts = ("meta", "data") if self.save_chunk_meta else ("data",)
        return [self._digest(k, p) for k in keys for p in parts]

    @property
    def _parts(self) -> int:
        return 2 if self.save_chunk_meta else 1

    def _call(self, fn: Callable[[tarn_kv.Client], Any]) -> Any:
        """``fn(client)``; raises ``KvConnectionError`` while the store is down."""
        clients = self._store.clients()
        if clients is None:
            raise tarn_kv.KvConnectionError(f"Tarn KV store at {self.endpoint} unavailable")
        try:
            return fn(clients[0])
        except tarn_kv.TarnError as e:
            self._store.failed(e)
            raise

    async def _run(self, fn: Callable[[tarn_kv.Client], Any]) -> Any:
        return await self.loop.run_in_executor(self._pool, self._call, fn)

    # -- lookups --------------------------------------------------------------

    async def exists(self, key: CacheEngineKey) -> bool:
        return await self.loop.run_in_executor(self._pool, self.exists_sync, key)

    def exists_sync(self, key: CacheEngineKey) -> bool:
        return all(self._store.stored(self._keys([key])) or [False])

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: List[CacheEngineKey]) -> int:
        """Leading chunks stored, every part of each."""
        try:
            return self._call(lambda c: c.prefix_hits(self._keys(keys))) // self._parts
        except tarn_kv.TarnError:
            return 0

    async def batched_async_contains(self, lookup_id: str, keys: List[CacheEngineKey], pin: bool = False) -> int:
        """Leading chunks stored; with ``pin`` they are kept from eviction
        for a minute (or until this connection closes), for the load that
        follows."""

        def look(c: tarn_kv.Client) -> int:
            tk = self._keys(keys)
            found = c.pin(tk) if pin else c.exists(tk)
            lead = found.index(False) if False in found else len(found)
            return lead // self._parts

        try:
            return await self._run(look)
        except tarn_kv.TarnError:
            return 0

    # -- data -----------------------------------------------------------------

    def _load(self, keys: List[CacheEngineKey]) -> list[Optional[MemoryObj]]:
        """Reads chunks into memory objects LMCache allocates: the headers
        first (shapes and dtypes), then every chunk's bytes in one call.
        Per key the object, or None (a miss, or anything that went wrong)."""
        out: list[Optional[MemoryObj]] = [None] * len(keys)
        objs: list[Optional[MemoryObj]] = [None] * len(keys)
        metas: list[Optional[RemoteMetadata]] = [None] * len(keys)
        clients = self._store.clients()
        if clients is None:
            return out
        c = clients[0]
        try:
            if self.save_chunk_meta:
                heads = [bytearray(self.remote_metadata_bytes) for _ in keys]
                got = c.get_into([self._digest(k, "meta") for k in keys], heads)
                metas = [RemoteMetadata.deserialize(h) if n == len(h) else None for h, n in zip(heads, got)]
            for i, m in enumerate(metas):
                if m is not None:
                    objs[i] = self.local_cpu_backend.allocate(m.shapes, m.dtypes, m.fmt)
                elif not self.save_chunk_meta:
                    objs[i] = self.local_cpu_backend.allocate(self.meta_shapes, self.meta_dtypes, self.meta_fmt)
            todo = [i for i, o in enumerate(objs) if o is not None]
            got = c.get_into([self._digest(keys[i], "data") for i in todo], [objs[i].byte_array for i in todo])
            for i, n in zip(todo, got):
                out[i] = self._fit(objs[i], metas[i], n)
                if out[i] is not None:
                    objs[i] = None
        except tarn_kv.TarnError as e:
            self._store.failed(e)
        except ValueError as e:  # a value larger than what LMCache allocated
            logger.warning("Tarn LMCache get: %s", e)
        finally:
            for o in objs:
                if o is not None:
                    o.ref_count_down()
        return out

    def _fit(self, obj: MemoryObj, meta: Optional[RemoteMetadata], n: Optional[int]) -> Optional[MemoryObj]:
        """The object holding a value of ``n`` bytes, if that is a whole
        chunk (or, without saved metadata, a legal partial one)."""
        if n is None:
            return None
        size = len(obj.byte_array)
        if meta is not None:
            return obj if n == meta.length == size else None
        if n == size:
            return obj
        try:
            return self.reshape_partial_chunk(obj, n)
        except ValueError:
            return None

    async def get(self, key: CacheEngineKey) -> Optional[MemoryObj]:
        return (await self.loop.run_in_executor(self._pool, self._load, [key]))[0]

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys: List[CacheEngineKey]) -> List[Optional[MemoryObj]]:
        return await self.loop.run_in_executor(self._pool, self._load, list(keys))

    async def batched_get_non_blocking(self, lookup_id: str, keys: List[CacheEngineKey]) -> List[MemoryObj]:
        """The leading chunks that could be read, in one call; the objects
        read past the first miss are released."""
        objs = await self.batched_get(list(keys))
        lead: List[MemoryObj] = []
        for o in objs:
            if o is None:
                break
            lead.append(o)
        for o in objs[len(lead) :]:
            if o is not None:
                o.ref_count_down()
        return lead

    def _store_objs(self, keys: List[CacheEngineKey], objs: List[MemoryObj]) -> None:
        bufs: list[Any] = []
        for o in objs:
            data = o.byte_array
            if self.save_chunk_meta:
                bufs.append(
                    RemoteMetadata(len(data), o.get_shapes(), o.get_dtypes(), o.get_memory_format()).serialize()
                )
            bufs.append(data)
        statuses = self._call(lambda c: c.put_from(self._keys(keys), bufs))
        failed = [s for s in statuses if not s.stored]
        if failed:
            raise RuntimeError(f"Tarn stored {len(statuses) - len(failed)} of {len(statuses)} values: {failed[0].name}")

    async def put(self, key: CacheEngineKey, memory_obj: MemoryObj) -> None:
        await self.loop.run_in_executor(self._pool, self._store_objs, [key], [memory_obj])

    def support_batched_put(self) -> bool:
        return True

    async def batched_put(self, keys: List[CacheEngineKey], memory_objs: List[MemoryObj]) -> None:
        await self.loop.run_in_executor(self._pool, self._store_objs, list(keys), list(memory_objs))

    def remove_sync(self, key: CacheEngineKey) -> bool:
        try:
            return any(self._call(lambda c: c.delete(self._keys([key]))))
        except tarn_kv.TarnError:
            return False

    async def list(self) -> List[str]:
        raise NotImplementedError("Tarn's KV store does not list keys (they are digests); nothing was listed")

    def support_ping(self) -> bool:
        return True

    async def ping(self) -> int:
        try:
            await self._run(lambda c: c.stats())
            return 0
        except tarn_kv.TarnError:
            return 1

    async def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._store.close()

    def __repr__(self) -> str:
        return f"<TarnRemoteConnector {self.endpoint} namespace={self.namespace!r}>"

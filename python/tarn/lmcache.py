"""LMCache plugins: Tarn's KV-cache store as LMCache's L2 tier.

LMCache's multi-process server (and ``lmcache bench l2``) loads the adapter
as a native plugin::

    {"type": "native_plugin", "module_path": "tarn.lmcache",
     "class_name": "TarnL2Adapter",
     "adapter_params": {"endpoint": "127.0.0.1:9400", "namespace": "lmcache"}}

``TarnL2Adapter`` is the connector LMCache's ``NativeConnectorL2Adapter``
wraps: batches are submitted without blocking and run on a few threads
(the GIL released while Tarn answers); each finished batch is queued and
the adapter's eventfd is signalled; ``drain_completions`` hands them over.
Values move between LMCache's L1 memory and Tarn with no copy in Python
(shared memory on the same host: one copy into the server, one out,
checksummed).

Keys: LMCache's object key string (model, KV rank, object group, chunk
hash, and the ``cache_salt`` if any), hashed to Tarn's 32-byte key. Keys
with a ``cache_salt`` live in their own namespace, ``<namespace>/salt/<salt>``,
so Tarn's per-namespace counters (``/metrics``: ``tarn_kv_namespace``, and
``tarn.kv.Client.stats``) report hits, misses and bytes per salt; LMCache's
own usage accounting per ``cache_salt`` comes from the completed stores.

A lookup pins what it finds for ``lock_seconds`` (LMCache loads what it
looked up next; the pin keeps eviction off it until then). A batch that
cannot be served (the server down, a value of another size) completes
with those keys failed, never with an exception in LMCache's threads.

LMCache inside an engine (no multi-process server) takes the same store as
an in-process remote storage plugin, ``tarn.lmcache.TarnConnectorAdapter``
(``tarn/lmcache_remote.py`` has the configuration).

Tested with LMCache 0.5.6.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional, Sequence

from . import kv as tarn_kv
from .kv_blocks import Store, credentials

logger = logging.getLogger("lmcache.tarn")

_KEY_SEP = "@"
#: Fields of LMCache's object key string before the optional cache_salt.
_KEY_FIELDS = 4
_NAMESPACE_MAX = 512

#: (future id, ok, error message, per-key results)
Completion = tuple[int, bool, str, Optional[list[bool]]]


class TarnL2Adapter:
    """LMCache native-plugin L2 connector backed by Tarn's KV-cache store.

    ``adapter_params`` (all optional):

    - ``endpoint``: KV endpoint, default ``127.0.0.1:9400``
    - ``namespace``: namespace (prefix, with ``/salt/<cache_salt>`` for
      salted keys), default ``lmcache``
    - ``transport``: ``auto`` (shared memory on the same host), ``shm``, ``tcp``
    - ``access_key`` / ``secret_key``: credentials, else the environment's
      ``TARN_ACCESS_KEY`` / ``TARN_SECRET_KEY``, else the loopback defaults
    - ``workers``: batches run at once (and connections per namespace),
      default 4
    - ``lock_seconds``: how long a lookup pins the blocks it found,
      default 10 (0: no pins)
    - ``call_timeout_seconds``: longest any call may take, default 30
    - ``retry_seconds``: after a failure to reach the server, how long
      batches fail at once before it is tried again, default 5
    """

    def __init__(
        self,
        endpoint: str = tarn_kv.DEFAULT_ENDPOINT,
        namespace: str = "lmcache",
        transport: str = "auto",
        access_key: Optional[str] = None,
        secret_key: Optional[str] = None,
        workers: int = 4,
        lock_seconds: float = 10.0,
        call_timeout_seconds: float = 30.0,
        retry_seconds: float = 5.0,
    ):
        creds = credentials(access_key, secret_key, "TarnL2Adapter")
        if int(workers) < 1:
            raise ValueError("TarnL2Adapter: workers must be at least 1")
        if float(lock_seconds) < 0:
            raise ValueError("TarnL2Adapter: lock_seconds must not be negative")
        base = str(namespace)
        if len(base.encode()) > _NAMESPACE_MAX - 80:
            raise ValueError(f"TarnL2Adapter: namespace {base!r} is too long (at most {_NAMESPACE_MAX - 80} bytes)")
        self.endpoint = str(endpoint)
        self.namespace = base
        self._transport = str(transport)
        self._credentials = creds
        self._workers = int(workers)
        self._lock_s = float(lock_seconds)
        self._timeout = float(call_timeout_seconds)
        self._retry = float(retry_seconds)
        self._efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._pool = ThreadPoolExecutor(self._workers, thread_name_prefix="tarn-lmcache")
        self._lock = threading.Lock()
        self._done: deque[Completion] = deque()
        self._next_id = 0
        self._closed = False
        self._stores: dict[str, Store] = {}
        self._store(base).clients()  # connect at start: a wrong endpoint is logged now

    # -- what LMCache calls ---------------------------------------------------

    def event_fd(self) -> int:
        """Readable when completions are waiting."""
        return self._efd

    def submit_batch_get(self, keys: Sequence[str], memviews: Sequence[Any]) -> int:
        """Reads each key's value into its buffer (which must be its size)."""
        return self._submit(keys, lambda c, ix, ds: self._get(c, ds, [memviews[i] for i in ix]))

    def submit_batch_set(self, keys: Sequence[str], memviews: Sequence[Any]) -> int:
        """Stores each buffer under its key."""
        return self._submit(keys, lambda c, ix, ds: [s.stored for s in c.put_from(ds, [memviews[i] for i in ix])])

    def submit_batch_exists(self, keys: Sequence[str]) -> int:
        """Which keys are stored; those found are pinned for ``lock_seconds``."""
        if self._lock_s > 0:
            return self._submit(keys, lambda c, ix, ds: c.pin(ds, self._lock_s))
        return self._submit(keys, lambda c, ix, ds: c.exists(ds))

    def submit_batch_delete(self, keys: Sequence[str]) -> int:
        """Deletes keys; per key whether it was stored."""
        return self._submit(keys, lambda c, ix, ds: c.delete(ds))

    def drain_completions(self) -> list[Completion]:
        """Every batch finished since the last call."""
        try:
            os.eventfd_read(self._efd)
        except BlockingIOError:
            pass
        with self._lock:
            out = list(self._done)
            self._done.clear()
        return out

    def close(self) -> None:
        """Finishes the batches submitted, then lets go of connections."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._pool.shutdown(wait=True)
        for s in self._stores.values():
            s.close()
        os.close(self._efd)

    # -- the work -------------------------------------------------------------

    @staticmethod
    def _get(client: tarn_kv.Client, digests: list[bytes], bufs: list[Any]) -> list[bool]:
        got = client.get_into(digests, bufs)
        return [n is not None and n == memoryview(b).nbytes for n, b in zip(got, bufs)]

    def _namespace_of(self, key: str) -> str:
        parts = key.split(_KEY_SEP, _KEY_FIELDS)
        if len(parts) <= _KEY_FIELDS or not parts[_KEY_FIELDS]:
            return self.namespace
        salt = parts[_KEY_FIELDS]
        ns = f"{self.namespace}/salt/{salt}"
        if len(ns.encode()) > _NAMESPACE_MAX:
            ns = f"{self.namespace}/salt/sha256:{hashlib.sha256(salt.encode()).hexdigest()}"
        return ns

    def _store(self, namespace: str) -> Store:
        with self._lock:
            s = self._stores.get(namespace)
            if s is None:
                s = Store(
                    self.endpoint,
                    [namespace],
                    self._transport,
                    self._retry,
                    logger,
                    max_connections=self._workers,
                    timeout_s=self._timeout,
                    credentials=self._credentials,
                )
                self._stores[namespace] = s
            return s

    def _submit(
        self,
        keys: Sequence[str],
        op: Callable[[tarn_kv.Client, list[int], list[bytes]], Sequence[bool]],
    ) -> int:
        keys = list(keys)
        with self._lock:
            if self._closed:
                raise RuntimeError("TarnL2Adapter is closed")
            fid = self._next_id
            self._next_id += 1
        self._pool.submit(self._run, fid, keys, op)
        return fid

    def _run(self, fid: int, keys: list[str], op: Callable[..., Sequence[bool]]) -> None:
        results = [False] * len(keys)
        errors: list[str] = []
        try:
            groups: dict[str, list[int]] = {}
            for i, k in enumerate(keys):
                groups.setdefault(self._namespace_of(k), []).append(i)
            for ns, ix in groups.items():
                store = self._store(ns)
                clients = store.clients()
                if clients is None:
                    errors.append(f"Tarn KV store at {self.endpoint} unavailable")
                    continue
                digests = [hashlib.sha256(keys[i].encode()).digest() for i in ix]
                try:
                    for i, r in zip(ix, op(clients[0], ix, digests)):
                        results[i] = bool(r)
                except tarn_kv.TarnError as e:
                    store.failed(e)
                    errors.append(str(e))
                except (ValueError, TypeError, BufferError) as e:
                    errors.append(str(e))
        except Exception as e:  # noqa: BLE001 - a completion must always come
            logger.exception("Tarn L2 batch failed")
            errors.append(f"{type(e).__name__}: {e}")
        self._complete((fid, not errors, "; ".join(errors), results))

    def _complete(self, c: Completion) -> None:
        with self._lock:
            self._done.append(c)
        os.eventfd_write(self._efd, 1)


def __getattr__(name: str) -> Any:
    """The in-process remote storage plugin (``TarnConnectorAdapter``,
    ``TarnRemoteConnector``) subclasses LMCache's own classes: imported from
    ``tarn.lmcache_remote`` on first use, so the L2 adapter does not pull in
    LMCache's storage backends."""
    if name in ("TarnConnectorAdapter", "TarnRemoteConnector"):
        from . import lmcache_remote

        return getattr(lmcache_remote, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

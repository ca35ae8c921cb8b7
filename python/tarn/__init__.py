"""Tarn: storage that keeps GPUs fed.

``tarn.kv`` is the KV-cache store client; ``tarn.vllm`` is the vLLM KV
connector (imported only by vLLM).
"""

from . import errors, kv
from .errors import (
    KvConnectionError,
    KvPermissionError,
    KvProtocolError,
    KvServerError,
    TarnError,
)

__version__ = "0.1.0"
__all__ = [
    "errors",
    "kv",
    "TarnError",
    "KvConnectionError",
    "KvServerError",
    "KvPermissionError",
    "KvProtocolError",
]

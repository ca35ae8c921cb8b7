"""vLLM model loader: ``--load-format tarn`` streams a model's safetensors
weights from Tarn (or any S3 endpoint) through ``tarn.loader``, with no
patch to vLLM. The ``tarn`` package registers it through the
``vllm.general_plugins`` entry point, which vLLM runs in every process it
starts:

    vllm serve CONFIG_DIR --load-format tarn \\
        --model-loader-extra-config '{"uri": "s3://models/llama-3-8b/"}'

``CONFIG_DIR`` holds the model's config and tokenizer (``tarn.loader.fetch_files``
writes them); the weights come from ``uri``. Other keys of the extra config:
``endpoint`` (else ``AWS_ENDPOINT_URL``...), ``connections``, ``chunk_size``,
``memory_cap`` (bytes), ``share_reads`` (default true: with tensor
parallelism, each rank reads its share of the bytes and receives the rest
from the others, so the model is read once, not once per rank).

Written against vLLM's ``register_model_loader`` and ``BaseModelLoader``
(vLLM 0.11 and later, checked with 0.32).
"""

from __future__ import annotations

from typing import Any

#: Extra-config keys passed to ``tarn.objects.Client``.
CLIENT_KEYS = ("endpoint", "connections", "chunk_size", "max_inflight", "retries", "hedge", "region", "profile")

_registered = False


def register() -> None:
    """The ``vllm.general_plugins`` entry point: registers ``tarn``."""
    global _registered
    if _registered:
        return
    from vllm.model_executor.model_loader import BaseModelLoader, register_model_loader

    @register_model_loader("tarn")
    class TarnModelLoader(BaseModelLoader):
        """Weights from ``model_loader_extra_config["uri"]`` through tarn.loader."""

        def __init__(self, load_config: Any):
            super().__init__(load_config)
            extra = dict(load_config.model_loader_extra_config or {})
            self.uri = extra.pop("uri", None)
            self.memory_cap = extra.pop("memory_cap", None)
            self.share_reads = extra.pop("share_reads", True)
            if self.memory_cap is not None and (
                not isinstance(self.memory_cap, int) or isinstance(self.memory_cap, bool) or self.memory_cap <= 0
            ):
                raise ValueError(f"--load-format tarn: memory_cap is a number of bytes, not {self.memory_cap!r}")
            if not isinstance(self.share_reads, bool):
                raise ValueError(f"--load-format tarn: share_reads is true or false, not {self.share_reads!r}")
            self.client_args = {k: extra.pop(k) for k in CLIENT_KEYS if k in extra}
            if extra:
                raise ValueError(
                    f"--load-format tarn: unknown keys in --model-loader-extra-config: {sorted(extra)}; "
                    f"known: uri, memory_cap, share_reads, {', '.join(CLIENT_KEYS)}"
                )

        def _uri(self, model_config: Any) -> str:
            uri = self.uri or (model_config.model if str(model_config.model).startswith("s3://") else None)
            if not uri:
                raise ValueError(
                    "--load-format tarn needs the weights' location: "
                    '--model-loader-extra-config \'{"uri": "s3://BUCKET/MODEL/"}\''
                )
            return uri

        def _client(self):
            from .objects import Client

            return Client(**self.client_args)

        def download_model(self, model_config: Any) -> None:
            # Nothing to download ahead: check that the weights are there.
            from .loader import resolve

            resolve(self._client(), self._uri(model_config))

        def load_weights(self, model: Any, model_config: Any) -> None:
            import torch

            from .loader import Loader

            device = next((p.device for p in model.parameters()), torch.device("cpu"))
            group = None
            if self.share_reads:
                group = _tp_group(device)
            loader = Loader(
                self._uri(model_config),
                device,
                client=self._client(),
                memory_cap=self.memory_cap,
                process_group=group,
            )
            wanted = {name for name, _ in model.named_parameters()}
            loaded = model.load_weights(iter(loader))
            if model_config.quantization is None and loaded is not None:
                missing = wanted - set(loaded)
                if missing:
                    raise ValueError(
                        f"these weights were not in {self._uri(model_config)}: {sorted(missing)[:10]}"
                        + (" ..." if len(missing) > 10 else "")
                    )

    _registered = True


def _tp_group(device: Any):
    """vLLM's tensor-parallel group when it has more than one rank: its
    device group for GPU tensors, its CPU (gloo) group otherwise."""
    try:
        from vllm.distributed import get_tp_group

        tp = get_tp_group()
    except Exception:  # noqa: BLE001 - not initialized: a single process
        return None
    if tp.world_size <= 1:
        return None
    return tp.device_group if device.type == "cuda" else tp.cpu_group

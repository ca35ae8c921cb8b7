"""TarnConnector with an eviction race made certain: on the loads numbered
in ``kv_connector_extra_config["fault_loads"]`` (default [2]; 1 is the
engine's first load) it deletes the back half of the blocks from Tarn after
vLLM's lookup found them and before they are read. vLLM must recompute
those blocks."""

from tarn import vllm as tarn_vllm
from tarn.vllm import TarnConnector, Transfer

tarn_vllm._EXTRA_KEYS.add("fault_loads")


class FaultyTarnConnector(TarnConnector):
    loads = 0

    def _load(self, t: Transfer) -> set[int]:
        FaultyTarnConnector.loads += 1
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        if FaultyTarnConnector.loads in extra.get("fault_loads", [2]):
            clients = self._store.clients()
            assert clients is not None
            clients[0].delete(t.keys[len(t.keys) // 2 :])
        return super()._load(t)

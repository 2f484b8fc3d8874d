"""How the front end talks to the `EngineCore` (vLLM's `vllm/v1/engine/core_client.py`).

`InprocClient`: the engine core in this process; `get_output()` runs one
step. Simple to step through in a notebook or a debugger.
"""

from __future__ import annotations

from minivllm.config import EngineConfig
from minivllm.v1.engine import EngineCoreOutputs, EngineCoreRequest
from minivllm.v1.engine.core import EngineCore


class EngineCoreClient:
    @staticmethod
    def make_client(engine_config: EngineConfig) -> EngineCoreClient:
        return InprocClient(engine_config)


class InprocClient(EngineCoreClient):
    def __init__(self, engine_config: EngineConfig) -> None:
        self.engine_core = EngineCore(engine_config)

    def get_output(self) -> EngineCoreOutputs:
        outputs, _ = self.engine_core.step()
        return outputs

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine_core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.engine_core.abort_requests(request_ids)

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.reset_prefix_cache()

    def shutdown(self) -> None:
        self.engine_core.shutdown()

"""An attention backend and a model that break only in a worker process (never in the
test's own process), to see a worker fail while the engine starts."""

from __future__ import annotations

import multiprocessing

from minivllm.attention.backends.torch_paged import TorchAttentionBackend
from minivllm.model_executor.models.llama import LlamaForCausalLM


class FailsInWorkers(TorchAttentionBackend):
    @staticmethod
    def get_impl_cls():
        if multiprocessing.parent_process() is not None:
            raise RuntimeError("this worker cannot build its attention layers")
        return TorchAttentionBackend.get_impl_cls()


class LlamaThatFailsInWorkers(LlamaForCausalLM):
    """Registered in place of Llama: a worker that builds it has received the registration."""

    def __init__(self, config) -> None:
        if multiprocessing.parent_process() is not None:
            raise RuntimeError("the registered model was built in a worker")
        super().__init__(config)

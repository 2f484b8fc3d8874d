"""An attention backend that breaks only in a worker process (never in the
test's own process), to see a worker fail while the engine starts."""

from __future__ import annotations

import multiprocessing

from minivllm.attention.backends.torch_paged import TorchAttentionBackend


class FailsInWorkers(TorchAttentionBackend):
    @staticmethod
    def get_impl_cls():
        if multiprocessing.parent_process() is not None:
            raise RuntimeError("this worker cannot build its attention layers")
        return TorchAttentionBackend.get_impl_cls()

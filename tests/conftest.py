"""Shared fixtures: tiny random checkpoints, saved once per test session and
loaded through the engine's real loading path."""

from __future__ import annotations

import asyncio
import importlib.util

import pytest
import torch
from transformers import AutoModelForCausalLM

from tools.tiny_models import make_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """tiny_model_dir(arch) -> path of a saved tiny checkpoint (made once)."""
    made: dict[str, str] = {}

    def get(arch: str) -> str:
        if arch not in made:
            made[arch] = make_tiny_model(arch, str(tmp_path_factory.mktemp(f"tiny-{arch}")))
        return made[arch]

    return get


@pytest.fixture(scope="session")
def hf_model(tiny_model_dir):
    """hf_model(arch) -> the same checkpoint as a Hugging Face model (the oracle)."""
    loaded: dict[str, torch.nn.Module] = {}

    def get(arch: str):
        if arch not in loaded:
            loaded[arch] = AutoModelForCausalLM.from_pretrained(tiny_model_dir(arch)).eval()
        return loaded[arch]

    return get


def cuda_kernels_unavailable() -> str | None:
    """Why the CUDA kernels cannot run here (None: they can)."""
    if not torch.cuda.is_available():
        return "needs an NVIDIA GPU (torch.cuda.is_available() is False)"
    if importlib.util.find_spec("cupy") is None:
        return "needs CuPy: pip install -e '.[cuda]'"
    return None


def pytest_collection_modifyitems(config, items):
    """Tests marked `cuda` are skipped, with the reason, where no GPU can run them."""
    reason = cuda_kernels_unavailable()
    if reason is None:
        return
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="module")
def loop():
    """One event loop for a module's asyncio tests, closed after them as
    `asyncio.run` closes its own: tasks still pending (an AsyncLLM's output
    tasks, cancelled by its shutdown) are let finish first."""
    loop = asyncio.new_event_loop()
    yield loop
    pending = asyncio.all_tasks(loop)
    for task in pending:
        task.cancel()
    if pending:  # (gather() of nothing would make a future of another loop)
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    loop.close()


@pytest.fixture(scope="module")
def async_llm(loop):
    """A V1 AsyncLLM on the shipped model (its engine core in a process of
    its own), shared by a module's tests and shut down after them."""
    from minivllm.engine.arg_utils import EngineArgs
    from minivllm.v1.engine.async_llm import AsyncLLM

    llm = AsyncLLM.from_engine_args(EngineArgs(use_v1=True))
    yield llm
    llm.shutdown()

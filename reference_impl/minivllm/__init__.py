"""minivllm: a small, complete engine that works the way vLLM does."""

# First, before anything imports torch: the OpenMP setting of envs.py.
import minivllm.envs  # noqa: F401, I001

from minivllm.engine.arg_utils import AsyncEngineArgs, EngineArgs
from minivllm.engine.async_llm_engine import AsyncLLMEngine
from minivllm.engine.llm_engine import LLMEngine
from minivllm.entrypoints.llm import LLM
from minivllm.model_executor.models import ModelRegistry
from minivllm.outputs import CompletionOutput, RequestOutput
from minivllm.sampling_params import SamplingParams

__version__ = "0.1.0"  # the package's version (pyproject.toml reads it from here)

__all__ = [
    "LLM",
    "AsyncEngineArgs",
    "AsyncLLMEngine",
    "CompletionOutput",
    "EngineArgs",
    "LLMEngine",
    "ModelRegistry",
    "RequestOutput",
    "SamplingParams",
]

"""`torch.compile` for both engines' model runners, selected by
`compilation_level` (vLLM's `CompilationLevel`; vLLM keeps the same pieces in
vllm/compilation/).

- `levels.py`: the levels 0-3 and what each does;
- `wrapper.py`: `CompiledModel`, the compiled model forward, and why it does
  not recompile every step (imported on use: it loads TorchDynamo, which an
  eager engine does not need);
- `backends.py`: the backend each captured graph goes to (eager or Inductor);
- `forward_context.py`: the per-step state the opaque ops (attention, packed
  CPU products) read;
- `counter.py`: compilations counted, for tests.
"""

from collections.abc import Callable

from torch import nn

from minivllm.compilation.counter import CompilationCounter, compilation_counter
from minivllm.compilation.forward_context import (
    ForwardContext,
    get_forward_context,
    set_forward_context,
)
from minivllm.compilation.levels import CompilationLevel


def model_forward(model: nn.Module, level: int) -> Callable:
    """What a model runner calls for the forward (both engines' runners): the
    model itself at NO_COMPILATION, else its compiled form (`CompiledModel`,
    imported here on use: it loads TorchDynamo, which an eager engine never needs)."""
    if level <= CompilationLevel.NO_COMPILATION:
        return model
    from minivllm.compilation.wrapper import CompiledModel

    return CompiledModel(model, level)


__all__ = [
    "CompilationCounter",
    "CompilationLevel",
    "ForwardContext",
    "compilation_counter",
    "get_forward_context",
    "model_forward",
    "set_forward_context",
]

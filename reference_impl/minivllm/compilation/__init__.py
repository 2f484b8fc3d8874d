"""`torch.compile` for the classic engine, selected by `compilation_level`
(vLLM's `CompilationLevel`; vLLM keeps the same pieces in vllm/compilation/).

- `levels.py`: the levels 0-3 and what each does;
- `wrapper.py`: `CompiledModel`, the compiled model forward, and why it does
  not recompile every step (imported on use: it loads TorchDynamo, which an
  eager engine does not need);
- `backends.py`: the backend each captured graph goes to (eager or Inductor);
- `forward_context.py`: the per-step state the attention op reads;
- `counter.py`: compilations counted, for tests.
"""

from minivllm.compilation.counter import CompilationCounter, compilation_counter
from minivllm.compilation.forward_context import (
    ForwardContext,
    get_forward_context,
    set_forward_context,
)
from minivllm.compilation.levels import CompilationLevel

__all__ = [
    "CompilationCounter",
    "CompilationLevel",
    "ForwardContext",
    "compilation_counter",
    "get_forward_context",
    "set_forward_context",
]

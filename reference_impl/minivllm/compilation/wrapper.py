"""`CompiledModel`: the model forward under `torch.compile`, as vLLM's
model runner sets it up (`support_torch_compile` in vllm/compilation/decorators.py).

What is compiled is `model.forward(input_ids, positions, kv_caches,
attn_metadata)`, the same call the eager engine makes; `compute_logits` and
the sampler stay eager, as in vLLM.

Four rules keep it from recompiling every step:

- Attention is not traced. Under compilation each `Attention` layer calls one
  opaque op (`attention/layer.py::unified_attention`) that reads the step's
  `AttentionMetadata` and its KV cache from the forward context
  (`forward_context.py`). The graph never touches the metadata's Python
  lists, so no guard depends on them, and whatever the backend does
  (Python loops over prefills, a Numba kernel) runs as it does eagerly.
- The number of tokens is dynamic: from DYNAMO_ONCE up, dimension 0 of
  `input_ids` and `positions` is marked before the call (vLLM's
  `dynamic_arg_dims`). It is marked *unbacked*: TorchDynamo then does not
  specialise a size of 1 either (with `mark_dynamic` it would, and a decode
  step of one sequence would need a second graph), so one graph serves every
  step, prefill, decode or mixed, of any size.
- Shapes fixed for the engine's life (hidden size, weights) stay static; their
  guards never fail. The weights are inputs of the graph, and the backend is
  one per level (backends.py), so a second engine on a model of the same
  shapes runs the code compiled for the first.
- From DYNAMO_ONCE up, the guard on torch's global state is dropped
  (`without_global_state_guard`), as vLLM drops it (`_compilation_context`
  in vllm/compilation/wrapper.py patches out `add_global_state_guard`).
  That guard holds torch's thread count, and a CPU worker runs small steps
  on one thread (worker/cpu_threads.py): kept, the first such step would
  compile a second graph. Nothing compiled depends on the count: Inductor's
  kernels are generated serial (backends.py), and the products and
  attention, opaque ops, use whatever threads torch has when they run.
  Grad mode has a guard of its own, which stays.

vLLM's PIECEWISE level also *splits* the graph at the attention ops and
compiles the pieces separately, so that each piece can be captured as a CUDA
graph while attention runs between them. minivllm captures the whole
forward as one CUDA graph instead (worker/cuda_graph_runner.py; decode steps
only, as vLLM v0.6), so Inductor compiles the graph whole, with the attention
op inside it as an opaque call: the same code runs, in one piece.
"""

from __future__ import annotations

import torch
from torch import nn

from minivllm.compilation.backends import make_backend
from minivllm.compilation.counter import compilation_counter
from minivllm.compilation.levels import CompilationLevel

# Graphs TorchDynamo may keep for the model's forward before it gives up
# (recompiling fails under `fullgraph`, falls back to eager otherwise). Its
# default, 8, counts the graphs of every compiled engine in the process that
# runs the same model class, at least one per model shape and level: a
# notebook or a test session passes that. vLLM raises it to 2048 for the same reason
# (`_compilation_context` in vllm/compilation/wrapper.py).
RECOMPILE_LIMIT = 2048


def without_global_state_guard(guards: list) -> list[bool]:
    """TorchDynamo's `guard_filter_fn`: keep every guard but the one on
    torch's global state (settings such as the thread count)."""
    return [guard.guard_type != "GLOBAL_STATE" for guard in guards]


class CompiledModel:
    """Calls `model.forward` through `torch.compile` at `level` (> 0).

    Compilation happens lazily, at the first call: an engine's first step is
    slow (seconds on a CPU), the later ones are not.
    """

    def __init__(self, model: nn.Module, level: int) -> None:
        if level <= CompilationLevel.NO_COMPILATION:
            raise ValueError(f"CompiledModel needs a compilation level > 0, got {level}")
        compilation_counter.num_models_seen += 1
        self.model = model
        self.level = level
        self.dynamic_num_tokens = level >= CompilationLevel.DYNAMO_ONCE
        # DYNAMO_AS_IS tolerates graph breaks and keeps every guard, as
        # vLLM's stock torch.compile does; the higher levels want one graph,
        # and a break is an error naming its cause.
        options = None
        if self.dynamic_num_tokens:
            options = {"guard_filter_fn": without_global_state_guard}
        self.forward = torch.compile(
            model.forward,
            backend=make_backend(level),
            fullgraph=self.dynamic_num_tokens,
            options=options,
            recompile_limit=RECOMPILE_LIMIT,
        )

    def __call__(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[torch.Tensor],
        attn_metadata,
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        if self.dynamic_num_tokens:
            # Fresh tensors every step: the mark goes on each one.
            torch._dynamo.decorators.mark_unbacked(input_ids, 0)
            torch._dynamo.decorators.mark_unbacked(positions, 0)
        return self.forward(input_ids, positions, kv_caches, attn_metadata)

"""The backend TorchDynamo hands each captured graph to (vLLM's
`compilation/backends.py`, without its graph splitting: see wrapper.py)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch._dynamo.backends.registry import lookup_backend

from minivllm.compilation.counter import compilation_counter
from minivllm.compilation.levels import CompilationLevel

# Inductor's C++ kernels without OpenMP. Each parallel kernel wakes torch's
# OpenMP threads, which minivllm lets sleep between regions (envs.py), and
# at batch 1 the step alternates them with Numba's pool (the few-row
# matmuls, the attention kernel): side by side, 1-token steps ran 0.76-0.86x
# eager with parallel kernels and 1.02-1.11x with serial ones; the throughput
# workload ran as fast either way (the element-wise work between the
# products is small at any batch). Eager torch runs such small operators on
# one thread too (below its grain size).
INDUCTOR_CONFIG = {"cpp.threads": 1}


@functools.cache
def make_backend(level: int) -> Callable[[torch.fx.GraphModule, list], Callable]:
    """A backend for `torch.compile` at `level`: it counts every graph it is
    given (each is a compilation: a new shape, or a failed guard), then runs
    it as captured (DYNAMO_AS_IS, DYNAMO_ONCE: torch's "eager" backend) or
    has Inductor generate code for it (PIECEWISE, with INDUCTOR_CONFIG).

    One backend per level for the whole process: TorchDynamo guards on the
    backend's identity, and the weights are inputs of the graph, not
    constants in it, so a second engine on a model of the same shapes reuses
    the first one's compiled code instead of compiling again."""
    if level >= CompilationLevel.PIECEWISE:
        from torch._inductor.compile_fx import compile_fx  # slow to import: only when used

        inner = functools.partial(compile_fx, config_patches=INDUCTOR_CONFIG)
    else:
        inner = lookup_backend("eager")

    def backend(graph: torch.fx.GraphModule, example_inputs: list) -> Callable:
        compilation_counter.num_graphs_seen += 1
        if level >= CompilationLevel.PIECEWISE:
            compilation_counter.num_inductor_compilations += 1
        return inner(graph, example_inputs)

    return backend

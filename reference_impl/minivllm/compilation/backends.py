"""The backend TorchDynamo hands each captured graph to (vLLM's
`compilation/backends.py`, without its graph splitting: see wrapper.py)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch._dynamo.backends.registry import lookup_backend

from minivllm.compilation.counter import compilation_counter
from minivllm.compilation.levels import CompilationLevel


@functools.cache
def make_backend(level: int) -> Callable[[torch.fx.GraphModule, list], Callable]:
    """A backend for `torch.compile` at `level`: it counts every graph it is
    given (each is a compilation: a new shape, or a failed guard), then runs
    it as captured (DYNAMO_AS_IS, DYNAMO_ONCE: torch's "eager" backend) or
    has Inductor generate code for it (PIECEWISE).

    One backend per level for the whole process: TorchDynamo guards on the
    backend's identity, and the weights are inputs of the graph, not
    constants in it, so a second engine on a model of the same shapes reuses
    the first one's compiled code instead of compiling again."""
    inner = lookup_backend("inductor" if level >= CompilationLevel.PIECEWISE else "eager")

    def backend(graph: torch.fx.GraphModule, example_inputs: list) -> Callable:
        compilation_counter.num_graphs_seen += 1
        if level >= CompilationLevel.PIECEWISE:
            compilation_counter.num_inductor_compilations += 1
        return inner(graph, example_inputs)

    return backend

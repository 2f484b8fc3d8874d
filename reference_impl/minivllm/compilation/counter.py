"""Counting compilations, as vLLM's `compilation/counter.py` does, so a test
can say "these steps compiled nothing new" instead of timing them."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Iterator


@dataclasses.dataclass
class CompilationCounter:
    """Process-wide totals (every engine in the process adds to them).

    num_models_seen: models wrapped for compilation.
    num_graphs_seen: graphs TorchDynamo captured and handed to our backend;
        a new one means a (re)compilation: a new shape, or a guard that failed.
    num_inductor_compilations: of those, the ones Inductor turned into code.
    """

    num_models_seen: int = 0
    num_graphs_seen: int = 0
    num_inductor_compilations: int = 0

    def clone(self) -> CompilationCounter:
        return copy.deepcopy(self)

    @contextlib.contextmanager
    def expect(self, **increments: int) -> Iterator[None]:
        """Assert that the block raises each named count by exactly that much:
        `with compilation_counter.expect(num_graphs_seen=0): ...`."""
        before = self.clone()
        yield
        for name, increment in increments.items():
            got = getattr(self, name) - getattr(before, name)
            assert got == increment, f"{name} went up by {got}, expected {increment}"


compilation_counter = CompilationCounter()

"""The compilation levels, by vLLM's names and numbers (`CompilationLevel`).

vLLM 0.6.3 read the level from VLLM_TORCH_COMPILE_LEVEL; from 0.6.4 it is
`CompilationConfig.level` (`-O3` on the command line). minivllm takes it as
the engine option `compilation_level`. What each level does here is in
`compilation/wrapper.py`.
"""

from __future__ import annotations


class CompilationLevel:
    """How much of the model forward `torch.compile` takes over.

    NO_COMPILATION: eager PyTorch, operator by operator (the default).
    DYNAMO_AS_IS: TorchDynamo captures the forward with its own defaults
        (first shape static, dynamic after a second one); the captured graph
        runs as captured, no code generated. For finding graph breaks.
    DYNAMO_ONCE: the same capture with the number of tokens dynamic from the
        start and no graph break allowed; still no code generated.
    PIECEWISE: that capture compiled by Inductor (fused C++ loops on a CPU,
        Triton on a GPU), attention left out of the compiled code as one
        opaque call per layer.
    """

    NO_COMPILATION = 0
    DYNAMO_AS_IS = 1
    DYNAMO_ONCE = 2
    PIECEWISE = 3

    NAMES = {0: "NO_COMPILATION", 1: "DYNAMO_AS_IS", 2: "DYNAMO_ONCE", 3: "PIECEWISE"}

    @classmethod
    def allowed(cls) -> str:
        """The accepted values, as an error message lists them."""
        return ", ".join(f"{level} ({name})" for level, name in cls.NAMES.items())

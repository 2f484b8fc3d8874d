"""Run the CUDA kernels of `reference_impl/csrc/` on the CPU.

A machine without a GPU can compile the `.cu` files (`nvcc --ptx`, in the
tests) but not run them. This emulator runs them: it compiles a `.cu` file
with the host C++ compiler in front of `cuda_emu.h` (one fiber per CUDA
thread, real barriers and warp shuffles; read its header comment), and
offers the two calls `minivllm._custom_ops` makes of a CuPy `RawModule`:
`get_function(name)` and `kernel(grid, block, args, shared_mem=...)`.

So `emulated_custom_ops()` runs the launchers of `_custom_ops.py` as they are
(grid sizes, shared-memory sizes, argument order) against the kernels as they
are, on CPU tensors. Each launch also checks every argument against the
kernel's C++ signature: a pointer gets a tensor of the right element size, an
`int` gets an `np.int32`, and so on, mistakes a real GPU would not report.

It is slow (every thread a fiber) and says nothing about speed: keep shapes
small. It needs `g++` (or `$CXX`) with `_Float16` (GCC 12, Clang 15).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from minivllm import _custom_ops, envs

HERE = Path(__file__).resolve().parent
HEADER = HERE / "cuda_emu.h"

# `extern __shared__ T name[];` (dynamic shared memory) becomes a pointer to
# the launch's buffer: the one rewrite the sources need.
_DYNAMIC_SMEM = re.compile(r"extern\s+__shared__\s+(\w+)\s+(\w+)\s*\[\s*\]\s*;")


def compiler() -> str | None:
    """The host C++ compiler to use, or None if there is none."""
    return shutil.which(envs.CXX or "g++")


class _ArgInfo(ctypes.Structure):
    """Mirror of emu::ArgInfo in cuda_emu.h."""

    _fields_ = [
        (name, ctypes.c_int)
        for name in ("size", "is_pointer", "is_integral", "is_floating", "pointee_size")
    ]


def emulator_unit(code: str, name_expressions: Sequence[str]) -> str:
    """CUDA source made ready for the emulator: its dynamic shared memory
    rewritten, then a C entry point (launch and signature) for each
    instantiation, the i-th named `emu_launch_i` / `emu_signature_i` as
    `EmulatedKernel` looks them up."""
    code = _DYNAMIC_SMEM.sub(r"\1* const \2 = static_cast<\1*>(emu::dynamic_smem());", code)
    entries = []
    for i, expr in enumerate(name_expressions):
        entries.append(
            f'extern "C" int emu_launch_{i}(const unsigned* grid, const unsigned* block, '
            f"std::size_t smem, void** args, unsigned seed) {{\n"
            f"  return emu::launch(&{expr}, grid, block, smem, args, seed);\n}}\n"
            f'extern "C" int emu_signature_{i}(emu::ArgInfo* out) {{\n'
            f"  return emu::signature(&{expr}, out);\n}}\n"
        )
    return f'{code}\n#line 1 "emulator-entries"\n' + "".join(entries)


class CompileError(RuntimeError):
    """The host compiler refused a translation unit; `stderr` says why."""

    def __init__(self, message: str, stderr: str) -> None:
        super().__init__(message)
        self.stderr = stderr


def build(unit: str, name: str, opt: str = "-O2") -> ctypes.PyDLL:
    """Build (or reuse) the shared library of an `emulator_unit`, and load it.
    It is keyed by the content of every input (the unit, the headers, the
    compiler and its flags), so an edited source is rebuilt at its next
    launch, with no restart (the real loader compiles once per process).
    `name` names the file and the error; `opt` is the optimisation flag
    (the lab checkers compile many small variants at -O0, faster to build)."""
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("the CUDA emulator needs a C++ compiler: install g++ or set $CXX")
    flags = ["-std=c++17", opt, "-shared", "-fPIC", "-include", str(HEADER)]
    flags.append(f"-I{_custom_ops.CSRC_DIR}")
    headers = sorted(_custom_ops.CSRC_DIR.glob("*.cuh")) + [HEADER]
    key = hashlib.sha256("\0".join([cxx, *flags, unit, *(h.read_text() for h in headers)]).encode())
    cache = Path(tempfile.gettempdir()) / "minivllm-cuda-emu"
    cache.mkdir(exist_ok=True)
    library = cache / f"{Path(name).stem}-{key.hexdigest()[:16]}.so"
    if not library.exists():
        # Per-process names until the final rename: concurrent builds cannot
        # see half a file.
        unit_path = library.with_suffix(f".{os.getpid()}.cpp")
        unit_path.write_text(unit)
        partial = library.with_suffix(f".{os.getpid()}.tmp")
        result = subprocess.run(
            [cxx, *flags, str(unit_path), "-o", str(partial)], capture_output=True, text=True
        )
        unit_path.unlink()
        if result.returncode != 0:
            raise CompileError(
                f"compiling {name} for the emulator failed:\n{result.stderr}", result.stderr
            )
        partial.replace(library)
    return _load(library)


def _compile(source: str, name_expressions: tuple[str, ...]) -> ctypes.PyDLL:
    """The library of `source`, a file of csrc/ or an absolute path (the
    tests' own kernels)."""
    path = _custom_ops.CSRC_DIR / source
    unit = f'#line 1 "{path}"\n' + emulator_unit(path.read_text(), name_expressions)
    return build(unit, source)


@functools.cache
def _load(library: Path) -> ctypes.PyDLL:
    # PyDLL keeps the GIL during a call: the emulator has one launch state per
    # process, so launches from several Python threads must not overlap.
    return ctypes.PyDLL(str(library))


def _dim3(dims: tuple[int, ...]) -> ctypes.Array:
    """(x,), (x, y) or (x, y, z) as the three unsigneds of a dim3."""
    return (ctypes.c_uint * 3)(*(tuple(dims) + (1, 1))[:3])


class EmulatedKernel:
    """One instantiation; called like a CuPy RawKernel."""

    def __init__(self, library: ctypes.PyDLL, index: int, name: str, seed: int):
        self.name = name
        self.seed = seed
        self._launch = getattr(library, f"emu_launch_{index}")
        self._error = library.emu_error
        self._error.restype = ctypes.c_char_p
        infos = (_ArgInfo * 32)()
        count = getattr(library, f"emu_signature_{index}")(infos)
        self.signature = list(infos[:count])

    def _marshal(self, i: int, arg, info: _ArgInfo) -> ctypes.c_void_p | ctypes.Array:
        """A ctypes value for parameter i, once it is checked against the signature."""
        where = f"{self.name}: argument {i}"
        if isinstance(arg, torch.Tensor):
            if not info.is_pointer:
                raise TypeError(f"{where} is a {info.size}-byte scalar, got a tensor")
            if arg.device.type != "cpu":
                raise ValueError(f"{where}: the emulator runs on CPU tensors, got {arg.device}")
            kind_ok = info.is_integral if not arg.dtype.is_floating_point else info.is_floating
            if arg.element_size() != info.pointee_size or not kind_ok:
                raise TypeError(
                    f"{where} points to {info.pointee_size}-byte "
                    f"{'integers' if info.is_integral else 'floats'}, got a {arg.dtype} tensor"
                )
            return ctypes.c_void_p(arg.data_ptr())
        if info.is_pointer:
            raise TypeError(f"{where} is a pointer, got {type(arg).__name__}")
        value = np.asarray(arg)
        kind_ok = info.is_integral if value.dtype.kind in "iu" else info.is_floating
        if value.dtype.itemsize != info.size or not kind_ok:
            raise TypeError(
                f"{where} is a {info.size}-byte {'integer' if info.is_integral else 'float'}, "
                f"got {value.dtype} (pass np.int32 for int, np.int64 for long long, "
                f"np.float32 for float)"
            )
        return ctypes.create_string_buffer(value.tobytes(), info.size)

    def __call__(self, grid, block, args, shared_mem: int = 0) -> None:
        if len(args) != len(self.signature):
            raise TypeError(f"{self.name} takes {len(self.signature)} arguments, got {len(args)}")
        values = [
            self._marshal(i, arg, info)
            for i, (arg, info) in enumerate(zip(args, self.signature, strict=True))
        ]
        pointers = (ctypes.c_void_p * len(values))(*(ctypes.addressof(v) for v in values))
        status = self._launch(
            _dim3(grid),
            _dim3(block),
            ctypes.c_size_t(shared_mem),
            pointers,
            ctypes.c_uint(self.seed),
        )
        if status != 0:
            raise RuntimeError(f"{self.name}: {self._error().decode()}")


class EmulatedModule:
    """The counterpart of `cupy.RawModule(code=..., name_expressions=...)`."""

    def __init__(self, source: str, name_expressions: tuple[str, ...], seed: int = 0):
        self._library = _compile(source, name_expressions)
        self._names = name_expressions
        self.seed = seed

    def get_function(self, name: str) -> EmulatedKernel:
        return EmulatedKernel(self._library, self._names.index(name), name, self.seed)


def _exported(t: torch.Tensor) -> torch.Tensor:
    t = _custom_ops.dlpack_view(t)
    t.__dlpack__()  # raises BufferError where cupy.from_dlpack would
    return t


@contextlib.contextmanager
def emulated_custom_ops(seed: int = 0) -> Iterator[None]:
    """Within this block, `minivllm._custom_ops` launches its kernels in the
    emulator, on CPU tensors. `seed` orders the fibers between barriers
    (0: by thread index; another value: a fresh shuffle each round)."""
    saved = _custom_ops._module, _custom_ops._launch

    def launch(kernel, grid, args, shared_mem=0):
        # Tensors as a GPU launch hands them over, exported once to DLPack
        # as CuPy would: what torch refuses to export fails here too.
        args = tuple(_exported(a) if isinstance(a, torch.Tensor) else a for a in args)
        kernel(grid, (_custom_ops.NUM_THREADS,), args, shared_mem=shared_mem)

    _custom_ops._module = lambda source, names: EmulatedModule(source, names, seed)
    _custom_ops._launch = launch
    try:
        yield
    finally:
        _custom_ops._module, _custom_ops._launch = saved

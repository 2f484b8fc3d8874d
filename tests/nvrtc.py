"""NVRTC, the run-time CUDA compiler, called through ctypes.

On a GPU, CuPy's `RawModule` hands our sources to NVRTC. NVRTC itself needs
no GPU and no driver (CuPy does: it refuses to compile without one), so the
tests call the library directly to compile the sources exactly as the loader
would. The library comes from the `nvidia-cuda-nvrtc` wheel (the `dev` extra,
on Linux) or from a CUDA toolkit.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
from pathlib import Path


def find_library() -> str | None:
    """Path or name of libnvrtc, or None if there is none."""
    spec = importlib.util.find_spec("nvidia")
    for root in spec.submodule_search_locations if spec else []:
        found = sorted(Path(root).glob("cu*/lib/libnvrtc.so*"))
        if found:
            return str(found[0])
    return ctypes.util.find_library("nvrtc")


class NvrtcError(RuntimeError):
    pass


def compile_to_ptx(
    library: str, code: str, name: str, options: tuple[str, ...], name_expressions: list[str]
) -> tuple[str, dict[str, str]]:
    """Compile `code`; returns the PTX and each name expression's mangled name."""
    nvrtc = ctypes.CDLL(library)
    nvrtc.nvrtcGetErrorString.restype = ctypes.c_char_p
    program = ctypes.c_void_p()

    def check(status: int) -> None:
        if status == 0:
            return
        message = nvrtc.nvrtcGetErrorString(status).decode()
        size = ctypes.c_size_t()
        if program and nvrtc.nvrtcGetProgramLogSize(program, ctypes.byref(size)) == 0:
            log = ctypes.create_string_buffer(size.value)
            nvrtc.nvrtcGetProgramLog(program, log)
            message += "\n" + log.value.decode()
        raise NvrtcError(message)

    check(
        nvrtc.nvrtcCreateProgram(ctypes.byref(program), code.encode(), name.encode(), 0, None, None)
    )
    try:
        for expression in name_expressions:
            check(nvrtc.nvrtcAddNameExpression(program, expression.encode()))
        encoded = [o.encode() for o in options]
        check(
            nvrtc.nvrtcCompileProgram(
                program, len(encoded), (ctypes.c_char_p * len(encoded))(*encoded)
            )
        )
        lowered = {}
        for expression in name_expressions:
            mangled = ctypes.c_char_p()
            check(nvrtc.nvrtcGetLoweredName(program, expression.encode(), ctypes.byref(mangled)))
            lowered[expression] = mangled.value.decode()
        size = ctypes.c_size_t()
        check(nvrtc.nvrtcGetPTXSize(program, ctypes.byref(size)))
        ptx = ctypes.create_string_buffer(size.value)
        check(nvrtc.nvrtcGetPTX(program, ptx))
        return ptx.value.decode(), lowered
    finally:
        nvrtc.nvrtcDestroyProgram(ctypes.byref(program))

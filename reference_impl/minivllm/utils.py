"""Small helpers shared across the engine."""

from __future__ import annotations

import importlib
import math
import numbers
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager


def resolve_obj_by_qualname(qualname: str, option: str) -> type:
    """"package.module.Name" -> the object, for options that take a class by name."""
    module_name, _, attr = qualname.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(
            f"{option}={qualname!r} names no importable class: give a class or "
            f"'package.module.ClassName' ({e})"
        ) from e


def resolve_class(value: str | type, option: str) -> type:
    """An option given as a class or by its qualified name -> the class."""
    cls = resolve_obj_by_qualname(value, option) if isinstance(value, str) else value
    if not isinstance(cls, type):
        raise ValueError(f"{option} must be a class or 'package.module.ClassName', got {value!r}")
    return cls


def get_open_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now ("" for every interface), for the
    tensor-parallel ranks to meet at."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def cdiv(a: int, b: int) -> int:
    """a / b rounded up (vLLM's `cdiv`): e.g. the blocks that hold a tokens."""
    return -(-a // b)


def host_memory_bytes() -> int | None:
    """This machine's physical memory in bytes (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def gib(num_bytes: int) -> str:
    """A byte count in GiB for a message, even one too large for a float."""
    if num_bytes.bit_length() > 1000:
        return f"2**{num_bytes.bit_length() - 31}"
    return f"{num_bytes / 2**30:.4g}"


@contextmanager
def numba_threads(num_threads: int | None = None) -> Iterator[None]:
    """Run the Numba kernels called inside on `num_threads` threads (default
    and at most: torch's thread count, and Numba's pool size), and leave
    torch's thread count as it was.

    At most torch's threads: an executor that gives each tensor-parallel rank
    its share of the cores (torch.set_num_threads) then limits the kernels
    too, instead of every rank's threads spinning on all the cores (tp=2 on
    2 cores: 2-3x slower steps). And Numba's OpenMP pool, starting at its
    first kernel, sets the OpenMP thread count to its own size, a call that
    reaches torch's runtime too: a process given 1 thread (OMP_NUM_THREADS=1,
    one per tensor-parallel rank) would compute on 2 from then on; the count
    is put back after.
    """
    import numba  # here: the rest of this module needs neither
    import torch

    torch_threads = torch.get_num_threads()
    allowed = min(torch_threads, numba.config.NUMBA_NUM_THREADS)
    numba.set_num_threads(max(1, min(num_threads or allowed, allowed)))
    try:
        yield
    finally:
        if torch.get_num_threads() != torch_threads:
            torch.set_num_threads(torch_threads)


# -- argument checks ----------------------------------------------------------
# SamplingParams, the configs and LLMEngine.add_request refuse a bad value
# where it is given, before anything is queued. These helpers do the part
# they share: the type (bool is an int to Python, but True is not a count),
# finiteness, and a message of the form "<name> must be <allowed>, got <value>".


class WrongTypeError(TypeError, ValueError):
    """A value of the wrong type for its field.

    A TypeError, and also a ValueError: vLLM raises ValueError for bad
    arguments, and minivllm did for some wrong types, so code that catches
    ValueError still catches these.
    """


def show(value: object) -> str:
    """repr(value), short enough for an error message (a 5000-digit integer
    cannot even be printed by default)."""
    if isinstance(value, int) and abs(value).bit_length() > 128:
        sign = "-" if value < 0 else ""
        return f"{sign}an integer of {abs(value).bit_length()} bits"
    try:
        text = repr(value)
    except Exception:  # a broken __repr__ must not hide the real error
        text = f"<{type(value).__name__}>"
    return text if len(text) <= 80 else text[:77] + "..."


def is_int(value: object) -> bool:
    """An integer, numpy's included; not a bool, not a float like 2.0."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_int(
    name: str,
    value: object,
    *,
    low: int | None = None,
    high: int | None = None,
    allowed: str | None = None,
) -> int:
    """`value` as a plain int if it is an integer in [low, high] (None: no
    bound); else a WrongTypeError (not an integer) or a ValueError (out of
    range), both saying "<name> must be <allowed>, got <value>"."""
    if allowed is None:
        allowed = "an integer" + _range_text(low, high)
    if not is_int(value):
        raise WrongTypeError(f"{name} must be {allowed}, got {show(value)}")
    value = int(value)
    if (low is not None and value < low) or (high is not None and value > high):
        raise ValueError(f"{name} must be {allowed}, got {show(value)}")
    return value


def check_float(
    name: str,
    value: object,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    allowed: str | None = None,
) -> float:
    """`value` as a float if it is a finite real number (an int will do, a
    bool or a string will not) in [low, high], or (low, high] with
    `low_open`; else a WrongTypeError or a ValueError naming `name`."""
    if allowed is None:
        allowed = "a finite number" + _range_text(low, high, low_open)
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise WrongTypeError(f"{name} must be {allowed}, got {show(value)}")
    try:
        as_float = float(value)
    except OverflowError:  # an int too large for a float
        raise ValueError(f"{name} must be {allowed}, got {show(value)}") from None
    too_low = low is not None and (as_float <= low if low_open else as_float < low)
    too_high = high is not None and as_float > high
    if not math.isfinite(as_float) or too_low or too_high:
        raise ValueError(f"{name} must be {allowed}, got {show(value)}")
    return as_float


def check_choice(
    name: str, value: object, choices: tuple[str, ...], allowed: str | None = None
) -> str:
    """`value` if it is one of the strings `choices`; else a WrongTypeError
    (not a string) or a ValueError (another string), naming `name`."""
    if allowed is None:
        allowed = f"one of {list(choices)}"
    if not isinstance(value, str):
        raise WrongTypeError(f"{name} must be {allowed}, got {show(value)}")
    if value not in choices:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
    return value


def check_seed(value: object, allowed_prefix: str = "") -> int:
    """A seed (the engine's or a request's): it seeds a torch.Generator,
    whose manual_seed takes 64 bits, signed or unsigned, as vLLM's seeds."""
    allowed = (
        f"{allowed_prefix}a 64-bit integer, from -2**63 to 2**64 - 1 (what torch.Generator takes)"
    )
    return check_int("seed", value, low=-(2**63), high=2**64 - 1, allowed=allowed)


def check_text(name: str, text: str) -> str:
    """`text` if it is valid Unicode; else a ValueError naming `name`. A
    Python string (and JSON) can hold a lone surrogate such as "\\ud800",
    which is no character: UTF-8 cannot encode it and no tokenizer takes it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"{name} must be valid Unicode text, got {show(text)}: {e.reason} "
            f"at character {e.start}"
        ) from None
    return text


def check_bool(name: str, value: object, allowed: str = "True or False") -> bool:
    """`value` if it is a bool: "no", None or 1 are not (a string is always
    true, which is how ignore_eos="no" used to mean yes)."""
    if not isinstance(value, bool):
        raise WrongTypeError(f"{name} must be {allowed}, got {show(value)}")
    return value


def _range_text(low, high, low_open: bool = False) -> str:
    if low is not None and high is not None:
        return f" in {'(' if low_open else '['}{low}, {high}]"
    if low is not None:
        return f" {'>' if low_open else '>='} {low}"
    if high is not None:
        return f" <= {high}"
    return ""

"""Profiler labels for the classic engine: where one step's time goes.

The engine has no profiler regions of its own (vLLM v0.6 has none either;
its profiler runs show aten operators and Python frames). `labelled(llm)`
wraps six hot functions of *one* engine's objects in
`torch.profiler.record_function` regions, so that a profile says which
phase every operator ran in:

    schedule        Scheduler.schedule (queues, budgets, block tables)
    prepare_inputs  ModelRunner.prepare_model_input (the batch's tensors)
    model           the model's forward and compute_logits (the LM head)
    attention       each layer's AttentionImpl.forward (K/V write + attention)
    sampler         Sampler.forward
    process         LLMEngine._process_model_outputs (append, stop, outputs)

and `profile_steps(llm, n)` profiles the next `n` engine steps, each inside a
`step` region. Regions nest (attention runs inside model): the *innermost*
label around an event says what it is (`innermost_label`).

The classes are never patched, only the attributes of this engine's
objects, and only while the `with` block runs: other engines in the same
process, and this one afterwards, run exactly as before.

Used by Day 12's checker (tools/labs/checks/day12.py) and by the roofline
benchmark (tools/bench/roofline.py); `wrap_method`, the patching underneath,
also by the step-split benchmark (tools/bench/step_split.py); `attention_impls`
and `timed_into` by both benchmarks' timers.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from torch.profiler import ProfilerActivity, profile, record_function

if TYPE_CHECKING:
    from minivllm import LLM

# Kineto, torch's profiler back end, prints two log lines to stderr each time a
# profile starts and stops; level 6 is above all of its levels (read at first use).
os.environ.setdefault("KINETO_LOG_LEVEL", "6")

# The profiler regions `labelled` and `profile_steps` add.
LABELS = ("step", "schedule", "prepare_inputs", "model", "attention", "sampler", "process")
# The matrix products: an event with one of these on its way up is matmul time.
MATMUL_OPS = (
    "aten::linear", "aten::matmul", "aten::mm", "aten::addmm",
    "mkldnn::_linear_pointwise",  # a packed CPU weight (model_executor/layers/utils.py)
    "minivllm::gemv",  # the few-row kernel's region (model_executor/layers/gemv_numba.py)
    "minivllm::few_rows",  # oneDNN's product of a few rows in a batch (layers/utils.py)
)


def wrap_method(
    obj: Any,
    attr: str,
    around: Callable[[], AbstractContextManager],
    undo: list[Callable[[], None]],
) -> None:
    """Replace `obj.attr` (on this object only) by a call inside `around()`, a
    fresh context manager per call; append to `undo` what puts the original
    back. `labelled` wraps calls in profiler regions, `step_split` in timers."""
    inner = getattr(obj, attr)

    @functools.wraps(inner)
    def wrapped_call(*args, **kwargs):
        with around():
            return inner(*args, **kwargs)

    had_own = attr in vars(obj)
    setattr(obj, attr, wrapped_call)
    undo.append(lambda: setattr(obj, attr, inner) if had_own else delattr(obj, attr))


def attention_impls(llm: LLM) -> list[Any]:
    """Each attention layer's implementation (an `AttentionImpl`, or a
    learner's class with its `forward_decode`) in this engine's model, in
    layer order."""
    impls = (getattr(m, "impl", None) for m in llm.llm_engine.worker.model_runner.model.modules())
    return [impl for impl in impls if hasattr(impl, "forward_decode")]


@contextlib.contextmanager
def timed_into(
    totals: dict[str, float], key: str, sync: Callable[[], None] | None = None
) -> Iterator[None]:
    """Add the wall time of the block to `totals[key]`; with `sync` (a GPU
    synchronize), called before and after, inside the timing. `wrap_method`
    puts it around a method's calls (step_split's parts, roofline's decode
    attention)."""
    start = time.perf_counter()
    if sync:
        sync()
    try:
        yield
    finally:
        if sync:
            sync()
        totals[key] += time.perf_counter() - start


@contextlib.contextmanager
def labelled(llm: LLM) -> Iterator[LLM]:
    """Put profiler labels around the hot functions of this engine (its own
    objects only; the classes are untouched), for as long as the block runs."""
    engine = llm.llm_engine
    runner = engine.worker.model_runner
    undo: list[Callable[[], None]] = []

    def label(obj: Any, attr: str, name: str) -> None:
        wrap_method(obj, attr, functools.partial(record_function, name), undo)

    label(engine.scheduler, "schedule", "schedule")
    label(runner, "prepare_model_input", "prepare_inputs")
    label(runner.model, "forward", "model")
    label(runner.model, "compute_logits", "model")
    for impl in attention_impls(llm):
        label(impl, "forward", "attention")
    label(runner.sampler, "forward", "sampler")
    label(engine, "_process_model_outputs", "process")
    try:
        yield llm
    finally:
        for restore in reversed(undo):
            restore()


def profile_steps(llm: LLM, num_steps: int = 1) -> list:
    """The profiler events of the engine's next `num_steps` steps, each inside a
    `step` region, with the labels of `labelled`: a list of torch's
    FunctionEvent (`.name`, `.self_cpu_time_total`, `.cpu_time_total` in µs,
    `.cpu_parent`, `.cpu_children`)."""
    engine = llm.llm_engine
    with labelled(llm), profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(num_steps):
            with record_function("step"):
                engine.step()
    return list(prof.events())


def innermost_label(event) -> str | None:
    """The innermost of `LABELS` around `event` (itself included), or None."""
    e = event
    while e is not None:
        if e.name in LABELS:
            return e.name
        e = e.cpu_parent
    return None


def in_model_matmul(event) -> bool:
    """Whether `event` is a matrix product, or called by one, with no label
    between it and that product (so its time is the product's)."""
    e = event
    while e is not None and e.name not in LABELS:
        if e.name in MATMUL_OPS:
            return True
        e = e.cpu_parent
    return False

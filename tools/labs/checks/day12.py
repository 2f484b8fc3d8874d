"""Checkers for Day 12, where the time goes (labs/day12_where_the_time_goes.ipynb).

The engine is the classic one on the shipped model, greedy, with a small KV cache.
It has no profiler labels of its own, so `labelled(llm)` wraps six of its hot
functions, on that engine's objects only, in `torch.profiler.record_function`
regions: `schedule`, `prepare_inputs`, `model` (the forward pass and the LM head),
`attention` (each layer's attention implementation, K/V write included), `sampler`
and `process`; `profile_steps` adds a `step` region around each step. Both live in
tools/bench/profiling.py (the roofline benchmark uses them too). The checkers:

1. `time_by_part(events)`: on a made-up profile whose every number is known, then
   on a real profile of decode steps, against the reference grouping;
2. `decode_throughput(steps)`: on made-up trace steps, then on a real trace;
3. `graph_batch_size` and `decode_step_us`: vLLM v0.6's CUDA-graph padding and the
   launch-overhead model, on fixed numbers;
4. `prepare_model_input`, the fixed copy of a slowed-down hot function: installed
   in a real engine's model runner, its inputs must equal the engine's own step by
   step and its greedy tokens the reference's; then the profile must show that the
   number of torch calls it makes per step no longer grows with the batch size or
   the prompt length. No timing is compared anywhere.

Each checker prints one line, or raises AssertionError saying what it saw, what it
expected, and the likely misconception.
"""

from __future__ import annotations

import contextlib
import functools
import math
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from minivllm import LLM, SamplingParams
from minivllm.model_executor.sampling_metadata import SamplingMetadata
from minivllm.worker.model_runner import (
    FlatBatch,
    ModelInput,
    ModelRunner,
    _get_graph_batch_size,
    _get_max_graph_batch_size,
)
from tools.bench.profiling import (  # noqa: F401 - labelled, profile_steps: for the notebook
    LABELS,
    MATMUL_OPS,
    in_model_matmul,
    innermost_label,
    labelled,
    profile_steps,
)
from tools.labs.checks._common import needs, passed  # noqa: F401 - needs: for the notebook
from tools.labs.checks._engine_runs import learner_code, quiet_engine, token_prompts

DAY = 12

# A small engine: blocks of 16 tokens, 96 of them, up to 16 sequences a step.
# Eager on a GPU too: the lab profiles operators and compares unpadded inputs,
# which a CUDA graph's replay would hide and pad.
ENGINE = dict(max_model_len=128, max_num_seqs=16, num_gpu_blocks_override=96,
              max_num_batched_tokens=512, disable_log_stats=True, enforce_eager=True)

PARTS = ("matmul", "attention", "model_other", "sampling", "bookkeeping")


def one_thread(fn):
    """Run a checker with torch (and so the Numba kernel) on one thread, as the
    notebook does: the tiny model gains nothing from more, and on a busy
    2-core machine spinning threads make every step several times slower."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return fn(*args, **kwargs)
        finally:
            torch.set_num_threads(before)

    return run


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def make_llm(**engine: Any) -> LLM:
    """The classic engine on the shipped model, quiet."""
    with quiet_engine():
        return LLM(**{**ENGINE, **engine})


@functools.cache
def shared_llm() -> LLM:
    """One engine for the checkers (each leaves it empty and unpatched)."""
    return make_llm()


# -- driving the engine (labels and profiles: tools/bench/profiling.py) -----------------

def add_requests(llm: LLM, prompts: list[list[int]], max_tokens: int, prefix: str = "r") -> None:
    for i, tokens in enumerate(prompts):
        llm.llm_engine.add_request(f"{prefix}{i}", {"prompt_token_ids": tokens},
                                   greedy(max_tokens))


def decoding_batch(llm: LLM, batch_size: int, prompt_len: int = 20, max_tokens: int = 60,
                   prefix: str = "d") -> None:
    """`batch_size` requests, prefilled: the engine's next step is a decode of all of them."""
    add_requests(llm, token_prompts([prompt_len] * batch_size), max_tokens, prefix)
    llm.llm_engine.step()  # the prefills (they fit one step)


def drain(llm: LLM) -> None:
    """Abort every request left and run the step that hands them back."""
    engine = llm.llm_engine
    if engine.errored:  # a step failed (the learner's code raised): build a new one next time
        shared_llm.cache_clear()
        return
    ids = [sg.request_id for queue in (engine.scheduler.waiting, engine.scheduler.running,
                                       engine.scheduler.swapped) for sg in queue]
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()


def torch_calls(events: list) -> list:
    """The operators Python code called: aten:: events not inside another
    aten:: event (on a GPU, each of these launches one kernel or more), nor
    inside a matrix product: what oneDNN's product allocates, or a few-row
    product's region (the kernel's arrays, oneDNN's padded batch), is the
    product's."""
    return [e for e in events if e.name.startswith("aten::")
            and not (e.cpu_parent is not None and (e.cpu_parent.name.startswith("aten::")
                                                   or e.cpu_parent.name in MATMUL_OPS))]


def calls_by_label(events: list) -> dict[str, int]:
    """How many torch calls each label's own code made (innermost label)."""
    out = dict.fromkeys(LABELS, 0)
    for e in torch_calls(events):
        out[innermost_label(e) or "step"] += 1
    return out


def direct_calls(events: list, label: str) -> list[str]:
    """The torch operators called directly inside each `label` region (not
    the operators those call in turn), in order, all regions together."""
    return [e.name for e in events
            if e.cpu_parent is not None and e.cpu_parent.name == label
            and e.name.startswith("aten::")]


# -- exercise 1: where one step's time goes -------------------------------------------------

def reference_time_by_part(events) -> dict[str, float]:
    """Each event's SELF time goes to one part, decided by the innermost label
    around it (itself included): attention, sampler, or model; inside model,
    a matrix product and everything it calls are "matmul", the rest
    "model_other"; everything else (schedule, prepare_inputs, process, the
    step's own code, no label at all) is "bookkeeping"."""
    parts = dict.fromkeys(PARTS, 0.0)
    for event in events:
        parts[_reference_part(event)] += event.self_cpu_time_total
    return parts


def _reference_part(event) -> str:
    label = innermost_label(event)
    if label == "model":
        return "matmul" if in_model_matmul(event) else "model_other"
    return {"attention": "attention", "sampler": "sampling"}.get(label, "bookkeeping")


def shares(parts: dict[str, float]) -> dict[str, float]:
    total = sum(parts.values())
    return {k: v / total for k, v in parts.items()}


@dataclass(eq=False)
class Event:
    """A profiler event as torch's FunctionEvent has it (the fields used here)."""

    name: str
    self_cpu_time_total: float
    cpu_time_total: float = 0.0
    cpu_parent: Event | None = None
    cpu_children: list[Event] = field(default_factory=list)

    def __repr__(self) -> str:
        return f"Event({self.name!r}, self {self.self_cpu_time_total:g} µs)"


def build_events(tree: tuple) -> list[Event]:
    """Events from a nested (name, self µs, [children]) tree, parents first,
    with totals = self + children's totals, as the profiler reports them."""
    out: list[Event] = []

    def visit(node: tuple, parent: Event | None) -> Event:
        name, self_us, children = node
        event = Event(name, float(self_us), cpu_parent=parent)
        out.append(event)
        event.cpu_children = [visit(child, event) for child in children]
        event.cpu_time_total = event.self_cpu_time_total + sum(
            c.cpu_time_total for c in event.cpu_children)
        return event

    visit(tree, None)
    return out


def made_up_profile() -> list[Event]:
    """One step, every number known (µs). Built so that each common mistake
    gives its own, recognisable, wrong answer."""
    op = lambda name, us, *kids: (name, us, list(kids))  # noqa: E731
    tree = op("step", 40,
              op("schedule", 120, op("aten::empty", 5)),
              op("prepare_inputs", 60, op("aten::lift_fresh", 4), op("aten::copy_", 3)),
              op("model", 300,
                 op("aten::embedding", 20, op("aten::index_select", 15)),
                 op("aten::linear", 10, op("aten::t", 6), op("aten::mm", 400)),
                 op("attention", 500,
                    op("aten::index_put_", 35),
                    op("aten::bmm", 90),
                    op("aten::matmul", 3, op("aten::mm", 60)),
                    op("aten::softmax", 30)),
                 op("aten::linear", 8, op("aten::t", 5), op("aten::mm", 200)),
                 op("aten::mul", 25),
                 op("aten::silu", 15),
                 op("aten::addmm", 150),
                 op("aten::index", 18)),
              op("model", 45, op("aten::linear", 4, op("aten::t", 2), op("aten::mm", 110))),
              op("sampler", 80,
                 op("aten::argmax", 12),
                 op("aten::mm", 7),
                 op("aten::log_softmax", 21)),
              op("process", 200),
              op("aten::copy_", 9))
    return build_events(tree)


def _variant_parts(events, how: str) -> dict[str, float]:
    """What a common mistake computes (to name it when an answer matches)."""
    parts = dict.fromkeys(PARTS, 0.0)
    for event in events:
        time = event.cpu_time_total if how == "total" else event.self_cpu_time_total
        if how == "ops_only" and not event.name.startswith("aten::"):
            continue
        if how == "labelled_only" and innermost_label(event) in (None, "step"):
            continue
        if how == "outermost":
            parts[_outermost_part(event)] += time
            continue
        part = _reference_part(event)
        if how == "matmul_anywhere" and event.name in MATMUL_OPS:
            part = "matmul"
        if how == "matmul_op_only" and part == "matmul" and event.name not in MATMUL_OPS:
            part = "model_other"
        parts[part] += time
    return parts


def _outermost_part(event) -> str:
    """The part by the OUTERMOST label under `step` (a common mistake)."""
    e, in_matmul, part = event, False, "bookkeeping"
    while e is not None:
        if e.name in MATMUL_OPS:
            in_matmul = True
        if e.name in LABELS and e.name != "step":
            part = {"attention": "attention", "sampler": "sampling",
                    "model": "matmul" if in_matmul else "model_other"}.get(e.name, "bookkeeping")
        e = e.cpu_parent
    return part


_VARIANTS = {
    "total": (
        "you added up TOTAL times (cpu_time_total). An event's total includes every event "
        "nested inside it, so a matmul is counted in aten::mm, again in its aten::linear, "
        "again in `model`, again in `step`: the parts add up to more than the step took. "
        "Add each event's SELF time (self_cpu_time_total) exactly once."),
    "outermost": (
        "you gave each event to its OUTERMOST label. `attention` runs inside `model`; the "
        "innermost label around an event is the one that says what it is, so attention's "
        "time must come out of the model's, not stay in it."),
    "ops_only": (
        "you counted only the aten:: operators and dropped the labels' own self time. A "
        "label's self time is the Python that ran inside it between operators: the "
        "scheduler's whole work, the engine's output processing, the numba attention "
        "kernel (no aten:: op at all). That is real time, often most of a small model's "
        "step; count every event."),
    "labelled_only": (
        "you dropped the events under no label but `step` (and the step's own self time): "
        "the engine's code between the phases is bookkeeping too. Every event belongs to "
        "exactly one part, so the parts must add up to the step's total time."),
    "matmul_anywhere": (
        "you counted every matrix product as \"matmul\", including the ones inside "
        "`attention` and `sampler`. The part is decided by the innermost label first: a "
        "product inside attention is attention's time (q·K and p·V), one inside the sampler "
        "is sampling; \"matmul\" is the model's own linear layers and LM head."),
    "matmul_op_only": (
        "inside the model you counted only the events NAMED like a matrix product, not what "
        "they call: the aten::t (transpose) and copies an aten::linear makes are part of "
        "that linear layer. Once a matmul op is on the way up to `model`, the event is "
        "matmul time."),
}


def _describe_parts(parts: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k!r}: {parts.get(k, 0):g}" for k in PARTS) + "}"


def _check_parts(got: Any, events, where: str) -> None:
    want = reference_time_by_part(events)
    if not isinstance(got, dict):
        raise AssertionError(
            f"Day {DAY}, exercise 1: time_by_part({where}) should return a dict from part "
            f"name to microseconds, got {type(got).__name__}: {got!r}.")
    missing = [k for k in PARTS if k not in got]
    extra = [k for k in got if k not in PARTS]
    if missing or extra:
        raise AssertionError(
            f"Day {DAY}, exercise 1: time_by_part({where}) returned the keys {sorted(got)}; "
            f"it must return exactly {list(PARTS)} (a part with no time is 0).")
    total = sum(want.values())

    def close(a: dict, b: dict) -> bool:
        return all(math.isclose(float(a[k]), b[k], rel_tol=1e-9, abs_tol=1e-6 * max(total, 1))
                   for k in PARTS)

    if close(got, want):
        return
    got_total = sum(float(v) for v in got.values())
    if math.isclose(got_total, 1.0, rel_tol=1e-6) and close(
            {k: got[k] * total for k in PARTS}, want):
        hint = ("you returned shares (fractions of the step). Return microseconds per part; "
                "the notebook's `shares()` turns them into fractions.")
    elif close({k: float(got[k]) * 1000 for k in PARTS}, want):
        hint = "you returned milliseconds; the profiler's times are microseconds: keep them."
    else:
        hint = next((text for how, text in _VARIANTS.items()
                     if close(got, _variant_parts(events, how))), None)
        if hint is None:
            hint = ("every event's SELF time goes to exactly one part, decided by the innermost "
                    "label around it (itself included): attention -> \"attention\", sampler -> "
                    "\"sampling\", model -> \"matmul\" if a matrix product lies on the way up "
                    "to it, else \"model_other\"; anything else -> \"bookkeeping\".")
    raise AssertionError(
        f"Day {DAY}, exercise 1: on {where}, time_by_part gave\n  {_describe_parts(got)}\n"
        f"but the step's time splits as\n  {_describe_parts(want)}\n"
        f"(the step took {total:g} µs in all; your parts add up to {got_total:g}).\n"
        f"Hint: {hint}")


@functools.cache
def recorded_profile() -> tuple:
    """A decode step of a batch of 6 on the shared engine, labelled."""
    llm = shared_llm()
    try:
        decoding_batch(llm, 6, prompt_len=8)
        return tuple(profile_steps(llm))
    finally:
        drain(llm)


@one_thread
def exercise_1(time_by_part) -> None:
    """`time_by_part(events)` on the made-up profile, then on a real one."""
    events = made_up_profile()
    with learner_code("time_by_part(the made-up profile)"):
        got = time_by_part(list(events))
    _check_parts(got, events, "the made-up profile (print check.made_up_profile() to see it)")
    real = list(recorded_profile())
    with learner_code("time_by_part(a real profile of a decode step)"):
        got = time_by_part(real)
    _check_parts(got, real, "a real profile of a decode step")
    passed(DAY, 1)


# -- exercise 2: batch size against throughput ---------------------------------------------

def step_seconds(step: dict) -> float:
    return sum(step["timings"].values()) / 1000


def is_decode_step(step: dict) -> bool:
    return bool(step["scheduled"]) and not any(e["is_prefill"] for e in step["scheduled"])


def reference_decode_throughput(steps: list[dict]) -> dict[int, float]:
    """Per batch size (sequences in a decode-only step): generated tokens per
    second over all such steps, the whole step's time counted."""
    tokens: dict[int, int] = {}
    seconds: dict[int, float] = {}
    for step in steps:
        if not is_decode_step(step):
            continue
        batch = len(step["scheduled"])
        tokens[batch] = tokens.get(batch, 0) + step["num_batched_tokens"]
        seconds[batch] = seconds.get(batch, 0.0) + step_seconds(step)
    return {b: tokens[b] / seconds[b] for b in sorted(tokens)}


def _entry(request: str, seq: int, prefill: bool, n: int = 1) -> dict:
    return {"request_id": request, "seq_id": seq, "is_prefill": prefill, "num_tokens": n}


def _step(n: int, entries: list[dict], schedule: float, execute: float, process: float) -> dict:
    return {"step": n, "scheduled": entries,
            "num_batched_tokens": sum(e["num_tokens"] for e in entries),
            "timings": {"schedule_ms": schedule, "execute_ms": execute, "process_ms": process}}


def made_up_steps() -> list[dict]:
    """A run's step lines (the fields used here). Request "b" samples two
    sequences (n=2): after its prefill it decodes as seqs 2 and 3."""
    e = _entry
    return [
        _step(0, [e("a", 0, True, 12)], 0.5, 9.0, 0.5),
        _step(1, [e("a", 0, False)], 0.25, 3.5, 0.25),
        _step(2, [e("a", 0, False)], 0.25, 5.5, 0.25),
        _step(3, [e("b", 1, True, 30), e("a", 0, False)], 0.5, 12.0, 0.5),
        _step(4, [e("a", 0, False), e("b", 2, False), e("b", 3, False)], 0.5, 4.0, 0.5),
        _step(5, [e("a", 0, False), e("b", 2, False), e("b", 3, False)], 0.5, 2.5, 1.0),
        _step(6, [e("c", 4, True, 8), e("a", 0, False), e("b", 2, False), e("b", 3, False)],
              0.5, 7.0, 0.5),
        _step(7, [e("a", 0, False), e("b", 2, False), e("b", 3, False), e("c", 4, False)],
              0.5, 5.0, 0.5),
        _step(8, [e("a", 0, False), e("b", 2, False), e("b", 3, False), e("c", 4, False)],
              0.25, 4.0, 0.75),
        _step(9, [], 0.25, 0.0, 0.25),
        _step(10, [e("b", 3, False)], 0.25, 3.0, 0.75),
    ]


def _throughput_variant(steps: list[dict], how: str) -> dict:
    """What a common mistake computes (to name it when an answer matches)."""
    groups: dict[int, list[tuple[float, float]]] = {}
    for step in steps:
        keep = {"with_mixed": bool(step["scheduled"]),
                "with_empty": not any(e["is_prefill"] for e in step["scheduled"])
                }.get(how, is_decode_step(step))
        if not keep:
            continue
        if how == "requests":
            batch = len({e["request_id"] for e in step["scheduled"]})
        else:
            batch = len(step["scheduled"])
        seconds = step["timings"]["execute_ms"] / 1000 if how == "execute" else step_seconds(step)
        if how == "ms":
            seconds *= 1000
        tokens = 1 if how == "steps" else step["num_batched_tokens"]
        groups.setdefault(batch, []).append((tokens, seconds))
    if how == "mean_of_rates":
        return {b: sum(t / s for t, s in v) / len(v) for b, v in sorted(groups.items())}
    result = {}
    for b, v in sorted(groups.items()):
        seconds = sum(s for _, s in v)
        result[b] = sum(t for t, _ in v) / seconds if seconds else math.inf
    return result


_THROUGHPUT_HINTS = {
    "steps": (
        "you computed steps per second. Throughput is generated tokens per second: a decode "
        "step of batch B makes B tokens, so at batch 4 it is 4 x the step rate. (Steps per "
        "second is what falls as the batch grows; tokens per second is what rises.)"),
    "mean_of_rates": (
        "you averaged the per-step rates. The throughput over a run is total tokens / total "
        "time: a mean of per-step ratios gives a fast step the same weight as a slow one, "
        "and over-states it whenever step times vary."),
    "ms": "the trace's timings are milliseconds: divide by 1000 for seconds.",
    "execute": (
        "you counted only execute_ms. The user waits for the whole step: schedule + execute "
        "+ process (the bookkeeping is part of the cost, and at small batch a large part)."),
    "requests": (
        "you took the batch size as the number of requests. A request with n=2 decodes two "
        "sequences, each making a token per step: the batch size is the number of scheduled "
        "entries (sequences), which is also num_batched_tokens for a decode step."),
    "with_mixed": (
        "you kept the steps that also prefill a prompt. Their time is mostly the prompt's, "
        "and their tokens are not generated tokens: use decode-only steps (no entry with "
        "is_prefill) to measure decode throughput."),
    "with_empty": (
        "a step that scheduled nothing (it only handed back an aborted request, say) has "
        "no batch: leave it out."),
}


def _check_throughput(got: Any, steps: list[dict], where: str) -> None:
    want = reference_decode_throughput(steps)
    if not isinstance(got, dict):
        raise AssertionError(
            f"Day {DAY}, exercise 2: decode_throughput({where}) should return a dict from "
            f"batch size to tokens per second, got {type(got).__name__}: {got!r}.")

    def same(a: dict, b: dict) -> bool:
        return set(a) == set(b) and all(
            math.isclose(float(a[k]), b[k], rel_tol=1e-9) for k in b)

    try:
        if same(got, want):
            return
    except (TypeError, ValueError):
        pass
    hint = next((text for how, text in _THROUGHPUT_HINTS.items()
                 if _safe_same(same, got, _throughput_variant(steps, how))), None)
    if hint is None and set(got) != set(want):
        hint = ("the batch sizes are those of the decode-only steps: "
                f"{sorted(want)} here.")
    if hint is None:
        hint = ("per batch size B: the tokens of all decode-only steps of B sequences, divided "
                "by their total time (schedule + execute + process) in seconds.")
    show = lambda d: "{" + ", ".join(f"{k}: {float(v):.1f}" for k, v in sorted(d.items())) + "}"  # noqa: E731
    raise AssertionError(
        f"Day {DAY}, exercise 2: on {where}, decode_throughput gave\n  {_safe_show(show, got)}\n"
        f"expected (tokens/s per batch size)\n  {show(want)}\nHint: {hint}")


def _safe_same(same, a, b) -> bool:
    try:
        return same(a, b)
    except (TypeError, ValueError):
        return False


def _safe_show(show, d) -> str:
    try:
        return show(d)
    except (TypeError, ValueError, AttributeError):
        return repr(d)


@functools.cache
def recorded_trace_steps() -> tuple:
    """The step lines of a real traced run: 4 requests arriving two steps
    apart, one with n=2, so batches of several sizes and mixed steps occur."""
    import json
    import os
    import tempfile

    llm = shared_llm()
    engine = llm.llm_engine
    prompts = token_prompts([10, 14, 7, 9], first=40)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "run.jsonl")
        engine.start_trace(path)
        try:
            for i, tokens in enumerate(prompts):
                params = greedy(4 + 2 * i)
                if i == 1:
                    params = SamplingParams(temperature=0.8, n=2, seed=1, max_tokens=6,
                                            ignore_eos=True)
                engine.add_request(f"t{i}", {"prompt_token_ids": tokens}, params)
                engine.step()
                engine.step()
            while engine.has_unfinished_requests():
                engine.step()
        finally:
            engine.stop_trace()
        with open(path, encoding="utf-8") as f:
            lines = [json.loads(line) for line in f]
    return tuple(line for line in lines if line["type"] == "step")


@one_thread
def exercise_2(decode_throughput) -> None:
    """`decode_throughput(steps)` on made-up step lines, then on a real trace's."""
    steps = made_up_steps()
    with learner_code("decode_throughput(the made-up steps)"):
        got = decode_throughput([dict(s) for s in steps])
    _check_throughput(got, steps, "the made-up steps (print check.made_up_steps() to see them)")
    real = [dict(s) for s in recorded_trace_steps()]
    with learner_code("decode_throughput(a real trace's steps)"):
        got = decode_throughput(real)
    _check_throughput(got, real, "a real trace's steps")
    passed(DAY, 2)


# -- exercise 3: launch overhead and CUDA graphs -------------------------------------------

def reference_graph_batch_size(batch: int, max_num_seqs: int = 256) -> int | None:
    """The captured size a decode batch of `batch` sequences runs at (padded
    up with dummy rows), or None when no graph is that large: eager. The
    engine's own rule (worker/model_runner.py, vLLM v0.6's functions)."""
    if batch > _get_max_graph_batch_size(max_num_seqs):
        return None
    return _get_graph_batch_size(batch)


@dataclass(frozen=True)
class StepCost:
    """What one decode step costs, for the launch-overhead model."""

    num_kernels: int  # kernels one forward pass launches
    launch_us: float  # CPU time to launch one kernel eagerly (Python + dispatch + driver)
    graph_launch_us: float  # CPU time to replay a whole captured graph
    weight_bytes: float  # read once per step, whatever the batch
    kv_bytes_per_token: float  # K and V of one token, all layers
    bandwidth_bytes_per_us: float  # the GPU's memory bandwidth


# About a 1B-parameter Llama in bf16 on an H100: 16 layers of ~16 kernels, weights
# 2.5 GB, K/V 32 KiB per token (8 KV heads x 64 x 2 x 16 layers x 2 bytes), 3.35 TB/s.
H100_1B = StepCost(num_kernels=16 * 16 + 6, launch_us=6.0, graph_launch_us=20.0,
                   weight_bytes=2.5e9, kv_bytes_per_token=32 * 1024,
                   bandwidth_bytes_per_us=3.35e6)


def reference_decode_step_us(batch: int, context_len: int, cost: StepCost,
                             cuda_graphs: bool, max_num_seqs: int = 256) -> float:
    """max(CPU launch time, GPU memory time): launches are asynchronous, so the
    CPU runs ahead while the GPU works, and the slower of the two sets the pace.
    A batch with no captured graph runs eagerly."""
    gpu = (cost.weight_bytes + batch * context_len * cost.kv_bytes_per_token) \
        / cost.bandwidth_bytes_per_us
    graph = cuda_graphs and reference_graph_batch_size(batch, max_num_seqs) is not None
    cpu = cost.graph_launch_us if graph else cost.num_kernels * cost.launch_us
    return max(cpu, gpu)


_GRAPH_CASES = [(b, 256) for b in (1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 33, 63, 64, 65, 100, 255,
                                   256, 257, 300, 1000)] + [
    (b, m) for m in (6, 32, 40, 100) for b in (1, 3, 5, 6, 8, 9, 32, 33, 40, 41, 100, 101)]


def _graph_hint(batch: int, max_num_seqs: int, got: Any, want: int | None) -> str:
    if want is None:
        return (f"no graph is captured for {batch} sequences: vLLM captures decode batches up "
                f"to {_get_max_graph_batch_size(max_num_seqs)} "
                f"(max_num_seqs={max_num_seqs} padded, and never more than 256); a larger "
                "batch runs eagerly. Return None.")
    if got is None:
        return (f"{batch} sequences do fit a captured graph: pad up to the next captured size "
                f"({want}).")
    if isinstance(got, int) and got < batch:
        return ("a graph has a fixed batch size and cannot run fewer rows than the batch: "
                "pad UP to the next captured size (the extra rows are dummies).")
    if got == batch and batch in (3,) + tuple(range(5, 8)):
        return ("graphs exist only for 1, 2, 4 and multiples of 8: a batch of "
                f"{batch} runs in the graph of {want}, padded with dummy rows.")
    if isinstance(got, int) and got & (got - 1) == 0 and got != want:
        return ("past 4 the captured sizes are multiples of 8 (8, 16, 24, 32, ...), not powers "
                f"of two: {batch} sequences pad to {want}, not {got}.")
    return f"{batch} sequences run in the graph of the next captured size, {want}."


def _check_graph_batch_size(fn) -> None:
    for batch, max_num_seqs in _GRAPH_CASES:
        with learner_code(f"graph_batch_size({batch}, max_num_seqs={max_num_seqs})"):
            got = fn(batch, max_num_seqs)
        want = reference_graph_batch_size(batch, max_num_seqs)
        if got != want:
            raise AssertionError(
                f"Day {DAY}, exercise 3: graph_batch_size({batch}, max_num_seqs={max_num_seqs})"
                f" returned {got!r}, vLLM v0.6 gives {want!r}.\n"
                f"Hint: {_graph_hint(batch, max_num_seqs, got, want)}")


def _step_variants(batch: int, context_len: int, cost: StepCost, graphs: bool,
                   max_num_seqs: int) -> dict[str, float]:
    kv = batch * context_len * cost.kv_bytes_per_token
    bw = cost.bandwidth_bytes_per_us
    gpu = (cost.weight_bytes + kv) / bw
    has_graph = graphs and reference_graph_batch_size(batch, max_num_seqs) is not None
    cpu = cost.graph_launch_us if has_graph else cost.num_kernels * cost.launch_us
    eager_cpu = cost.num_kernels * cost.launch_us
    return {
        "additive": cpu + gpu,
        "weights_per_seq": max(cpu, (batch * cost.weight_bytes + kv) / bw),
        "launch_per_seq": max(cost.graph_launch_us if has_graph else eager_cpu * batch, gpu),
        "graph_always": max(cost.graph_launch_us if graphs else eager_cpu, gpu),
        "graph_still_launches": max(eager_cpu + (cost.graph_launch_us if has_graph else 0), gpu),
        "no_context": max(cpu, (cost.weight_bytes + batch * cost.kv_bytes_per_token) / bw),
        "padded_kv": max(cpu, (cost.weight_bytes + (reference_graph_batch_size(
            batch, max_num_seqs) or batch) * context_len * cost.kv_bytes_per_token) / bw)
        if has_graph else math.nan,
    }


_STEP_HINTS = {
    "additive": (
        "you added the CPU's launch time to the GPU's time. Kernel launches are asynchronous: "
        "the CPU queues kernel after kernel while the GPU runs the earlier ones, so the two "
        "overlap and the slower one sets the pace: max(cpu, gpu). (They add up only when "
        "something waits for the GPU after each kernel, e.g. a .item() per layer.)"),
    "weights_per_seq": (
        "you read the weights once per sequence. One decode step multiplies the whole "
        "batch by each weight matrix at once: the weights cross the memory bus once per "
        "step, whatever the batch; only the K/V grows with it. That is why batching pays."),
    "launch_per_seq": (
        "you launched the kernels once per sequence. One kernel serves the whole batch; "
        "the number of launches per step does not depend on the batch size."),
    "graph_always": (
        "you used a graph for every batch. vLLM captures graphs only up to its largest "
        "capture size; a bigger decode batch runs eagerly (use your graph_batch_size)."),
    "graph_still_launches": (
        "with a graph, the CPU launches ONE graph (graph_launch_us), not every kernel: "
        "replaying a captured graph is what removes the per-kernel launch cost."),
    "no_context": (
        "each sequence reads the K/V of its whole context, context_len tokens of "
        "kv_bytes_per_token each, every step."),
    "padded_kv": (
        "the dummy rows a graph is padded with have a sequence length of 1: they read no "
        "K/V worth counting. Count the K/V of the real batch."),
}


def _check_decode_step(fn) -> None:
    cases = [(b, c, g, m) for b in (1, 3, 8, 40, 256, 300) for c in (128, 1000)
             for g in (False, True) for m in (256,)] + [(24, 500, True, 16), (12, 500, True, 16)]
    for cost in (H100_1B, StepCost(40, 8.0, 15.0, 1.4e10, 128 * 1024, 3.35e6)):
        for batch, context_len, graphs, max_num_seqs in cases:
            call = (f"decode_step_us(batch={batch}, context_len={context_len}, cost={cost}, "
                    f"cuda_graphs={graphs}, max_num_seqs={max_num_seqs})")
            with learner_code(call):
                got = fn(batch, context_len, cost, graphs, max_num_seqs)
            want = reference_decode_step_us(batch, context_len, cost, graphs, max_num_seqs)
            try:
                ok = math.isclose(float(got), want, rel_tol=1e-6)
            except (TypeError, ValueError):
                ok = False
            if ok:
                continue
            variants = _step_variants(batch, context_len, cost, graphs, max_num_seqs)
            hint = next((_STEP_HINTS[how] for how, value in variants.items()
                         if _isclose(got, value) and not math.isclose(value, want)), None)
            raise AssertionError(
                f"Day {DAY}, exercise 3: {call} returned {got!r}, expected {want:.1f} µs.\n"
                "Hint: " + (hint or "step time = max(CPU launch time, bytes / bandwidth): the "
                            "CPU launches num_kernels kernels (or one graph), the GPU reads "
                            "the weights once and each sequence's context K/V."))


def _isclose(got: Any, value: float) -> bool:
    try:
        return math.isclose(float(got), value, rel_tol=1e-6)
    except (TypeError, ValueError):
        return False


def exercise_3(graph_batch_size, decode_step_us) -> None:
    """vLLM v0.6's padding to a captured batch size, then the step-time model."""
    _check_graph_batch_size(graph_batch_size)
    _check_decode_step(decode_step_us)
    passed(DAY, 3)


# -- exercise 4: the planted slowdown ------------------------------------------------------

def slow_prepare_model_input(self: ModelRunner, seq_group_metadata_list) -> ModelInput:
    """A copy of `ModelRunner.prepare_model_input` (worker/model_runner.py)
    as someone might have written it. It gives the same inputs. Is it as fast?"""
    batch = FlatBatch.build(seq_group_metadata_list, self.block_size)
    max_blocks = max(len(t) for t in batch.block_tables)

    def as_tensor(values, dtype=torch.long) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)

    # The block tables, one row per sequence, zero-padded to the longest.
    block_tables = torch.zeros(len(batch.block_tables), max_blocks, dtype=torch.long,
                               device=self.device)
    for row, table in enumerate(batch.block_tables):
        block_tables[row, : len(table)] = as_tensor(table)
    # Where each new token's K/V go: its block's number, read from the table, and
    # its offset in the block.
    slot_mapping = torch.empty(len(batch.positions), dtype=torch.long, device=self.device)
    token = 0
    for row, (context_len, seq_len) in enumerate(zip(batch.context_lens, batch.seq_lens,
                                                     strict=True)):
        for position in range(context_len, seq_len):
            block = block_tables[row, position // self.block_size]
            slot_mapping[token] = block * self.block_size + position % self.block_size
            token += 1

    attn_metadata = self.attn_backend.get_metadata_cls()(
        num_prefills=batch.num_prefills,
        num_prefill_tokens=batch.num_prefill_tokens,
        num_decode_tokens=len(batch.input_ids) - batch.num_prefill_tokens,
        slot_mapping=slot_mapping,
        seq_lens=batch.seq_lens,
        context_lens=batch.context_lens,
        query_start_loc=batch.query_start_loc,
        block_tables=block_tables,
        seq_lens_tensor=as_tensor(batch.seq_lens),
    )
    sampling_metadata = SamplingMetadata.prepare(
        seq_group_metadata_list, batch.seq_lens, batch.context_lens, self.device)
    return ModelInput(
        input_ids=as_tensor(batch.input_ids),
        positions=as_tensor(batch.positions),
        attn_metadata=attn_metadata,
        selected_token_indices=sampling_metadata.selected_token_indices,
        batch=batch,
        sampling_metadata=sampling_metadata,
    )


@contextlib.contextmanager
def installed_prepare(llm: LLM, prepare) -> Iterator[None]:
    """The engine's model runner uses `prepare(runner, seq_group_metadata_list)`
    as its `prepare_model_input` (this engine only) while the block runs."""
    runner = llm.llm_engine.worker.model_runner
    runner.prepare_model_input = types.MethodType(prepare, runner)
    try:
        yield
    finally:
        del runner.prepare_model_input


_TENSOR_FIELDS = ("input_ids", "positions", "selected_token_indices")
_ATTN_TENSORS = ("slot_mapping", "block_tables", "seq_lens_tensor")
_ATTN_VALUES = ("num_prefills", "num_prefill_tokens", "num_decode_tokens", "seq_lens",
                "context_lens", "query_start_loc")


def _compare_inputs(got: Any, want: ModelInput, step: int) -> str | None:
    """Why `got` is not the model input the engine builds, or None."""
    if not isinstance(got, ModelInput):
        return f"returned {type(got).__name__}, not a ModelInput"
    if not isinstance(got.batch, FlatBatch):
        return ("its `batch` is not the FlatBatch the tensors were made from (the engine hands "
                "it to the tracer and the step observers: keep `batch=batch`)")
    if got.sampling_metadata is None:
        return "it has no sampling_metadata: the sampler needs it"
    pairs = [(name, getattr(got, name), getattr(want, name)) for name in _TENSOR_FIELDS]
    pairs += [(f"attn_metadata.{name}", getattr(got.attn_metadata, name, None),
               getattr(want.attn_metadata, name)) for name in _ATTN_TENSORS]
    for name, mine, ref in pairs:
        if not isinstance(mine, torch.Tensor):
            return f"{name} is a {type(mine).__name__}, not a tensor"
        if mine.dtype != ref.dtype:
            return (f"{name} has dtype {mine.dtype}, the engine's {ref.dtype}: indices and "
                    "slots stay torch.long (int64), which the attention backends index with")
        if mine.shape != ref.shape:
            hint = ""
            if name.endswith("block_tables"):
                hint = (": the engine pads each table to the LONGEST table of this batch (a "
                        "wider table makes every decode gather blocks it never uses; vLLM pads "
                        "to a fixed width only for its CUDA graphs, whose shapes are frozen)")
            return f"{name} has shape {tuple(mine.shape)}, the engine's {tuple(ref.shape)}{hint}"
        if not torch.equal(mine, ref):
            hint = ""
            if name.endswith("block_tables"):
                hint = " (pad with block 0, as the engine does)"
            elif name.endswith("slot_mapping"):
                hint = (" (slot = block_table[p // block_size] * block_size + p % block_size, "
                        "for every new position p; FlatBatch.build has them already)")
            return (f"{name} differs from the engine's{hint}:\n    yours:  {mine.tolist()}\n"
                    f"    engine: {ref.tolist()}")
    for name in _ATTN_VALUES:
        mine, ref = getattr(got.attn_metadata, name, None), getattr(want.attn_metadata, name)
        if mine != ref:
            return f"attn_metadata.{name} is {mine!r}, the engine's {ref!r}"
    return None


def _fix_hint(error: BaseException) -> str:
    text = str(error)
    if "expected sequence of length" in text or "inhomogeneous" in text:
        return ("torch.tensor needs rows of one length: pad each block table with 0 up to "
                "the longest (max_blocks) first, in Python, then make one tensor.")
    return "compare your lines with the slow copy's: they must build the same tensors."


# Reference tokens of the workload below, by the engine's own prepare_model_input.
def _workload() -> tuple[list[list[int]], list[int]]:
    """Prompts of 3 to 30 tokens (1 or 2 blocks of 16) with 5 to 8 tokens to
    generate: block tables of different lengths in one batch, prefills side by
    side, and two sequences (30 and 14 tokens) that open a new block while decoding."""
    lengths = [3, 17, 30, 5, 14]
    return token_prompts(lengths, first=60), [6, 8, 6, 7, 5]


def _run_workload(llm: LLM, compare_with: Callable | None = None) -> list[tuple[int, ...]]:
    """Greedy tokens of the workload; with `compare_with` (the learner's
    prepare), every step's input is also checked against the engine's own.
    A step whose input is wrong (or whose prepare raised) runs on the
    engine's input instead, so that the engine stays healthy, and the
    problem is raised once that step is over."""
    engine = llm.llm_engine
    runner = engine.worker.model_runner
    prompts, max_tokens = _workload()
    outputs: dict[str, tuple[int, ...]] = {}
    problems: list[BaseException] = []
    step = [0]

    def checked(seq_group_metadata_list):
        want = ModelRunner.prepare_model_input(runner, seq_group_metadata_list)
        if problems:
            return want
        try:
            with learner_code("your prepare_model_input, inside the engine", _fix_hint):
                got = compare_with(runner, seq_group_metadata_list)
        except NotImplementedError as error:
            problems.append(error)
            return want
        except AssertionError as error:
            problems.append(AssertionError(f"Day {DAY}, exercise 4: {error}"))
            return want
        why = _compare_inputs(got, want, step[0])
        if why is not None:
            problems.append(AssertionError(
                f"Day {DAY}, exercise 4: at step {step[0]} your prepare_model_input's model "
                f"input differs from the engine's: {why}.\nA fix must not change what the model "
                "is given, only how fast it is built."))
            return want
        return got

    def run_step() -> None:
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = tuple(out.outputs[0].token_ids)
        step[0] += 1
        if problems:
            raise problems[0]

    if compare_with is not None:
        runner.prepare_model_input = checked
    try:
        for i, tokens in enumerate(prompts):
            engine.add_request(f"w{i}", {"prompt_token_ids": tokens}, greedy(max_tokens[i]))
            if i % 2:
                run_step()
        while engine.has_unfinished_requests():
            run_step()
    finally:
        if compare_with is not None:
            del runner.prepare_model_input
        drain(llm)
    return [outputs[f"w{i}"] for i in range(len(prompts))]


@functools.cache
def reference_tokens() -> tuple:
    return tuple(_run_workload(shared_llm()))


@dataclass
class CallCounts:
    """Torch calls made directly by prepare_model_input, per profiled step."""

    decode: dict[int, int]  # batch size -> calls in one decode step
    prefill: dict[int, int]  # prompt length -> calls in one prefill step (one prompt)
    names: dict[str, dict[str, int]]  # workload -> op name -> calls

    def table(self) -> str:
        rows = [f"decode, batch {b:2d}: {n:4d} torch calls" for b, n in self.decode.items()]
        rows += [f"prefill of {p:2d} tokens: {n:4d} torch calls" for p, n in self.prefill.items()]
        return "\n".join(rows)


def count_prepare_calls(llm: LLM, decode_batches=(1, 8), prompt_lens=(8, 40)) -> CallCounts:
    """Profile one step per workload with the engine's current
    prepare_model_input; count the torch operators it calls directly."""
    counts = CallCounts({}, {}, {})
    for batch in decode_batches:
        try:
            decoding_batch(llm, batch, prompt_len=4, prefix=f"c{batch}_")
            names = direct_calls(profile_steps(llm), "prepare_inputs")
        finally:
            drain(llm)
        counts.decode[batch] = len(names)
        counts.names[f"decode, batch {batch}"] = _tally(names)
    for length in prompt_lens:
        try:
            add_requests(llm, token_prompts([length], first=90), 4, prefix=f"p{length}_")
            names = direct_calls(profile_steps(llm), "prepare_inputs")
        finally:
            drain(llm)
        counts.prefill[length] = len(names)
        counts.names[f"prefill of {length} tokens"] = _tally(names)
    return counts


def _tally(names: list[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for name in names:
        out[name] = out.get(name, 0) + 1
    return dict(sorted(out.items(), key=lambda kv: (-kv[1], kv[0])))


def top_calls(tally: dict[str, int], n: int = 4) -> str:
    return ", ".join(f"{name} x{count}" for name, count in list(tally.items())[:n])


@one_thread
def exercise_4(prepare_model_input) -> None:
    """The fixed copy, in a real engine: same inputs and tokens, and a profile in
    which its torch calls per step do not grow with the batch or the prompt."""
    llm = shared_llm()
    want_tokens = reference_tokens()
    with quiet_engine():
        got_tokens = _run_workload(llm, compare_with=prepare_model_input)
    assert got_tokens == list(want_tokens), (
        f"Day {DAY}, exercise 4: with your prepare_model_input the engine generated "
        f"{got_tokens}, with its own {list(want_tokens)}: a fix must not change the outputs.")
    with installed_prepare(llm, prepare_model_input), quiet_engine(), \
            learner_code("your prepare_model_input, inside the engine", _fix_hint):
        counts = count_prepare_calls(llm)
    (short, n_short), (long, n_long) = sorted(counts.prefill.items())
    (small, n_small), (large, n_large) = sorted(counts.decode.items())
    # A loop over tokens (or sequences) adds at least one call per token (or
    # sequence); vectorised code may differ by a call or so between shapes.
    if n_long - n_short >= long - short:
        raise AssertionError(
            f"Day {DAY}, exercise 4: the profile shows your prepare_model_input still making "
            f"torch calls per TOKEN: {n_short} for a prefill of {short} tokens, {n_long} for "
            f"{long} tokens (mostly {top_calls(counts.names[f'prefill of {long} tokens'])}).\n"
            f"{counts.table()}\nHint: a loop over positions that indexes or assigns tensor "
            "elements launches a few operators per token. The slots are plain integers: "
            "compute them in Python (FlatBatch.build already has them in batch.slot_mapping) "
            "and make ONE tensor of them.")
    if n_large - n_small >= large - small:
        raise AssertionError(
            f"Day {DAY}, exercise 4: the profile shows your prepare_model_input still making "
            f"torch calls per SEQUENCE: {n_small} at batch {small}, {n_large} at batch {large} "
            f"(mostly {top_calls(counts.names[f'decode, batch {large}'])}).\n{counts.table()}\n"
            "Hint: writing each row into a tensor (or making one small tensor per row and "
            "stacking or padding them) is a loop of torch calls. Pad the tables as Python "
            "lists and make ONE tensor of the padded lists.")
    passed(DAY, 4)

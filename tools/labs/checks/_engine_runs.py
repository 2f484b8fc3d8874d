"""Shared by the checkers that run the engine (days 2, 5, 6 and 15): run a
workload on the real engine (with or without the model) with tracing on,
run a learner's component inside it beside the reference, and compare the
two runs step by step, naming the first step that differs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sysconfig
import tempfile
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import minivllm
from minivllm import LLM, SamplingParams
from minivllm.tracer import load_trace
from minivllm.tracer.trace import Trace
from tools.labs.checks._common import is_unfinished


@dataclass
class Run:
    """What one engine run produced: completions, its trace, its engine."""

    outputs: list[list[tuple[int, ...]]]  # per request, per completion: token ids
    texts: list[list[str]]
    trace: Trace
    llm: LLM


class StepLimit:
    """A step observer that stops a run that goes on far longer than the
    reference's: a component that never lets requests finish (a block leak
    that preempts forever) would otherwise hang the notebook."""

    def __init__(self, max_steps: int) -> None:
        self.max_steps = max_steps
        self.steps = 0

    def on_add_request(self, engine, seq_group) -> None:
        pass

    def on_step(self, engine, record) -> None:
        self.steps += 1
        if self.steps > self.max_steps:
            raise AssertionError(
                f"The engine ran {self.max_steps} steps without finishing, far more than the "
                "reference needs for this workload: requests are preempted or kept waiting "
                "forever. In a block manager, look for blocks that are never given back, or a "
                "table that grows faster than one block per block_size tokens; in a scheduler, "
                "for a request that is never admitted, never scheduled again, or never leaves "
                "its queue."
            )


def run_traced(
    prompts: list[Any],
    params: SamplingParams | list[SamplingParams],
    dry_run: bool,
    max_steps: int | None = None,
    **engine_kwargs: Any,
) -> Run:
    """`LLM.generate` on a fresh engine (the shipped model, or its dry run),
    traced; request ids are "0", "1", ... in prompt order. With `max_steps`,
    a run still going after that many steps fails with AssertionError."""
    with tempfile.TemporaryDirectory() as tmp, quiet_engine():
        path = os.path.join(tmp, "run.jsonl")
        llm = LLM(dry_run=dry_run, trace=path, disable_log_stats=True, **engine_kwargs)
        if max_steps is not None:
            llm.llm_engine.add_step_observer(StepLimit(max_steps))
        try:
            outs = llm.generate(prompts, params, use_tqdm=False)
        finally:
            llm.llm_engine.stop_trace()
        trace = load_trace(path)
    return Run(
        outputs=[[tuple(c.token_ids) for c in o.outputs] for o in outs],
        texts=[[c.text for c in o.outputs] for o in outs],
        trace=trace,
        llm=llm,
    )


@contextlib.contextmanager
def quiet_engine():
    """Keep the engine's warnings (preemptions, ignored prompts) out of the
    notebook while a checker runs: the checker reports what matters."""
    logger = logging.getLogger("minivllm")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


# Where the engine's code lives (reference_impl/), and the other code that is
# not the learner's: the checkers, the standard library, installed packages.
_ENGINE_DIR = os.path.dirname(os.path.dirname(os.path.realpath(minivllm.__file__)))
_LIBRARY_DIRS = tuple(
    os.path.realpath(d) + os.sep
    for d in (
        _ENGINE_DIR,
        os.path.dirname(os.path.dirname(os.path.realpath(__file__))),  # tools/labs
        *sysconfig.get_paths().values(),
    )
)


def _is_library(filename: str) -> bool:
    """A frame of the engine, the checkers, or an installed library: not
    code the learner wrote (a notebook cell, or a test standing in for one)."""
    return filename.startswith("<frozen") or os.path.realpath(filename).startswith(_LIBRARY_DIRS)


def _function(frames: list[traceback.FrameSummary]) -> str:
    """The innermost named function: a comprehension (`<listcomp>` before
    Python 3.12) is reported as the function it is written in."""
    return next((f.name for f in reversed(frames) if not f.name.startswith("<")), frames[-1].name)


def where_it_failed(error: BaseException) -> str:
    """Where an exception was raised, said for a learner: the last line of
    their own code on its way, or, when none is, the engine's line that
    tripped over what their code left behind."""
    frames = traceback.extract_tb(error.__traceback__)
    mine = [f for f in frames if not _is_library(f.filename)]
    if mine:
        line = (mine[-1].line or "").strip()
        return f"in your `{_function(mine)}`" + (f", at the line `{line}`" if line else "")
    if not frames:
        return "before any code ran"
    last = frames[-1]
    return (
        f"not in your code but in the engine's `{_function(frames)}` "
        f"({os.path.relpath(os.path.realpath(last.filename), _ENGINE_DIR)}, line {last.lineno}), "
        "which tripped over something your code returned or left behind"
    )


def component_of(error: BaseException, cls: type) -> Any:
    """The innermost `self` of class `cls` on the exception's way (None if
    none): the learner's block manager or scheduler as the error left it,
    for a hint that reads its state."""
    found = None
    tb = error.__traceback__
    while tb is not None:
        candidate = tb.tb_frame.f_locals.get("self")
        if isinstance(candidate, cls):
            found = candidate
        tb = tb.tb_next
    return found


def passes_through(error: BaseException) -> bool:
    """What a checker's guard re-raises as it is: its own verdict
    (AssertionError) and an unfinished exercise."""
    return isinstance(error, AssertionError) or is_unfinished(error)


_NO_KERNEL_HINT = (
    "PyTorch has no version of this operator for that dtype (the message names the operator, "
    "then the dtype): check the dtype of the tensors you give it. A common cause: "
    "torch.tensor of an empty list is float32, so build token ids with dtype=torch.long."
)


def learner_code(what: str, hint: str | Callable[[BaseException], str] = ""):
    """Turn an unexpected exception from the learner's component into an
    AssertionError that names the component, says where it was raised (the
    learner's line, or the engine's line that tripped), and gives a hint:
    `hint` is a string, or a function of the exception that names the likely
    mistake. AssertionError, and the placeholder of an unfinished exercise,
    pass through unchanged (`passes_through`)."""

    @contextlib.contextmanager
    def guard():
        try:
            yield
        except Exception as error:  # noqa: BLE001 - reported to the learner
            if passes_through(error):
                raise
            message = f"{what} raised {type(error).__name__}: {error}, {where_it_failed(error)}."
            if isinstance(error, NotImplementedError) and "not implemented for" in str(error):
                advice = _NO_KERNEL_HINT  # PyTorch's "<op>" not implemented for '<dtype>'
            else:
                advice = hint(error) if callable(hint) else hint
            if advice:
                message += f"\nHint: {advice}"
            raise AssertionError(message) from error

    return guard()


# The fields of a step line that say what the scheduler and block manager
# decided (timings and token values aside).
DECISIONS = (
    "scheduled",
    "queues_after",
    "preempted",
    "ignored",
    "copy",
    "swap_out",
    "swap_in",
    "block_tables",
    "free_blocks",
    "finished",
)


def _scheduled_view(step: dict) -> list[tuple]:
    return [
        (e["request_id"], e["seq_id"], e["is_prefill"], e["num_tokens"]) for e in step["scheduled"]
    ]


def _slots_view(step: dict) -> list[tuple]:
    return [(e["seq_id"], tuple(e["slot_mapping"])) for e in step["scheduled"]]


def step_view(step: dict, field: str) -> Any:
    if field == "scheduled":
        return _scheduled_view(step)
    if field == "block_tables":
        tables = step["block_tables"]
        return {int(k): tables[k] for k in sorted(tables, key=int)}
    return step[field]


def first_difference(ref: Trace, got: Trace, fields=DECISIONS) -> tuple[int, str, Any, Any] | None:
    """(step, field, reference value, learner's value) of the first
    decision that differs, or None when the runs agree step for step."""
    for ref_step, got_step in zip(ref.steps, got.steps, strict=False):
        for field in fields:
            a, b = step_view(ref_step, field), step_view(got_step, field)
            if a != b:
                return ref_step["step"], field, a, b
        if _slots_view(ref_step) != _slots_view(got_step):
            return ref_step["step"], "slot_mapping", _slots_view(ref_step), _slots_view(got_step)
    if len(ref.steps) != len(got.steps):
        return (
            min(len(ref.steps), len(got.steps)),
            "number of steps",
            len(ref.steps),
            len(got.steps),
        )
    return None


def describe_step(step: dict) -> str:
    """One line: what the step scheduled, with block tables and free blocks."""
    batch = ", ".join(
        f"{e['request_id']}{'(prefill ' + str(e['num_tokens']) + ')' if e['is_prefill'] else ''}"
        for e in step["scheduled"]
    )
    tables = "; ".join(f"seq {k}: {v}" for k, v in step["block_tables"].items())
    return (
        f"step {step['step']}: batch [{batch}] · block tables {{{tables}}} · "
        f"free gpu {step['free_blocks']['gpu']}, cpu {step['free_blocks']['cpu']}"
    )


def the_step_before(trace: Trace, step: int) -> str:
    """A message's closing lines: the reference's step before `step` (none for the first)."""
    if not 0 < step <= len(trace.steps):
        return ""
    return "\nThe step before, in the reference:\n  " + describe_step(trace.steps[step - 1])


def token_prompts(
    lengths: list[int],
    *,
    request_stride: int = 7,
    token_stride: int = 3,
    modulo: int = 900,
    first: int = 5,
) -> list[list[int]]:
    """Prompts of these lengths as fixed token ids, the same on every run:
    token j of prompt i is first + (request_stride * i + token_stride * j) % modulo."""
    return [
        [first + (request_stride * i + token_stride * j) % modulo for j in range(n)]
        for i, n in enumerate(lengths)
    ]


_FALLBACK_HINT = "compare the two runs step by step with the tracer."


def compare_runs(
    ref: Run,
    got: Run,
    label: str,
    hints: Mapping[str, str],
    *,
    agreed: str = "every step agreed",
    refine_hint: Callable[[str, Any, Any], str | None] | None = None,
) -> None:
    """AssertionError naming the first step whose decisions differ, with the
    hint for that field (`refine_hint(field, reference, yours)` may give a
    closer one) and the reference's step before; then, if every step agreed
    (`agreed` says what), one naming differing generated tokens."""
    diff = first_difference(ref.trace, got.trace)
    if diff is not None:
        step, field, want, have = diff
        hint = (refine_hint and refine_hint(field, want, have)) or hints.get(
            field, _FALLBACK_HINT
        )
        raise AssertionError(
            f"{label}: step {step}'s {field} differ from the reference's.\n"
            f"  reference: {want}\n  yours:     {have}\n"
            f"Hint: {hint}{the_step_before(ref.trace, step)}"
        )
    assert got.outputs == ref.outputs, (
        f"{label}: the generated tokens differ from the reference's although {agreed}."
        f"\n  reference: {ref.texts}\n  yours:     {got.texts}"
    )


# The engine option that installs a component, and where the engine keeps it.
_COMPONENTS: dict[str, Callable[[Any], Any]] = {
    "scheduler_cls": lambda engine: engine.scheduler,
    "block_manager_cls": lambda engine: engine.scheduler.block_manager,
}


def check_in_engine(
    option: str,
    cls: type,
    label: str,
    prompts: list[Any],
    params: SamplingParams | list[SamplingParams],
    dry_run: bool,
    *,
    hints: Mapping[str, str],
    error_hint: str | Callable[[BaseException], str] = "",
    agreed: str = "every step agreed",
    refine_hint: Callable[[str, Any, Any], str | None] | None = None,
    **engine: Any,
) -> Run:
    """Run the workload with the reference, then with the learner's `cls`
    installed by the engine option `option` (scheduler_cls or
    block_manager_cls), and compare the runs (compare_runs); the learner's run.
    An exception from the learner's code becomes an AssertionError naming
    it, with `error_hint`; a run far longer than the reference's fails."""
    ref = run_traced(prompts, params, dry_run, **engine)
    with learner_code(f"{cls.__name__}, inside the engine ({label}),", error_hint):
        got = run_traced(
            prompts, params, dry_run, max_steps=3 * len(ref.trace.steps) + 20,
            **{option: cls}, **engine,
        )
    used = _COMPONENTS[option](got.llm.llm_engine)
    assert type(used) is cls, (
        f"the engine should have used {cls.__name__}, not {type(used).__name__}"
    )
    compare_runs(ref, got, label, hints, agreed=agreed, refine_hint=refine_hint)
    return got


class BatchRecorder:
    """A step observer of the classic engine that keeps what each step
    scheduled: request id -> tokens it computes (days 6 and 15)."""

    def __init__(self) -> None:
        self.steps: list[dict[str, int]] = []

    def on_add_request(self, engine, seq_group) -> None:
        pass

    def on_step(self, engine, record) -> None:
        self.steps.append({
            s.seq_group.request_id: s.token_chunk_size
            for s in record.scheduler_outputs.scheduled_seq_groups
        })

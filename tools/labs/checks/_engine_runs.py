"""Shared by the day 5 and day 6 checkers: run a workload on the real engine
(with or without the model) with tracing on, and compare a learner's run
with the reference's step by step, naming the first step that differs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from dataclasses import dataclass
from typing import Any

from minivllm import LLM, SamplingParams
from tools.tracer import load_trace
from tools.tracer.trace import Trace


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
                "forever. Look for blocks that are never given back, or a table that grows "
                "faster than one block per block_size tokens."
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


def learner_code(what: str, hint: str = ""):
    """Turn an unexpected exception from the learner's component into an
    AssertionError that says where it came from (and a hint); an
    AssertionError, or NotImplementedError (an unfinished exercise), passes
    through unchanged."""

    @contextlib.contextmanager
    def guard():
        try:
            yield
        except (NotImplementedError, AssertionError):
            raise
        except Exception as error:  # noqa: BLE001 - reported to the learner
            raise AssertionError(
                f"{what} raised {type(error).__name__}: {error}. Read the traceback above "
                f"this message: its last lines inside your code show where.{hint}"
            ) from error

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

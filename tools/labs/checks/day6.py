"""Checkers for day 6, the scheduler and continuous batching
(labs/day6_scheduler.ipynb).

Each runs the learner's code beside the reference (core/scheduler.py) and
prints one line, or raises AssertionError saying what was expected, what
came back, and where to look.
"""

from __future__ import annotations

import functools
import math

from minivllm import SamplingParams
from minivllm.core.scheduler import Scheduler
from minivllm.tracer.trace import Trace
from tools.labs.checks._common import passed
from tools.labs.checks._engine_runs import (
    Run,
    check_in_engine,
    first_difference,
    learner_code,
    run_traced,
    token_prompts,
)

DAY = 6


# -- exercise 1: one step's admission, by hand -------------------------------------


def reference_admit(
    prompt_lens: list[int],
    *,
    free_blocks: int,
    block_size: int,
    watermark_blocks: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    num_running: int = 0,
) -> tuple[int, str | None]:
    """How many waiting prompts (from the head) one step of vLLM's default
    scheduling admits, and which limit stopped it: "blocks", "tokens",
    "seqs", or None (all admitted). The running requests keep their
    sequence slots but spend no tokens: they do not decode in a step that
    admits prompts."""
    tokens, seqs = 0, num_running
    for i, n in enumerate(prompt_lens):
        need = math.ceil(n / block_size)
        if free_blocks - need < watermark_blocks:
            return i, "blocks"
        if tokens + n > max_num_batched_tokens:
            return i, "tokens"
        if seqs + 1 > max_num_seqs:
            return i, "seqs"
        free_blocks -= need
        tokens += n
        seqs += 1
    return len(prompt_lens), None


_ADMIT_CASES = [
    ("four 100-token prompts, 256-token budget",
     [100, 100, 100, 100], dict(free_blocks=64, block_size=16, watermark_blocks=0,
                                max_num_seqs=256, max_num_batched_tokens=256)),
    ("one request running with 7 of 10 blocks; a 50-token prompt waits",
     [50], dict(free_blocks=3, block_size=16, watermark_blocks=0, max_num_seqs=256,
                max_num_batched_tokens=2048, num_running=1)),
    ("five short prompts, 2 running, max_num_seqs 4",
     [10, 10, 10, 10, 10], dict(free_blocks=100, block_size=16, watermark_blocks=0,
                                max_num_seqs=4, max_num_batched_tokens=2048, num_running=2)),
    ("the watermark: 4 free blocks, 2 kept back",
     [16, 16, 16], dict(free_blocks=4, block_size=16, watermark_blocks=2, max_num_seqs=256,
                        max_num_batched_tokens=2048)),
    ("head-of-line: a long prompt first, a short one behind it",
     [200, 10], dict(free_blocks=5, block_size=16, watermark_blocks=0, max_num_seqs=256,
                     max_num_batched_tokens=2048)),
    ("250 running requests hold 250 of 251 sequence slots, and no tokens",
     [10, 10], dict(free_blocks=100, block_size=16, watermark_blocks=0, max_num_seqs=251,
                    max_num_batched_tokens=256, num_running=250)),
    ("everything fits",
     [17, 33, 5], dict(free_blocks=6, block_size=16, watermark_blocks=0, max_num_seqs=8,
                       max_num_batched_tokens=64)),
    ("exactly full: blocks, tokens and seqs all used up",
     [32, 32], dict(free_blocks=4, block_size=16, watermark_blocks=0, max_num_seqs=3,
                    max_num_batched_tokens=65, num_running=1)),
]

_ADMIT_HINTS = {
    "blocks": "a prompt needs ceil(len / block_size) blocks, and admitting it must leave at "
    "least watermark_blocks free",
    "tokens": "a prompt is admitted whole (no chunked prefill here); the running requests "
    "spend no tokens, since a step that admits prompts runs no decode",
    "seqs": "the running requests keep their places: they count against max_num_seqs",
    None: "check the order: blocks, then tokens, then seqs; stop at the first prompt that "
    "does not fit (first come, first served: no skipping ahead)",
}


def exercise_1(admit) -> None:
    for label, lens, kwargs in _ADMIT_CASES:
        want = reference_admit(lens, **kwargs)
        got = admit(lens, **kwargs)
        assert tuple(got) == want, (
            f"{label}: admit({lens}, {', '.join(f'{k}={v}' for k, v in kwargs.items())}) "
            f"should return {want}, got {tuple(got)}.\nHint: {_ADMIT_HINTS[want[1]]}."
        )
    passed(DAY, 1)


# -- exercises 2 and 4: a scheduler inside the engine --------------------------------

_HINTS = {
    "scheduled": "The batch differs. Admission walks the waiting queue from its head: "
    "can_allocate (LATER: stop; NEVER: ignore it and go on), then budget.can_schedule with the "
    "whole prompt's tokens and seq_group.get_max_num_running_seqs() (stop if not), then "
    "self._allocate_and_set_running(seq_group), charge budget.add_num_batched_tokens and "
    "budget.add_num_seqs under its request_id, and record it with self._scheduled.",
    "queues_after": "A request ended the step in another queue: an admitted group leaves "
    "self.waiting (popleft) and is returned; the step itself puts admitted groups in "
    "self.running and preemption victims back in line (RECOMPUTE: the head of self.waiting; "
    "SWAP: self.swapped), so neither method should add to a queue.",
    "ignored": "A prompt that can never fit (AllocStatus.NEVER) must leave the waiting queue "
    "through self._ignore(seq_group, out, reason); admission then goes on with the next one.",
    "preempted": "Each preemption is recorded as out.preempted.append((seq_group, mode)). "
    "The mode: the configured preemption_mode; when it is None, RECOMPUTE if "
    "seq_group.get_max_num_running_seqs() == 1, else SWAP; and SWAP whenever the group has "
    "several running sequences.",
    "swap_out": "A SWAP victim's (gpu, cpu) block pairs come from "
    "self.block_manager.swap_out(seq_group) and go into out.blocks_to_swap_out.",
    "block_tables": "A RECOMPUTE victim gives its blocks back (self.free_seq(seq)) and forgets "
    "its progress (seq.reset_state_for_recompute()); a SWAP victim's table moves to the CPU "
    "pool (swap_out).",
    "free_blocks": "Blocks were not given back, or given back twice: RECOMPUTE frees each "
    "running sequence of the victim; SWAP moves them (swap_out) and frees nothing itself.",
}


def _prefill_or_decode(field: str, want, have) -> str | None:
    """The closer hint when the same sequences ran, one as a prefill here and a decode there."""
    if field == "scheduled" and [(r, s, n) for r, s, _, n in want] == [
        (r, s, n) for r, s, _, n in have
    ]:
        return (
            "The same requests ran, but as a prefill in one run and a decode in the other. "
            "A RECOMPUTE victim must be prefilled again from scratch: call "
            "seq.reset_state_for_recompute() on each of its sequences."
        )
    return None


def _check_in_engine(cls, label: str, prompts, params, dry_run: bool, **engine) -> Run:
    return check_in_engine(
        "scheduler_cls", cls, label, prompts, params, dry_run,
        hints=_HINTS, refine_hint=_prefill_or_decode, **engine,
    )


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


STORY_PROMPTS = ["Once upon a time", "The little dog", "Tom and Mia went to", "One day, a cat"]


def _require_scheduler(cls) -> None:
    if not (isinstance(cls, type) and issubclass(cls, Scheduler)):
        raise AssertionError(f"pass your Scheduler subclass itself (the class), got {cls!r}")


def exercise_2(scheduler_cls) -> None:
    """The admission loop (`_schedule_prefills`) in the engine, against the reference."""
    _require_scheduler(scheduler_cls)
    workloads = [
        ("token budget: four 100-token prompts, max_num_batched_tokens=256",
         token_prompts([100] * 4), _greedy(4),
         dict(block_size=16, num_gpu_blocks_override=64, max_model_len=256,
              max_num_batched_tokens=256)),
        ("free blocks: 100 + 50 tokens in 10 blocks of 16",
         token_prompts([100, 50]), _greedy(3),
         dict(block_size=16, num_gpu_blocks_override=10)),
        ("max_num_seqs=2, five prompts of different lengths",
         token_prompts([30, 5, 60, 12, 25]),
         [_greedy(m) for m in (6, 2, 4, 8, 3)],
         dict(block_size=16, num_gpu_blocks_override=64, max_num_seqs=2)),
        ("a prompt that can never fit (80 tokens, 4 blocks of 16), then one that fits",
         token_prompts([80, 20]), _greedy(3),
         dict(block_size=16, num_gpu_blocks_override=4, max_model_len=128)),
        ("the watermark: four 390-token prompts (25 blocks each) in 100 blocks, 1 kept back",
         token_prompts([390] * 4), _greedy(4),
         dict(block_size=16, num_gpu_blocks_override=100, max_model_len=512)),
        ("n=2 reserves two sequence slots: max_num_seqs=3",
         token_prompts([20, 20, 20]),
         SamplingParams(n=2, temperature=0.8, seed=0, max_tokens=4, ignore_eos=True),
         dict(block_size=16, num_gpu_blocks_override=64, max_num_seqs=3)),
        ("RECOMPUTE preemption: preempted requests are admitted again",
         token_prompts([40, 16, 17, 31, 5, 40]), _greedy(40),
         dict(block_size=16, num_gpu_blocks_override=12, preemption_mode="recompute")),
    ]
    for label, prompts, params, engine in workloads:
        _check_in_engine(scheduler_cls, f"dry run, {label}", prompts, params, True, **engine)
    _check_in_engine(
        scheduler_cls,
        "the story model, max_num_seqs=2",
        STORY_PROMPTS,
        SamplingParams(temperature=0, max_tokens=12),
        False,
        block_size=8,
        num_gpu_blocks_override=32,
        max_num_seqs=2,
    )
    passed(DAY, 2)


# -- exercise 3: static batching, measured ----------------------------------------------


class ReferenceStaticScheduler(Scheduler):
    """Static batching: a new batch is admitted only once the previous one is done."""

    def _schedule_prefills(self, budget, out, enable_chunking=False):
        if self.running or self.swapped:
            return []
        return super()._schedule_prefills(budget, out, enable_chunking)


def reference_slot_usage(trace: Trace, max_num_seqs: int) -> tuple[int, int, int]:
    steps = len(trace.steps)
    used = sum(len(step["scheduled"]) for step in trace.steps)
    return steps, used, steps * max_num_seqs - used


# Eight requests with very different output lengths, four rows per batch.
MEASURE_PROMPT_LENS = [12, 30, 8, 25, 40, 16, 9, 33]
MEASURE_MAX_TOKENS = [4, 60, 8, 30, 50, 5, 12, 40]
MEASURE_ENGINE = dict(block_size=16, num_gpu_blocks_override=128, max_num_seqs=4)


def measure_workload() -> tuple[list[list[int]], list[SamplingParams]]:
    return token_prompts(MEASURE_PROMPT_LENS), [_greedy(m) for m in MEASURE_MAX_TOKENS]


@functools.lru_cache(maxsize=1)
def _measure_reference() -> tuple[Run, Run]:
    prompts, params = measure_workload()
    continuous = run_traced(prompts, params, True, **MEASURE_ENGINE)
    static = run_traced(prompts, params, True, scheduler_cls=ReferenceStaticScheduler,
                        **MEASURE_ENGINE)
    return continuous, static


def exercise_3(static_scheduler_cls, slot_usage) -> None:
    _require_scheduler(static_scheduler_cls)
    continuous, static = _measure_reference()
    for name, run in (("continuous batching", continuous), ("static batching", static)):
        want = reference_slot_usage(run.trace, 4)
        got = slot_usage(run.trace, 4)
        assert tuple(got) == want, (
            f"slot_usage on the {name} trace (max_num_seqs=4) should be (steps, used, idle) = "
            f"{want}, got {tuple(got)}.\nHint: every entry of step['scheduled'] is one "
            "sequence computing in that step (one used slot); idle = steps × max_num_seqs − used."
        )
    prompts, params = measure_workload()
    with learner_code(f"{static_scheduler_cls.__name__}, inside the engine,"):
        got = run_traced(prompts, params, True, max_steps=3 * len(static.trace.steps),
                         scheduler_cls=static_scheduler_cls, **MEASURE_ENGINE)
    for step in got.trace.steps:
        busy = step["queues_before"]["running"] or step["queues_before"]["swapped"]
        admitted = [e["request_id"] for e in step["scheduled"] if e["is_prefill"]]
        assert not (busy and admitted), (
            f"Step {step['step']} admitted {admitted} while {busy} were still running: static "
            "batching starts a new batch only when the whole previous batch has finished. "
            "Hint: return no prefills while self.running (or self.swapped) is non-empty."
        )
    diff = first_difference(static.trace, got.trace)
    assert diff is None, (
        f"Your static scheduler's step {diff[0]} differs from the reference static scheduler "
        f"in {diff[1]}: reference {diff[2]}, yours {diff[3]}. Hint: when nothing is running, "
        "admit exactly as the normal scheduler does (super()._schedule_prefills)."
    )
    assert got.outputs == continuous.outputs, "the tokens should not depend on the batching"
    passed(DAY, 3)


# -- exercise 4: preemption -------------------------------------------------------------


def exercise_4(scheduler_cls) -> None:
    """`_preempt`: RECOMPUTE and SWAP, and the choice between them."""
    _require_scheduler(scheduler_cls)
    three = token_prompts([40, 40, 40])
    for mode in ("recompute", "swap", None):
        _check_in_engine(
            scheduler_cls,
            f"dry run, three 40-token prompts growing to 80 in 12 blocks, preemption_mode={mode}",
            three, _greedy(40), True,
            block_size=16, num_gpu_blocks_override=12, preemption_mode=mode, swap_space=0.01,
        )
    _check_in_engine(
        scheduler_cls,
        "dry run, n=2 groups under pressure with preemption_mode='recompute' (forked: SWAP)",
        token_prompts([40, 16, 31]),
        SamplingParams(n=2, temperature=0.8, seed=1, max_tokens=30, ignore_eos=True),
        True,
        block_size=16, num_gpu_blocks_override=12, preemption_mode="recompute", swap_space=0.01,
    )
    _check_in_engine(
        scheduler_cls,
        "dry run, chunked prefill under pressure with preemption_mode='swap'",
        token_prompts([90, 70, 60, 50]), _greedy(30), True,
        block_size=16, num_gpu_blocks_override=16, enable_chunked_prefill=True,
        max_num_batched_tokens=32, max_num_seqs=4, preemption_mode="swap", swap_space=0.01,
    )
    got = _check_in_engine(
        scheduler_cls,
        "the story model, four prompts in 8 blocks of 8, preemption_mode='swap'",
        STORY_PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), False,
        block_size=8, num_gpu_blocks_override=8, preemption_mode="swap",
    )
    assert any(step["swap_out"] for step in got.trace.steps), "this run should swap out"
    passed(DAY, 4)

"""Checkers for day 6, the scheduler and continuous batching
(labs/day6_scheduler.ipynb).

Each runs the learner's code beside the reference (core/scheduler.py) and
prints one line, or raises AssertionError saying what was expected, what
came back, and where to look.
"""

from __future__ import annotations

import functools
import math
import traceback

from minivllm import LLM, SamplingParams
from minivllm.core.scheduler import Scheduler
from minivllm.tracer.trace import Trace
from tools.labs.checks._common import passed
from tools.labs.checks._engine_runs import (
    BatchRecorder,
    Run,
    check_in_engine,
    component_of,
    first_difference,
    learner_code,
    quiet_engine,
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


# Each case: a label, the prompts, the limits, and two hints: for an answer
# that admits more prompts than the reference, and for one that admits fewer.
_ADMIT_CASES = [
    ("four 100-token prompts, 256-token budget",
     [100, 100, 100, 100], dict(free_blocks=64, block_size=16, watermark_blocks=0,
                                max_num_seqs=256, max_num_batched_tokens=256),
     "a prompt is admitted whole (no chunked prefill here) only if the tokens admitted so far "
     "plus its own stay within max_num_batched_tokens",
     "two 100-token prompts make 200 tokens, within the 256-token budget"),
    ("one request running with 7 of 10 blocks; a 50-token prompt waits",
     [50], dict(free_blocks=3, block_size=16, watermark_blocks=0, max_num_seqs=256,
                max_num_batched_tokens=2048, num_running=1),
     "a prompt needs ceil(len / block_size) blocks (a partly filled block is a whole block): "
     "50 tokens need 4 blocks of 16, and only 3 are free",
     "the running request spends no tokens in this step"),
    ("five short prompts, 2 running, max_num_seqs 4",
     [10, 10, 10, 10, 10], dict(free_blocks=100, block_size=16, watermark_blocks=0,
                                max_num_seqs=4, max_num_batched_tokens=2048, num_running=2),
     "the running requests keep their places: they count against max_num_seqs, so only "
     "4 - 2 = 2 prompts join them",
     "2 running plus 2 admitted is 4 sequences, which max_num_seqs=4 allows"),
    ("the watermark: 4 free blocks, 2 kept back",
     [16, 16, 16], dict(free_blocks=4, block_size=16, watermark_blocks=2, max_num_seqs=256,
                        max_num_batched_tokens=2048),
     "each admitted prompt takes its blocks: subtract them from free_blocks before you "
     "look at the next prompt",
     "admitting may leave exactly watermark_blocks free: a prompt fits while at least "
     "watermark_blocks free remain after it (stop only when free - need < watermark_blocks)"),
    ("head-of-line: a long prompt first, a short one behind it",
     [200, 10], dict(free_blocks=5, block_size=16, watermark_blocks=0, max_num_seqs=256,
                     max_num_batched_tokens=2048),
     "first come, first served: stop at the first prompt that does not fit, and return its "
     "index (no skipping ahead: the short prompt waits behind the long one)",
     "the first prompt does not fit; nothing is admitted"),
    ("250 running requests hold 250 of 251 sequence slots, and no tokens",
     [10, 10], dict(free_blocks=100, block_size=16, watermark_blocks=0, max_num_seqs=251,
                    max_num_batched_tokens=256, num_running=250),
     "the 250 running requests hold 250 of the 251 sequence slots",
     "the running requests spend no tokens, since a step that admits prompts runs no decode "
     "(vLLM's default scheduling): start the token count at 0, and the slot count at "
     "num_running"),
    ("everything fits",
     [17, 33, 5], dict(free_blocks=6, block_size=16, watermark_blocks=0, max_num_seqs=8,
                       max_num_batched_tokens=64),
     "there are only three prompts",
     "2 + 3 + 1 = 6 blocks, 55 tokens and 3 sequences: every limit holds"),
    ("exactly full: blocks, tokens and seqs all used up",
     [32, 32], dict(free_blocks=4, block_size=16, watermark_blocks=0, max_num_seqs=3,
                    max_num_batched_tokens=64, num_running=1),
     "there are only two prompts",
     "a limit reached exactly still holds: 4 blocks of 4, 64 tokens of 64 and 3 sequences of "
     "3 all fit (stop only when a limit would be exceeded: `>`, not `>=`)"),
    ("two limits at once: 100 tokens need 7 blocks (3 free) and exceed the 64-token budget",
     [100], dict(free_blocks=3, block_size=16, watermark_blocks=0, max_num_seqs=8,
                 max_num_batched_tokens=64), "", ""),
    ("two limits at once: no free block and no free sequence slot",
     [20], dict(free_blocks=1, block_size=16, watermark_blocks=0, max_num_seqs=2,
                max_num_batched_tokens=2048, num_running=2), "", ""),
    ("two limits at once: the second prompt exceeds both the token budget and max_num_seqs",
     [40, 40], dict(free_blocks=50, block_size=16, watermark_blocks=0, max_num_seqs=2,
                    max_num_batched_tokens=64, num_running=1), "", ""),
]


def _admit_hint(lens, want, got, more: str, fewer: str) -> str:
    """The closer hint: too many admitted, too few, or the right number
    stopped by another limit (two failed at once)."""
    if got[0] == want[0]:
        return (
            f"prompt {want[0]} ({lens[want[0]]} tokens) fails more than one limit, and "
            f"the answer names the first one checked: blocks, then tokens, then seqs "
            f"(two limits failed at once here; yours reported {got[1]!r})"
            if want[1] and got[1] else
            "return None as the limit only when every prompt was admitted"
        )
    return more if got[0] > want[0] else fewer


def _call_admit(admit, lens, kwargs) -> tuple:
    with learner_code("your `admit`", "run the failing case by hand, prompt by prompt"):
        got = admit(lens, **kwargs)
    assert isinstance(got, (tuple, list)) and len(got) == 2, (
        f"admit should return a pair (number admitted, the limit that stopped it or None), "
        f"got {got!r}" + (": did you forget the `return`?" if got is None else "")
    )
    return tuple(got)


def exercise_1(admit) -> None:
    for label, lens, kwargs, more, fewer in _ADMIT_CASES:
        want = reference_admit(lens, **kwargs)
        got = _call_admit(admit, lens, kwargs)
        assert got == want, (
            f"{label}: admit({lens}, {', '.join(f'{k}={v}' for k, v in kwargs.items())}) "
            f"should return {want}, got {got}.\n"
            f"Hint: {_admit_hint(lens, want, got, more, fewer)}. (Lesson section 2, the worked "
            "table; the engine's rules are in core/scheduler.py::Scheduler._schedule_prefills.)"
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


def _raised_in(error: BaseException, filename: str) -> bool:
    last = traceback.extract_tb(error.__traceback__)[-1:]
    return bool(last) and last[0].filename.replace("\\", "/").endswith(filename)


def _twice_in_a_queue(scheduler: Scheduler | None) -> str | None:
    if scheduler is None:
        return None
    for name in ("waiting", "running", "swapped"):
        ids = [g.request_id for g in getattr(scheduler, name)]
        twice = sorted({i for i in ids if ids.count(i) > 1})
        if twice:
            return f"request {twice[0]} is twice in self.{name}"
    return None


def _admitted_twice(error: BaseException, scheduler: Scheduler | None) -> bool:
    """Did the engine trip over a group whose sequences already hold blocks,
    that is, a group it had just admitted from an earlier place in the queue?"""
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    seq_group = tb.tb_frame.f_locals.get("seq_group") if tb is not None else None
    if scheduler is None or seq_group is None:
        return False
    tables = scheduler.block_manager.block_tables
    return any(seq.seq_id in tables for seq in seq_group.get_seqs())


_FALLBACK_ERROR_HINT = (
    "run the failing workload with run_traced(..., scheduler_cls=YourClass) and look at the "
    "queues step by step (lesson section 2)"
)

_TOKENS_NOT_SUMMED = "num_batched_tokens is not the sum"


# Exercise 2's RECOMPUTE workload, which _admits_recomputed_short replays.
RECOMPUTE_PROMPT_LENS = [40, 16, 17, 31, 5, 40]
RECOMPUTE_MAX_TOKENS = 40
RECOMPUTE_ENGINE = dict(block_size=16, num_gpu_blocks_override=12, preemption_mode="recompute")


def _admits_recomputed_short(scheduler_cls) -> bool:
    """Does the scheduler admit a recomputed request with fewer tokens than
    it holds? Replays the RECOMPUTE workload, looking after each step for a
    running group still in its prefill: without chunked prefill an admitted
    group computes all its tokens in its first step. (The default step runs
    no prefill chunks and drops such a group: it never finishes.)"""
    try:
        with quiet_engine():
            llm = LLM(dry_run=True, disable_log_stats=True, scheduler_cls=scheduler_cls,
                      **RECOMPUTE_ENGINE)
            engine = llm.llm_engine
            for i, prompt in enumerate(token_prompts(RECOMPUTE_PROMPT_LENS)):
                engine.add_request(str(i), {"prompt_token_ids": prompt},
                                   _greedy(RECOMPUTE_MAX_TOKENS))
            for _ in range(1000):  # the reference needs about 100 steps
                if not engine.has_unfinished_requests():
                    break
                engine.step()
                if any(group.is_prefill() for group in engine.scheduler.running):
                    return True
    except Exception:  # noqa: BLE001 - another mistake, which the caller's hint names
        pass
    return False


def _admission_error_hint(error: BaseException) -> str:
    """Exercise 2: the likely mistake behind an exception from the engine."""
    twice = _twice_in_a_queue(component_of(error, Scheduler))
    if twice:
        return (
            f"{twice}: the step itself puts the groups you return in self.running, so "
            "neither method should add to a queue"
        )
    if isinstance(error, KeyError) and _raised_in(error, "entrypoints/llm.py"):
        llm = component_of(error, LLM)
        if llm is not None and _admits_recomputed_short(type(llm.llm_engine.scheduler)):
            return (
                "a request recomputed after a preemption was admitted with too few tokens: it "
                "prefills its prompt AND the tokens it had generated, so its num_new_tokens is "
                "seq.get_len() (prompt + outputs); seq.get_prompt_len() leaves the outputs out. "
                f"(Left half-prefilled, such a request is dropped by the step, so request {error} "
                "never finished.)"
            )
        return (
            f"request {error} never finished: it left self.waiting but never reached "
            "self.running. Your _schedule_prefills took it off self.waiting but did not "
            "return it (append self._scheduled(seq_group, num_new_tokens) to the list you "
            "return: only those groups join self.running)"
        )
    if isinstance(error, IndexError) and _raised_in(error, "core/block_manager.py"):
        return (
            "the group at the head of self.waiting has no WAITING sequence left: a prompt "
            "you ignored (self._ignore) or admitted was not taken off self.waiting "
            "(self.waiting.popleft())"
        )
    if _TOKENS_NOT_SUMMED in str(error):
        return (
            "the step's token count is not the sum of what it scheduled. Either an admitted "
            "prompt was not charged (budget.add_num_batched_tokens(seq_group.request_id, "
            "num_new_tokens)), or a group ran twice in a step because your method also put "
            "it in self.running: the step puts the groups you return there, so neither "
            "method should add to a queue"
        )
    return _FALLBACK_ERROR_HINT


def _preemption_error_hint(error: BaseException) -> str:
    """Exercise 4: the likely mistake behind an exception from the engine."""
    scheduler = component_of(error, Scheduler)
    twice = _twice_in_a_queue(scheduler)
    if twice:
        return (
            f"{twice}: _preempt only records the victim in out.preempted; the step puts it "
            "back in line (_requeue_preempted), so neither method should add to a queue"
        )
    if isinstance(error, AttributeError) and "NoneType" in str(error):
        return (
            "a preemption was recorded with mode None: preemption_mode is None unless the "
            "user chose one, and when it is None, RECOMPUTE if "
            "seq_group.get_max_num_running_seqs() == 1, else SWAP"
        )
    if isinstance(error, KeyError) and _raised_in(error, "entrypoints/llm.py"):
        return (
            f"request {error} never finished: after its preemption it was in no queue. Record "
            "every victim with out.preempted.append((seq_group, mode)): the step puts the "
            "recorded victims back in line"
        )
    if isinstance(error, KeyError) and _raised_in(error, "core/block_manager.py"):
        return (
            f"the block manager has no block table for sequence {error}: your _preempt calls "
            "free_seq on a SWAP victim. swap_out moves its table to the CPU pool, where it "
            "must stay until swap_in; only RECOMPUTE frees"
        )
    if "a decode computes 1 token per sequence" in str(error):
        return (
            "a RECOMPUTE victim came back as a decode of all its tokens: call "
            "seq.reset_state_for_recompute() on each of its sequences, so that it is "
            "prefilled again from scratch"
        )
    if isinstance(error, IndexError) and _raised_in(error, "core/scheduler.py"):
        if _admitted_twice(error, scheduler):
            return (
                "a victim was twice in self.waiting, and its second copy was met after the "
                "first had been admitted: _preempt only records the victim in out.preempted; "
                "the step puts it back in line (_requeue_preempted), so neither method should "
                "add to a queue"
            )
        return (
            "a victim in self.waiting has no WAITING sequence (or one in self.swapped no "
            "SWAPPED one): set seq.status on each of its running sequences, "
            "SequenceStatus.WAITING for RECOMPUTE and SequenceStatus.SWAPPED for SWAP"
        )
    if _TOKENS_NOT_SUMMED in str(error):
        return (
            "a group with several running sequences was recomputed: forked sequences hold "
            "different tokens in shared blocks, which one prefill cannot rebuild. Such a "
            "group is swapped whatever the configured mode (SWAP when it has several running "
            "sequences)"
        )
    return _FALLBACK_ERROR_HINT


def _closer_hint(field: str, want, have) -> str | None:
    """The closer hint when the values show the mistake: the same sequences
    ran, one as a prefill here and a decode there; or a victim went to the
    other queue (the other preemption mode)."""
    if field == "scheduled" and [(r, s, n) for r, s, _, n in want] == [
        (r, s, n) for r, s, _, n in have
    ]:
        return (
            "The same requests ran, but as a prefill in one run and a decode in the other. "
            "A RECOMPUTE victim must be prefilled again from scratch: call "
            "seq.reset_state_for_recompute() on each of its sequences."
        )
    if field == "swap_out" and have and len(have) < len(want) and want[-len(have):] == have:
        return (
            "This step swapped out several groups, and yours kept only the last one's block "
            "moves: `out.blocks_to_swap_out = ...` replaced the earlier victims' pairs. Add to "
            "the list (`+=` or `.extend`): every victim's blocks must be copied to the CPU pool "
            "before the pass, or its K/V is lost and it comes back with whatever those CPU "
            "blocks held."
        )
    if field == "queues_after":
        for mine, theirs, mode in (("waiting", "swapped", "RECOMPUTE"),
                                   ("swapped", "waiting", "SWAP")):
            moved = sorted(set(have[mine]) & set(want[theirs]))
            if moved:
                return (
                    f"Request {moved[0]} was preempted by {mode} (it is in self.{mine}) where "
                    f"the reference chose the other mode (self.{theirs}): check the mode rule "
                    "(lesson section 4)."
                )
    return None


def _check_in_engine(
    cls, label: str, prompts, params, dry_run: bool, *, focus: str = "",
    error_hint=_FALLBACK_ERROR_HINT, **engine,
) -> Run:
    """check_in_engine with the scheduler installed; a failure also says
    what this workload is there to show (`focus`)."""
    try:
        return check_in_engine(
            "scheduler_cls", cls, label, prompts, params, dry_run,
            hints=_HINTS, error_hint=error_hint, refine_hint=_closer_hint, **engine,
        )
    except AssertionError as error:
        if not focus:
            raise
        raise AssertionError(f"{error}\nWhat this workload shows: {focus}") from error


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


STORY_PROMPTS = ["Once upon a time", "The little dog", "Tom and Mia went to", "One day, a cat"]


def _require_scheduler(cls) -> None:
    if not (isinstance(cls, type) and issubclass(cls, Scheduler)):
        raise AssertionError(f"pass your Scheduler subclass itself (the class), got {cls!r}")


def exercise_2(scheduler_cls) -> None:
    """The admission loop (`_schedule_prefills`) in the engine, against the reference."""
    _require_scheduler(scheduler_cls)
    # (label, prompts, params, engine options, what the workload shows)
    workloads = [
        # The 20-token prompt would fit beside the first two: only FCFS keeps it waiting.
        ("token budget: prompts of 100, 100, 150 and 20 tokens, max_num_batched_tokens=256",
         token_prompts([100, 100, 150, 20]), _greedy(4),
         dict(block_size=16, num_gpu_blocks_override=64, max_model_len=256,
              max_num_batched_tokens=256),
         "the two 100-token prompts fit the 256-token budget, the 150-token one after them "
         "does not: charge each admitted prompt with budget.add_num_batched_tokens, and stop "
         "when budget.can_schedule says no. vLLM stops at the first prompt that does not fit "
         "(FCFS: no skipping ahead), so the 20-token prompt waits behind it although it would "
         "fit: a `continue` where the loop must `break` admitted it."),
        ("free blocks: 100 + 50 tokens in 10 blocks of 16",
         token_prompts([100, 50]), _greedy(3),
         dict(block_size=16, num_gpu_blocks_override=10),
         "the second prompt waits (AllocStatus.LATER) until the first has finished."),
        ("head of line: 60, 100 and 20 tokens in 10 blocks of 16",
         token_prompts([60, 100, 20]), _greedy(3),
         dict(block_size=16, num_gpu_blocks_override=10),
         "first come, first served: request 1 (7 blocks) must wait for blocks, and request "
         "2 waits behind it although its 2 blocks are free. A `continue` where the loop must "
         "`break` skipped ahead of a prompt that must wait."),
        ("max_num_seqs=2, five prompts of different lengths",
         token_prompts([30, 5, 60, 12, 25]),
         [_greedy(m) for m in (6, 2, 4, 8, 3)],
         dict(block_size=16, num_gpu_blocks_override=64, max_num_seqs=2),
         "only two requests run at a time: charge each admitted group with "
         "budget.add_num_seqs, so that budget.can_schedule refuses a third."),
        ("a prompt that can never fit (80 tokens, 4 blocks of 16), then one that fits",
         token_prompts([80, 20]), _greedy(3),
         dict(block_size=16, num_gpu_blocks_override=4, max_model_len=128),
         "a prompt with AllocStatus.NEVER must leave the waiting queue (popleft, then "
         "self._ignore(seq_group, out, reason)) and admission goes on with the next: waiting "
         "cannot help it, and stopping there would block every request behind it forever."),
        ("max_num_seqs=1: a prompt that fits, one that can never fit, one that fits",
         token_prompts([20, 80, 20]), _greedy(3),
         dict(block_size=16, num_gpu_blocks_override=4, max_model_len=128, max_num_seqs=1),
         "request 1 can never fit: it is ignored in step 0, as soon as it reaches the head of "
         "the queue, even when the budget is spent (request 0 took the only sequence slot). "
         "Ask can_allocate first, then the budget."),
        ("the watermark: four 390-token prompts (25 blocks each) in 100 blocks, 1 kept back",
         token_prompts([390] * 4), _greedy(4),
         dict(block_size=16, num_gpu_blocks_override=100, max_model_len=512),
         "can_allocate keeps the watermark free: only three prompts fit at first."),
        ("n=2 reserves two sequence slots: max_num_seqs=3",
         token_prompts([20, 20, 20]),
         SamplingParams(n=2, temperature=0.8, seed=0, max_tokens=4, ignore_eos=True),
         dict(block_size=16, num_gpu_blocks_override=64, max_num_seqs=3),
         "an n=2 request will run two sequences: it asks for "
         "seq_group.get_max_num_running_seqs() == 2 slots, not 1, so only one fits in 3."),
        ("RECOMPUTE preemption: preempted requests are admitted again",
         token_prompts(RECOMPUTE_PROMPT_LENS), _greedy(RECOMPUTE_MAX_TOKENS), RECOMPUTE_ENGINE,
         "a RECOMPUTE victim is back at the head of self.waiting and is admitted like a "
         "prompt, with all its tokens (prompt and generated) to prefill."),
    ]
    for label, prompts, params, engine, focus in workloads:
        _check_in_engine(scheduler_cls, f"dry run, {label}", prompts, params, True,
                         focus=focus, error_hint=_admission_error_hint, **engine)
    _check_in_engine(
        scheduler_cls,
        "the story model, max_num_seqs=2",
        STORY_PROMPTS,
        SamplingParams(temperature=0, max_tokens=12),
        False,
        error_hint=_admission_error_hint,
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


@functools.lru_cache(maxsize=1)
def _parallel_sampling_run() -> Run:
    """n=2, n=3 and n=1 requests in 4 sequence slots: a step's entries are
    sequences, more than its requests."""
    params = [SamplingParams(n=n, temperature=0.8, seed=n, max_tokens=5, ignore_eos=True)
              for n in (2, 3, 1)]
    return run_traced(token_prompts([12, 20, 8]), params, True, **MEASURE_ENGINE)


def _slot_usage_hint(trace: Trace, want: tuple, got: tuple) -> str:
    """The closer hint for a wrong (steps, used, idle)."""
    if got[0] != want[0]:
        return (
            f"steps is len(trace.steps) = {want[0]} (step numbers start at 0, so the last "
            "step's number is one less)"
        )
    requests = sum(len({e["request_id"] for e in step["scheduled"]}) for step in trace.steps)
    decodes = sum(not e["is_prefill"] for step in trace.steps for e in step["scheduled"])
    if got[1] == requests != want[1]:
        return (
            "a used slot counts sequences, not requests: an n=2 request runs two sequences, "
            "each with its own entry in step['scheduled'] and its own slot (max_num_seqs "
            "counts sequences too)"
        )
    if got[1] == decodes != want[1]:
        return "a prefill uses its slot too: count every entry of step['scheduled']"
    if got[1] != want[1]:
        return "every entry of step['scheduled'] is one sequence computing in that step"
    return "idle = steps × max_num_seqs − used"


def _static_error_hint(error: BaseException) -> str:
    if isinstance(error, TypeError) and "NoneType" in str(error):
        return (
            "your _schedule_prefills returned None: when it admits nothing, return an empty "
            "list (the step adds the prefills to the decodes)"
        )
    return "while a batch runs, return []; otherwise what super()._schedule_prefills returns"


def exercise_3(static_scheduler_cls, slot_usage) -> None:
    _require_scheduler(static_scheduler_cls)
    continuous, static = _measure_reference()
    traces = (
        ("continuous batching", continuous.trace),
        ("static batching", static.trace),
        ("parallel sampling (n=2, n=3 and n=1)", _parallel_sampling_run().trace),
    )
    for name, trace in traces:
        want = reference_slot_usage(trace, 4)
        with learner_code("your `slot_usage`", "print one step's trace['scheduled'] entries"):
            got = tuple(slot_usage(trace, 4))
        assert got == want, (
            f"slot_usage on the {name} trace (max_num_seqs=4) should be (steps, used, idle) = "
            f"{want}, got {got}.\nHint: {_slot_usage_hint(trace, want, got)}."
        )
    prompts, params = measure_workload()
    try:
        with learner_code(f"{static_scheduler_cls.__name__}, inside the engine,",
                          _static_error_hint):
            got = run_traced(prompts, params, True, max_steps=3 * len(static.trace.steps),
                             scheduler_cls=static_scheduler_cls, **MEASURE_ENGINE)
    except AssertionError as error:
        raise AssertionError(
            f"{error}\nHint: your static scheduler stopped admitting. Static batching starts a "
            "new batch only when the whole previous batch has finished: test self.running "
            "(and self.swapped), not self.waiting, which stays non-empty until the last batch; "
            "and when nothing runs, admit exactly as the normal scheduler does (return "
            "super()._schedule_prefills(budget, out, enable_chunking))."
        ) from error
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


def _check_preempting(cls, label: str, prompts, params, dry_run: bool, focus: str,
                      **engine) -> Run:
    """One exercise 4 workload; the learner's preemption counter must
    count the preemptions the reference made."""
    got = _check_in_engine(cls, label, prompts, params, dry_run, focus=focus,
                           error_hint=_preemption_error_hint, **engine)
    want = sum(len(step["preempted"]) for step in got.trace.steps)
    counted = got.llm.llm_engine.scheduler.num_cumulative_preemption
    assert counted == want, (
        f"{label}: {want} preemptions happened, but your scheduler's "
        f"self.num_cumulative_preemption says {counted}. Hint: add 1 for every preemption, "
        "whatever its mode, as vLLM's scheduler does (its warning every 50 preemptions "
        "reads this counter)."
    )
    return got


def exercise_4(scheduler_cls) -> None:
    """`_preempt`: RECOMPUTE and SWAP, and the choice between them."""
    _require_scheduler(scheduler_cls)
    three = token_prompts([40, 40, 40])
    for mode, focus in (
        ("recompute", "a RECOMPUTE victim gives its blocks back (self.free_seq), forgets its "
         "progress (seq.reset_state_for_recompute()) and waits to be prefilled again."),
        ("swap", "a SWAP victim's blocks move to the CPU pool (self.block_manager.swap_out) "
         "and come back later (swap_in); its sequences become SWAPPED."),
        (None, "with no preemption_mode configured, a request that runs one sequence is "
         "recomputed: vLLM's rule is, when it is None, RECOMPUTE if "
         "get_max_num_running_seqs() == 1, else SWAP."),
    ):
        _check_preempting(
            scheduler_cls,
            f"dry run, three 40-token prompts growing to 80 in 12 blocks, preemption_mode={mode}",
            three, _greedy(40), True, focus,
            block_size=16, num_gpu_blocks_override=12, preemption_mode=mode, swap_space=0.01,
        )
    _check_preempting(
        scheduler_cls,
        "dry run, four 16-token prompts in 4 blocks of 16, preemption_mode='swap'",
        token_prompts([16] * 4), _greedy(3), True,
        "in step 1 each request needs a second block and none is free: requests 0 and 1 get "
        "theirs by swapping out 3, then 2. One step, two victims: out.blocks_to_swap_out "
        "must hold both victims' block moves.",
        block_size=16, num_gpu_blocks_override=4, preemption_mode="swap", swap_space=0.01,
    )
    _check_preempting(
        scheduler_cls,
        "dry run, n=2 groups under pressure with preemption_mode='recompute' (forked: SWAP)",
        token_prompts([40, 16, 31]),
        SamplingParams(n=2, temperature=0.8, seed=1, max_tokens=30, ignore_eos=True),
        True,
        "a forked group (several running sequences) is swapped whatever the configured mode: "
        "its sequences hold different tokens in shared blocks, which one prefill cannot "
        "rebuild.",
        block_size=16, num_gpu_blocks_override=12, preemption_mode="recompute", swap_space=0.01,
    )
    _check_preempting(
        scheduler_cls,
        "dry run, chunked prefill under pressure with preemption_mode='swap'",
        token_prompts([90, 70, 60, 50]), _greedy(30), True,
        "with preemption_mode='swap', request 3 is swapped even while it is still prefilling "
        "(mid-prompt): it comes back as a prefill of the rest of its prompt. Being a prefill "
        "does not make a victim RECOMPUTE.",
        block_size=16, num_gpu_blocks_override=16, enable_chunked_prefill=True,
        max_num_batched_tokens=32, max_num_seqs=4, preemption_mode="swap", swap_space=0.01,
    )
    _check_preempting(
        scheduler_cls,
        "dry run, chunked prefill, an n=2 prompt preempted mid-prefill, preemption_mode=None",
        token_prompts([62, 100]),
        [_greedy(30),
         SamplingParams(n=2, temperature=0.8, seed=1, max_tokens=6, ignore_eos=True)],
        True,
        "request 1 (n=2) is preempted while still prefilling, when only one of its sequences "
        "exists yet (it is forked after its prompt). The rule reads "
        "get_max_num_running_seqs(), which is n = 2 for a prompt of an n=2 request, so it is "
        "SWAPPED; num_seqs(SequenceStatus.RUNNING) is 1 here, and a rule built on it "
        "recomputes it.",
        block_size=16, num_gpu_blocks_override=12, enable_chunked_prefill=True,
        max_num_batched_tokens=32, max_num_seqs=4, preemption_mode=None, swap_space=0.01,
    )
    got = _check_preempting(
        scheduler_cls,
        "the story model, four prompts in 8 blocks of 8, preemption_mode='swap'",
        STORY_PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), False,
        "SWAP on the real model: the swapped blocks must come back with the same K/V, or the "
        "tokens change.",
        block_size=8, num_gpu_blocks_override=8, preemption_mode="swap",
    )
    assert any(step["swap_out"] for step in got.trace.steps), "this run should swap out"
    passed(DAY, 4)


# -- exercise 5: one step, two policies ---------------------------------------------------

# The state before the step: R is running (its 20-token prompt was prefilled
# in the step before); P (40 tokens) and Q (36 tokens) arrived since and wait,
# P first. max_num_batched_tokens is 64; blocks and sequence slots are plenty.
BUDGET_PROMPTS = {"R": 20, "P": 40, "Q": 36}
BUDGET_ENGINE = dict(block_size=16, num_gpu_blocks_override=32, max_num_batched_tokens=64,
                     max_model_len=64, max_num_seqs=8)
_POLICIES = {
    "default": {},
    "chunked": {"enable_chunked_prefill": True},
    "mixed": {"scheduler_cls": "minivllm.core.scheduler.MixedBatchScheduler"},
}


@functools.cache
def _budget_step(policy: str) -> tuple[tuple[str, int], ...]:
    with quiet_engine():
        llm = LLM(dry_run=True, disable_log_stats=True, **BUDGET_ENGINE, **_POLICIES[policy])
    engine, batch = llm.llm_engine, BatchRecorder()
    engine.add_step_observer(batch)
    prompts = dict(zip(BUDGET_PROMPTS, token_prompts(list(BUDGET_PROMPTS.values())),
                       strict=True))
    engine.add_request("R", {"prompt_token_ids": prompts["R"]}, _greedy(8))
    engine.step()  # R's prefill
    for rid in ("P", "Q"):
        engine.add_request(rid, {"prompt_token_ids": prompts[rid]}, _greedy(4))
    engine.step()  # the step of the exercise
    return tuple((rid, batch.steps[1].get(rid, 0)) for rid in BUDGET_PROMPTS)


def budget_step(policy: str) -> dict[str, int]:
    """What the engine computes in the exercise's step under `policy`
    ("default", "chunked", or "mixed": the course's MixedBatchScheduler):
    request id -> tokens (0: it waits)."""
    return dict(_budget_step(policy))


_BUDGET_WHY = {
    ("default", "R"): "vLLM's default scheduling (Scheduler._schedule_default) runs no decode in "
    "a step that admits prompts: R keeps its sequence slot but waits this step (0 tokens)",
    ("default", "P"): "P is at the head of waiting and its 40 tokens fit the 64-token budget: "
    "it is admitted whole",
    ("default", "Q"): "without chunked prefill a prompt is admitted whole or not at all: "
    "40 + 36 = 76 > 64, so Q waits (0 tokens)",
    ("chunked", "R"): "with chunked prefill (Scheduler._schedule_chunked_prefill) the running "
    "requests go first: R decodes 1 token",
    ("chunked", "P"): "after R's 1 token, P's whole 40-token prompt fits what is left (63)",
    ("chunked", "Q"): "Q gets what is left of the budget as a chunk: 64 - 1 - 40 = 23 of its "
    "36 tokens (the other 13 come in the next step)",
}


def exercise_5(steps: dict) -> None:
    """The learner's table for one step under both policies ({"default": {...},
    "chunked": {...}}), against the engine."""
    assert isinstance(steps, dict) and set(steps) == {"default", "chunked"}, (
        f"return a dict with two tables, {{'default': {{...}}, 'chunked': {{...}}}}, got {steps!r}"
    )
    mixed = budget_step("mixed")
    for policy in ("default", "chunked"):
        mine = steps[policy]
        assert isinstance(mine, dict) and set(mine) == set(BUDGET_PROMPTS), (
            f"your {policy} table should map each of {sorted(BUDGET_PROMPTS)} to the tokens "
            f"it computes in the step (0 if it waits), got {mine!r}"
        )
        engine = budget_step(policy)
        wrong = [rid for rid in BUDGET_PROMPTS if mine[rid] != engine[rid]]
        if not wrong:
            continue
        why = "\n".join(
            f"  {rid}: yours {mine[rid]}, the engine's {engine[rid]}: {_BUDGET_WHY[policy, rid]}."
            for rid in wrong
        )
        note = ""
        if policy == "default" and mine == mixed:
            note = (
                "\nYour table is what the course's MixedBatchScheduler does (decodes first, "
                "then whole prompts), as many walkthroughs of vLLM's scheduler tell such a "
                "step; vLLM v0.6 has no such mode (lesson section 2, 'One step, two policies')."
            )
        raise AssertionError(
            f"In the {policy} policy's step (R running; P 40 and Q 36 tokens waiting; budget "
            f"64), the engine computes {engine}, your table says {mine}.\n{why}{note}"
        )
    passed(DAY, 5)

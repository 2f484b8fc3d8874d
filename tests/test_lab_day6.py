"""Day 6's checkers (tools/labs/checks/day6.py) reject every catalogued
mistake with the message that names it, and pass the solution and a
differently written correct answer.

Each mistake is a flag on a copy of the solution (solutions/day6_scheduler.ipynb),
written here: tests never import notebooks.
"""

from __future__ import annotations

import math
import re

import pytest

from minivllm.config import PreemptionMode
from minivllm.core.block_manager import AllocStatus
from minivllm.core.scheduler import Scheduler
from minivllm.sequence import SequenceStatus
from tools.labs.checks import day6

# -- exercise 1: admit -------------------------------------------------------------------


def _admit(prompt_lens, *, free_blocks, block_size, watermark_blocks, max_num_seqs,
           max_num_batched_tokens, num_running=0, order="bts", decodes_spend_tokens=False,
           running_left_out=False, skip_ahead=False, round_down=False, keep_blocks=False,
           watermark_le=False, strict=False):
    tokens = num_running if decodes_spend_tokens else 0
    seqs = 0 if running_left_out else num_running
    admitted, stopped = 0, None
    for n in prompt_lens:
        need = n // block_size if round_down else math.ceil(n / block_size)
        fails = {
            "b": (free_blocks - need <= watermark_blocks) if watermark_le
            else (free_blocks - need < watermark_blocks),
            "t": (tokens + n >= max_num_batched_tokens) if strict
            else (tokens + n > max_num_batched_tokens),
            "s": seqs + 1 > max_num_seqs,
        }
        names = {"b": "blocks", "t": "tokens", "s": "seqs"}
        failed = next((names[k] for k in order if fails[k]), None)
        if failed:
            if skip_ahead:
                stopped = stopped or failed
                continue
            return admitted, failed
        free_blocks -= 0 if keep_blocks else need
        tokens, seqs, admitted = tokens + n, seqs + 1, admitted + 1
    return admitted, stopped


def _admit_alternative(prompt_lens, **limits):
    """Correct, written otherwise: running totals, one condition list."""
    free, tokens, seqs = limits["free_blocks"], 0, limits.get("num_running", 0)
    for i, n in enumerate(prompt_lens):
        blocks = -(-n // limits["block_size"])
        for name, over in (
            ("blocks", free - blocks < limits["watermark_blocks"]),
            ("tokens", tokens + n > limits["max_num_batched_tokens"]),
            ("seqs", seqs >= limits["max_num_seqs"]),
        ):
            if over:
                return i, name
        free, tokens, seqs = free - blocks, tokens + n, seqs + 1
    return len(prompt_lens), None


@pytest.mark.parametrize("mistake, message", [
    ({"order": "tbs"}, "two limits failed at once"),
    ({"order": "bst"}, "two limits failed at once"),
    ({"order": "sbt"}, "two limits failed at once"),
    ({"decodes_spend_tokens": True}, "spend no tokens"),
    ({"running_left_out": True}, "count against max_num_seqs"),
    ({"skip_ahead": True}, "no skipping ahead"),
    ({"round_down": True}, "ceil(len / block_size)"),
    ({"keep_blocks": True}, "takes its blocks"),
    ({"watermark_le": True}, "at least watermark_blocks free"),
    ({"strict": True}, "`>`, not `>=`"),
])
def test_exercise_1_rejects(mistake, message):
    with pytest.raises(AssertionError, match=re.escape(message)):
        day6.exercise_1(lambda lens, **kw: _admit(lens, **kw, **mistake))


def test_exercise_1_rejects_no_return():
    with pytest.raises(AssertionError, match=re.escape("did you forget the `return`?")):
        day6.exercise_1(lambda lens, **kw: None)


def test_exercise_1_rejects_a_crash_with_a_hint():
    def admit(prompt_lens, **limits):
        return prompt_lens[len(prompt_lens)], None  # an IndexError

    with pytest.raises(AssertionError, match=re.escape("your `admit` raised IndexError")):
        day6.exercise_1(admit)


@pytest.mark.parametrize("answer", [_admit, _admit_alternative])
def test_exercise_1_passes(answer, capsys):
    day6.exercise_1(answer)
    assert capsys.readouterr().out == "Day 6, exercise 1: passed\n"


# -- exercise 2: _schedule_prefills ---------------------------------------------------------


def _admission(*, skip_ahead=False, never_not_popped=False, never_breaks=False,
               one_seq=False, append_running=False, not_returned=False, no_token_charge=False,
               no_seq_charge=False, budget_first=False, budget_skip=False, prompt_len=False):
    class MyScheduler(Scheduler):
        def _schedule_prefills(self, budget, out, enable_chunking=False):
            prefills = []
            skipped = []
            while self.waiting:
                seq_group = self.waiting[0]
                if budget_first and not budget.can_schedule(
                    num_new_tokens=seq_group.get_seqs(SequenceStatus.WAITING)[0].get_len(),
                    num_new_seqs=seq_group.get_max_num_running_seqs(),
                ):
                    break
                status = self.block_manager.can_allocate(seq_group)
                if status == AllocStatus.LATER:
                    if skip_ahead:
                        skipped.append(self.waiting.popleft())
                        continue
                    break
                if status == AllocStatus.NEVER:
                    if never_breaks:
                        break
                    if not never_not_popped:
                        self.waiting.popleft()
                    self._ignore(seq_group, out, "it can never fit in the KV cache")
                    continue
                seq = seq_group.get_seqs(SequenceStatus.WAITING)[0]
                num_new_tokens = seq.get_prompt_len() if prompt_len else seq.get_len()
                num_new_seqs = 1 if one_seq else seq_group.get_max_num_running_seqs()
                if not budget.can_schedule(num_new_tokens=num_new_tokens,
                                           num_new_seqs=num_new_seqs):
                    if budget_skip:
                        skipped.append(self.waiting.popleft())
                        continue
                    break
                self.waiting.popleft()
                self._allocate_and_set_running(seq_group)
                if not no_token_charge:
                    budget.add_num_batched_tokens(seq_group.request_id, num_new_tokens)
                if not no_seq_charge:
                    budget.add_num_seqs(seq_group.request_id, num_new_seqs)
                if append_running:
                    self.running.append(seq_group)
                if not not_returned:
                    prefills.append(self._scheduled(seq_group, num_new_tokens))
            self.waiting.extendleft(reversed(skipped))
            return prefills

    return MyScheduler


class _AlternativeAdmission(Scheduler):
    """Correct, written otherwise: a for loop over a snapshot, early returns."""

    def _schedule_prefills(self, budget, out, enable_chunking=False):
        prefills = []
        for seq_group in list(self.waiting):
            fits = self.block_manager.can_allocate(seq_group)
            if fits is AllocStatus.NEVER:
                self.waiting.remove(seq_group)
                self._ignore(seq_group, out, "too big")
                continue
            tokens = seq_group.get_seqs(SequenceStatus.WAITING)[0].get_len()
            seqs = seq_group.get_max_num_running_seqs()
            if fits is AllocStatus.LATER or not budget.can_schedule(
                num_new_tokens=tokens, num_new_seqs=seqs
            ):
                return prefills
            self.waiting.remove(seq_group)
            self._allocate_and_set_running(seq_group)
            budget.add_num_batched_tokens(seq_group.request_id, tokens)
            budget.add_num_seqs(seq_group.request_id, seqs)
            prefills.append(self._scheduled(seq_group, tokens))
        return prefills


@pytest.mark.slow
@pytest.mark.parametrize("mistake, message", [
    ("skip_ahead", "skipped ahead of a prompt that must wait"),
    ("never_not_popped", "was not taken off self.waiting"),
    ("never_breaks", "AllocStatus.NEVER must leave the waiting queue"),
    ("one_seq", "get_max_num_running_seqs()"),
    ("append_running", "neither method should add to a queue"),
    ("not_returned", "took it off self.waiting but did not return it"),
    ("no_token_charge", "budget.add_num_batched_tokens"),
    ("no_seq_charge", "budget.add_num_seqs"),
    ("budget_first", "even when the budget is spent"),
    ("budget_skip", "vLLM stops at the first prompt that does not fit (FCFS: no skipping ahead)"),
])
def test_exercise_2_rejects(mistake, message):
    with pytest.raises(AssertionError, match=re.escape(message)):
        day6.exercise_2(_admission(**{mistake: True}))


@pytest.mark.slow
def test_exercise_2_names_the_recomputed_tokens_first():
    """The prompt's length for a recomputed request loses the request, which
    reads like a group not returned: the hint must lead with the real cause."""
    with pytest.raises(AssertionError) as error:
        day6.exercise_2(_admission(prompt_len=True))
    hint = str(error.value).split("Hint: ", 1)[1]
    assert hint.startswith("a request recomputed after a preemption was admitted with too few")
    assert "seq.get_prompt_len() leaves the outputs out" in hint


@pytest.mark.slow
@pytest.mark.parametrize("answer", [_admission(), _AlternativeAdmission],
                         ids=["solution", "other"])
def test_exercise_2_passes(answer, capsys):
    day6.exercise_2(answer)
    assert capsys.readouterr().out == "Day 6, exercise 2: passed\n"


# -- exercise 3: static batching and slot_usage ----------------------------------------------


def _static(*, test_waiting=False, return_none=False, never_super=False):
    class StaticBatchScheduler(Scheduler):
        def _schedule_prefills(self, budget, out, enable_chunking=False):
            busy = self.waiting if test_waiting else (self.running or self.swapped)
            if busy:
                return None if return_none else []
            if never_super:
                return []
            return super()._schedule_prefills(budget, out, enable_chunking)

    return StaticBatchScheduler


def _slot_usage(trace, max_num_seqs, *, requests=False, decodes_only=False, last_step=False):
    steps = trace.steps[-1]["step"] if last_step else len(trace.steps)
    if requests:
        used = sum(len({e["request_id"] for e in s["scheduled"]}) for s in trace.steps)
    elif decodes_only:
        used = sum(not e["is_prefill"] for s in trace.steps for e in s["scheduled"])
    else:
        used = sum(len(s["scheduled"]) for s in trace.steps)
    return steps, used, steps * max_num_seqs - used


class _AlternativeStatic(Scheduler):
    """Correct, written otherwise: ask the queues' lengths."""

    def _schedule_prefills(self, budget, out, enable_chunking=False):
        if len(self.running) + len(self.swapped) > 0:
            return []
        return Scheduler._schedule_prefills(self, budget, out, enable_chunking)


def _alternative_slot_usage(trace, max_num_seqs):
    used = 0
    for step in trace.steps:
        used += len({e["seq_id"] for e in step["scheduled"]})
    total = max_num_seqs * len(trace.steps)
    return len(trace.steps), used, total - used


@pytest.mark.slow
@pytest.mark.parametrize("static, usage, message", [
    ({"test_waiting": True}, {}, "starts a new batch only when the whole previous batch"),
    ({"return_none": True}, {}, "return an empty list"),
    ({"never_super": True}, {}, "admit exactly as the normal scheduler does"),
    ({}, {"requests": True}, "counts sequences, not requests"),
    ({}, {"decodes_only": True}, "a prefill uses its slot too"),
    ({}, {"last_step": True}, "len(trace.steps)"),
])
def test_exercise_3_rejects(static, usage, message):
    with pytest.raises(AssertionError, match=re.escape(message)):
        day6.exercise_3(_static(**static), lambda t, m: _slot_usage(t, m, **usage))


@pytest.mark.slow
@pytest.mark.parametrize("static, usage", [
    (_static(), _slot_usage),
    (_AlternativeStatic, _alternative_slot_usage),
], ids=["solution", "other"])
def test_exercise_3_passes(static, usage, capsys):
    day6.exercise_3(static, usage)
    assert capsys.readouterr().out == "Day 6, exercise 3: passed\n"


# -- exercise 4: _preempt ---------------------------------------------------------------------


def _preempting(*, always_configured=False, by_running_seqs=False, prefill_recompute=False,
                no_forced_swap=False, no_reset=False, free_on_swap=False, queue_victim=False,
                not_recorded=False, no_counter=False, no_status=False, assign_swap_out=False):
    class MyPreemptingScheduler(Scheduler):
        def _preempt(self, seq_group, out):
            mode = self.scheduler_config.preemption_mode
            if mode is None and not always_configured:
                if by_running_seqs:
                    single = seq_group.num_seqs(SequenceStatus.RUNNING) == 1
                else:
                    single = seq_group.get_max_num_running_seqs() == 1
                mode = PreemptionMode.RECOMPUTE if single else PreemptionMode.SWAP
            if seq_group.num_seqs(SequenceStatus.RUNNING) > 1 and not no_forced_swap:
                mode = PreemptionMode.SWAP
            if prefill_recompute and seq_group.is_prefill():
                mode = PreemptionMode.RECOMPUTE
            if not no_counter:
                self.num_cumulative_preemption += 1
            if mode == PreemptionMode.RECOMPUTE:
                for seq in seq_group.get_seqs(SequenceStatus.RUNNING):
                    if not no_status:
                        seq.status = SequenceStatus.WAITING
                    self.free_seq(seq)
                    if not no_reset:
                        seq.reset_state_for_recompute()
                if queue_victim:
                    self.waiting.appendleft(seq_group)
            else:
                moves = self.block_manager.swap_out(seq_group)
                if assign_swap_out:
                    out.blocks_to_swap_out = moves
                else:
                    out.blocks_to_swap_out += moves
                for seq in seq_group.get_seqs(SequenceStatus.RUNNING):
                    if free_on_swap:
                        self.free_seq(seq)
                    if not no_status:
                        seq.status = SequenceStatus.SWAPPED
                if queue_victim:
                    self.swapped.append(seq_group)
            if not not_recorded:
                out.preempted.append((seq_group, mode))

    return MyPreemptingScheduler


class _AlternativePreempting(Scheduler):
    """Correct, written otherwise: the mode in a helper, swap first."""

    def _mode(self, seq_group):
        if seq_group.num_seqs(SequenceStatus.RUNNING) > 1:
            return PreemptionMode.SWAP
        if self.scheduler_config.preemption_mode is not None:
            return self.scheduler_config.preemption_mode
        if seq_group.get_max_num_running_seqs() > 1:
            return PreemptionMode.SWAP
        return PreemptionMode.RECOMPUTE

    def _preempt(self, seq_group, out):
        mode = self._mode(seq_group)
        running = seq_group.get_seqs(SequenceStatus.RUNNING)
        if mode is PreemptionMode.SWAP:
            out.blocks_to_swap_out.extend(self.block_manager.swap_out(seq_group))
            for seq in running:
                seq.status = SequenceStatus.SWAPPED
        else:
            for seq in running:
                self.free_seq(seq)
                seq.reset_state_for_recompute()
                seq.status = SequenceStatus.WAITING
        out.preempted.append((seq_group, mode))
        self.num_cumulative_preemption = self.num_cumulative_preemption + 1


@pytest.mark.slow
@pytest.mark.parametrize("mistake, message", [
    ("always_configured", "when it is None, RECOMPUTE"),
    ("by_running_seqs", "a rule built on it recomputes it"),
    ("prefill_recompute", "swapped even while it is still prefilling"),
    ("no_forced_swap", "several running sequences"),
    ("no_reset", "reset_state_for_recompute()"),
    ("free_on_swap", "calls free_seq on a SWAP victim"),
    ("queue_victim", "neither method should add to a queue"),
    ("not_recorded", "out.preempted.append((seq_group, mode))"),
    ("no_counter", "num_cumulative_preemption"),
    ("no_status", "seq.status"),
    ("assign_swap_out", "`out.blocks_to_swap_out = ...` replaced the earlier victims' pairs"),
])
def test_exercise_4_rejects(mistake, message):
    with pytest.raises(AssertionError, match=re.escape(message)):
        day6.exercise_4(_preempting(**{mistake: True}))


@pytest.mark.slow
@pytest.mark.parametrize("answer", [_preempting(), _AlternativePreempting],
                         ids=["solution", "other"])
def test_exercise_4_passes(answer, capsys):
    day6.exercise_4(answer)
    assert capsys.readouterr().out == "Day 6, exercise 4: passed\n"


# -- exercise 5: one step, two policies -----------------------------------------------------

DEFAULT_STEP = {"R": 0, "P": 40, "Q": 0}
CHUNKED_STEP = {"R": 1, "P": 40, "Q": 23}


@pytest.mark.parametrize("default, chunked, message", [
    ({"R": 1, "P": 40, "Q": 0}, CHUNKED_STEP, "what the course's MixedBatchScheduler does"),
    ({"R": 0, "P": 40, "Q": 24}, CHUNKED_STEP, "admitted whole or not at all"),
    ({"R": 0, "P": 40, "Q": 36}, CHUNKED_STEP, "40 + 36 = 76 > 64"),
    (DEFAULT_STEP, {"R": 0, "P": 40, "Q": 24}, "the running requests go first"),
    (DEFAULT_STEP, {"R": 1, "P": 40, "Q": 24}, "64 - 1 - 40 = 23"),
    (DEFAULT_STEP, {"R": 1, "P": 40, "Q": 0}, "Q gets what is left of the budget as a chunk"),
    (DEFAULT_STEP, {"R": 1, "P": 40}, "should map each of ['P', 'Q', 'R']"),
])
def test_exercise_5_rejects(default, chunked, message):
    with pytest.raises(AssertionError, match=re.escape(message)):
        day6.exercise_5({"default": default, "chunked": chunked})


@pytest.mark.parametrize("default, chunked", [
    (DEFAULT_STEP, CHUNKED_STEP),
    (dict(Q=0, R=0, P=40), dict(Q=64 - 41, P=40, R=1)),
], ids=["solution", "other"])
def test_exercise_5_passes(default, chunked, capsys):
    day6.exercise_5({"chunked": chunked, "default": default})
    assert capsys.readouterr().out == "Day 6, exercise 5: passed\n"


def test_exercise_5_wants_both_tables():
    with pytest.raises(AssertionError, match=re.escape("return a dict with two tables")):
        day6.exercise_5(DEFAULT_STEP)

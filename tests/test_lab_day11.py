"""Day 11's checkers (tools/labs/checks/day11.py) reject every catalogued
mistake with the message that names it, and pass the solution and a
differently written correct answer.

The answers are written here as plain functions and classes (tests never
import notebooks); each mistake is the solution with one thing changed.
"""

from __future__ import annotations

import copy
import math
import re

import numpy as np
import pytest

from minivllm.core.scheduler import Scheduler
from minivllm.sequence import SequenceStatus
from tools.labs.checks import day11

# -- exercise 1: four steps by hand ------------------------------------------------------

_STEPS = {
    "plain": [
        {"A": 1, "B": 31, "C": 0},
        {"A": 1, "B": 29, "C": 2},
        {"A": 1, "B": 1, "C": 18},
        {"A": 1, "B": 1, "C": 1},
    ],
    "prefix_caching": [
        {"A": 1, "B": 24, "C": 0},
        {"A": 1, "B": 24, "C": 0},
        {"A": 1, "B": 12, "C": 16},
        {"A": 1, "B": 1, "C": 4},
    ],
}


def _steps_with(variant=None, step=None, **changes):
    steps = copy.deepcopy(_STEPS)
    if variant is not None:
        steps[variant][step - 1].update(changes)
    return steps


def test_exercise_1_passes(capsys):
    day11.exercise_1(copy.deepcopy(_STEPS))
    assert capsys.readouterr().out == "Day 11, exercise 1: passed\n"


def test_exercise_1_passes_without_the_zeros(capsys):
    """Correct, written otherwise: requests that compute nothing left out, tuples of steps."""
    answer = {v: tuple({k: n for k, n in s.items() if n} for s in steps)
              for v, steps in _STEPS.items()}
    day11.exercise_1(answer)
    assert capsys.readouterr().out == "Day 11, exercise 1: passed\n"


@pytest.mark.parametrize("mistake, message", [
    # the chunk capped at the whole budget, not what the decode left
    (("plain", 1, {"B": 32}), "A's decode left 32 - 1 = 31"),
    # an off-by-one in the last chunk
    (("plain", 2, {"B": 30}), "60 - 31 = 29"),
    # the default policy's step: no decode while a prompt is admitted
    (("plain", 1, {"A": 0}), "decodes go first"),
    # a new prompt not cut to the tokens left
    (("plain", 2, {"C": 0}), "admitted with what is left: 32 - 1 - 29 = 2"),
    # a prompt that finished its last chunk still prefilling
    (("plain", 3, {"B": 0}), "now it decodes, 1 token"),
    # prefix caching: the cut chunk not rounded to blocks
    (("prefix_caching", 1, {"B": 31}), "rounded down to blocks of 8 is 24"),
    # prefix caching: the last chunk rounded too
    (("prefix_caching", 3, {"B": 8}), "the chunk that ends the prompt is not rounded"),
    # prefix caching: a chunk of less than one block
    (("prefix_caching", 2, {"C": 7}), "less than one block"),
    # prefix caching: rounding up
    (("prefix_caching", 3, {"C": 24}), "a whole number of blocks, 16"),
])
def test_exercise_1_rejects(mistake, message):
    variant, step, changes = mistake
    with pytest.raises(AssertionError, match=re.escape(message)):
        day11.exercise_1(_steps_with(variant, step, **changes))


def test_exercise_1_rejects_a_wrong_shape():
    with pytest.raises(AssertionError, match=re.escape("should return {'plain'")):
        day11.exercise_1(_STEPS["plain"])
    with pytest.raises(AssertionError, match=re.escape("should hold 4 dicts")):
        day11.exercise_1({"plain": _STEPS["plain"][:3], "prefix_caching": _STEPS["plain"]})


# -- exercise 2: the chunk-size rule ------------------------------------------------------


def _rule(*, no_cap=False, whole_budget=False, off=0, prompt_len=False, prefill_prompt_len=False,
          whole_len=False, one_per_group=False, always_chunk=False, chunk_decode=False,
          no_round=False, round_always=False, round_up=False, no_uncached=False, crash=False):
    class MyChunkedScheduler(Scheduler):
        def _get_num_new_tokens(self, seq_group, status, enable_chunking, budget):
            seqs = seq_group.get_seqs(status)
            if status == SequenceStatus.WAITING or seq_group.is_prefill():
                seqs = seqs[:1]
            if crash:
                return seqs[3].get_len()
            if status == SequenceStatus.WAITING and not no_uncached:
                n = self._num_uncached_tokens(seqs[0])
            elif prompt_len or (prefill_prompt_len and seq_group.is_prefill()):
                n = sum(s.get_prompt_len() - s.data.num_computed_tokens for s in seqs)
            elif whole_len:
                n = sum(s.get_len() for s in seqs)
            else:
                n = sum(s.get_len() - s.data.num_computed_tokens for s in seqs)
            n += off
            if one_per_group and status != SequenceStatus.WAITING and not seq_group.is_prefill():
                n = 1
            if not enable_chunking and not always_chunk:
                return n
            left = budget.token_budget if whole_budget else budget.remaining_token_budget()
            if no_cap:
                return n
            if n <= left and not round_always:
                return n
            if len(seqs) > 1 and not chunk_decode:
                return 0
            if self.cache_config.enable_prefix_caching and not no_round:
                bs = self.cache_config.block_size
                if round_up:
                    return min(-(-left // bs) * bs, n)
                if round_always:
                    return min(left // bs * bs, n)
                return left // bs * bs
            return min(n, left)

    return MyChunkedScheduler


class _Alternative(Scheduler):
    """Correct, written otherwise: get_num_new_tokens, one min, early exits."""

    def _get_num_new_tokens(self, seq_group, status, enable_chunking, budget):
        seqs = seq_group.get_seqs(status)
        if status == SequenceStatus.WAITING or seq_group.is_prefill():
            seqs = seqs[:1]
        todo = (self._num_uncached_tokens(seqs[0]) if status == SequenceStatus.WAITING
                else sum(map(lambda s: s.get_num_new_tokens(), seqs)))
        left = budget.remaining_token_budget()
        if not enable_chunking or todo <= left:
            return todo
        if len(seqs) != 1:
            return 0
        block = self.cache_config.block_size if self.cache_config.enable_prefix_caching else 1
        return min(todo, left) // block * block


@pytest.mark.parametrize("answer", [_rule(), _Alternative], ids=["solution", "alternative"])
def test_exercise_2_passes(answer, capsys):
    day11.exercise_2(answer)
    assert capsys.readouterr().out == "Day 11, exercise 2: passed\n"


@pytest.mark.parametrize("mistake, message", [
    ({"no_cap": True}, "cap the chunk at what the budget has left"),
    ({"whole_budget": True}, "not at the whole max_num_batched_tokens"),
    ({"off": 1}, "an off-by-one"),
    ({"off": -1}, "an off-by-one"),
    ({"prompt_len": True}, "seq.get_prompt_len() leaves the outputs out"),
    ({"prefill_prompt_len": True}, "prefills its prompt AND the tokens it had generated"),
    ({"whole_len": True}, "a decode computes 1 token per sequence"),
    ({"one_per_group": True}, "one token per running sequence"),
    ({"always_chunk": True}, "with enable_chunking=False"),
    ({"chunk_decode": True}, "never chunked"),
    ({"no_round": True}, "round what is left down to a multiple of block_size"),
    ({"round_always": True}, "the chunk that ends the prompt is not rounded"),
    ({"round_up": True}, "DOWN to whole blocks"),
    ({"no_uncached": True}, "self._num_uncached_tokens(seq)"),
    ({"crash": True}, "raised IndexError"),
])
def test_exercise_2_rejects(mistake, message):
    with pytest.raises(AssertionError, match=re.escape(message)):
        day11.exercise_2(_rule(**mistake))


def test_exercise_2_rejects_what_is_not_an_override():
    with pytest.raises(AssertionError, match="pass your Scheduler subclass"):
        day11.exercise_2(lambda: None)
    with pytest.raises(AssertionError, match="does not define _get_num_new_tokens"):
        day11.exercise_2(type("Empty", (Scheduler,), {}))


def test_exercise_2_rejects_a_rule_that_changes_the_budget():
    class Charging(Scheduler):
        def _get_num_new_tokens(self, seq_group, status, enable_chunking, budget):
            n = super()._get_num_new_tokens(seq_group, status, enable_chunking, budget)
            budget.add_num_batched_tokens(seq_group.request_id, n)
            return n

    with pytest.raises(AssertionError, match="your method changed the budget"):
        day11.exercise_2(Charging)


# -- exercise 3: TTFT, TPOT, percentile ----------------------------------------------------


def _ttft(out, *, from_scheduled=False, end_to_end=False):
    m = out.metrics
    if from_scheduled:
        return m.first_token_time - m.first_scheduled_time
    if end_to_end:
        return m.finished_time - m.arrival_time
    return m.first_token_time - m.arrival_time


def _tpot(out, *, by_n=False, from_arrival=False, zero=False, raises=False, e2e=False):
    m, n = out.metrics, len(out.outputs[0].token_ids)
    if n == 1 and not raises:
        return 0.0 if zero else None
    start = m.arrival_time if (from_arrival or e2e) else m.first_token_time
    return (m.finished_time - start) / (n if (by_n or e2e) else n - 1)


def _percentile(values, q, *, nearest=False, unsorted=False, n_not_n1=False, rank=False,
                no_clamp=False):
    ordered = list(values) if unsorted else sorted(values)
    if rank:
        return ordered[max(math.ceil(len(ordered) * q / 100) - 1, 0)]
    pos = (len(ordered) if n_not_n1 else len(ordered) - 1) * q / 100
    pos = min(pos, len(ordered) - 1)
    if nearest:
        return ordered[round(pos)]
    lo = int(pos)
    hi = lo + 1 if no_clamp else min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def test_exercise_3_passes(capsys):
    day11.exercise_3(_ttft, _tpot, _percentile)
    assert capsys.readouterr().out == "Day 11, exercise 3: passed\n"


def test_exercise_3_passes_written_otherwise(capsys):
    """Correct, written otherwise: last_token_time, NumPy's percentile."""
    def tpot(out):
        n = len(out.outputs[0].token_ids)
        m = out.metrics
        return None if n < 2 else (m.last_token_time - m.first_token_time) / (n - 1)

    day11.exercise_3(lambda o: o.metrics.first_token_time - o.metrics.arrival_time, tpot,
                     lambda v, q: float(np.percentile(v, q)))
    assert capsys.readouterr().out == "Day 11, exercise 3: passed\n"


@pytest.mark.parametrize("ttft, tpot, pct, message", [
    (dict(from_scheduled=True), {}, {}, "from the request's ARRIVAL"),
    (dict(end_to_end=True), {}, {}, "end-to-end latency"),
    ({}, dict(by_n=True), {}, "output tokens - 1"),
    ({}, dict(from_arrival=True), {}, "not the arrival"),
    ({}, dict(e2e=True), {}, "TPOT leaves out the first token"),
    ({}, dict(zero=True), {}, "return None"),
    ({}, dict(raises=True), {}, "raised ZeroDivisionError"),
    ({}, {}, dict(nearest=True), "a nearest-rank rule"),
    ({}, {}, dict(unsorted=True), "sort the values first"),
    ({}, {}, dict(n_not_n1=True), "(n - 1) * q / 100, not n * q / 100"),
    ({}, {}, dict(rank=True), "interpolates linearly between the two closest ranks"),
    ({}, {}, dict(no_clamp=True), "hi = min(lo + 1, n - 1)"),  # IndexError at q=100
])
def test_exercise_3_rejects(ttft, tpot, pct, message):
    with pytest.raises(AssertionError, match=re.escape(message)):
        day11.exercise_3(lambda o: _ttft(o, **ttft), lambda o: _tpot(o, **tpot),
                         lambda v, q: _percentile(v, q, **pct))


def test_exercise_3_turns_a_crash_into_a_hint():
    """An exception from the learner's function names it and its line."""
    with pytest.raises(AssertionError) as caught:
        day11.exercise_3(lambda o: o.first_token_time - o.arrival_time, _tpot, _percentile)
    message = str(caught.value)
    assert message.startswith("ttft of the recorded request 'admitted at once, 9 tokens' "
                              "raised AttributeError")
    assert "the times are the fields of out.metrics" in message


# -- the measurements ----------------------------------------------------------------------


def test_chunking_trades_ttft_for_the_tpot_tail():
    """The lesson's table: on the modeled clock, chunking lowers TPOT p99 and
    raises TTFT p50, the more so the smaller the budget."""
    rows = []
    for on, budget in ((False, 512), (True, 256), (True, 64)):
        outs = day11.simulate(on, budget)
        ttfts = [day11.reference_ttft(o) for o in outs]
        tpots = [t for t in map(day11.reference_tpot, outs) if t is not None]
        rows.append((day11.reference_percentile(ttfts, 50), day11.reference_percentile(tpots, 99)))
    assert rows[0][1] > rows[1][1] > rows[2][1]
    assert rows[0][0] < rows[1][0] < rows[2][0]
    assert round(rows[0][1] * 1e3, 1) == 26.8 and round(rows[2][0] * 1e3, 1) == 209.0

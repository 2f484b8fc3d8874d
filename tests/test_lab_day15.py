"""Day 15's checkers (tools/labs/checks/day15.py) reject every catalogued
mistake with the message that names it, and pass the solution and a
differently written correct answer.

Each mistake is a flag on a copy of the solution (solutions/day15_v0_to_v1.ipynb),
written here: tests never import notebooks. Every exercise-2 and -3 check runs
the real V1 engine on the shipped model.
"""

from __future__ import annotations

import re

import pytest

from minivllm.utils import cdiv
from minivllm.v1.core.sched.output import SchedulerOutput
from minivllm.v1.core.sched.request_queue import SchedulingPolicy
from minivllm.v1.core.sched.scheduler import Scheduler
from minivllm.v1.request import RequestStatus
from tools.labs.checks import day15

# -- exercise 1: the token budget by hand --------------------------------------------------

SOLUTION_1 = [
    {"A": 32},
    {"A": 18, "B": 14},
    {"A": 1, "B": 16, "C": 10},
    {"A": 1, "B": 1, "C": 1, "D": 12},
    {"B": 1, "C": 1, "D": 1},
    {"D": 1},
]


def _alternative_1():
    """Correct, written otherwise: zeros for requests that wait, tuples of pairs."""
    names = "ABCD"
    rows = [(32, 0, 0, 0), (18, 14, 0, 0), (1, 16, 10, 0), (1, 1, 1, 12), (0, 1, 1, 1),
            (0, 0, 0, 1)]
    return [dict(zip(names, row, strict=True)) for row in rows]


def test_exercise_1_passes(capsys):
    for answer in (SOLUTION_1, _alternative_1()):
        day15.exercise_1(answer)
    assert capsys.readouterr().out == "Day 15, exercise 1: passed\n" * 2


@pytest.mark.parametrize("table, message", [
    # classic thinking: a prompt is admitted whole, or waits
    ([{"B": 30}, {"A": 50}], "V1 chunks by default"),
    # the waiting prompt served before the running one
    ([{"A": 32}, {"B": 30, "A": 2}] + SOLUTION_1[2:], "V1 hands the budget to the RUNNING"),
    # more than the budget
    ([{"A": 32}, {"A": 18, "B": 30}] + SOLUTION_1[2:], "never spends more than the budget"),
    # A still decoding after its third token
    (SOLUTION_1[:4] + [{"A": 1, "B": 1, "C": 1, "D": 1}, {"D": 1}], "A is finished by step 4"),
    # D before it arrives
    (SOLUTION_1[:2] + [{"A": 1, "B": 16, "C": 10, "D": 5}] + SOLUTION_1[3:],
     "D arrives before step 3"),
    # a step missing at the end
    (SOLUTION_1[:5], "Step 5 is missing"),
    # a step too many
    (SOLUTION_1 + [{"D": 1}], "there is no step after that"),
    ("A32 A18B14", "return a list with one dict per step"),
])
def test_exercise_1_rejects(table, message):
    with pytest.raises(AssertionError, match=re.escape(message)):
        day15.exercise_1(table)



# -- exercise 2: schedule() in the engine -----------------------------------------------------


def _scheduler(*, waiting_first=False, admit_after_preemption=False, preempt_head=False,
               no_chunk=False, no_cut_running=False, no_max_seqs=False, resumed_as_new=False,
               new_blocks_only=False, forget_computed=False, skip_ahead=False,
               ignore_unchunked=False, no_break_self=False, no_budget_return=False,
               no_index_fix=False, keep_scheduled=False, fcfs_only=False, no_full_isl=False):
    class MyScheduler(Scheduler):
        def schedule(self) -> SchedulerOutput:
            new_reqs, resumed_reqs, running_reqs, preempted_reqs = [], [], [], []
            req_to_new_blocks, num_scheduled_tokens = {}, {}
            token_budget = self.max_num_scheduled_tokens

            def running_loop():
                nonlocal token_budget
                req_index = 0
                while req_index < len(self.running) and token_budget > 0:
                    request = self.running[req_index]
                    num_new_tokens = request.num_tokens - request.num_computed_tokens
                    if not no_cut_running:
                        num_new_tokens = min(num_new_tokens, token_budget)
                    while True:
                        new_blocks = self.kv_cache_manager.allocate_slots(request, num_new_tokens)
                        if new_blocks is not None:
                            break
                        if self.policy == SchedulingPolicy.PRIORITY and not fcfs_only:
                            victim = max(self.running, key=lambda r: (r.priority, r.arrival_time))
                            self.running.remove(victim)
                            if victim in running_reqs and not keep_scheduled:
                                running_reqs.remove(victim)
                                tokens = num_scheduled_tokens.pop(victim.request_id)
                                if not no_budget_return:
                                    token_budget += tokens
                                req_to_new_blocks.pop(victim.request_id)
                                if not no_index_fix:
                                    req_index -= 1
                        else:
                            victim = self.running.pop(0 if preempt_head else -1)
                        self._preempt_request(victim)
                        preempted_reqs.append(victim)
                        if victim is request and not no_break_self:
                            break
                    if new_blocks is None:
                        break
                    running_reqs.append(request)
                    req_to_new_blocks[request.request_id] = new_blocks
                    num_scheduled_tokens[request.request_id] = num_new_tokens
                    token_budget -= num_new_tokens
                    req_index += 1

            def waiting_loop():
                nonlocal token_budget
                skipped = []
                while self.waiting and token_budget > 0:
                    if len(self.running) == self.max_num_running_reqs and not no_max_seqs:
                        break
                    request = self.waiting.peek_request()
                    blocks, num_hit = self.kv_cache_manager.get_computed_blocks(request)
                    num_new_tokens = request.num_tokens - num_hit
                    unchunked = not self.scheduler_config.enable_chunked_prefill or no_chunk
                    if unchunked and num_new_tokens > token_budget and not ignore_unchunked:
                        break
                    num_new_tokens = min(num_new_tokens, token_budget)
                    new_blocks = self.kv_cache_manager.allocate_slots(
                        request, num_new_tokens, num_hit, blocks, full_sequence_must_fit=(
                            self.scheduler_config.scheduler_reserve_full_isl and not no_full_isl))
                    if new_blocks is None:
                        if skip_ahead:
                            skipped.append(self.waiting.pop_request())
                            continue
                        break
                    self.waiting.pop_request()
                    self.running.append(request)
                    if request.status == RequestStatus.WAITING or resumed_as_new:
                        new_reqs.append(request)
                    else:
                        resumed_reqs.append(request)
                    req_to_new_blocks[request.request_id] = (
                        new_blocks if new_blocks_only
                        else self.kv_cache_manager.get_blocks(request.request_id))
                    num_scheduled_tokens[request.request_id] = num_new_tokens
                    token_budget -= num_new_tokens
                    request.status = RequestStatus.RUNNING
                    if not forget_computed:
                        request.num_computed_tokens = num_hit
                    if request.num_cached_tokens < 0:
                        request.num_cached_tokens = num_hit
                self.waiting.prepend_requests(skipped)

            if waiting_first:
                waiting_loop()
                running_loop()
            else:
                running_loop()
                if not preempted_reqs or admit_after_preemption:
                    waiting_loop()
            return day15.finish_schedule(self, new_reqs, resumed_reqs, running_reqs,
                                         preempted_reqs, req_to_new_blocks, num_scheduled_tokens)

    return MyScheduler


class _AlternativeScheduler(Scheduler):
    """Correct, written otherwise: a for loop over a snapshot of running (a
    victim taken out is skipped), the budget as what is spent so far."""

    def schedule(self) -> SchedulerOutput:
        new_reqs, resumed_reqs, running_reqs, preempted = [], [], [], []
        blocks_of, tokens_of = {}, {}
        spent, limit = 0, self.max_num_scheduled_tokens
        manager = self.kv_cache_manager
        for request in list(self.running):
            if spent == limit:
                break
            if request not in self.running:
                continue  # preempted by an earlier request of this loop
            n = min(request.num_tokens - request.num_computed_tokens, limit - spent)
            blocks = manager.allocate_slots(request, n)
            while blocks is None:
                if self.policy == SchedulingPolicy.PRIORITY:
                    victim = sorted(self.running, key=lambda r: (r.priority, r.arrival_time))[-1]
                else:
                    victim = self.running[-1]
                self.running.remove(victim)
                if victim.request_id in tokens_of:
                    spent -= tokens_of.pop(victim.request_id)
                    del blocks_of[victim.request_id]
                    running_reqs.remove(victim)
                self._preempt_request(victim)
                preempted.append(victim)
                if victim is request:
                    break
                blocks = manager.allocate_slots(request, n)
            if blocks is None:
                break
            running_reqs.append(request)
            blocks_of[request.request_id], tokens_of[request.request_id] = blocks, n
            spent += n
        while not preempted and self.waiting and spent < limit \
                and len(self.running) < self.max_num_running_reqs:
            request = self.waiting.peek_request()
            hit_blocks, hit = manager.get_computed_blocks(request)
            want = request.num_tokens - hit
            if want > limit - spent and not self.scheduler_config.enable_chunked_prefill:
                break
            n = min(want, limit - spent)
            whole = self.scheduler_config.scheduler_reserve_full_isl
            if manager.allocate_slots(request, n, hit, hit_blocks, whole) is None:
                break
            request = self.waiting.pop_request()
            (resumed_reqs if request.status == RequestStatus.PREEMPTED else new_reqs).append(
                request)
            self.running.append(request)
            request.status, request.num_computed_tokens = RequestStatus.RUNNING, hit
            request.num_cached_tokens = hit if request.num_cached_tokens < 0 else \
                request.num_cached_tokens
            blocks_of[request.request_id] = manager.get_blocks(request.request_id)
            tokens_of[request.request_id] = n
            spent += n
        return day15.finish_schedule(self, new_reqs, resumed_reqs, running_reqs, preempted,
                                     blocks_of, tokens_of)


@pytest.mark.slow
@pytest.mark.parametrize("answer", [_scheduler(), _AlternativeScheduler],
                         ids=["solution", "other"])
def test_exercise_2_passes(answer, capsys):
    day15.exercise_2(answer)
    assert capsys.readouterr().out == "Day 15, exercise 2: passed\n"


@pytest.mark.slow
@pytest.mark.parametrize("mistake, message", [
    ("waiting_first", "V1 serves the RUNNING requests first"),
    ("admit_after_preemption", "After a preemption V1 admits no WAITING request"),
    ("preempt_head", "the HEAD of self.running"),
    ("no_chunk", "V1 chunks by default"),
    ("no_cut_running", "more than the token budget max_num_batched_tokens=32"),
    ("no_max_seqs", "stop admitting WAITING requests once len(self.running)"),
    ("resumed_as_new", "it is resumed, not new"),
    ("new_blocks_only", "all its blocks, cached prefix included"),
    ("forget_computed", "must be its prefix hit before the step"),
    ("skip_ahead", "stops the loop (break), even if a shorter one behind it would fit"),
    ("ignore_unchunked", "with enable_chunked_prefill=False"),
    ("no_break_self", "if preempted_req is request: break"),
    ("no_budget_return", "its tokens were not given back to the budget"),
    ("no_index_fix", "was running and was skipped"),
    ("keep_scheduled", "is still in its batch"),
    ("fcfs_only", "the running request with the largest (priority, arrival_time)"),
    ("no_full_isl", "admits a WAITING request only if its whole prompt fits"),
])
def test_exercise_2_rejects(mistake, message):
    with pytest.raises(AssertionError, match=re.escape(message)):
        day15.exercise_2(_scheduler(**{mistake: True}))


def test_exercise_2_rejects_a_crash_with_a_hint():
    class Crashing(Scheduler):
        def schedule(self):
            return self.missing_helper()

    with pytest.raises(AssertionError, match=re.escape("your scheduler raised AttributeError")):
        day15.exercise_2(Crashing)


def test_exercise_2_wants_a_v1_scheduler_class():
    from minivllm.core.scheduler import Scheduler as ClassicScheduler

    with pytest.raises(AssertionError, match="minivllm.v1.core.sched.scheduler.Scheduler"):
        day15.exercise_2(ClassicScheduler)


# -- exercise 3: the prefix-hit cap and the block count ------------------------------------------


def _hits(num_tokens, block_size, cached, *, no_cap=False, cap_wrong=False, no_stop=False,
          token_cap=False):
    if no_cap:
        limit = num_tokens // block_size
    elif cap_wrong:
        limit = num_tokens // block_size - 1
    else:
        limit = (num_tokens - 1) // block_size
    if no_stop:
        return sum(cached[:limit]) * block_size
    hits = 0
    for is_cached in cached[: len(cached) if token_cap else limit]:
        if not is_cached:
            break
        hits += 1
    return min(hits * block_size, num_tokens - 1) if token_cap else hits * block_size


def _hits_alternative(num_tokens, block_size, cached):
    """Correct, written otherwise: the index of the first miss."""
    usable = cached[: (num_tokens - 1) // block_size] + [False]
    return usable.index(False) * block_size


def _blocks(computed, hit, new, held, block_size, *, forget_held=False, forget_hit=False,
            floor=False, only_new=False):
    if only_new:
        return cdiv(new, block_size)
    total = computed + hit + new
    needed = total // block_size if floor else cdiv(total, block_size)
    return needed - (0 if forget_held else held) - (0 if forget_hit else hit // block_size)


def _blocks_alternative(computed, hit, new, held, block_size):
    """Correct, written otherwise: slots left in the held and hit blocks."""
    room = (held + hit // block_size) * block_size - computed - hit
    return max(0, -(-(new - room) // block_size))


@pytest.mark.slow
@pytest.mark.parametrize("hits, blocks", [(_hits, _blocks),
                                          (_hits_alternative, _blocks_alternative)],
                         ids=["solution", "other"])
def test_exercise_3_passes(hits, blocks, capsys):
    day15.exercise_3(hits, blocks)
    assert capsys.readouterr().out == "Day 15, exercise 3: passed\n"


@pytest.mark.parametrize("mistake, message", [
    ("no_cap", "the hit is capped at num_tokens - 1 tokens"),
    ("cap_wrong", "should be 32, got 16: 40 tokens, both full blocks cached"),
    ("no_stop", "a hit stops at the first block that is not cached"),
    ("token_cap", "31 is not a whole number of blocks"),
])
def test_exercise_3_rejects_hits(mistake, message):
    with pytest.raises(AssertionError, match=re.escape(message)):
        day15.exercise_3(lambda *a: _hits(*a, **{mistake: True}), _blocks)


@pytest.mark.parametrize("mistake, message", [
    ("forget_held", "you did not subtract the blocks the request already holds"),
    ("forget_hit", "you did not subtract the cached blocks"),
    ("floor", "round up (cdiv), not down"),
    ("only_new", "count the blocks the request's TOTAL needs"),
])
def test_exercise_3_rejects_blocks(mistake, message):
    with pytest.raises(AssertionError, match=re.escape(message)):
        day15.exercise_3(_hits, lambda *a: _blocks(*a, **{mistake: True}))


def test_exercise_3_rejects_no_return():
    with pytest.raises(AssertionError, match=re.escape("did you forget the `return`?")):
        day15.exercise_3(lambda *a: None, _blocks)


def test_an_unfinished_exercise_2_stays_unfinished():
    """The lab's stub raises NotImplementedError inside the engine: the
    checker lets it through (the lab's cell waits for the learner)."""

    class Unfinished(Scheduler):
        def schedule(self):
            raise NotImplementedError("Day 15, exercise 2")

    with pytest.raises(NotImplementedError):
        day15.exercise_2(Unfinished)

"""Checkers for day 15, from V0 to V1: one token budget
(labs/day15_v0_to_v1.ipynb).

Every workload runs on the real V1 engine (`LLM(use_v1=True)`, the shipped
model, greedy): the reference scheduler beside the learner's, which the
engine installs through `scheduler_cls=`. `run_v1` records each step's
SchedulerOutput and the queues around it; each checker prints one line, or
raises AssertionError saying what was expected, what came back, and why.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field

from minivllm import LLM, SamplingParams
from minivllm.utils import cdiv
from minivllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from minivllm.v1.core.sched.output import NewRequestData, SchedulerOutput
from minivllm.v1.core.sched.scheduler import Scheduler
from minivllm.v1.engine import EngineCoreEventType
from minivllm.v1.request import Request
from tools.labs.checks._common import is_unfinished, passed
from tools.labs.checks._engine_runs import (
    BatchRecorder,
    learner_code,
    quiet_engine,
    token_prompts,
    where_it_failed,
)

DAY = 15

# -- running a workload on V1, step by step ------------------------------------------------


@dataclass
class V1Step:
    """One step of a V1 run: the queues before it (request id -> (computed,
    num_tokens), in queue order), what schedule() returned, the queues after."""

    running_before: dict[str, tuple[int, int]]
    waiting_before: dict[str, tuple[int, int]]
    num_scheduled_tokens: dict[str, int]
    new: list[str]
    resumed: list[str]
    preempted: list[str]
    blocks_sent: dict[str, list[int]]  # request id -> block ids the worker is told to add
    computed_after: dict[str, int]
    running_after: list[str]
    waiting_after: list[str]

    def table_row(self) -> dict[str, int]:
        return dict(self.num_scheduled_tokens)


class TooManySteps(AssertionError):
    """A run went on far longer than the reference's."""


@dataclass
class V1Run:
    steps: list[V1Step]
    outputs: dict[str, tuple[int, ...]]  # request id -> generated token ids
    llm: LLM
    error: BaseException | None = None
    # (allocate_slots inputs, blocks it allocated), when logged
    allocations: list[tuple[tuple[int, int, int, int, int], int]] = field(default_factory=list)

    def table(self) -> list[dict[str, int]]:
        """Per step: request id -> tokens scheduled."""
        return [s.table_row() for s in self.steps]


def engine_core(llm: LLM):
    """The in-process EngineCore of a V1 `LLM`."""
    return llm.llm_engine.engine_core.engine_core


def _states(requests) -> dict[str, tuple[int, int]]:
    return {r.request_id: (r.num_computed_tokens, r.num_tokens) for r in requests}


class _Recorder:
    """Wraps one scheduler's schedule() and records every step."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.steps: list[V1Step] = []
        self._schedule = scheduler.schedule
        scheduler.schedule = self

    def __call__(self) -> SchedulerOutput:
        s = self.scheduler
        running_before, waiting_before = _states(s.running), _states(s.waiting)
        out = self._schedule()
        cached = out.scheduled_cached_reqs
        self.steps.append(V1Step(
            running_before=running_before,
            waiting_before=waiting_before,
            num_scheduled_tokens=dict(out.num_scheduled_tokens),
            new=[r.req_id for r in out.scheduled_new_reqs],
            resumed=sorted(cached.resumed_req_ids),
            preempted=sorted(out.preempted_req_ids),
            blocks_sent=_blocks_sent(out),
            computed_after={rid: r.num_computed_tokens for rid, r in s.requests.items()},
            running_after=[r.request_id for r in s.running],
            waiting_after=[r.request_id for r in s.waiting],
        ))
        return out


def v1_llm(**engine) -> LLM:
    """A V1 engine on the shipped model, quiet."""
    with quiet_engine():
        return LLM(use_v1=True, disable_log_stats=True, **engine)


def run_v1(
    prompts: dict[str, list[int]],
    params: SamplingParams | dict[str, SamplingParams],
    *,
    arrivals: dict[str, int] | None = None,
    priorities: dict[str, int] | None = None,
    max_steps: int = 200,
    catch: bool = False,
    **engine,
) -> V1Run:
    """Run requests (id -> prompt token ids) on a fresh V1 engine, one
    `step()` at a time; a request in `arrivals` is added before that step
    (the others before step 0), with its priority from `priorities` (0).
    Stops after `max_steps` steps with the run's `error` set (a scheduler
    that never lets requests finish); with `catch`, an exception from a step
    also ends the run as its `error`."""
    return run_v1_on(v1_llm(**engine), prompts, params, arrivals=arrivals,
                     priorities=priorities, max_steps=max_steps, catch=catch)


def run_v1_on(
    llm: LLM,
    prompts: dict[str, list[int]],
    params: SamplingParams | dict[str, SamplingParams],
    *,
    arrivals: dict[str, int] | None = None,
    priorities: dict[str, int] | None = None,
    max_steps: int = 200,
    catch: bool = False,
) -> V1Run:
    """`run_v1` on an engine already built."""
    engine_obj = llm.llm_engine
    recorder = _Recorder(engine_core(llm).scheduler)
    arrivals = arrivals or {}
    pending = {rid: arrivals.get(rid, 0) for rid in prompts}
    outputs: dict[str, tuple[int, ...]] = {}
    step = 0
    while pending or engine_obj.has_unfinished_requests():
        for rid in [r for r, at in pending.items() if at <= step]:
            p = params[rid] if isinstance(params, dict) else params
            priority = (priorities or {}).get(rid, 0)
            engine_obj.add_request(rid, {"prompt_token_ids": prompts[rid]}, p, priority=priority)
            del pending[rid]
        if step >= max_steps:
            return V1Run(recorder.steps, outputs, llm, TooManySteps(
                f"the engine ran {max_steps} steps without finishing, far more than the "
                "reference needs: requests are kept waiting or preempted forever"))
        try:
            request_outputs = engine_obj.step()
        except Exception as error:
            if not catch or is_unfinished(error):
                raise  # an unfinished exercise stays one
            return V1Run(recorder.steps, outputs, llm, error)
        for out in request_outputs:
            if out.finished:
                outputs[out.request_id] = tuple(out.outputs[0].token_ids)
        step += 1
    return V1Run(recorder.steps, outputs, llm)


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def named_prompts(lengths: dict[str, int], **kw) -> dict[str, list[int]]:
    return dict(zip(lengths, token_prompts(list(lengths.values()), **kw), strict=True))


# -- the classic engine, for the side-by-side table ------------------------------------------


def classic_table(
    prompts: dict[str, list[int]],
    params: SamplingParams,
    *,
    arrivals: dict[str, int] | None = None,
    **engine,
) -> list[dict[str, int]]:
    """The same workload as `run_v1` on the classic engine (minivllm/core/):
    per step, request id -> tokens it computed."""
    with quiet_engine():
        llm = LLM(disable_log_stats=True, **engine)
    engine_obj, batch = llm.llm_engine, BatchRecorder()
    engine_obj.add_step_observer(batch)
    arrivals = arrivals or {}
    pending = {rid: arrivals.get(rid, 0) for rid in prompts}
    step = 0
    while pending or engine_obj.has_unfinished_requests():
        for rid in [r for r, at in pending.items() if at <= step]:
            engine_obj.add_request(rid, {"prompt_token_ids": prompts[rid]}, params)
            del pending[rid]
        engine_obj.step()
        step += 1
    return batch.steps


def format_tables(tables: dict[str, list[dict[str, int]]], names: list[str]) -> str:
    """Side by side: one column per engine, one line per step; a cell lists
    each request's tokens (blank: not in the step)."""
    width = max(8, max(len(k) for k in tables))
    cells = {
        k: [" ".join(f"{r}{t[r]:<3d}" if r in t else "    " for r in names).rstrip() for t in v]
        for k, v in tables.items()
    }
    width = max(width, *(len(c) for v in cells.values() for c in v))
    lines = [("step  " + "  ".join(f"{k:<{width}}" for k in tables)).rstrip()]
    for i in range(max(len(v) for v in tables.values())):
        row = [cells[k][i] if i < len(cells[k]) else "(done)" for k in tables]
        lines.append(f"{i:>4}  " + "  ".join(f"{c:<{width}}" for c in row).rstrip())
    return "\n".join(lines)


# -- exercise 1: the token budget by hand ----------------------------------------------------

# A 50-, a 30- and a 10-token prompt; D (12 tokens) arrives before step 3.
# 32 tokens a step, 3 tokens each, blocks and sequence slots plentiful.
BUDGET_LENS = {"A": 50, "B": 30, "C": 10, "D": 12}
BUDGET_ARRIVALS = {"D": 3}
BUDGET_MAX_TOKENS = 3
BUDGET_ENGINE = dict(block_size=16, num_gpu_blocks_override=64, max_num_batched_tokens=32,
                     max_num_seqs=8, max_model_len=128)


@functools.cache
def _budget_run() -> V1Run:
    return run_v1(named_prompts(BUDGET_LENS), _greedy(BUDGET_MAX_TOKENS),
                  arrivals=BUDGET_ARRIVALS, **BUDGET_ENGINE)


def budget_table() -> list[dict[str, int]]:
    """The real V1 scheduler's steps on exercise 1's workload."""
    return _budget_run().table()


def explain_step(step: V1Step, budget: int) -> str:
    """How one step's budget was handed out, request by request (a workload
    with no prefix hits and no preemption)."""
    left, lines = budget, []
    for queue, states in (("running", step.running_before), ("waiting", step.waiting_before)):
        for rid, (computed, total) in states.items():
            got = step.num_scheduled_tokens.get(rid, 0)
            missing = total - computed
            if left == 0:
                lines.append(f"{rid} ({queue}) gets nothing: the budget is spent")
                continue
            what = (f"{rid} is running, {computed} of its {total} tokens computed"
                    if queue == "running" else f"{rid} is waiting, {total} tokens to compute")
            line = f"{what}: min({missing}, {left} left) = {got}"
            if got == missing:
                line += " (it reaches its last known token: the step samples its next one)"
            lines.append(line)
            left -= got
    return "\n".join(f"  {line}" for line in lines)


def _normalized_table(table) -> list[dict[str, int]]:
    assert isinstance(table, (list, tuple)) and all(isinstance(s, dict) for s in table), (
        "return a list with one dict per step, request name -> tokens, e.g. "
        f"[{{'A': 32}}, {{'A': 18, 'B': 14}}, ...]; got {table!r}"
    )
    return [{k: v for k, v in step.items() if v} for step in table]


def exercise_1(table) -> None:
    """The learner's per-step token table for the budget workload, against V1."""
    mine = _normalized_table(table)
    run = _budget_run()
    want = run.table()
    last_step = {rid: max(i for i, s in enumerate(want) if rid in s) for rid in BUDGET_LENS}
    budget = BUDGET_ENGINE["max_num_batched_tokens"]
    for i, (theirs, step) in enumerate(zip(want, run.steps, strict=False)):
        if i >= len(mine):
            break
        if mine[i] == theirs:
            continue
        notes = []
        if sum(mine[i].values()) > budget:
            notes.append(f"your step {i} computes {sum(mine[i].values())} tokens: a step never "
                         f"spends more than the budget, max_num_batched_tokens={budget}")
        for rid in mine[i]:
            if rid in last_step and i > last_step[rid]:
                notes.append(f"{rid} is finished by step {i}: its {BUDGET_MAX_TOKENS} tokens were "
                             f"sampled by step {last_step[rid]} (max_tokens={BUDGET_MAX_TOKENS})")
            elif rid in BUDGET_ARRIVALS and i < BUDGET_ARRIVALS[rid]:
                notes.append(f"{rid} arrives before step {BUDGET_ARRIVALS[rid]}, not earlier")
        early = [r for r in step.waiting_before if mine[i].get(r, 0) > theirs.get(r, 0)]
        late = [r for r in step.running_before if mine[i].get(r, 0) < theirs.get(r, 0)]
        if early and late:
            notes.append(f"{', '.join(late)} (running) must be served before {', '.join(early)} "
                         "(waiting): V1 hands the budget to the RUNNING requests first")
        chunked = [r for r in theirs if r in step.waiting_before
                   and theirs[r] < step.waiting_before[r][1] and r not in mine[i]]
        if chunked:
            notes.append(f"{chunked[0]} does not wait for a step with room for its whole prompt: "
                         "V1 chunks by default, giving it what is left of the budget")
        note = "".join(f"\nNote: {n}." for n in notes)
        raise AssertionError(
            f"Step {i}: the V1 scheduler computes {theirs}, your table says {mine[i]}.\n"
            f"How step {i}'s {budget} tokens are handed out (running first, then waiting, "
            f"each request's missing tokens cut to what is left):\n"
            f"{explain_step(step, budget)}{note}"
        )
    assert len(mine) == len(want), (
        f"The V1 scheduler needs {len(want)} steps for this workload, your table has "
        f"{len(mine)}. " + (
            f"Step {len(mine)} is missing: {want[len(mine)]}." if len(mine) < len(want) else
            "Every request has generated its tokens by then; there is no step after that."
        ) + " A request samples a token in every step that reaches the end of its known tokens, "
        f"and finishes with its {BUDGET_MAX_TOKENS}rd."
    )
    passed(DAY, 1)


# -- exercise 2: schedule(), in the engine ------------------------------------------------


class ScheduleRuleBroken(AssertionError):
    """finish_schedule found a step no V1 scheduler may return."""


def finish_schedule(
    scheduler: Scheduler,
    scheduled_new_reqs: list[Request],
    scheduled_resumed_reqs: list[Request],
    scheduled_running_reqs: list[Request],
    preempted_reqs: list[Request],
    req_to_new_blocks: dict[str, KVCacheBlocks],
    num_scheduled_tokens: dict[str, int],
) -> SchedulerOutput:
    """The end of V1's `Scheduler.schedule()` (reference_impl/minivllm/v1/core/
    sched/scheduler.py), for the lab's `schedule()`: check the step's limits,
    record each admitted request's SCHEDULED event (its queue time), build
    the SchedulerOutput (the diff the worker applies), and advance every
    scheduled request's num_computed_tokens (`_update_after_schedule`)."""
    total = sum(num_scheduled_tokens.values())
    budget = scheduler.max_num_scheduled_tokens
    if total > budget:
        over = {rid: n for rid, n in num_scheduled_tokens.items() if n > 1}
        raise ScheduleRuleBroken(
            f"this step schedules {total} tokens ({num_scheduled_tokens}), more than the token "
            f"budget max_num_batched_tokens={budget} (prefills and chunks here: {over}). Every "
            "request gets min(what it is missing, token_budget), running or waiting, and "
            "token_budget goes down by what it got"
        )
    if len(scheduler.running) > scheduler.max_num_running_reqs:
        raise ScheduleRuleBroken(
            f"{len(scheduler.running)} requests are running after this step, more than "
            f"max_num_seqs={scheduler.max_num_running_reqs}: stop admitting WAITING requests "
            "once len(self.running) == self.max_num_running_reqs"
        )
    for rid, n in num_scheduled_tokens.items():
        request = scheduler.requests[rid]
        if n <= 0 or request.num_computed_tokens + n > request.num_tokens:
            raise ScheduleRuleBroken(
                f"request {rid} is scheduled for {n} tokens with {request.num_computed_tokens} "
                f"of its {request.num_tokens} computed: a request gets between 1 and "
                "num_tokens - num_computed_tokens tokens"
            )
    now = time.time()
    for request in [*scheduled_new_reqs, *scheduled_resumed_reqs]:
        request.record_event(EngineCoreEventType.SCHEDULED, now)
    output = SchedulerOutput(
        scheduled_new_reqs=[
            NewRequestData.from_request(r, req_to_new_blocks[r.request_id].get_block_ids())
            for r in scheduled_new_reqs
        ],
        scheduled_cached_reqs=scheduler._make_cached_request_data(
            scheduled_running_reqs, scheduled_resumed_reqs, req_to_new_blocks
        ),
        num_scheduled_tokens=num_scheduled_tokens,
        total_num_scheduled_tokens=total,
        num_common_prefix_blocks=(
            scheduler.kv_cache_manager.get_num_common_prefix_blocks(scheduler.running[0].request_id)
            if scheduler.running
            else 0
        ),
        # This step's victims, and any preempted since the last step.
        preempted_req_ids=scheduler.reset_preempted_req_ids
        | {r.request_id for r in preempted_reqs},
        finished_req_ids=scheduler.finished_req_ids,
    )
    scheduler.reset_preempted_req_ids = set()
    scheduler.prev_step_scheduled_req_ids = set(num_scheduled_tokens)
    scheduler._update_after_schedule(output)
    return output


# The fields of a step compared with the reference's, in this order.
_FIELDS = ("num_scheduled_tokens", "preempted", "new", "resumed", "blocks_sent",
           "computed_after", "running_after", "waiting_after")

_FIELD_HINTS = {
    "num_scheduled_tokens": "each RUNNING request in order gets min(num_tokens - "
    "num_computed_tokens, token_budget); then, if nothing was preempted, each WAITING request in "
    "order gets min(num_tokens - its prefix hit, token_budget), until the budget is spent, a "
    "request does not fit, or max_num_seqs requests run",
    "preempted": "when allocate_slots returns None for a running request, preempt "
    "self.running.pop() (the tail) with self._preempt_request, and try again; stop when the "
    "victim is the request itself",
    "new": "a request admitted with status WAITING is new (scheduled_new_reqs); one with status "
    "PREEMPTED is resumed (scheduled_resumed_reqs): the worker already knows it",
    "resumed": "a request admitted with status PREEMPTED goes in scheduled_resumed_reqs",
    "blocks_sent": "req_to_new_blocks says which blocks the worker adds: for a RUNNING "
    "request the blocks allocate_slots returned; for an admitted WAITING request all its "
    "blocks, cached prefix included (self.kv_cache_manager.get_blocks(request.request_id)), "
    "since the worker builds its block table from scratch",
    "computed_after": "an admitted request's num_computed_tokens must be its prefix hit before "
    "the step (request.num_computed_tokens = num_computed_tokens); finish_schedule then adds "
    "what the step computes",
    "running_after": "an admitted request joins the tail of self.running "
    "(self.running.append); a victim leaves it (self.running.pop()); nothing else moves",
    "waiting_after": "an admitted request leaves the waiting queue with "
    "self.waiting.pop_request(); a victim goes back to its front through "
    "self._preempt_request, which puts it there itself",
}


def _step_field(step: V1Step, name: str):
    return getattr(step, name)


_TAKE_BACK = (
    "take it back: remove it from scheduled_running_reqs, give its tokens back "
    "(token_budget += num_scheduled_tokens.pop(victim.request_id)), drop its "
    "req_to_new_blocks entry, and step req_index back by one (self.running just lost a "
    "request before it)"
)


def _schedule_hint(name: str, ref: V1Step, got: V1Step, engine: dict) -> str:
    """The likely mistake behind the first field that differs."""
    want, have = ref.num_scheduled_tokens, got.num_scheduled_tokens
    waiting, running = list(ref.waiting_before), list(ref.running_before)
    priority = engine.get("scheduling_policy") == "priority"
    if got.preempted and set(got.preempted) != set(ref.preempted):
        if priority and ref.preempted:
            return (
                f"you preempted {got.preempted}, the reference {ref.preempted}. With "
                "scheduling_policy='priority' the victim is the running request with the "
                "largest (priority, arrival_time): max(self.running, key=lambda r: "
                "(r.priority, r.arrival_time)), taken out with self.running.remove(victim)"
            )
        if running and got.preempted[0] == running[0] and running[0] not in ref.preempted:
            return (
                f"you preempted {running[0]}, the HEAD of self.running (the oldest request); "
                f"V1 preempts the TAIL, self.running.pop() (here {ref.preempted}): the newest "
                "request has the least work to lose"
            )
    victims = set(got.preempted)
    readmitted = [r for r in have if r in got.resumed and r in victims]
    admitted = [r for r in have if r in waiting]
    if victims and (readmitted or admitted):
        return (
            f"this step preempted {sorted(victims)} and then admitted "
            f"{readmitted + admitted}. After a preemption V1 admits no WAITING request in the "
            "same step (if not preempted_reqs: ...): the blocks just freed are for the running "
            "requests and, later, for the victims to come back to"
        )
    in_batch = sorted(victims & set(have))
    if in_batch:
        return (
            f"{in_batch[0]} was preempted in this step and is still in its batch. A victim "
            "computes nothing this step: if it is the request being scheduled, stop (if "
            "preempted_req is request: break) and leave the RUNNING loop; if it was scheduled "
            f"earlier in this step (possible with the priority policy), {_TAKE_BACK}"
        )
    if set(got.preempted) != set(ref.preempted):
        return _FIELD_HINTS["preempted"]
    if name == "num_scheduled_tokens":
        if priority and ref.preempted:
            skipped = [r for r in running if r in want and r not in have and r not in victims]
            if skipped:
                return (
                    f"{skipped[0]} was running and was skipped: the victim "
                    f"{ref.preempted[0]} sat before it in self.running and was scheduled "
                    f"earlier in the step; after self.running.remove(victim), {_TAKE_BACK}"
                )
            if sum(have.values()) < sum(want.values()):
                return (
                    f"the victim {ref.preempted[0]} had been scheduled earlier in this step; "
                    f"its tokens were not given back to the budget. When you preempt such a "
                    f"request, {_TAKE_BACK}"
                )
        early = [r for r in waiting if have.get(r, 0) > want.get(r, 0)]
        late = [r for r in running if have.get(r, 0) < want.get(r, 0)]
        if early and late:
            return (
                f"{late[0]} is RUNNING and got {have.get(late[0], 0)} tokens instead of "
                f"{want[late[0]]}, while the WAITING {early[0]} got {have.get(early[0], 0)}: "
                "V1 serves the RUNNING requests first, then the WAITING ones with what is left"
            )
        chunk = engine.get("enable_chunked_prefill", True)
        for r in waiting:
            if chunk and r in want and r not in have and want[r] < ref.waiting_before[r][1]:
                return (
                    f"{r} is WAITING with {ref.waiting_before[r][1]} tokens and only "
                    f"{want[r]} of the budget left: V1 chunks by default. Cut its tokens to the "
                    "budget left (min(num_new_tokens, token_budget)) instead of making it wait"
                )
            if not chunk and r in have and r not in want:
                return (
                    f"with enable_chunked_prefill=False a WAITING request whose tokens exceed "
                    f"the budget left waits for a later step (break); {r} was cut to "
                    f"{have[r]} tokens instead"
                )
        reserve = engine.get("scheduler_reserve_full_isl", True)
        for r in waiting:
            computed, tokens = ref.waiting_before[r]
            if chunk and reserve and r not in want and 0 < have.get(r, 0) < tokens - computed:
                return (
                    f"{r} was admitted with {have[r]} of its {tokens} tokens, but the free "
                    "blocks cannot hold all of them: V1 admits a WAITING request only if its "
                    "whole prompt fits (allocate_slots(..., full_sequence_must_fit=self."
                    "scheduler_config.scheduler_reserve_full_isl)), or it runs short of blocks "
                    "at a later chunk and preempts"
                )
        jumped = [r for r in waiting if r in have and r not in want]
        if jumped:
            first = next((r for r in waiting if r not in want), None)
            if first is not None and waiting.index(first) < waiting.index(jumped[0]):
                return (
                    f"{first} could not be scheduled (no room for its blocks), and {jumped[0]}, "
                    "behind it, was admitted: first come, first served. The first WAITING "
                    "request that cannot be scheduled stops the loop (break), even if a "
                    "shorter one behind it would fit"
                )
    if name == "new" and set(have) == set(want):
        back = sorted(set(got.new) & set(ref.resumed))
        if back:
            return (
                f"{back[0]} was preempted before (its status is PREEMPTED): it is resumed, "
                "not new. A resumed request goes in scheduled_resumed_reqs; only a request "
                "with status WAITING goes in scheduled_new_reqs"
            )
    return _FIELD_HINTS.get(name, "compare the two runs step by step")


def _describe(step: V1Step) -> str:
    queues = (f"running {list(step.running_before)}, waiting {list(step.waiting_before)}; "
              "computed/tokens: " + ", ".join(
                  f"{r} {c}/{n}" for r, (c, n) in {**step.running_before,
                                                   **step.waiting_before}.items()))
    return queues


def compare_v1_runs(ref: V1Run, got: V1Run, label: str, engine: dict, hint_for) -> None:
    """AssertionError naming the first step and field where the learner's run
    differs from the reference's, with a hint; then the steps' count and the
    generated tokens."""
    for i, (r, g) in enumerate(zip(ref.steps, got.steps, strict=False)):
        for name in _FIELDS:
            want, have = _step_field(r, name), _step_field(g, name)
            if want != have:
                raise AssertionError(
                    f"{label}: step {i}'s {name} differ from the reference V1 scheduler's.\n"
                    f"  reference: {want}\n  yours:     {have}\n"
                    f"Before the step: {_describe(r)}.\n"
                    f"Hint: {hint_for(name, r, g, engine)}."
                )
    if got.error is not None:
        error = got.error
        if isinstance(error, (ScheduleRuleBroken, TooManySteps)):
            raise AssertionError(f"{label}: step {len(got.steps)}: {error}.") from error
        raise AssertionError(
            f"{label}: step {len(got.steps)}: your scheduler raised {type(error).__name__}: "
            f"{error}, {where_it_failed(error)}.\nHint: {_error_hint(error)}."
        ) from error
    assert len(got.steps) == len(ref.steps), (
        f"{label}: the reference needs {len(ref.steps)} steps, yours {len(got.steps)}, although "
        "every step you both ran agreed."
    )
    assert got.outputs == ref.outputs, (
        f"{label}: every step agreed with the reference, but the generated tokens differ:\n"
        f"  reference: {ref.outputs}\n  yours:     {got.outputs}\nHint: the worker was told "
        f"something else than it needed: {_FIELD_HINTS['blocks_sent']}."
    )


def _blocks_sent(out: SchedulerOutput) -> dict[str, list[int]]:
    sent = {r.req_id: list(r.block_ids) for r in out.scheduled_new_reqs}
    cached = out.scheduled_cached_reqs
    sent.update({rid: list(ids) for rid, ids in zip(cached.req_ids, cached.new_block_ids,
                                                    strict=True)})
    return sent


def _error_hint(error: BaseException) -> str:
    if isinstance(error, IndexError) and "pop from empty list" in str(error):
        return (
            "self.running.pop() on an empty list: stop preempting when the victim is the request "
            "being scheduled itself (if preempted_req is request: break), and then stop the "
            "RUNNING loop: that request cannot run this step"
        )
    if isinstance(error, KeyError):
        return (
            f"no entry for request {error}: every scheduled request needs "
            "req_to_new_blocks[request_id] and num_scheduled_tokens[request_id]"
        )
    if isinstance(error, ValueError) and "num_new_tokens must be > 0" in str(error):
        return (
            "allocate_slots was asked for 0 tokens: schedule a request only while token_budget "
            "> 0 (the loops' conditions) and only if it is missing tokens"
        )
    return (
        "run the failing workload with check.run_v1(..., scheduler_cls=YourClass) and print "
        "its steps"
    )


@dataclass
class Workload:
    label: str
    lens: dict[str, int] | None  # request -> prompt length (None: prefix_prompts())
    engine: dict
    max_tokens: int | dict[str, int]
    focus: str  # what the workload is there to show
    arrivals: dict[str, int] = field(default_factory=dict)
    priorities: dict[str, int] = field(default_factory=dict)

    def params(self) -> SamplingParams | dict[str, SamplingParams]:
        if isinstance(self.max_tokens, int):
            return _greedy(self.max_tokens)
        return {rid: _greedy(n) for rid, n in self.max_tokens.items()}

    def run(self, **kw) -> V1Run:
        """On a fresh V1 engine; `kw`: run_v1's options, scheduler_cls."""
        prompts = prefix_prompts() if self.lens is None else named_prompts(self.lens)
        return run_v1(prompts, self.params(), arrivals=self.arrivals,
                      priorities=self.priorities, **self.engine, **kw)


def _engine(blocks: int, budget: int, max_model_len: int = 96, **kw) -> dict:
    return dict(block_size=16, num_gpu_blocks_override=blocks, max_num_batched_tokens=budget,
                max_num_seqs=kw.pop("max_num_seqs", 8), max_model_len=max_model_len, **kw)


SCHEDULE_WORKLOADS = [
    Workload(
        "the token budget: A 50, B 30, C 10 and (from step 3) D 12 tokens, 32 tokens a step",
        BUDGET_LENS, BUDGET_ENGINE, BUDGET_MAX_TOKENS,
        "the RUNNING requests are served first, each cut to the budget left; then the WAITING "
        "ones, the last admitted cut to what is left (chunked prefill, by default).",
        arrivals=BUDGET_ARRIVALS),
    Workload(
        "a long prompt in chunks: B (10 tokens) decodes while A (100 tokens) is prefilled, "
        "32 tokens a step",
        {"B": 10, "A": 100}, _engine(32, 32, 128), 4,
        "a RUNNING request still prefilling gets the rest of its prompt cut to the budget "
        "left, step after step, beside the decodes."),
    Workload(
        "preemption: A, B and C (30 tokens each) grow to 50 in 7 blocks of 16",
        {"A": 30, "B": 30, "C": 30}, _engine(8, 64), 20,
        "when a running request needs a block and none is free, the TAIL of running is "
        "preempted (C at step 3, then B at step 19), by recompute; B comes back RESUMED "
        "and finds its blocks in the prefix cache."),
    Workload(
        "priority preemption: L (priority 1), then H and P (priority 0) in 6 blocks of 16, "
        "34 tokens a step, admitting by first chunk (scheduler_reserve_full_isl=False)",
        {"L": 31, "H": 32, "P": 80},
        _engine(7, 34, scheduling_policy="priority", scheduler_reserve_full_isl=False),
        {"L": 6, "H": 6, "P": 3},
        "with scheduling_policy='priority' the victim is the lowest-priority request, even "
        "one already scheduled in this step (L at step 2), whose tokens and place go back.",
        arrivals={"H": 1, "P": 1}, priorities={"L": 1}),
    Workload(
        "no admission after a preemption: L (priority 1), H, P, and W (8 tokens, priority 0) "
        "arriving in the step that preempts L, admitting by first chunk "
        "(scheduler_reserve_full_isl=False)",
        {"L": 31, "H": 31, "P": 100, "W": 8},
        _engine(12, 64, 128, scheduling_policy="priority", scheduler_reserve_full_isl=False),
        {"L": 6, "H": 6, "P": 3, "W": 3},
        "W is at the head of the waiting queue (priority 0) and would fit in the blocks L "
        "frees at step 3, but a step that preempted admits nobody: W waits for step 4.",
        arrivals={"H": 1, "P": 2, "W": 3}, priorities={"L": 1}),
    Workload(
        "prefix hits: S (40 tokens), then T (S's first 32 tokens and 10 more) and U (S's "
        "first 32 tokens exactly)",
        None, _engine(32, 64), 4,
        "an admitted request starts from its prefix hit: num_computed_tokens is set to the "
        "cached tokens, and the worker is sent all its blocks, the cached ones included.",
        arrivals={"T": 2, "U": 2}),
    Workload(
        "max_num_seqs=2: four 12-token prompts",
        {"A": 12, "B": 12, "C": 12, "D": 12}, _engine(32, 64, max_num_seqs=2), 3,
        "at most max_num_seqs requests run: WAITING requests are admitted only while "
        "len(self.running) < self.max_num_running_reqs."),
    Workload(
        "first come, first served: A (100 tokens) runs, B (60) and C (10) wait for 9 blocks",
        {"A": 100, "B": 60, "C": 10}, _engine(10, 128, 128), 6,
        "B needs 4 blocks and only 2 are free: it waits, and C, behind it, waits too although "
        "its 1 block would fit.",
        arrivals={"B": 1, "C": 1}),
    Workload(
        "enable_chunked_prefill=False: A (40 tokens), B (30), 64 tokens a step",
        {"A": 40, "B": 30}, _engine(32, 64, 64, enable_chunked_prefill=False), 3,
        "without chunked prefill a WAITING request whose tokens exceed the budget left waits "
        "for a step with room for all of them (break)."),
    Workload(
        "room for the whole prompt: A (30 tokens) runs in 4 blocks of 16, B (40 tokens) "
        "arrives at step 1, 32 tokens a step",
        {"A": 30, "B": 40}, _engine(5, 32, 64), {"A": 4, "B": 3},
        "a WAITING request is admitted only if the free blocks hold its whole prompt, not "
        "only this step's chunk (allocate_slots(..., full_sequence_must_fit=self."
        "scheduler_config.scheduler_reserve_full_isl), on by default): B's 3 blocks are not "
        "free while A runs, so B waits, where admitting its first chunk would leave it short "
        "of blocks at its next chunk.",
        arrivals={"B": 1}),
]


def _index(label_start: str) -> int:
    return next(i for i, w in enumerate(SCHEDULE_WORKLOADS) if w.label.startswith(label_start))


BUDGET, PREEMPTION, PREFIX = _index("the token budget"), _index("preemption"), _index("prefix")


def prefix_prompts() -> dict[str, list[int]]:
    """S, and two requests that share S's first two blocks (block_size 16)."""
    (s,) = token_prompts([40])
    (tail,) = token_prompts([10], first=700)
    return {"S": s, "T": s[:32] + tail, "U": s[:32]}


def reference_run(index: int) -> V1Run:
    """Workload `index` of SCHEDULE_WORKLOADS on the reference V1 engine
    (run once, then remembered)."""
    return _reference_run(index)


@functools.cache
def _reference_run(index: int) -> V1Run:
    """Workload `index` on the reference V1 engine, its allocations logged."""
    work = SCHEDULE_WORKLOADS[index]
    llm = v1_llm(**work.engine)
    log = _AllocationLog(engine_core(llm).scheduler.kv_cache_manager)
    prompts = prefix_prompts() if work.lens is None else named_prompts(work.lens)
    run = run_v1_on(llm, prompts, work.params(), arrivals=work.arrivals,
                    priorities=work.priorities)
    run.allocations = log.calls
    return run


def _require_v1_scheduler(cls) -> None:
    if not (isinstance(cls, type) and issubclass(cls, Scheduler)):
        raise AssertionError(
            "pass your subclass of minivllm.v1.core.sched.scheduler.Scheduler itself (the "
            f"class), got {cls!r}"
        )


def check_v1_in_engine(scheduler_cls, index: int, hint_for=_schedule_hint) -> V1Run:
    """Workload `index` on the reference V1 engine and with `scheduler_cls`,
    compared step by step."""
    work = SCHEDULE_WORKLOADS[index]
    ref = _reference_run(index)
    got = work.run(max_steps=3 * len(ref.steps) + 20, catch=True, scheduler_cls=scheduler_cls)
    used = type(engine_core(got.llm).scheduler)
    assert used is scheduler_cls, (
        f"the engine should have used {scheduler_cls.__name__}, not {used.__name__}"
    )
    try:
        compare_v1_runs(ref, got, work.label, work.engine, hint_for)
    except AssertionError as error:
        raise AssertionError(f"{error}\nWhat this workload shows: {work.focus}") from error
    return got


def exercise_2(scheduler_cls) -> None:
    """`schedule()`'s two loops, inside the real V1 engine, against the reference."""
    _require_v1_scheduler(scheduler_cls)
    for index in range(len(SCHEDULE_WORKLOADS)):
        check_v1_in_engine(scheduler_cls, index)
    passed(DAY, 2)


# -- exercise 3: the prefix-hit cap and allocate_slots' arithmetic -----------------------------


def reference_cache_hit_tokens(num_tokens: int, block_size: int, cached: list[bool]) -> int:
    """Tokens a request takes from the prefix cache: its leading full blocks
    that are cached, up to the first miss, never its last token."""
    hits = 0
    for is_cached in cached[: (num_tokens - 1) // block_size]:
        if not is_cached:
            break
        hits += 1
    return hits * block_size


def reference_num_new_blocks(num_computed_tokens: int, num_new_computed_tokens: int,
                             num_new_tokens: int, num_held_blocks: int, block_size: int) -> int:
    """Blocks allocate_slots takes from the free pool for a step."""
    total = num_computed_tokens + num_new_computed_tokens + num_new_tokens
    return cdiv(total, block_size) - num_held_blocks - num_new_computed_tokens // block_size


T, F = True, False
# (num_tokens, cached, what the case shows); block_size 16
_HIT_CASES = [
    (40, [T, T], "40 tokens, both full blocks cached: 32 come from the cache, 8 are computed"),
    (32, [T, T], "32 tokens, both blocks cached: the last token must still be computed (its "
     "logits give the next token), so at most num_tokens - 1 = 31 tokens may come from the "
     "cache, and only whole blocks: 1 block, 16 tokens"),
    (33, [T, T], "33 tokens: 32 may come from the cache, the 33rd is computed"),
    (48, [T, F, T], "the second block is not cached: a hit stops at the first miss (each "
     "block's hash covers every token before it, so nothing after a miss can be reused)"),
    (50, [F, T, T], "the first block is not cached: nothing comes from the cache"),
    (17, [T], "17 tokens, the one full block cached: 16 from the cache"),
    (16, [T], "16 tokens, its one block cached: the last token must be computed, and a hit is "
     "whole blocks, so nothing comes from the cache"),
    (1, [], "a 1-token prompt has no full block"),
    (64, [T, T, T, T], "64 tokens, all 4 blocks cached: num_tokens - 1 = 63 allows 3 whole "
     "blocks"),
    (49, [T, T, T], "a request preempted after 49 tokens finds its 3 full blocks again: only "
     "its last token is recomputed"),
]

# (num_computed_tokens, num_new_computed_tokens, num_new_tokens, num_held_blocks, what)
_BLOCK_CASES = [
    (0, 0, 40, 0, "a fresh 40-token prompt, computed whole: ceil(40 / 16) blocks"),
    (0, 32, 8, 0, "a 40-token prompt whose first 32 tokens are a cache hit: the 2 cached blocks "
     "are taken into use, not allocated; only the block for tokens 32-39 is new"),
    (0, 0, 32, 0, "the first 32-token chunk of a 100-token prompt"),
    (32, 0, 32, 2, "its second 32-token chunk: it holds 2 blocks already"),
    (20, 0, 1, 2, "a decode at position 20: block 2 (slots 16-31) is held and has room"),
    (32, 0, 1, 2, "a decode at position 32: the 2 held blocks are full, it needs a third"),
    (20, 0, 10, 2, "a 10-token chunk after 20 computed tokens: the held second block has room "
     "for tokens 20-29, so nothing new (count the blocks the TOTAL needs, then subtract what "
     "is held: the new tokens first fill the held block's empty slots)"),
    (0, 48, 1, 0, "a resumed request: 48 of its 49 tokens are a cache hit (3 blocks), the last "
     "token needs a fourth block"),
    (0, 16, 16, 0, "a 32-token prompt with its first block cached (the cap keeps the second "
     "from being a hit): one new block"),
]


def _call(fn, name: str, *args):
    with learner_code(f"your `{name}`", "work the failing case out on paper, block by block"):
        got = fn(*args)
    assert isinstance(got, int) and not isinstance(got, bool), (
        f"{name}{args} should return an int, got {got!r}"
        + (": did you forget the `return`?" if got is None else "")
    )
    return got


def _hit_hint(num_tokens: int, cached: list[bool], got: int) -> str:
    bs = 16
    if got % bs:
        return (f"{got} is not a whole number of blocks: a cache hit reuses whole blocks of "
                f"{bs} tokens")
    full_run = 0
    for c in cached:
        if not c:
            break
        full_run += 1
    if got == bs * sum(cached[: (num_tokens - 1) // bs]) and F in cached:
        return "you counted every cached block; a hit stops at the first block that is not cached"
    if got == bs * min(full_run, num_tokens // bs) and got > (num_tokens - 1):
        return ("the hit is capped at num_tokens - 1 tokens: the last token is always computed, "
                "since its logits give the next token. Look at cached[: (num_tokens - 1) // "
                "block_size] only")
    if got > num_tokens - 1:
        return "never take more than num_tokens - 1 tokens from the cache"
    return "take the leading cached blocks among the first (num_tokens - 1) // block_size"


def _block_hint(args: tuple, got: int) -> str:
    computed, hit, new, held, bs = args
    total = computed + hit + new
    if got == cdiv(total, bs) - hit // bs:
        return ("you did not subtract the blocks the request already holds (num_held_blocks): "
                "they hold its computed tokens and are not allocated again")
    if got == cdiv(total, bs) - held:
        return ("you did not subtract the cached blocks (num_new_computed_tokens // block_size): "
                "a cache hit is taken into use, not allocated")
    if got == total // bs - held - hit // bs:
        return "a partly filled block is a whole block: round up (cdiv), not down"
    if got == cdiv(new, bs):
        return ("count the blocks the request's TOTAL needs (computed + cached + new tokens), "
                "then subtract those it has: new tokens first fill the empty slots of its last "
                "held block")
    return "cdiv(computed + cached + new tokens, block_size) - held blocks - cached blocks"


def _check_hits(cache_hit_tokens) -> None:
    for num_tokens, cached, why in _HIT_CASES:
        want = reference_cache_hit_tokens(num_tokens, 16, cached)
        got = _call(cache_hit_tokens, "cache_hit_tokens", num_tokens, 16, cached)
        assert got == want, (
            f"cache_hit_tokens(num_tokens={num_tokens}, block_size=16, cached={cached}) should "
            f"be {want}, got {got}: {why}.\nHint: {_hit_hint(num_tokens, cached, got)}."
        )


def _check_blocks(num_new_blocks) -> None:
    for *args, why in _BLOCK_CASES:
        args = (*args, 16)
        want = reference_num_new_blocks(*args)
        got = _call(num_new_blocks, "num_new_blocks", *args)
        names = ("num_computed_tokens", "num_new_computed_tokens", "num_new_tokens",
                 "num_held_blocks", "block_size")
        call = ", ".join(f"{n}={v}" for n, v in zip(names, args, strict=True))
        assert got == want, (
            f"num_new_blocks({call}) should be {want}, got {got}: {why}.\n"
            f"Hint: {_block_hint(args, got)}."
        )


class _AllocationLog:
    """Wraps a KVCacheManager's allocate_slots: every call's arithmetic inputs
    and how many blocks it took from the pool."""

    def __init__(self, manager: KVCacheManager) -> None:
        self.manager = manager
        self.calls: list[tuple[tuple[int, int, int, int, int], int]] = []
        self._allocate = manager.allocate_slots
        manager.allocate_slots = self

    def __call__(self, request, num_new_tokens, num_new_computed_tokens=0,
                 new_computed_blocks=None, full_sequence_must_fit=False):
        m = self.manager
        args = (request.num_computed_tokens, num_new_computed_tokens, num_new_tokens,
                len(m.req_to_blocks.get(request.request_id, [])), m.block_size)
        blocks = self._allocate(request, num_new_tokens, num_new_computed_tokens,
                                new_computed_blocks, full_sequence_must_fit)
        if blocks is not None:
            self.calls.append((args, len(blocks.blocks)))
        return blocks


@functools.cache
def engine_allocations() -> tuple[tuple[tuple[int, int, int, int, int], int], ...]:
    """Every successful allocate_slots of the real V1 engine on exercise 2's
    budget, preemption and prefix workloads: (inputs, blocks allocated)."""
    calls = [c for i in (BUDGET, PREEMPTION, PREFIX) for c in _reference_run(i).allocations]
    return tuple(dict.fromkeys(calls))


def _learner_get_computed_blocks(manager: KVCacheManager, cache_hit_tokens, request):
    """KVCacheManager.get_computed_blocks with the learner's hit count."""
    if not manager.prefix_cache_lookup_enabled(request):
        return KVCacheBlocks([]), 0
    pool = manager.block_pool
    cached = [pool.get_cached_block(h) is not None for h in request.block_hashes]
    num_computed = cache_hit_tokens(request.num_tokens, manager.block_size, cached)
    blocks = [pool.get_cached_block(h)
              for h in request.block_hashes[: num_computed // manager.block_size]]
    return KVCacheBlocks(blocks), num_computed


def hit_scheduler(cache_hit_tokens) -> type[Scheduler]:
    """V1's scheduler whose KV cache manager counts prefix hits with
    `cache_hit_tokens`."""

    class LearnerHitsScheduler(Scheduler):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            manager = self.kv_cache_manager
            manager.get_computed_blocks = functools.partial(
                _learner_get_computed_blocks, manager, cache_hit_tokens)

    return LearnerHitsScheduler


def exercise_3(cache_hit_tokens, num_new_blocks) -> None:
    """The prefix-hit cap and allocate_slots' block count: hand cases, every
    allocation of real V1 runs, and the learner's hits inside the engine."""
    _check_hits(cache_hit_tokens)
    _check_blocks(num_new_blocks)
    for args, allocated in engine_allocations():
        got = _call(num_new_blocks, "num_new_blocks", *args)
        assert got == allocated, (
            f"In a real V1 run, allocate_slots was called with num_computed_tokens={args[0]}, "
            f"num_new_computed_tokens={args[1]}, num_new_tokens={args[2]}, with "
            f"{args[3]} blocks held, and took {allocated} new blocks; your num_new_blocks "
            f"says {got}.\nHint: {_block_hint(args, got)}."
        )
    cls = hit_scheduler(cache_hit_tokens)
    for index in (PREEMPTION, PREFIX):
        try:
            check_v1_in_engine(cls, index, hint_for=_hits_in_engine_hint)
        except AssertionError as error:
            raise AssertionError(
                f"With your cache_hit_tokens inside the V1 engine's KVCacheManager:\n{error}"
            ) from error
    passed(DAY, 3)


def _hits_in_engine_hint(name, ref, got, engine) -> str:
    return (
        "the engine looked the request up with your cache_hit_tokens(request.num_tokens, "
        "block_size, cached) and got another hit than the reference: compare your function "
        "with the cases above on this request's numbers"
    )

"""Checkers for day 11, chunked prefill and latency
(labs/day11_chunked_prefill.ipynb).

Exercise 1 compares a by-hand prediction of a few steps with what the
engine's scheduler does in the same state. Exercise 2 runs the learner's
chunk-size rule (`Scheduler._get_num_new_tokens`, in a `scheduler_cls`
subclass) inside the real engine: every call is compared, on the very same
state, with the reference rule (the first that differs is described and the
likely mistake named), then every step of the run and the tokens with the
reference run. Exercise 3 checks TTFT, TPOT and the percentile on recorded
timestamps. The notebook's measurements use `simulate` (the real scheduler
on the dry run, with a modeled step clock: deterministic) and
`serve_outputs` (tools/bench/latency.py's: the real model in real time,
each request's final output).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from minivllm import LLM, SamplingParams
from minivllm.core.scheduler import Scheduler, SchedulingBudget
from minivllm.outputs import CompletionOutput, RequestOutput
from minivllm.sequence import RequestMetrics, SequenceGroup, SequenceStatus
from minivllm.tracer import load_trace
from minivllm.tracer.errors import ScenarioError
from minivllm.tracer.scenario import Scenario, run_scenario
from minivllm.tracer.trace import Trace
from tools.bench.common import BenchRequest
from tools.bench.common import percentile as reference_percentile
from tools.bench.latency import serve_outputs  # noqa: F401 - for the notebook
from tools.labs.checks._common import needs, passed  # noqa: F401 - needs: for the notebook
from tools.labs.checks._engine_runs import (
    BatchRecorder,
    first_difference,
    learner_code,
    passes_through,
    quiet_engine,
    the_step_before,
    token_prompts,
    where_it_failed,
)

DAY = 11

# -- playing a workload whose requests arrive at given steps ------------------------------


@dataclass(frozen=True)
class Req:
    """One request of a step-driven workload. Its prompt is fixed token ids
    (`token_prompts`); the first `prefix` of them are the same in every
    request that has one (a shared system prompt)."""

    id: str
    prompt_len: int
    max_tokens: int
    arrival_step: int = 0
    n: int = 1
    prefix: int = 0


def _prompt_ids(requests: Sequence[Req]) -> list[list[int]]:
    """Each request's prompt: its shared prefix (the same ids in every request
    that has one), then ids of its own (no block in common with any other)."""
    shared = token_prompts([max(r.prefix for r in requests)], first=600)[0]
    own = token_prompts([r.prompt_len - r.prefix for r in requests])
    return [shared[:r.prefix] + mine for r, mine in zip(requests, own, strict=True)]


def _scenario(requests: Sequence[Req], engine: dict[str, Any]) -> Scenario:
    lines = []
    for r, prompt in zip(requests, _prompt_ids(requests), strict=True):
        params: dict[str, Any] = dict(max_tokens=r.max_tokens, ignore_eos=True)
        if r.n > 1:  # several samples need a random sampler: seeded, the same every run
            params.update(n=r.n, temperature=1.0, seed=7)
        else:
            params.update(temperature=0.0)
        lines.append(dict(id=r.id, prompt_token_ids=prompt,
                          arrival_step=r.arrival_step, **params))
    return Scenario(name="day11", description="", engine=dict(engine), requests=lines)


@contextlib.contextmanager
def _one_thread():
    """Run torch on one thread: the model is tiny, and on a busy 2-core
    machine a second thread that lost its core stalls every small matmul
    (tools/bench/common.py::set_threads says the same)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@dataclass
class Played:
    trace: Trace
    batches: list[dict[str, int]]  # per step: request id -> tokens it computed
    tokens: dict[str, list[int]]  # request id -> its tokens (all its sequences, in order)


def play(requests: Sequence[Req], engine: dict[str, Any], *, dry_run: bool = True,
         scheduler_cls: type | None = None, max_steps: int = 2000) -> Played:
    """Run the workload on a fresh engine (the shipped model, or its dry run),
    each request added before its arrival step; traced."""
    from minivllm.assets import DEFAULT_MODEL

    recorder = BatchRecorder()
    overrides = {} if scheduler_cls is None else {"scheduler_cls": scheduler_cls}
    with tempfile.TemporaryDirectory() as tmp, quiet_engine(), _one_thread():
        path = os.path.join(tmp, "run.jsonl")
        run_scenario(_scenario(requests, engine), path, DEFAULT_MODEL, dry_run=dry_run,
                     engine_overrides=overrides, max_steps=max_steps, observers=[recorder])
        trace = load_trace(path)
    owners = trace.seq_owners()
    tokens: dict[str, list[int]] = {r.id: [] for r in requests}
    for step in trace.steps:
        for seq_id, token in step["sampled"].items():
            tokens[owners[int(seq_id)]].append(token)
    return Played(trace, recorder.steps, tokens)


# -- exercise 1: one state, a few steps, by hand -------------------------------------------

BY_HAND_ENGINE = dict(block_size=8, num_gpu_blocks_override=64, max_model_len=128,
                      max_num_seqs=4, max_num_batched_tokens=32, enable_chunked_prefill=True)
BY_HAND_REQUESTS = (
    Req("A", 6, 20, arrival_step=0),
    Req("B", 60, 4, arrival_step=1),
    Req("C", 20, 4, arrival_step=2),
)
BY_HAND_STEPS = (1, 2, 3, 4)

# Why the engine gives each request what it does, per variant, step and request.
_BY_HAND_WHY = {
    ("plain", 1, "A"): "A decodes: 1 token, and decodes go first",
    ("plain", 1, "B"): "B arrived this step; A's decode left 32 - 1 = 31 tokens, so B's 60-token "
                       "prompt is cut to a 31-token chunk",
    ("plain", 1, "C"): "C has not arrived yet",
    ("plain", 2, "A"): "A decodes: 1 token",
    ("plain", 2, "B"): "B is running, mid-prompt: it gets the rest of its prompt, 60 - 31 = 29 "
                       "tokens, which fit the 31 left after A's decode (a chunk is the "
                       "uncomputed tokens, len - num_computed_tokens, capped at what is left)",
    ("plain", 2, "C"): "C arrives and is admitted with what is left: 32 - 1 - 29 = 2 tokens",
    ("plain", 3, "A"): "A decodes: 1 token",
    ("plain", 3, "B"): "B's last chunk sampled its first token in step 2: now it decodes, 1 token",
    ("plain", 3, "C"): "C is running, mid-prompt: the rest of its prompt, 20 - 2 = 18 tokens, fits",
    ("plain", 4, "A"): "A decodes: 1 token",
    ("plain", 4, "B"): "B decodes: 1 token",
    ("plain", 4, "C"): "C finished its prompt in step 3: it decodes, 1 token",
    ("prefix_caching", 1, "A"): "A decodes: 1 token",
    ("prefix_caching", 1, "B"): "31 tokens are left, but with prefix caching a chunk that does not "
                                "end the prompt is a whole number of blocks: 31 rounded down to "
                                "blocks of 8 is 24",
    ("prefix_caching", 1, "C"): "C has not arrived yet",
    ("prefix_caching", 2, "A"): "A decodes: 1 token",
    ("prefix_caching", 2, "B"): "B has 60 - 24 = 36 tokens to go; 31 are left, rounded down to "
                                "blocks: 24",
    ("prefix_caching", 2, "C"): "only 32 - 1 - 24 = 7 tokens are left, less than one block: C's "
                                "chunk would be 0 tokens, so C waits (admission stops on a "
                                "0-token chunk)",
    ("prefix_caching", 3, "A"): "A decodes: 1 token",
    ("prefix_caching", 3, "B"): "B's last 12 tokens fit the 31 left: the chunk that ends the "
                                "prompt is not rounded",
    ("prefix_caching", 3, "C"): "C is admitted with 32 - 1 - 12 = 19 left: its 20 tokens do not "
                                "fit, so a whole number of blocks, 16",
    ("prefix_caching", 4, "A"): "A decodes: 1 token",
    ("prefix_caching", 4, "B"): "B sampled its first token in step 3: it decodes, 1 token",
    ("prefix_caching", 4, "C"): "C's last 4 tokens fit: its last chunk, not rounded",
}


@functools.cache
def by_hand_steps(variant: str) -> tuple[dict[str, int], ...]:
    """What the engine computes in BY_HAND_STEPS, per request (0: it waits or
    has not arrived), in the lab's state; variant "plain" or "prefix_caching"."""
    engine = dict(BY_HAND_ENGINE, enable_prefix_caching=variant == "prefix_caching")
    played = play(BY_HAND_REQUESTS, engine)
    names = [r.id for r in BY_HAND_REQUESTS]
    return tuple({rid: played.batches[s].get(rid, 0) for rid in names} for s in BY_HAND_STEPS)


def exercise_1(predicted: dict[str, list[dict[str, int]]]) -> None:
    """Your table of steps 1-4 for both variants against the engine's."""
    assert isinstance(predicted, dict) and set(predicted) == {"plain", "prefix_caching"}, (
        "predicted_steps() should return {'plain': [...], 'prefix_caching': [...]}, each a list "
        f"of {len(BY_HAND_STEPS)} dicts (steps {BY_HAND_STEPS[0]} to {BY_HAND_STEPS[-1]}), "
        f"got {predicted!r}"
    )
    names = [r.id for r in BY_HAND_REQUESTS]
    for variant in ("plain", "prefix_caching"):
        mine = predicted[variant]
        assert isinstance(mine, (list, tuple)) and len(mine) == len(BY_HAND_STEPS), (
            f"predicted_steps()[{variant!r}] should hold {len(BY_HAND_STEPS)} dicts, one per "
            f"step {BY_HAND_STEPS[0]}..{BY_HAND_STEPS[-1]}, got {mine!r}"
        )
        engine = by_hand_steps(variant)
        wrong = []
        for step, want, got in zip(BY_HAND_STEPS, engine, mine, strict=True):
            assert isinstance(got, dict), (
                f"step {step} of {variant!r} should be a dict, got {got!r}")
            got = {rid: int(got.get(rid, 0)) for rid in names}
            wrong += [(step, rid, want[rid], got[rid]) for rid in names if want[rid] != got[rid]]
        if wrong:
            lines = "\n".join(
                f"  step {step}, {rid}: yours {have}, the engine's {want}: "
                f"{_BY_HAND_WHY[variant, step, rid]}."
                for step, rid, want, have in wrong
            )
            table = "\n".join(
                f"  step {s}: {b}" for s, b in zip(BY_HAND_STEPS, engine, strict=True))
            raise AssertionError(
                f"{variant.replace('_', ' ')}: {len(wrong)} of your numbers differ from what the "
                f"engine computes in that state.\n{lines}\nThe engine's steps:\n{table}"
            )
    passed(DAY, 1)


# -- exercise 2: the chunk-size rule in the engine ----------------------------------------


class _Mismatch(Exception):
    """The learner's rule returned another number than the reference's."""


@dataclass
class _Call:
    """One `_get_num_new_tokens` call: the state it saw, and both answers."""

    step: int
    request_id: str
    status: SequenceStatus
    phase: str  # "prefill" or "decode"
    num_seqs: int  # the sequences it counts (a prompt: 1)
    seq_len: int
    prompt_len: int
    computed: int
    uncached: int  # for a waiting prompt: tokens not found in the prefix cache
    enable_chunking: bool
    remaining: int
    token_budget: int
    caching: bool
    block_size: int
    want: int
    got: Any
    changed_budget: tuple | None = None  # (tokens, seqs) before and after, if it changed

    def describe(self) -> str:
        where = {SequenceStatus.WAITING: "waiting", SequenceStatus.RUNNING: "running",
                 SequenceStatus.SWAPPED: "swapped"}[self.status]
        what = (
            f"a {self.phase} with {self.num_seqs} running sequences" if self.num_seqs > 1
            else f"a {self.phase}"
        )
        recomputed = (
            f", recomputed after a preemption ({self.seq_len - self.prompt_len} generated tokens "
            "to prefill again)" if self.phase == "prefill" and self.seq_len > self.prompt_len
            else ""
        )
        cached = (
            f", {self.seq_len - self.uncached} of them found in the prefix cache"
            if self.status == SequenceStatus.WAITING and self.uncached != self.seq_len else ""
        )
        return (
            f"in step {self.step}, request {self.request_id} ({where}, {what}: {self.seq_len} "
            f"tokens, {self.computed} computed{recomputed}{cached}), "
            f"enable_chunking={self.enable_chunking}, budget {self.token_budget} tokens with "
            f"{self.remaining} left"
            + (f", prefix caching on (blocks of {self.block_size})" if self.caching else "")
        )


def _diagnose(c: _Call) -> str:
    """The likely mistake behind one wrong answer."""
    if c.changed_budget:
        (tokens, seqs), (tokens_after, seqs_after) = c.changed_budget
        return (
            f"your method changed the budget (tokens {tokens} -> {tokens_after}, sequences "
            f"{seqs} -> {seqs_after}): it only computes a number; the caller checks "
            "budget.can_schedule and charges the budget once the group is scheduled"
        )
    got, want = c.got, c.want
    bs = c.block_size
    uncomputed = c.seq_len - c.computed
    if c.phase == "decode":
        if c.num_seqs > 1 and want == 0:
            return (
                f"a decoding group computes one token per running sequence ({c.num_seqs} here), "
                "and a group of several sequences is never chunked: when its tokens do not fit "
                "what is left, return 0 so that it waits for the next step (a chunk of a decode "
                "would leave a sequence without its token)"
            )
        if c.num_seqs > 1 and got == 1:
            return (
                "a decoding group computes one token per running sequence: count them all "
                f"(n = {c.num_seqs} here); only a prompt, which its sequences still share, is "
                "counted once"
            )
        if isinstance(got, int) and got <= 0 and c.seq_len > c.prompt_len:
            return (
                "a decode's uncomputed tokens count its generated tokens too: seq.get_len() "
                "(prompt + outputs) - seq.data.num_computed_tokens; seq.get_prompt_len() leaves "
                "the outputs out"
            )
        if isinstance(got, int) and got > c.num_seqs:
            return (
                "a decode computes 1 token per sequence: its uncomputed tokens, "
                "seq.get_len() - seq.data.num_computed_tokens (= seq.get_num_new_tokens()), "
                "not its whole length"
            )
        return "a decode computes 1 token per running sequence"
    # a prefill
    if not c.enable_chunking:
        return (
            "with enable_chunking=False (the default scheduler, or a swap-in) nothing is chunked: "
            "return every uncomputed token; the caller then decides whether the whole prompt "
            "fits the budget (if not, it waits)"
        )
    if c.status == SequenceStatus.WAITING and c.caching and c.uncached != c.seq_len and got in (
        c.seq_len, min(c.seq_len, c.remaining),
        c.seq_len if c.seq_len <= c.remaining else c.remaining - c.remaining % bs,
    ) and got != want:
        return (
            "with prefix caching, a waiting prompt's blocks found in the cache are not computed: "
            "its new tokens are self._num_uncached_tokens(seq), not seq.get_len() (Day 10)"
        )
    if c.phase == "prefill" and c.seq_len > c.prompt_len and got in (
        c.prompt_len - c.computed, min(c.prompt_len - c.computed, c.remaining),
    ):
        return (
            "a request recomputed after a preemption prefills its prompt AND the tokens it had "
            "generated: count seq.get_len() (prompt + outputs), not seq.get_prompt_len()"
        )
    if c.caching and want < c.remaining and want % bs == 0 and got == c.remaining:
        return (
            "with prefix caching, a chunk that does not end the prompt is a whole number of "
            f"blocks: round what is left down to a multiple of block_size ({c.remaining} -> "
            f"{want}), so that every block a chunk completes can be cached"
        )
    if c.caching and want == uncomputed and got == uncomputed - uncomputed % bs:
        return (
            "the chunk that ends the prompt is not rounded to blocks: when all the uncomputed "
            "tokens fit what is left, return them all (only a cut chunk is rounded)"
        )
    if c.caching and want < c.remaining and got == want + bs and got <= uncomputed:
        return "round what is left DOWN to whole blocks (a chunk must fit the budget), not up"
    if got == c.token_budget and c.remaining < c.token_budget and want <= c.remaining:
        return (
            f"a chunk is capped at what the budget has LEFT ({c.remaining}: "
            "budget.remaining_token_budget()), not at the whole max_num_batched_tokens "
            f"({c.token_budget}): the decodes and chunks scheduled before it have spent the rest"
        )
    if got == uncomputed and want < uncomputed:
        return (
            "cap the chunk at what the budget has left, budget.remaining_token_budget(): the "
            f"{uncomputed} uncomputed tokens do not fit the {c.remaining} left, so only "
            f"{want} are computed this step and the rest in the next"
        )
    if isinstance(got, int) and abs(got - want) == 1:
        return (
            "an off-by-one: the tokens still to compute are seq.get_len() - "
            "seq.data.num_computed_tokens exactly (no +1 or -1; the engine counts the prompt's "
            "last token in the chunk that samples), and a chunk may use the budget left exactly"
        )
    if got == c.seq_len and c.computed:
        return (
            "a prefill under way has computed num_computed_tokens tokens already: its next chunk "
            "starts there (seq.get_len() - seq.data.num_computed_tokens), not at 0"
        )
    if got == 0:
        return (
            "return 0 only when nothing fits: a single-sequence prompt is cut to what is left "
            "(rounded down to whole blocks with prefix caching)"
        )
    return (
        "the rule: the uncomputed tokens (a waiting prompt: its uncached tokens); without "
        "chunking all of them; with chunking, all if they fit what is left, else 0 for a group "
        "of several sequences, else what is left (rounded down to blocks with prefix caching)"
    )


# Each workload: (label, requests, engine options, what it shows).
_BLOCK8 = dict(block_size=8, num_gpu_blocks_override=64, max_model_len=128, max_num_seqs=8)
WORKLOADS: list[tuple[str, tuple[Req, ...], dict[str, Any], str]] = [
    ("long prompts arriving while A decodes (chunked prefill, budget 16)",
     (Req("A", 10, 12), Req("B", 50, 4, arrival_step=2), Req("C", 37, 5, arrival_step=3)),
     dict(_BLOCK8, enable_chunked_prefill=True, max_num_batched_tokens=16),
     "decodes first, 1 token each; then B's and C's prompts in chunks of what is left, each "
     "last chunk exactly the tokens still uncomputed"),
    ("chunking off: prompts of 100, 60 and 20 tokens, budget 128",
     (Req("A", 100, 3), Req("B", 60, 3), Req("C", 20, 3)),
     dict(_BLOCK8, enable_chunked_prefill=False, max_num_batched_tokens=128),
     "without chunked prefill a prompt is admitted whole or waits: B's 60 tokens do not fit the "
     "28 left after A, so B waits a step"),
    ("prefix caching: a shared 24-token prefix, chunks of whole blocks (budget 32)",
     (Req("A", 30, 6, prefix=24), Req("B", 44, 4, arrival_step=2, prefix=24),
      Req("C", 50, 4, arrival_step=3)),
     dict(_BLOCK8, enable_chunked_prefill=True, max_num_batched_tokens=32,
          enable_prefix_caching=True),
     "B finds A's 24 prefix tokens in the cache and computes only the rest; a chunk that does "
     "not end its prompt is rounded down to whole blocks"),
    ("preemption by RECOMPUTE with chunked prefill (9 blocks of 8, budget 16)",
     (Req("A", 20, 24), Req("B", 20, 24), Req("C", 12, 8, arrival_step=1)),
     dict(_BLOCK8, num_gpu_blocks_override=9, enable_chunked_prefill=True,
          max_num_batched_tokens=16, preemption_mode="recompute"),
     "a recomputed request is prefilled again, prompt and generated tokens, in chunks"),
    ("n=2 behind a prompt's last chunk (prefix caching, budget 32)",
     (Req("D", 4, 10), Req("P", 54, 3, arrival_step=1), Req("X", 4, 3, arrival_step=1, n=2)),
     dict(_BLOCK8, enable_chunked_prefill=True, max_num_batched_tokens=32,
          enable_prefix_caching=True),
     "in step 2, D's decode and P's last 30 tokens leave 1 token; X's two sequences need 2: "
     "X is not chunked, it waits for the next step"),
]
# The same arrivals as the first workload, longer, on the real model: the tokens must match.
MODEL_WORKLOAD = (
    "the first workload's shape on the shipped model (greedy tokens compared)",
    (Req("A", 8, 6), Req("B", 30, 3, arrival_step=2), Req("C", 20, 3, arrival_step=3)),
    dict(_BLOCK8, enable_chunked_prefill=True, max_num_batched_tokens=16),
    "chunks computed in pieces give the same tokens as the reference's",
)


@functools.cache
def _reference(index: int) -> Played:
    if index < len(WORKLOADS):
        _, reqs, engine, _ = WORKLOADS[index]
        return play(reqs, engine)
    _, reqs, engine, _ = MODEL_WORKLOAD
    return play(reqs, engine, dry_run=False)


def _ask(cls: type, scheduler: Scheduler, seq_group: SequenceGroup, status: SequenceStatus,
         enable_chunking: bool, budget: SchedulingBudget, step: int) -> _Call:
    """The reference rule's answer and the learner's (`cls`'s method run on
    `scheduler`), with the state both saw."""
    want = Scheduler._get_num_new_tokens(scheduler, seq_group, status, enable_chunking, budget)
    seqs = seq_group.get_seqs(status)
    prefill = status == SequenceStatus.WAITING or seq_group.is_prefill()
    first = seqs[0]
    call = _Call(
        step=step, request_id=seq_group.request_id, status=status,
        phase="prefill" if prefill else "decode",
        num_seqs=1 if prefill else len(seqs), seq_len=first.get_len(),
        prompt_len=first.get_prompt_len(), computed=first.data.num_computed_tokens,
        uncached=scheduler._num_uncached_tokens(first) if status == SequenceStatus.WAITING
        else first.get_len(),
        enable_chunking=enable_chunking, remaining=budget.remaining_token_budget(),
        token_budget=budget.token_budget, caching=scheduler.cache_config.enable_prefix_caching,
        block_size=scheduler.cache_config.block_size, want=want, got=None,
    )
    before = (budget.num_batched_tokens, budget.num_curr_seqs)
    call.got = cls._get_num_new_tokens(scheduler, seq_group, status, enable_chunking, budget)
    after = (budget.num_batched_tokens, budget.num_curr_seqs)
    if after != before:
        call.changed_budget = (before, after)
    return call


def _probe(cls: type) -> tuple[type, list[_Call]]:
    """A subclass of `cls` whose `_get_num_new_tokens` compares the learner's
    answer with the reference rule on the same state, stopping at the first
    that differs. Also counts the engine's steps (`schedule` calls)."""
    calls: list[_Call] = []
    state = {"step": -1}

    class Probe(cls):  # type: ignore[misc, valid-type]
        def schedule(self):
            state["step"] += 1
            return super().schedule()

        def _get_num_new_tokens(self, seq_group: SequenceGroup, status: SequenceStatus,
                                enable_chunking: bool, budget: SchedulingBudget) -> int:
            call = _ask(cls, self, seq_group, status, enable_chunking, budget, state["step"])
            calls.append(call)
            if call.got != call.want or call.changed_budget:
                raise _Mismatch()
            return call.got

    Probe.__name__ = Probe.__qualname__ = cls.__name__
    return Probe, calls


def _call_message(label: str, call: _Call, what: str, focus: str) -> str:
    answer = (
        f"your _get_num_new_tokens returned {call.got!r}, the rule gives {call.want}"
        if call.got != call.want else f"your _get_num_new_tokens returned {call.got!r}, right, "
        "but it changed the budget"
    )
    return (
        f"{label}: {call.describe()}: {answer}.\nHint: {_diagnose(call)}.\n"
        f"What this {what} shows: {focus}."
    )


def _require_scheduler(cls) -> None:
    if not (isinstance(cls, type) and issubclass(cls, Scheduler)):
        raise AssertionError(f"pass your Scheduler subclass itself (the class), got {cls!r}")
    if "_get_num_new_tokens" not in vars(cls):
        raise AssertionError(
            f"{cls.__name__} does not define _get_num_new_tokens: override it in the class"
        )


def _check_workload(cls: type, index: int) -> None:
    if index < len(WORKLOADS):
        label, reqs, engine, focus = WORKLOADS[index]
        dry_run = True
    else:
        label, reqs, engine, focus = MODEL_WORKLOAD
        dry_run = False
    ref = _reference(index)
    probe, calls = _probe(cls)
    try:
        got = play(reqs, engine, dry_run=dry_run, scheduler_cls=probe,
                   max_steps=3 * len(ref.trace.steps) + 20)
    except _Mismatch:
        raise AssertionError(_call_message(label, calls[-1], "workload", focus)) from None
    except ScenarioError as error:
        if "still running" in str(error):
            raise AssertionError(
                f"{label}: the run went on far longer than the reference's "
                f"({len(ref.trace.steps)} steps): a request is never given a token. Hint: "
                f"return 0 only when nothing fits.\nWhat this workload shows: {focus}."
            ) from None
        raise
    except Exception as error:  # noqa: BLE001 - reported to the learner
        if passes_through(error):  # a verdict, or an unfinished exercise
            raise
        raise AssertionError(
            f"{label}: the engine with {cls.__name__} raised {type(error).__name__}: {error}, "
            f"{where_it_failed(error)}.\nHint: _get_num_new_tokens returns one int, the tokens "
            "the group computes this step; it changes nothing (no budget charges, no queues)."
        ) from error
    diff = first_difference(ref.trace, got.trace)
    if diff is not None:
        step, field, want, have = diff
        raise AssertionError(
            f"{label}: every _get_num_new_tokens answer was right, yet step {step}'s {field} "
            f"differ from the reference's.\n  reference: {want}\n  yours:     {have}\n"
            "Hint: _get_num_new_tokens must only compute a number: leave the budget, the queues "
            f"and the sequences as they are.{the_step_before(ref.trace, step)}"
        )
    assert got.tokens == ref.tokens, (
        f"{label}: the generated tokens differ from the reference's although every step "
        f"agreed.\n  reference: {ref.tokens}\n  yours:     {got.tokens}"
    )


DIRECT_LABEL = (
    "asked directly: request X (n=2, chunked prefill, no prefix caching) decodes, with 5, 2, 1 "
    "and 0 tokens left in the budget"
)
DIRECT_FOCUS = (
    "a decoding group of two sequences needs 2 tokens; with fewer left it is not chunked but "
    "waits (0). In the engine's runs this state is rare: the checker builds it and asks your "
    "method, without running a step"
)


def _check_direct(cls: type) -> None:
    """The n=2 decode against a nearly spent budget: built on the reference
    scheduler, then the learner's method is asked."""
    with quiet_engine():
        llm = LLM(dry_run=True, disable_log_stats=True, enable_chunked_prefill=True,
                  max_num_batched_tokens=16, **_BLOCK8)
    engine = llm.llm_engine
    engine.add_request("X", {"prompt_token_ids": token_prompts([4])[0]},
                       SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=4,
                                      ignore_eos=True))
    engine.step()  # X's prompt; it forks into two sequences
    scheduler = engine.scheduler
    (group,) = scheduler.running
    for left in (5, 2, 1, 0):
        budget = SchedulingBudget(token_budget=16, max_num_seqs=8)
        if left < 16:
            budget.add_num_batched_tokens("the others", 16 - left)
        try:
            call = _ask(cls, scheduler, group, SequenceStatus.RUNNING, True, budget, 1)
        except Exception as error:  # noqa: BLE001 - reported to the learner
            if passes_through(error):  # a verdict, or an unfinished exercise
                raise
            raise AssertionError(
                f"{DIRECT_LABEL}: your _get_num_new_tokens raised {type(error).__name__}: "
                f"{error}, {where_it_failed(error)}."
            ) from error
        assert call.got == call.want and not call.changed_budget, _call_message(
            DIRECT_LABEL, call, "check", DIRECT_FOCUS)


def exercise_2(scheduler_cls) -> None:
    """The chunk-size rule (`_get_num_new_tokens`) in the engine, against the reference."""
    _require_scheduler(scheduler_cls)
    for index in range(len(WORKLOADS)):
        _check_workload(scheduler_cls, index)
    _check_direct(scheduler_cls)
    _check_workload(scheduler_cls, len(WORKLOADS))  # the shipped model: tokens too
    passed(DAY, 2)


# -- exercise 3: TTFT, TPOT and percentiles -------------------------------------------------


def reference_ttft(out: RequestOutput) -> float:
    m = out.metrics
    return m.first_token_time - m.arrival_time


def reference_tpot(out: RequestOutput) -> float | None:
    m, n = out.metrics, len(out.outputs[0].token_ids)
    return (m.finished_time - m.first_token_time) / (n - 1) if n > 1 else None


def recorded_output(arrival: float, scheduled: float, first: float, finished: float,
                    num_tokens: int, request_id: str = "0") -> RequestOutput:
    """A finished request with these timestamps (seconds, time.time() style)."""
    metrics = RequestMetrics(arrival_time=arrival, first_scheduled_time=scheduled,
                             first_token_time=first, last_token_time=finished,
                             time_in_queue=scheduled - arrival, finished_time=finished)
    completion = CompletionOutput(index=0, text="", token_ids=list(range(7, 7 + num_tokens)),
                                  cumulative_logprob=None, logprobs=None, finish_reason="length")
    return RequestOutput(request_id=request_id, prompt=None, prompt_token_ids=[5, 6, 7],
                         prompt_logprobs=None, outputs=[completion], finished=True,
                         metrics=metrics)


T0 = 1_764_000_000.0
# (label, arrival, first scheduled, first token, finished, output tokens): offsets in seconds.
RECORDED = [
    ("admitted at once, 9 tokens", 0.000, 0.000, 0.031, 0.191, 9),
    ("waited 0.25 s in the queue, then 5 tokens", 0.100, 0.350, 0.420, 0.500, 5),
    ("a long prompt chunked over 6 steps, 17 tokens", 0.200, 0.210, 0.480, 0.960, 17),
    ("two tokens", 0.300, 0.305, 0.355, 0.395, 2),
    ("a single token (TPOT is None: no gap between tokens)", 0.400, 0.460, 0.500, 0.500, 1),
]


def recorded_outputs() -> list[tuple[str, RequestOutput]]:
    return [
        (label, recorded_output(T0 + a, T0 + s, T0 + f, T0 + e, n, str(i)))
        for i, (label, a, s, f, e, n) in enumerate(RECORDED)
    ]


def _close(a: Any, b: float | None) -> bool:
    if b is None or a is None:
        return a is None and b is None
    return isinstance(a, (int, float)) and math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)


def _ttft_hint(out: RequestOutput, got: float) -> str:
    m = out.metrics
    if _close(got, m.first_token_time - m.first_scheduled_time):
        return (
            "TTFT is measured from the request's ARRIVAL (metrics.arrival_time), not from its "
            "first schedule: the time it waited in the queue is part of what the user waits"
        )
    if _close(got, m.finished_time - m.arrival_time):
        return "that is the whole request (end-to-end latency); TTFT stops at the first token"
    if _close(got, m.first_scheduled_time - m.arrival_time):
        return "that is the time in the queue only; TTFT goes on until the first token"
    return "TTFT = metrics.first_token_time - metrics.arrival_time"


def _tpot_hint(out: RequestOutput, got: Any) -> str:
    m, n = out.metrics, len(out.outputs[0].token_ids)
    decode = m.finished_time - m.first_token_time
    if n > 1 and _close(got, decode / n):
        return (
            f"divide by the gaps between tokens, output tokens - 1 ({n - 1}), not by the "
            f"{n} tokens: the first token's time is TTFT's, not TPOT's"
        )
    if n > 1 and _close(got, (m.finished_time - m.arrival_time) / (n - 1)):
        return (
            "start from the FIRST TOKEN's time, not the arrival: the wait and the prefill are "
            "TTFT's"
        )
    if n > 1 and _close(got, (m.finished_time - m.arrival_time) / n):
        return (
            "that is end-to-end latency per token; TPOT leaves out the first token: "
            "(finished - first token) / (output tokens - 1)"
        )
    if n > 1 and _close(got, (m.finished_time - m.first_scheduled_time) / (n - 1)):
        return "start from the first token's time, not the first schedule"
    if n == 1:
        return (
            "with a single output token there is no gap between tokens: return None (it is left "
            "out of the TPOT percentiles), not 0 and not an error"
        )
    return "TPOT = (metrics.finished_time - metrics.first_token_time) / (output tokens - 1)"


PERCENTILE_CASES = [
    ([0.8, 0.1, 0.5, 0.3, 0.9, 0.2, 0.7], q) for q in (50, 99, 90, 25, 0, 100)
] + [([0.004, 0.012, 0.006, 0.031], 50), ([0.004, 0.012, 0.006, 0.031], 99), ([0.25], 99)]


_PERCENTILE_RULE = (
    "position (n - 1) * q / 100 in the sorted values, linear between its two neighbours"
)


def _percentile_hint(values: list[float], q: float, got: Any) -> str:
    ordered = sorted(values)
    n = len(ordered)

    def interp(seq, pos):
        lo = int(pos)
        hi = min(lo + 1, len(seq) - 1)
        return seq[lo] + (seq[hi] - seq[lo]) * (pos - lo)

    pos = (n - 1) * q / 100
    if n > 1 and _close(got, interp(list(values), pos)):
        return "sort the values first: the rank is a position in the SORTED list"
    picks = {ordered[min(round(pos), n - 1)], ordered[min(int(pos), n - 1)],
             ordered[min(int(n * q / 100), n - 1)], ordered[max(math.ceil(n * q / 100) - 1, 0)]}
    if any(_close(got, v) for v in picks):
        return (
            "that is one value of the list (a nearest-rank rule); the course's percentile, "
            "tools/bench/common.py::percentile, interpolates linearly between the two closest "
            "ranks: position (n - 1) * q / 100, then ordered[lo] + (ordered[hi] - ordered[lo]) "
            "* fraction"
        )
    if _close(got, interp(ordered, min(n * q / 100, n - 1))):
        return "the position is (n - 1) * q / 100, not n * q / 100: q=100 is the last value"
    return _PERCENTILE_RULE


_METRICS_HINT = (
    "the times are the fields of out.metrics (arrival_time, first_scheduled_time, "
    "first_token_time, finished_time: seconds, time.time() style), the tokens "
    "out.outputs[0].token_ids"
)


def _tpot_error_hint(out: RequestOutput) -> Callable[[BaseException], str]:
    """The hint for an exception from the learner's tpot(out)."""
    return lambda error: (
        _tpot_hint(out, 0.0) if isinstance(error, ZeroDivisionError) else _METRICS_HINT
    )


def _percentile_error_hint(error: BaseException) -> str:
    if isinstance(error, IndexError):
        return (
            "when the position (n - 1) * q / 100 is the last index (q=100, or a single value), "
            "lo + 1 is past the end of the list: take the upper neighbour as "
            "hi = min(lo + 1, n - 1)"
        )
    return _PERCENTILE_RULE


def exercise_3(ttft: Callable, tpot: Callable, percentile: Callable) -> None:
    """TTFT and TPOT of recorded requests, and the percentile, against the bench's definitions."""
    for label, out in recorded_outputs():
        want = reference_ttft(out)
        with learner_code(f"ttft of the recorded request '{label}'", _METRICS_HINT):
            got = ttft(out)
        assert _close(got, want), (
            f"ttft of the recorded request '{label}' should be {want:.3f} s, got {got!r}.\n"
            f"Hint: {_ttft_hint(out, got)}."
        )
    for label, out in recorded_outputs():
        want = reference_tpot(out)
        with learner_code(f"tpot of the recorded request '{label}'", _tpot_error_hint(out)):
            got = tpot(out)
        assert _close(got, want), (
            f"tpot of the recorded request '{label}' should be "
            f"{'None' if want is None else f'{want:.4f} s'}, got {got!r}.\n"
            f"Hint: {_tpot_hint(out, got)}."
        )
    for values, q in PERCENTILE_CASES:
        want = reference_percentile(values, q)
        with learner_code(f"percentile({values}, {q})", _percentile_error_hint):
            got = percentile(list(values), q)
        assert _close(got, want), (
            f"percentile({values}, {q}) should be {want:.6g}, got {got!r}.\n"
            f"Hint: {_percentile_hint(values, q, got)}."
        )
    passed(DAY, 3)


# -- the measurements: a bursty workload ---------------------------------------------------

# (arrival in ms, prompt tokens, output tokens): four chats decoding, then four long
# documents at once, then three more chats.
BURSTY = (
    [(0, 24, 40), (10, 30, 40), (20, 20, 40), (30, 28, 40)]
    + [(80, 480, 8)] * 4
    + [(150, 24, 30), (200, 30, 30), (250, 20, 30)]
)
SIM_ENGINE = dict(block_size=16, num_gpu_blocks_override=512, max_model_len=512, max_num_seqs=16)
STEP_FIXED_MS = 8.0  # a step's cost regardless of its size (reading the weights)
STEP_PER_TOKEN_MS = 0.06  # and per token it computes


def workload_requests(workload=BURSTY) -> list[BenchRequest]:
    prompts = token_prompts([p for _, p, _ in workload])
    return [BenchRequest(p, o) for p, (_, _, o) in zip(prompts, workload, strict=True)]


class _StepTokens:
    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.ids: list[list[str]] = []

    def on_add_request(self, engine, seq_group) -> None:
        pass

    def on_step(self, engine, record) -> None:
        out = record.scheduler_outputs
        self.tokens.append(out.num_batched_tokens)
        self.ids.append([s.seq_group.request_id for s in out.scheduled_seq_groups])


def simulate(enable_chunked_prefill: bool, max_num_batched_tokens: int, workload=BURSTY,
             fixed_ms: float = STEP_FIXED_MS, per_token_ms: float = STEP_PER_TOKEN_MS
             ) -> list[RequestOutput]:
    """The workload through the real scheduler (the dry run: no model), on a
    modeled clock: requests arrive at their times (ms), and a step of k
    tokens takes fixed_ms + per_token_ms * k. Returns each request's final
    RequestOutput, its metrics stamped by that clock (in seconds, from 0).
    Deterministic: it depends only on the scheduler's decisions."""
    with quiet_engine():
        llm = LLM(dry_run=True, disable_log_stats=True,
                  enable_chunked_prefill=enable_chunked_prefill,
                  max_num_batched_tokens=max_num_batched_tokens, **SIM_ENGINE)
    engine = llm.llm_engine
    steps = _StepTokens()
    engine.add_step_observer(steps)
    requests = workload_requests(workload)
    arrivals = [a / 1000 for a, _, _ in workload]
    pending = sorted(range(len(requests)), key=lambda i: arrivals[i])
    clock = 0.0
    metrics: dict[str, RequestMetrics] = {}
    done: dict[str, RequestOutput] = {}
    while pending or engine.has_unfinished_requests():
        while pending and arrivals[pending[0]] <= clock + 1e-12:
            i = pending.pop(0)
            params = SamplingParams(temperature=0, max_tokens=requests[i].output_len,
                                    ignore_eos=True)
            engine.add_request(str(i), {"prompt_token_ids": requests[i].prompt_token_ids},
                               params, arrival_time=arrivals[i])
            metrics[str(i)] = RequestMetrics(arrival_time=arrivals[i])
        if not engine.has_unfinished_requests():
            clock = arrivals[pending[0]]
            continue
        start = clock
        outs = engine.step()
        clock += (fixed_ms + per_token_ms * steps.tokens[-1]) / 1000
        for rid in steps.ids[-1]:
            if metrics[rid].first_scheduled_time is None:
                metrics[rid].first_scheduled_time = start
                metrics[rid].time_in_queue = start - metrics[rid].arrival_time
        for out in outs:
            m = metrics[out.request_id]
            if out.outputs[0].token_ids:
                if m.first_token_time is None:
                    m.first_token_time = clock
                m.last_token_time = clock
            if out.finished:
                m.finished_time = clock
                out.metrics = m
                done[out.request_id] = out
    return [done[str(i)] for i in range(len(requests))]

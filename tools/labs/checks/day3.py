"""Checkers for Day 3, the request lifecycle (labs/day3_request_lifecycle.ipynb).

Each `exercise_k` runs the learner's code on fixed workloads (the shipped
scenarios in their dry run, and the shipped model) and compares it with
what the trace recorded. It prints one line when everything agrees, or
raises AssertionError saying what was expected, what came back, and where
to look. A NotImplementedError from an unfinished exercise propagates.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from minivllm.assets import DEFAULT_MODEL
from minivllm.tracer import load_trace
from minivllm.tracer.scenario import SCENARIO_DIR, Scenario, load_scenario, run_scenario
from minivllm.tracer.trace import Trace
from tools.labs.checks._common import needs, passed

__all__ = ["exercise_1", "exercise_2", "exercise_3", "exercise_4", "exercise_5", "needs",
           "play", "states_runs"]

DAY = 3

# Extra workloads, beside the shipped scenarios: several preemptions of one
# request, an ignored prompt, and parallel sampling (one prompt, two sequences).
_EXTRA = {
    "tight": {
        "engine": {"block_size": 16, "num_gpu_blocks_override": 9, "preemption_mode": "recompute"},
        "requests": [
            {"id": "A", "prompt_len": 30, "max_tokens": 50},
            {"id": "B", "prompt_len": 20, "max_tokens": 60, "arrival_step": 1},
            {"id": "C", "prompt_len": 40, "max_tokens": 30, "arrival_step": 2},
            {"id": "D", "prompt_len": 200, "max_tokens": 2, "arrival_step": 3},
        ],
    },
    "chunked_tight": {
        "engine": {
            "block_size": 16,
            "num_gpu_blocks_override": 10,
            "enable_chunked_prefill": True,
            "max_num_batched_tokens": 32,
            "max_num_seqs": 4,
            "preemption_mode": "recompute",
        },
        "requests": [
            {"id": "A", "prompt_len": 50, "max_tokens": 40},
            {"id": "B", "prompt_len": 45, "max_tokens": 40, "arrival_step": 2},
        ],
    },
    "gap": {  # nothing to do in steps 2 and 3: empty steps
        "engine": {"block_size": 16, "num_gpu_blocks_override": 16},
        "requests": [
            {"id": "A", "prompt_len": 10, "max_tokens": 2},
            {"id": "B", "prompt_len": 12, "max_tokens": 2, "arrival_step": 4},
        ],
    },
    "parallel": {
        "engine": {"block_size": 16, "num_gpu_blocks_override": 32},
        "requests": [
            {"id": "A", "prompt_len": 20, "max_tokens": 6, "n": 2, "temperature": 1.0, "seed": 1},
            {"id": "B", "prompt_len": 35, "max_tokens": 4, "arrival_step": 1},
        ],
    },
}


def play(name: str, observers=(), dry_run: bool = True) -> Trace:
    """Play a scenario (a shipped one by name, or one of _EXTRA) step by step
    on a fresh engine with tracing on and `observers` attached; its trace."""
    if name in _EXTRA:
        scenario = Scenario(name, "", _EXTRA[name]["engine"], _EXTRA[name]["requests"])
    else:
        scenario = load_scenario(SCENARIO_DIR / f"{name}.yaml")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"{name}.jsonl"
        run_scenario(scenario, path, DEFAULT_MODEL, dry_run=dry_run, observers=observers)
        return load_trace(path)


_TRACES: dict[str, Trace] = {}


def _trace(name: str) -> Trace:
    if name not in _TRACES:
        _TRACES[name] = play(name)
    return _TRACES[name]


def _first_index(expected: list, got: list) -> int:
    pairs = enumerate(zip(expected, got, strict=False))
    return next((i for i, (a, b) in pairs if a != b), min(len(expected), len(got)))


def _first_difference(expected: list, got: list) -> str:
    i = _first_index(expected, got)
    if i < min(len(expected), len(got)):
        return f"entry {i}: expected {expected[i]!r}, got {got[i]!r}"
    return f"expected {len(expected)} entries, got {len(got)}"


# Exercise 1 ------------------------------------------------------------------


def exercise_1(request_states) -> None:
    cases = [
        ("admission_blocked", "B"),
        ("preempt_recompute", "C"),
        ("preempt_swap", "C"),
        ("chunked_prefill", "B"),
        ("tight", "A"),
        ("tight", "D"),
    ]
    for name, rid in cases:
        trace = _trace(name)
        expected = trace.lifecycles()[rid].states
        got = [tuple(x) for x in request_states(trace, rid)]
        if got != expected:
            where = _first_difference(expected, got)
            hint = (
                "Walk the steps from the request's arrival_step; in each step ask, in this order: "
                "is it in `scheduled` (prefill / decode)? was it in `preempted`? which queue of "
                "`queues_after` holds it (waiting / running / swapped)? none: finished. Stop after "
                "the step whose `finished` names it."
            )
            i = max(_first_index(expected, got) - 2, 0)
            raise AssertionError(
                f"request {rid} in scenario {name!r}: {where}.\n"
                f"  expected, from entry {i}: {expected[i : i + 5]}\n"
                f"  got,      from entry {i}: {got[i : i + 5]}\n{hint}"
            )
    passed(DAY, 1)


# Exercise 2 ------------------------------------------------------------------


def exercise_2(ttft_steps) -> None:
    for name in ("admission_blocked", "chunked_prefill", "preempt_recompute", "tight", "parallel"):
        trace = _trace(name)
        for rid, life in trace.lifecycles().items():
            if life.first_token_step is None:
                expected = None
            else:
                expected = life.first_token_step - life.arrival_step + 1
            got = ttft_steps(trace, rid)
            if got != expected:
                raise AssertionError(
                    f"request {rid} in scenario {name!r} arrived at step {life.arrival_step} and "
                    f"got its first token in step {life.first_token_step}: TTFT is "
                    f"{expected} steps, your function returned {got!r}. Count both ends (a prompt "
                    "prefilled in its arrival step has a TTFT of 1 step), look for the first step "
                    "whose `sampled` holds one of the request's sequences (a chunk that does not "
                    "finish the prompt samples nothing), and return None if there is none."
                )
    passed(DAY, 2)


# Exercise 3 ------------------------------------------------------------------


def _reference_preemptions(trace: Trace, rid: str) -> list[tuple]:
    out = []
    for i, step in enumerate(trace.steps):
        for p in step["preempted"]:
            if p["request_id"] != rid:
                continue
            back, tokens = None, None
            for later in trace.steps[i + 1 :]:
                mine = [e for e in later["scheduled"] if e["request_id"] == rid]
                if mine:
                    back, tokens = later["step"], mine[0]["num_tokens"]
                    break
            out.append((step["step"], p["mode"], back, tokens))
    return out


def exercise_3(preemptions) -> None:
    cases = [("preempt_recompute", "C"), ("preempt_swap", "C"), ("preempt_recompute", "A")]
    trace = _trace("tight")
    cases += [("tight", rid) for rid in trace.requests]
    trace = _trace("chunked_tight")
    cases += [("chunked_tight", rid) for rid in trace.requests]
    for name, rid in cases:
        trace = _trace(name)
        expected = _reference_preemptions(trace, rid)
        got = [tuple(x) for x in preemptions(trace, rid)]
        if got != expected:
            raise AssertionError(
                f"request {rid} in scenario {name!r}: expected {expected}, got {got}.\n"
                "One tuple per entry of a step's `preempted` naming the request: (that step, its "
                "mode, the next step whose `scheduled` holds the request, the `num_tokens` of its "
                "entry there), with None, None if it never ran again. A RECOMPUTE victim comes "
                "back as a prefill of its whole sequence so far; a SWAP victim as a 1-token decode."
            )
    passed(DAY, 3)


# Exercise 4 ------------------------------------------------------------------


def _tokens_per_step(trace: Trace) -> list[tuple[int, int]]:
    out = []
    for step in trace.steps:
        prefill = sum(e["num_tokens"] for e in step["scheduled"] if e["is_prefill"])
        decode = sum(e["num_tokens"] for e in step["scheduled"] if not e["is_prefill"])
        out.append((prefill, decode))
    return out


def exercise_4(observer_cls) -> None:
    for name in ("chunked_prefill", "token_budget", "preempt_recompute", "parallel", "gap"):
        observer = observer_cls()
        trace = play(name, [observer])
        expected = _tokens_per_step(trace)
        got = [tuple(x) for x in observer.steps]
        if got != expected:
            where = _first_difference(expected, got)
            raise AssertionError(
                f"scenario {name!r}: per-step (prefill tokens, decode tokens) differ at {where}.\n"
                f"  trace: {expected[:12]}{' ...' if len(expected) > 12 else ''}\n"
                f"  yours: {got[:12]}{' ...' if len(got) > 12 else ''}\n"
                "Append one tuple per on_step call, empty steps included. Count tokens, not "
                "requests: a prefill chunk brings `token_chunk_size` tokens, and a decode one "
                "token per running sequence (a request with n=2 decodes 2). `record.batch` "
                "(FlatBatch) has num_prefill_tokens and the whole batch's input_ids."
            )
    passed(DAY, 4)


# Exercise 5 ------------------------------------------------------------------

_FINISHED = {
    "stop": "FINISHED_STOPPED",
    "length": "FINISHED_LENGTH_CAPPED",
    "abort": "FINISHED_ABORTED",
}


def _transitions_from_trace(trace: Trace) -> list[tuple]:
    """(step, request_id, old, new) status changes of single-sequence requests."""
    status = {rid: "WAITING" for rid in trace.requests}
    out = []
    for step in trace.steps:
        n = step["step"]
        ends = {f["request_id"]: f["finish_reason"] for f in step["finished"]}
        for rid in step["ignored"]:
            ends[rid] = "ignored"
        now = {}
        for seq in step["seqs"].values():
            now[seq["request_id"]] = seq["status"].upper()
        for rid, reason in ends.items():
            now[rid] = "FINISHED_IGNORED" if reason == "ignored" else _FINISHED[reason]
        for rid in trace.requests:  # request-line order: the order requests were added
            if rid in now and now[rid] != status[rid]:
                out.append((n, rid, status[rid], now[rid]))
                status[rid] = now[rid]
    return out


def exercise_5(observer_cls) -> None:
    for name in ("preempt_recompute", "preempt_swap", "tight", "chunked_tight"):
        observer = observer_cls()
        trace = play(name, [observer])
        expected = _transitions_from_trace(trace)
        got = [tuple(x) for x in observer.transitions]
        if sorted(got, key=_order(trace)) != expected:
            missing = [t for t in expected if t not in got]
            extra = [t for t in got if t not in expected]
            raise AssertionError(
                f"scenario {name!r}: the status transitions differ from the trace's.\n"
                f"  missing: {missing[:5]}\n  unexpected: {extra[:5]}\n"
                "Record (step, request_id, old status name, new status name) whenever a "
                "sequence's `status` differs from the one you saw last; a new request starts "
                "as WAITING, steps count from 0 (one per on_step call), and a finished request "
                "moves to its FINISHED_* status in the step that finished it. Keep watching "
                "requests in every step, not only while they are scheduled: preemption and "
                "ignoring happen to requests that are not in the batch."
            )
    passed(DAY, 5)


def _order(trace: Trace):
    rank = {rid: i for i, rid in enumerate(trace.requests)}
    return lambda t: (t[0], rank.get(t[1], len(rank)))


def states_runs(states: list[tuple[int, str]]) -> str:
    """[(0, 'prefill'), (1, 'decode'), (2, 'decode')] -> 'prefill 0, decode 1-2'."""
    runs: list[list[Any]] = []
    for step, state in states:
        if runs and runs[-1][0] == state and runs[-1][2] == step - 1:
            runs[-1][2] = step
        else:
            runs.append([state, step, step])
    return ", ".join(f"{s} {a}" if a == b else f"{s} {a}-{b}" for s, a, b in runs)


"""Checkers for Day 3, the request lifecycle (labs/day3_request_lifecycle.ipynb).

Each `exercise_k` runs the learner's code on fixed workloads (the shipped
scenarios in their dry run, and the shipped model) and compares it with
what the trace recorded. It prints one line when everything agrees, or
raises AssertionError saying what was expected, what came back, and where
to look; when a wrong answer matches a common mistake (lessons/INSTRUCTOR.md,
Day 3), the message names it. An exception from the learner's code becomes
an AssertionError saying where it was raised and which fields exist. A
NotImplementedError from an unfinished exercise propagates.
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
from tools.labs.checks._engine_runs import learner_code

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


def _trace_hint(error: BaseException) -> str:
    """The likely mistake behind an exception while reading a trace."""
    if isinstance(error, KeyError):
        return (
            f"the key {error} is not there. A step is a dict (reference_impl/minivllm/tracer/"
            "SCHEMA.md): `scheduled` is a list of entries with request_id, seq_id, is_prefill "
            "and num_tokens; `sampled` maps sequence ids *as strings* to tokens; `queues_after` "
            "maps waiting/running/swapped to lists of request ids."
        )
    if isinstance(error, IndexError):
        return "trace.steps[n] is step n: stop at len(trace.steps) - 1."
    return "print one step of the trace (`trace.steps[n]`) and read its fields."


# Exercise 1 ------------------------------------------------------------------


def _states_mistake(trace: Trace, rid: str, expected: list, got: list) -> str:
    """The common mistake behind `got`, said for the learner, or ''."""
    arrival = trace.requests[rid]["arrival_step"]
    if got and got[0][0] != expected[0][0]:
        return (
            f"you started at step {got[0][0]}; request {rid} arrives in step {arrival}: start "
            "there (`trace.requests[request_id]['arrival_step']`)."
        )
    if len(got) > len(expected) and got[: len(expected)] == expected:
        return (
            f"you went on after step {expected[-1][0]}, the step whose `finished` names the "
            "request: stop there."
        )
    i = _first_index(expected, got)
    if i >= min(len(expected), len(got)):
        return ""
    want, have = expected[i][1], got[i][1]
    if want == "preempted" and have in ("waiting", "swapped"):
        return (
            f"step {expected[i][0]} preempted the request, and a preempted request is already "
            f"back in `{have}` in `queues_after`: look at `preempted` before the queues."
        )
    if want in ("prefill", "decode") and have == "finished":
        return (
            f"in step {expected[i][0]} the request ran and finished: it is in `scheduled`, so "
            "its word is prefill or decode; look at `scheduled` before `finished`."
        )
    if {want, have} == {"prefill", "decode"}:
        return (
            f"step {expected[i][0]} ran it as a {want}: take the word from its entry's "
            "`is_prefill` (a request preempted by recompute comes back as a prefill, and a "
            "chunked prompt is a prefill in every chunk)."
        )
    return ""


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
        with learner_code(f"your request_states, on request {rid} of {name!r},", _trace_hint):
            result = request_states(trace, rid)
        assert result is not None, "your request_states returned None: return the list."
        got = [tuple(x) for x in result]
        if got != expected:
            where = _first_difference(expected, got)
            closer = _states_mistake(trace, rid, expected, got)
            hint = (f"It looks like {closer}\n" if closer else "") + (
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


def _ttft_mistake(trace: Trace, rid: str, expected: int | None, got) -> str:
    """The common mistake behind a wrong TTFT, or ''."""
    life = trace.lifecycles()[rid]
    if expected is None:
        return (
            f"request {rid} never sampled a token (it was {life.finished[1]}): return None."
        )
    if got is None:
        return (
            "you found no step that sampled the request's first token. `sampled`'s keys are "
            "sequence ids as strings: compare str(entry['seq_id'])."
        )
    first_run = next(
        s["step"] for s in trace.steps if any(e["request_id"] == rid for e in s["scheduled"])
    )
    if got == expected - 1:
        return "you forgot the +1: the arrival step and the first-token step both count."
    if got == life.first_token_step or got == life.first_token_step + 1:
        return (
            f"you returned a step number; TTFT counts from the arrival step "
            f"({life.arrival_step}): first-token step - arrival step + 1."
        )
    if first_run != life.first_token_step and got == first_run - life.arrival_step + 1:
        return (
            f"you stopped at step {first_run}, its first prefill chunk; a chunk that does not "
            "finish the prompt samples nothing: look for the first step whose `sampled` holds "
            "one of its sequences."
        )
    return ""


def exercise_2(ttft_steps) -> None:
    for name in ("admission_blocked", "chunked_prefill", "preempt_recompute", "tight", "parallel"):
        trace = _trace(name)
        for rid, life in trace.lifecycles().items():
            if life.first_token_step is None:
                expected = None
            else:
                expected = life.first_token_step - life.arrival_step + 1
            with learner_code(f"your ttft_steps, on request {rid} of {name!r},", _trace_hint):
                got = ttft_steps(trace, rid)
            if got != expected:
                closer = _ttft_mistake(trace, rid, expected, got)
                raise AssertionError(
                    f"request {rid} in scenario {name!r} arrived at step {life.arrival_step} and "
                    f"got its first token in step {life.first_token_step}: TTFT is "
                    f"{expected} steps, your function returned {got!r}.\n"
                    + (f"It looks like {closer}\n" if closer else "")
                    + "Count both ends (a prompt "
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


def _preemption_mistake(expected: list[tuple], got: list[tuple]) -> str:
    """The common mistake behind a wrong list of preemptions, or ''."""
    if 0 < len(got) < len(expected) and got == expected[: len(got)]:
        return (
            f"you stopped after {len(got)} of the request's {len(expected)} preemptions: keep "
            "going through every step's `preempted`."
        )
    for want, mine in zip(expected, got, strict=False):
        if len(mine) == 4 and mine[2] is not None and mine[2] <= want[0]:
            return (
                f"the return you found (step {mine[2]}) is not after the preemption (step "
                f"{want[0]}): search from the step after the preemption, not from the start."
            )
    for want, mine in zip(expected, got, strict=False):
        if len(mine) == 4 and mine[:3] == want[:3] and mine[3] != want[3]:
            return (
                f"the step is right but not the tokens ({mine[3]} for {want[3]}): take the "
                "`num_tokens` of the request's entry in the step it came back."
            )
    return ""


def exercise_3(preemptions) -> None:
    cases = [("preempt_recompute", "C"), ("preempt_swap", "C"), ("preempt_recompute", "A")]
    trace = _trace("tight")
    cases += [("tight", rid) for rid in trace.requests]
    trace = _trace("chunked_tight")
    cases += [("chunked_tight", rid) for rid in trace.requests]
    for name, rid in cases:
        trace = _trace(name)
        expected = _reference_preemptions(trace, rid)
        with learner_code(f"your preemptions, on request {rid} of {name!r},", _trace_hint):
            result = preemptions(trace, rid)
        assert result is not None, "your preemptions returned None: return the list."
        got = [tuple(x) for x in result]
        if got != expected:
            i = max(_first_index(expected, got) - 1, 0)
            closer = _preemption_mistake(expected, got)
            raise AssertionError(
                f"request {rid} in scenario {name!r}: {_first_difference(expected, got)}.\n"
                f"  expected, from entry {i}: {expected[i : i + 3]}\n"
                f"  got,      from entry {i}: {got[i : i + 3]}\n"
                + (f"It looks like {closer}\n" if closer else "")
                + "One tuple per entry of a step's `preempted` naming the request: (that step, its "
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


def _observer_hint(error: BaseException) -> str:
    if isinstance(error, AttributeError):
        return (
            "an observer gets (engine, record); `record` is a StepRecord "
            "(reference_impl/minivllm/engine/step_observer.py): record.batch is the step's "
            "FlatBatch, record.seq_group_metadata_list its groups. Set every attribute you "
            "use in __init__."
        )
    return "the engine calls on_add_request(engine, seq_group) and on_step(engine, record)."


def _count_mistake(trace: Trace, expected: list[tuple], got: list[tuple]) -> str:
    """The common mistake behind wrong per-step counts, or ''."""
    if len(got) < len(expected) and got == [e for e in expected if e != (0, 0)]:
        return "you skipped the empty steps: append (0, 0) for a step that ran nothing."
    groups, seqs = [], []
    for step in trace.steps:
        kinds = [(e["request_id"], e["is_prefill"]) for e in step["scheduled"]]
        groups.append(tuple(len({r for r, p in kinds if p == want}) for want in (True, False)))
        seqs.append(tuple(sum(p == want for _, p in kinds) for want in (True, False)))
    decode_groups = [(e[0], g[1]) for e, g in zip(expected, groups, strict=True)]
    if got in (groups, seqs):
        return (
            "you counted sequence groups or sequences; count tokens: a prefill brings "
            "token_chunk_size tokens."
        )
    if got == decode_groups:
        return "a request with n=2 decodes 2 tokens per step, one per sequence: count tokens."
    return ""


def exercise_4(observer_cls) -> None:
    for name in ("chunked_prefill", "token_budget", "preempt_recompute", "parallel", "gap"):
        with learner_code(f"your {observer_cls.__name__}, on scenario {name!r},",
                          _observer_hint):
            observer = observer_cls()
            trace = play(name, [observer])
        expected = _tokens_per_step(trace)
        got = [tuple(x) for x in observer.steps]
        if got != expected:
            where = _first_difference(expected, got)
            closer = _count_mistake(trace, expected, got)
            raise AssertionError(
                f"scenario {name!r}: per-step (prefill tokens, decode tokens) differ at {where}.\n"
                f"  trace: {expected[:12]}{' ...' if len(expected) > 12 else ''}\n"
                f"  yours: {got[:12]}{' ...' if len(got) > 12 else ''}\n"
                + (f"It looks like {closer}\n" if closer else "")
                + "Append one tuple per on_step call, empty steps included. Count tokens, not "
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


def _transition_mistake(missing: list[tuple], extra: list[tuple]) -> str:
    """The common mistake behind missing or unexpected transitions, or ''."""
    if missing and len(extra) == len(missing):
        pairs = list(zip(missing, extra, strict=True))
        if all(m[1:] == e[1:] for m, e in pairs) and {e[0] - m[0] for m, e in pairs} == {1}:
            return (
                "your step numbers are off by +1: steps count from 0, one per on_step call "
                "(count after recording the step's transitions)."
            )
        return (
            "your step counter drifts from the engine's: add exactly 1 per on_step call, empty "
            "steps included, not one per group or per scheduled step."
        )
    if missing and not extra:
        new = {m[3] for m in missing}
        if new <= {"FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED", "FINISHED_ABORTED"}:
            return (
                "the FINISHED_* transitions are missing: look at a group's sequences in the "
                "step that finished it, before you stop watching it."
            )
        queued = {"WAITING", "SWAPPED", "FINISHED_IGNORED"}
        if all(queued & {m[2], m[3]} for m in missing):
            return (
                "you watched only the scheduled groups: preempted (back to WAITING or SWAPPED) "
                "and ignored requests are not in the batch. Keep the groups from on_add_request."
            )
    return ""


def exercise_5(observer_cls) -> None:
    for name in ("gap", "preempt_recompute", "preempt_swap", "tight", "chunked_tight"):
        with learner_code(f"your {observer_cls.__name__}, on scenario {name!r},",
                          _observer_hint):
            observer = observer_cls()
            trace = play(name, [observer])
        expected = _transitions_from_trace(trace)
        got = [tuple(x) for x in observer.transitions]
        if sorted(got, key=_order(trace)) != expected:
            missing = [t for t in expected if t not in got]
            extra = [t for t in got if t not in expected]
            closer = _transition_mistake(missing, extra)
            raise AssertionError(
                f"scenario {name!r}: the status transitions differ from the trace's.\n"
                f"  missing: {missing[:5]}\n  unexpected: {extra[:5]}\n"
                + (f"It looks like {closer}\n" if closer else "")
                + "Record (step, request_id, old status name, new status name) whenever a "
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


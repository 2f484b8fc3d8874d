"""Checkers for Day 1, the map (labs/day1_the_map.ipynb).

Each `exercise_k` runs the learner's code on the notebook's own `LLM` (the
shipped story model) and, where a behaviour only shows under pressure, on
small dry-run engines (no weights: the real scheduler and block manager)
whose KV cache is so small that requests are swapped out and back, whose
prompts are prefilled in chunks, and whose requests ask for two completions
(n=2). It compares with what the engine itself does: `LLM.generate` for
outputs, the `StepRecord` every observed step carries for the per-step
counts, the scheduler's own block moves for `my_step`. It prints one line
when everything agrees, or raises AssertionError saying what was expected,
what came back and where to look. A NotImplementedError from an unfinished
exercise propagates unchanged.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import json
import os
import re
import runpy
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from minivllm import LLM, SamplingParams
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.step_observer import queue_request_ids
from minivllm.outputs import RequestOutput
from minivllm.worker.worker import Worker
from tools.labs.checks._common import needs, passed  # noqa: F401 - needs: for the notebook
from tools.labs.checks._engine_runs import learner_code, quiet_engine

PROMPTS = ["Once upon a time", "The little dog", "Lily was a kind girl"]
# Different lengths, so the requests finish in another order than they came.
MAX_TOKENS = [24, 5, 12]
_SUMMARY_KEYS = {"prompt_tokens", "output_tokens", "finish_reason", "text"}
_ids = itertools.count()
DAY = 1
_REPO = Path(__file__).resolve().parents[3]
SCENARIO = _REPO / "lessons" / "day1_breakpoint.py"
_LESSON = "lessons/day1_the_map.md"


def _greedy(max_tokens: int, **kwargs: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


def _reference(llm: LLM, prompts, params) -> list[RequestOutput]:
    return llm.generate(prompts, params, use_tqdm=False)


def _abort_leftovers(engine: LLMEngine, request_ids) -> None:
    """A failed attempt must not leave requests behind in the shared engine."""
    live = [rid for rid in request_ids if rid in engine._live_request_ids]
    if live:
        engine.abort_request(live)
        while engine.has_unfinished_requests():
            engine.step()


# Exercise 1 ---------------------------------------------------------------------


def _summary(out: RequestOutput) -> dict[str, Any]:
    completion = out.outputs[0]
    return {
        "prompt_tokens": len(out.prompt_token_ids),
        "output_tokens": len(completion.token_ids),
        "finish_reason": completion.finish_reason,
        "text": out.prompt + completion.text,
    }


def _summarize_error(error: BaseException) -> str:
    if isinstance(error, AttributeError) and "RequestOutput" in str(error):
        return ("`token_ids`, `text` and `finish_reason` belong to each completion, "
                "`output.outputs[0]`; the RequestOutput itself has `prompt`, "
                "`prompt_token_ids` and `outputs`")
    return "print `out` and `out.outputs[0]` and read their fields (minivllm/outputs.py)"


def _summary_hint(key: str, got: Any, out: RequestOutput) -> str:
    """The closest reason for a wrong field of summarize's dict."""
    completion = out.outputs[0]
    closer = {
        "prompt_tokens": {  # the last key wins where two coincide
            len(out.prompt): "that is the prompt's characters; count its tokens, "
            "out.prompt_token_ids",
            len(out.prompt.split()): "that is the prompt's words; count its tokens, "
            "out.prompt_token_ids",
            len(out.prompt_token_ids) - 1: "the BOS token (id 0) the tokenizer puts first is "
            "one of the prompt's tokens: count all of out.prompt_token_ids",
        },
        "output_tokens": {
            len(completion.text): "that is the generated text's characters; count its tokens, "
            "out.outputs[0].token_ids",
            len(completion.text.split()): "that is the generated text's words; count its "
            "tokens, out.outputs[0].token_ids",
        },
        "text": {
            completion.text: "that is the generated text alone; put the prompt in front: "
            "out.prompt + out.outputs[0].text",
        },
    }.get(key, {})
    if got in closer:
        return closer[got]
    return {
        "prompt_tokens": "count out.prompt_token_ids (the BOS token included), not characters "
        "or words",
        "output_tokens": "count out.outputs[0].token_ids: tokens, not characters or words",
        "finish_reason": "read out.outputs[0].finish_reason: 'stop' for a stop string or EOS, "
        "'length' for max_tokens",
        "text": "the prompt followed by the generated text: out.prompt + out.outputs[0].text "
        "(the stop string itself is not in the text)",
    }[key]


def _check_params(params: Any) -> None:
    assert isinstance(params, SamplingParams), (
        f"make_params() should return a SamplingParams, got {type(params).__name__}"
    )
    assert params.temperature == 0, (
        "make_params() should decode greedily (temperature=0), got "
        f"temperature={params.temperature}"
    )
    assert params.max_tokens == 30, (
        f"make_params() should allow at most 30 new tokens (max_tokens=30), got {params.max_tokens}"
    )
    hint = ""
    if not params.stop and params.stop_token_ids:
        hint = (" Hint: stop_token_ids takes token ids; a stop *string* such as '.' goes in "
                "`stop`.")
    assert params.stop == ["."], (
        f"make_params() should stop at the first full stop: stop=['.'] (or stop='.'), "
        f"got stop={params.stop!r}.{hint}"
    )
    assert not params.include_stop_str_in_output, (
        "make_params() should leave include_stop_str_in_output at False: the text ends "
        "before the full stop, as vLLM's does by default."
    )


def exercise_1(make_params, summarize, llm: LLM) -> None:
    with learner_code("Your make_params()"):
        params = make_params()
    _check_params(params)
    for run_params in (params, _greedy(5)):
        for out in _reference(llm, PROMPTS, run_params):
            with learner_code("Your summarize(output)", _summarize_error):
                got = summarize(out)
            want = _summary(out)
            assert isinstance(got, dict) and set(got) == _SUMMARY_KEYS, (
                f"summarize should return a dict with the keys {sorted(_SUMMARY_KEYS)}, "
                f"got {got!r}"
            )
            for key in ("prompt_tokens", "output_tokens", "finish_reason", "text"):
                assert got[key] == want[key], (
                    f"For the prompt {out.prompt!r} with max_tokens={run_params.max_tokens}, "
                    f"stop={run_params.stop!r}: {key} should be {want[key]!r}, got "
                    f"{got[key]!r}. Hint: {_summary_hint(key, got[key], out)}."
                )
    passed(DAY, 1)


# Exercise 2 ---------------------------------------------------------------------


def _run_engine_error(error: BaseException) -> str:
    if isinstance(error, ValueError) and "already in use" in str(error):
        return ("each request needs an id of its own (for example str(i)): the engine refuses "
                "an id that an unfinished request already has")
    if isinstance(error, KeyError):
        return ("you looked up a request id that never finished: collect the outputs with "
                "output.finished from every step, keyed by output.request_id, and step until "
                "engine.has_unfinished_requests() is false")
    if isinstance(error, (TypeError, IndexError, AttributeError)):
        return ("`params` is a list, one SamplingParams per prompt: add_request(request_id, "
                "prompts[i], params[i])")
    return "compare your loop with LLM._run_engine in reference_impl/minivllm/entrypoints/llm.py"


def _abort_all(engine: LLMEngine) -> int:
    """Abort what a failed attempt left in the shared engine; how many there were."""
    left = engine.get_num_unfinished_requests()
    _abort_leftovers(engine, list(engine._live_request_ids))
    return left


def exercise_2(run_engine, llm: LLM) -> None:
    params = [_greedy(m) for m in MAX_TOKENS]
    want = _reference(llm, PROMPTS, params)
    engine = llm.llm_engine
    try:
        with learner_code("Your run_engine", _run_engine_error):
            got = run_engine(engine, PROMPTS, params)
    finally:
        leftover = _abort_all(engine)
    assert leftover == 0, (
        f"After run_engine returned, the engine still had {leftover} unfinished request(s). "
        "Hint: keep calling engine.step() while engine.has_unfinished_requests()."
    )
    assert isinstance(got, list) and all(isinstance(o, RequestOutput) for o in got), (
        f"run_engine should return a list of RequestOutput, got {type(got).__name__}"
        + (f" of {sorted({type(o).__name__ for o in got})}" if isinstance(got, list) else "")
    )
    assert len(got) <= len(PROMPTS), (
        f"run_engine should return one RequestOutput per prompt ({len(PROMPTS)}), got "
        f"{len(got)}. Hint: a request appears in the outputs of every step it takes part in, "
        "finished or not; keep only the outputs with output.finished."
    )
    assert len(got) == len(PROMPTS), (
        f"run_engine should return one RequestOutput per prompt ({len(PROMPTS)}), got "
        f"{len(got)}. Hint: each step() returns the outputs of the requests that took part "
        "in it; collect the finished ones from every step, not only the last."
    )
    unfinished = [o.request_id for o in got if not o.finished]
    assert not unfinished, (
        f"Requests {unfinished} are not finished in what run_engine returned. Hint: step() "
        "returns an output for every request in the batch, finished or not: keep those "
        "with output.finished."
    )
    got_prompts = [o.prompt for o in got]
    assert got_prompts == PROMPTS, (
        f"The outputs should come back in the order of the prompts, {PROMPTS}, got "
        f"{got_prompts}. Hint: requests finish in any order (here the shortest max_tokens "
        "first); remember each request id and return the outputs in the order you added them."
    )
    for w, g in zip(want, got, strict=True):
        assert list(g.outputs[0].token_ids) == list(w.outputs[0].token_ids), (
            f"For {w.prompt!r} (max_tokens={len(w.outputs[0].token_ids)}) LLM.generate gave "
            f"tokens {list(w.outputs[0].token_ids)}, your loop gave "
            f"{list(g.outputs[0].token_ids)}. Hint: pass each prompt's own SamplingParams "
            "to add_request."
        )
    passed(DAY, 2)


# Exercise 3 ---------------------------------------------------------------------


class _ReferenceLog:
    """The rows StepLog should keep, and, per step, what the usual wrong
    counts would give (to name the mistake when a row differs)."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self.wrong: list[dict[str, dict[Any, str]]] = []

    def on_add_request(self, engine, seq_group) -> None:
        pass

    def on_step(self, engine, record) -> None:
        meta = record.seq_group_metadata_list
        row = {
            "prefills": sum(len(m.seq_data) for m in meta if m.is_prompt),
            "decodes": sum(len(m.seq_data) for m in meta if not m.is_prompt),
            "tokens": len(record.batch.input_ids),
            "schedule_ms": record.schedule_ms,
            "execute_ms": record.execute_ms,
            "process_ms": record.process_ms,
        }
        self.rows.append(row)
        self.wrong.append(_wrong_counts(engine, record, row))


_GROUPS = ("you counted groups (requests); count sequences, len(m.seq_data): a request with "
           "n=2 decodes two sequences")
_QUEUES = ("you counted the scheduler's queues, but a queue is not the batch: a waiting "
           "request may not be admitted this step (max_num_seqs, the token budget), a running "
           "one may sit out a step while a prompt is prefilled alone (the default scheduler "
           "does not mix prefills with decodes) or still be prefilling its prompt in chunks, "
           "and a preempted one is in no batch. Count from the step's own batch, "
           "record.seq_group_metadata_list")
_PROMPT_LENS = ("a prefill does not always bring its whole prompt: with chunked prefill a long "
                "prompt is split over several steps. Count the tokens the model really ran "
                "on, len(record.batch.input_ids)")


def _wrong_counts(engine, record, row: dict[str, Any]) -> dict[str, dict[Any, str]]:
    """key -> {a wrong value: why}, for the values that differ from the right one."""
    meta = record.seq_group_metadata_list
    before = record.queues_before
    after = queue_request_ids(engine.scheduler)
    admitted = [r for r in before["waiting"] if r not in after["waiting"]]
    prompt_lens = sum(len(m.seq_data[next(iter(m.seq_data))].prompt_token_ids)
                      for m in meta if m.is_prompt)
    wrong = {
        "prefills": [
            (sum(1 for m in meta if m.is_prompt), _GROUPS),
            (len(before["waiting"]), _QUEUES), (len(admitted), _QUEUES),
            (len(after["waiting"]), _QUEUES),
        ],
        "decodes": [
            (sum(1 for m in meta if not m.is_prompt), _GROUPS),
            (len(before["running"]), _QUEUES), (len(after["running"]), _QUEUES),
            (len(after["running"]) - len(admitted), _QUEUES),
        ],
        "tokens": [
            (len(meta), "that is the number of groups in the batch; count the tokens the model "
             "ran on, len(record.batch.input_ids)"),
            (row["prefills"] + row["decodes"], "that is the number of sequences; a prefill "
             "brings many tokens, len(record.batch.input_ids) counts them all"),
            (prompt_lens + row["decodes"], _PROMPT_LENS),
        ],
    }
    return {
        key: {value: why for value, why in reversed(pairs) if value != row[key]}
        for key, pairs in wrong.items()
    }


def _staggered_run(engine, observers) -> None:
    """A and B arrive, two steps pass, C arrives: step 2 is C's prefill
    alone, A and B running but not in the batch (the default scheduler does
    not mix prefills with decodes)."""
    tag = next(_ids)
    ids = [f"day1-ex3-{tag}-{name}" for name in "ABC"]
    for observer in observers:
        engine.add_step_observer(observer)
    try:
        engine.add_request(ids[0], PROMPTS[0], _greedy(6))
        engine.add_request(ids[1], PROMPTS[1], _greedy(4))
        engine.step()
        engine.step()
        engine.add_request(ids[2], PROMPTS[2], _greedy(3))
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        for observer in observers:
            if observer in engine.step_observers:
                engine.remove_step_observer(observer)
        _abort_leftovers(engine, ids)


# A dry run where the queues and the batch part ways: max_num_seqs=3 keeps C and
# D waiting while A and B's three sequences run, B asks for two completions,
# and an 8-token budget prefills B and C in chunks.
_BUSY_ENGINE = dict(dry_run=True, block_size=4, num_gpu_blocks_override=16,
                    enable_chunked_prefill=True, max_num_batched_tokens=8, max_num_seqs=3,
                    disable_log_stats=True)
_BUSY_REQUESTS = {"A": (6, 5, 1), "B": (5, 4, 2), "C": (13, 3, 1), "D": (3, 2, 1)}


def _sampling(max_tokens: int, n: int) -> SamplingParams:
    """Greedy, or for n > 1 (which needs a temperature) the dry run's hashed samples."""
    return SamplingParams(n=n, temperature=0.8 if n > 1 else 0.0, max_tokens=max_tokens,
                          ignore_eos=True)


def _busy_run(observers) -> None:
    with quiet_engine():
        engine = LLM(**_BUSY_ENGINE).llm_engine
        for observer in observers:
            engine.add_step_observer(observer)
        for rid, (prompt_len, max_tokens, n) in _BUSY_REQUESTS.items():
            engine.add_request(rid, {"prompt_token_ids": list(range(10, 10 + prompt_len))},
                               _sampling(max_tokens, n))
        while engine.has_unfinished_requests():
            engine.step()


def _step_log_error(error: BaseException) -> str:
    if isinstance(error, AttributeError):
        return ("on_step receives the engine and a StepRecord (minivllm/engine/step_observer.py"
                "): the batch is record.seq_group_metadata_list (each entry has is_prompt and "
                "seq_data), the model input record.batch, the times record.schedule_ms, ...")
    return "print(record) inside on_step once and read its fields"


def _compare_logs(label: str, mine, ref: _ReferenceLog) -> None:
    rows = getattr(mine, "rows", None)
    assert isinstance(rows, list), "StepLog should keep its rows in a list, `self.rows`"
    assert len(rows) == len(ref.rows), (
        f"{label} took {len(ref.rows)} steps but your StepLog has {len(rows)} rows. "
        "Hint: append exactly one row in each on_step call (and none in on_add_request)."
    )
    for n, (got, want, wrong) in enumerate(zip(rows, ref.rows, ref.wrong, strict=True)):
        assert isinstance(got, dict) and set(got) == set(want), (
            f"{label}, row {n} should be a dict with the keys {sorted(want)}, got {got!r}"
        )
        for key, hint in (
            ("prefills", "count the sequences of the groups whose metadata has is_prompt"),
            ("decodes", "count the sequences of the groups that are not prompts"),
            ("tokens", "the number of tokens in the model's input: len(record.batch.input_ids)"
             " (a prefill brings its prompt tokens, a decode one)"),
        ):
            if got[key] != want[key]:
                raise AssertionError(
                    f"{label}, step {n}: {key} should be {want[key]}, got {got[key]} (the whole "
                    f"row should read {_stable(want)}). Hint: {wrong[key].get(got[key], hint)}."
                )
        for key in ("schedule_ms", "execute_ms", "process_ms"):
            if got[key] == want[key]:
                continue
            closer = ("that is the time in seconds; the record's times are already in "
                      "milliseconds" if _close(got[key], want[key] / 1e3)
                      else "the engine times the phases for you")
            raise AssertionError(
                f"{label}, step {n}: {key} should be the StepRecord's own {key} "
                f"({want[key]:.3f}), got {got[key]!r}. Hint: {closer}: record.{key}."
            )


def _close(a: Any, b: float) -> bool:
    return isinstance(a, float) and abs(a - b) <= 1e-9 + 1e-6 * abs(b)


def exercise_3(step_log_cls, llm: LLM) -> None:
    runs: tuple[tuple[str, Callable[[list], None]], ...] = (
        ("The staggered run on the story model (A and B, two steps, then C)",
         lambda observers: _staggered_run(llm.llm_engine, observers)),
        ("The busy dry run (max_num_seqs=3; B asks for n=2 completions; prompts prefilled "
         "in chunks of at most 8 tokens)", _busy_run),
    )
    for label, run in runs:
        with learner_code("Your StepLog", _step_log_error):
            mine = step_log_cls()
            ref = _ReferenceLog()
            run([ref, mine])
        _compare_logs(label, mine, ref)
    passed(DAY, 3)


def _stable(row: dict[str, Any]) -> dict[str, Any]:
    return {k: row[k] for k in ("prefills", "decodes", "tokens")}


# Exercise 4 ---------------------------------------------------------------------


class _NoWholeSteps:
    """Fails if the learner calls engine.step(): the point is to call its pieces."""

    called = False

    def on_add_request(self, engine, seq_group) -> None:
        pass

    def on_step(self, engine, record) -> None:
        self.called = True


_PHASES = ("schedule", "execute", "process")
_MOVES = ("blocks_to_swap_in", "blocks_to_swap_out", "blocks_to_copy")
_EXECUTE = inspect.signature(Worker.execute_model)


class _PhaseSpy:
    """Watches one engine's `scheduler.schedule` and `worker.execute_model`
    (instance attributes that shadow the methods) during one `my_step`: how
    often each was called, what the scheduler decided, what reached the
    worker."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.schedules: list[tuple[Any, Any]] = []
        self.executes: list[dict[str, Any]] = []
        engine.scheduler.schedule = self._schedule
        engine.worker.execute_model = self._execute_model

    def _schedule(self):
        scheduler = self.engine.scheduler
        result = type(scheduler).schedule(scheduler)
        self.schedules.append(result)
        return result

    def _execute_model(self, *args, **kwargs):
        worker = self.engine.worker
        try:
            self.executes.append(_EXECUTE.bind(worker, *args, **kwargs).arguments)
        except TypeError:
            pass  # the call below raises it, for learner_code to report
        return type(worker).execute_model(worker, *args, **kwargs)

    def remove(self) -> None:
        del self.engine.scheduler.schedule
        del self.engine.worker.execute_model

    def check_step(self, n: int) -> None:
        """The step `n` just taken called each phase once and handed the
        worker the scheduler's metadata and block moves, in their places."""
        assert len(self.schedules) == 1, (
            f"In step {n} your my_step called engine.scheduler.schedule() "
            f"{len(self.schedules)} times. Hint: call it exactly once per step: each call "
            "decides a new batch (and admits, preempts, allocates blocks), so a second call "
            "throws the first decision away."
        )
        assert len(self.executes) == 1, (
            f"In step {n} your my_step called engine.worker.execute_model "
            f"{len(self.executes)} times; call it exactly once, with what schedule() returned."
        )
        (meta, outputs), args = self.schedules[0], self.executes[0]
        assert args["seq_group_metadata_list"] is meta, (
            f"In step {n} your my_step handed execute_model something other than the "
            "seq_group_metadata_list schedule() returned (the first item of its pair)."
        )
        want = {name: list(getattr(outputs, name)) for name in _MOVES}
        got = {name: _as_list(args[name]) for name in _MOVES}
        if got == want:
            return
        swap_in, swap_out = want["blocks_to_swap_in"], want["blocks_to_swap_out"]
        if swap_in != swap_out and (
            got["blocks_to_swap_in"], got["blocks_to_swap_out"]) == (swap_out, swap_in):
            raise AssertionError(
                f"In step {n} your my_step gave the worker the swap-out list as "
                f"blocks_to_swap_in and the swap-in list as blocks_to_swap_out: the scheduler "
                f"asked to swap in {want['blocks_to_swap_in']} and out "
                f"{want['blocks_to_swap_out']}. Hint: the lists are in the wrong order; "
                "Worker.execute_model takes (seq_group_metadata_list, blocks_to_swap_in, "
                "blocks_to_swap_out, blocks_to_copy), as LLMEngine._execute_model passes them."
            )
        name = next(name for name in _MOVES if got[name] != want[name])
        what = {
            "blocks_to_swap_in": "bring back the KV cache of a request that was swapped out "
            "(CPU block -> GPU block); without it, the request resumes on blocks that hold "
            "someone else's keys and values",
            "blocks_to_swap_out": "save the KV cache of a preempted request to the CPU pool "
            "(GPU block -> CPU block); without it, its keys and values are lost and its GPU "
            "blocks are overwritten by other requests",
            "blocks_to_copy": "copy a block that two sequences of one request (n=2) shared, "
            "before one of them writes into it (copy-on-write); without it, the new block "
            "holds no keys and values",
        }[name]
        raise AssertionError(
            f"In step {n} the scheduler asked the worker for {name}={want[name]}, but your "
            f"my_step passed {got[name]} (all three moves it passed: {got}). These moves "
            f"{what}. Hint: pass scheduler_outputs.blocks_to_swap_in, "
            "scheduler_outputs.blocks_to_swap_out and scheduler_outputs.blocks_to_copy, in that "
            "order, as LLMEngine._execute_model does."
        )

    def reset(self) -> None:
        self.schedules.clear()
        self.executes.clear()


def _as_list(value: Any) -> Any:
    return list(value) if isinstance(value, (list, tuple)) else value


def _my_step_error(error: BaseException) -> str:
    if isinstance(error, AttributeError) and "SchedulerOutputs" in str(error):
        return ("schedule() returns a pair, (seq_group_metadata_list, scheduler_outputs); the "
                "block moves are scheduler_outputs.blocks_to_swap_in, .blocks_to_swap_out and "
                ".blocks_to_copy")
    if isinstance(error, TypeError) and "execute_model" in str(error):
        return ("worker.execute_model takes four arguments: seq_group_metadata_list, "
                "blocks_to_swap_in, blocks_to_swap_out, blocks_to_copy")
    if isinstance(error, (TypeError, ValueError)):
        return ("schedule() returns a pair, (seq_group_metadata_list, scheduler_outputs), and "
                "_process_model_outputs(output, scheduler_outputs) takes what execute_model "
                "returned")
    return "read LLMEngine._plain_step in reference_impl/minivllm/engine/llm_engine.py"


def _drive(my_step, engine: LLMEngine, max_steps: int) -> tuple[dict[str, RequestOutput],
                                                                 list[tuple[dict, float]]]:
    """Step the engine with `my_step` alone until nothing is left; the
    finished outputs by request id and, per step, (timings, wall ms)."""
    spy = _NoWholeSteps()
    phases = _PhaseSpy(engine)
    engine.add_step_observer(spy)
    finished: dict[str, RequestOutput] = {}
    timed: list[tuple[dict, float]] = []
    try:
        while engine.has_unfinished_requests() and len(timed) < max_steps:
            phases.reset()
            start = time.perf_counter()
            with learner_code("Your my_step", _my_step_error):
                result = my_step(engine)
            wall_ms = (time.perf_counter() - start) * 1e3
            assert not spy.called, (
                "my_step called engine.step(): write the three phases yourself, calling "
                "engine.scheduler.schedule(), engine.worker.execute_model(...) and "
                "engine._process_model_outputs(...)."
            )
            phases.check_step(len(timed))
            outputs, timings = _split_result(result)
            timed.append((timings, wall_ms))
            for out in outputs:
                if out.finished:
                    finished[out.request_id] = out
        assert not engine.has_unfinished_requests(), (
            f"After {max_steps} calls of my_step the requests were still unfinished. Hint: "
            "the third phase, engine._process_model_outputs(output, scheduler_outputs), is "
            "what appends each sampled token and finishes the requests."
        )
    finally:
        engine.remove_step_observer(spy)
        phases.remove()
    return finished, timed


def _split_result(result: Any) -> tuple[list[RequestOutput], dict[str, float]]:
    assert isinstance(result, tuple) and len(result) == 2, (
        f"my_step should return (request_outputs, timings), got {result!r:.120}"
    )
    outputs, timings = result
    if isinstance(outputs, dict) and isinstance(timings, list):
        raise AssertionError("my_step returned (timings, request_outputs): return the "
                             "outputs first, (request_outputs, timings).")
    assert isinstance(timings, dict) and set(timings) == set(_PHASES), (
        f"timings should be a dict with the keys {list(_PHASES)}, got {timings!r}"
    )
    bad = {k: v for k, v in timings.items() if not isinstance(v, float) or v < 0}
    assert not bad, (
        f"Each timing should be a float >= 0 (milliseconds), got {bad}. Hint: "
        "time.perf_counter() differences, times 1000."
    )
    assert isinstance(outputs, list), (
        f"request_outputs should be the list _process_model_outputs returns, got "
        f"{type(outputs).__name__}"
    )
    return outputs, timings


def _check_timings(timed: list[tuple[dict, float]]) -> None:
    """The three phases add up to about the time the whole call took (in
    milliseconds), and executing the model takes most of it."""
    reported = sum(sum(t.values()) for t, _ in timed)
    wall = sum(w for _, w in timed)
    ratio = reported / wall
    said = (f"Over the {len(timed)} steps your timings add up to {reported:.4g}, while the "
            f"my_step calls took {wall:.4g} ms in all")
    assert not 1e-4 <= ratio <= 5e-3, (
        f"{said}: about a thousandth. Hint: those are seconds; the timings are in "
        "milliseconds, (t1 - t0) * 1000."
    )
    assert ratio < 100, (
        f"{said}: {ratio:.0f} times more. Hint: the timings are in milliseconds: "
        "time.perf_counter() differences (seconds) times 1000, not perf_counter_ns."
    )
    assert ratio <= 1.2, (
        f"{said}: more than the calls themselves took. Hint: time each phase from its own "
        "start (t1 - t0, t2 - t1, t3 - t2), not every phase from the first."
    )
    assert ratio >= 0.5, (
        f"{said}: the phases should account for nearly all of it. Hint: take a "
        "time.perf_counter() before and after each of the three calls."
    )
    execute = sum(t["execute"] for t, _ in timed)
    assert execute > reported / 2, (
        f"execute should take most of the time on the story model (it runs the model), but "
        f"your timings give it {execute:.3g} of {reported:.3g} ms. Hint: are the phases under "
        "the right keys? schedule: scheduler.schedule(); execute: worker.execute_model(...); "
        "process: _process_model_outputs(...)."
    )


@functools.cache
def _scenario() -> dict[str, Any]:
    """lessons/day1_breakpoint.py's functions (running it defines them only)."""
    return runpy.run_path(str(SCENARIO))


def _scenario_engine() -> LLMEngine:
    with quiet_engine():
        return _scenario()["build_engine"]()


def _token_ids(outputs: dict[str, RequestOutput]) -> dict[str, list[list[int]]]:
    return {rid: [list(c.token_ids) for c in o.outputs] for rid, o in sorted(outputs.items())}


def exercise_4(my_step, llm: LLM, max_steps: int = 100) -> None:
    # Under pressure first: the swap scenario of lessons/day1_breakpoint.py,
    # whose steps swap blocks out, swap them in and copy one; every move must
    # reach the worker (a dry run: no model, so only the moves can tell).
    with quiet_engine():
        reference = _scenario_engine()
        want_out: dict[str, RequestOutput] = {}
        while reference.has_unfinished_requests():
            want_out.update((o.request_id, o) for o in reference.step() if o.finished)
        got_out, _ = _drive(my_step, _scenario_engine(), max_steps)
    assert got_out, (
        "In the swap scenario (lessons/day1_breakpoint.py) no finished RequestOutput came back "
        "from your my_step. Hint: the third phase, engine._process_model_outputs(output, "
        "scheduler_outputs), is what appends each sampled token and finishes the requests; "
        "return what it returns."
    )
    assert _token_ids(got_out) == _token_ids(want_out), (
        "In the swap scenario (lessons/day1_breakpoint.py) your my_step finished "
        f"{_token_ids(got_out)}, engine.step() finishes {_token_ids(want_out)}. Hint: return "
        "every RequestOutput that _process_model_outputs returns."
    )
    # On the story model: the tokens, and the timings, against engine.step().
    params = [_greedy(m) for m in MAX_TOKENS]
    want = _reference(llm, PROMPTS, params)
    engine = llm.llm_engine
    tag = next(_ids)
    ids = [f"day1-ex4-{tag}-{i}" for i in range(len(PROMPTS))]
    try:
        for rid, prompt, p in zip(ids, PROMPTS, params, strict=True):
            engine.add_request(rid, prompt, p)
        finished, timed = _drive(my_step, engine, max_steps)
    finally:
        _abort_leftovers(engine, ids)
    for rid, w in zip(ids, want, strict=True):
        g = finished[rid]
        assert list(g.outputs[0].token_ids) == list(w.outputs[0].token_ids), (
            f"For {w.prompt!r}, engine.step() gives tokens {list(w.outputs[0].token_ids)}, your "
            f"my_step gave {list(g.outputs[0].token_ids)}. Hint: pass the scheduler's metadata "
            "list and block moves to worker.execute_model, and its outputs to "
            "_process_model_outputs, as LLMEngine._plain_step does."
        )
    _check_timings(timed)
    passed(DAY, 4)


# Exercises 5 and 6: a breakpoint in LLMEngine.step -------------------------------

# The breakpoint's place: a path pdb finds on sys.path, and the first line of
# LLMEngine.step's body (found in the source, so it follows edits of the engine).
ENGINE_FILE = "minivllm/engine/llm_engine.py"


def _first_body_line(function: Callable) -> int:
    lines, start = inspect.getsourcelines(function)
    body = next(i for i, line in enumerate(lines) if line.rstrip().endswith(":")) + 1
    while lines[body].strip().startswith(('"""', "#")) or not lines[body].strip():
        body += 1  # no docstring today; skip one if it comes
    return start + body


STEP_LINE = _first_body_line(LLMEngine.step)


def engine_state(engine: LLMEngine) -> dict[str, Any]:
    """What a breakpoint at the start of `step()` shows: the queues (request
    ids in order), each swapped sequence's status, the free blocks."""
    scheduler = engine.scheduler
    return {
        **queue_request_ids(scheduler),
        "swapped_seqs": sum(len(sg.get_seqs()) for sg in scheduler.swapped),
        "free_gpu_blocks": scheduler.block_manager.get_num_free_gpu_blocks(),
        "free_cpu_blocks": scheduler.block_manager.get_num_free_cpu_blocks(),
    }


def scenario_states() -> list[dict[str, Any]]:
    """`engine_state` at the start of every step of the scenario."""
    engine = _scenario_engine()
    states = []
    with quiet_engine():
        while engine.has_unfinished_requests():
            states.append(engine_state(engine))
            engine.step()
    return states


def _pdb_driver() -> None:
    """Run the scenario's `main` under pdb, reading the commands from stdin
    and echoing each one (pdb does not when its input is a pipe); at every
    stop in LLMEngine.step, append `engine_state` to the JSON-lines file
    named by DAY1_PDB_STOPS, for the checker."""
    import bdb
    import logging
    import pdb

    logging.getLogger("minivllm").setLevel(logging.ERROR)
    stops = os.environ["DAY1_PDB_STOPS"]
    step_code = LLMEngine.step.__code__

    class Session(pdb.Pdb):
        def precmd(self, line: str) -> str:
            self.message(line)
            return super().precmd(line)

        def interaction(self, frame, traceback) -> None:
            if frame is not None and frame.f_code is step_code:
                with open(stops, "a") as f:
                    f.write(json.dumps(engine_state(frame.f_locals["self"])) + "\n")
            super().interaction(frame, traceback)

    main = _scenario()["main"]
    try:
        Session(readrc=False).runcall(main)
    except bdb.BdbQuit:
        pass


_PDB_TIMEOUT_S = 120


def _run_pdb(commands: list[str]) -> tuple[str, list[dict[str, Any]]]:
    """The transcript of a pdb session on the scenario, and the engine's
    state at each stop in LLMEngine.step."""
    with tempfile.TemporaryDirectory() as tmp:
        stops = os.path.join(tmp, "stops.jsonl")
        path = os.pathsep.join(
            [str(_REPO), str(_REPO / "reference_impl"), os.environ.get("PYTHONPATH", "")]
        )
        try:
            proc = subprocess.run(
                [sys.executable, "-c",
                 "from tools.labs.checks.day1 import _pdb_driver; _pdb_driver()"],
                input="\n".join([*commands, "quit"]) + "\n", capture_output=True, text=True,
                timeout=_PDB_TIMEOUT_S, cwd=_REPO,
                env={**os.environ, "PYTHONPATH": path, "DAY1_PDB_STOPS": stops},
            )
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"The pdb session did not end within {_PDB_TIMEOUT_S} s. Hint: a command that "
                "waits for more input (interact, a multi-line command) keeps pdb waiting; "
                "use one-line commands such as break, continue, p and pp."
            ) from None
        assert proc.returncode == 0, f"the pdb session failed:\n{proc.stderr[-2000:]}"
        states = []
        if os.path.exists(stops):
            states = [json.loads(line) for line in Path(stops).read_text().splitlines()]
    return _tidy(proc.stdout), states


def _tidy(transcript: str) -> str:
    """Paths relative to the repository and to reference_impl, the step line
    named, the session's closing quit dropped: the same on every machine."""
    for root in (_REPO / "reference_impl", _REPO):
        transcript = transcript.replace(str(root) + os.sep, "")
    transcript = re.sub(rf"llm_engine\.py([:(]){STEP_LINE}\b", r"llm_engine.py\1STEP_LINE",
                        transcript)
    return transcript.rstrip().removesuffix("(Pdb) quit").rstrip()


def pdb_session(commands: list[str]) -> str:
    """Run `python -m pdb lessons/day1_breakpoint.py` with these commands
    typed in, and return what pdb printed (a `quit` ends it)."""
    return _run_pdb(list(commands))[0]


# The question of exercises 5 and 6: the first step that starts with two
# requests swapped out.
def _target(states: list[dict[str, Any]]) -> int:
    return next(i for i, s in enumerate(states) if len(s["swapped"]) == 2)


def _describe(state: dict[str, Any]) -> str:
    return (f"waiting {state['waiting']}, running {state['running']}, swapped "
            f"{state['swapped']}, {state['free_gpu_blocks']} free GPU blocks")


def exercise_5(pdb_commands) -> None:
    with learner_code("Your pdb_commands()"):
        commands = pdb_commands()
    assert isinstance(commands, list) and all(isinstance(c, str) for c in commands), (
        "pdb_commands() should return a list of strings, one pdb command each, got "
        f"{commands!r:.200}"
    )
    transcript, stops = _run_pdb(commands)
    errors = [line for line in transcript.splitlines() if line.startswith("***")]
    states = scenario_states()
    target = _target(states)
    assert stops, (
        "Your pdb session never stopped inside LLMEngine.step. "
        + (f"pdb said: {errors[0]!r}. " if errors else "")
        + f"Hint: `break {ENGINE_FILE}:{STEP_LINE}, <condition>` (check.ENGINE_FILE and "
        "check.STEP_LINE), then `continue`: pdb starts paused at the script's first line, and "
        "only `continue` runs it to your breakpoint."
    )
    first = stops[0]
    if first == states[target]:
        passed(DAY, 5)
        return
    when = next((i for i, s in enumerate(states) if s == first), None)
    hint = (
        "a breakpoint without a condition stops at every step, the first one included; add a "
        "condition: `break FILE:LINE, <expression>`; and a condition pdb cannot evaluate (a "
        "NameError, or an AttributeError such as `self.swapped`: the queues belong to "
        "`self.scheduler`) counts as true, so it stops at once too"
        if when == 0
        else "the question is the first step that starts with *two* requests in "
        "self.scheduler.swapped, e.g. `len(self.scheduler.swapped) == 2`"
    )
    raise AssertionError(
        f"Your breakpoint first stopped in LLMEngine.step "
        f"{'at step ' + str(when) if when is not None else 'somewhere'} ({_describe(first)}); "
        f"the step asked for is step {target}. Hint: {hint}."
    )


_ANSWER_KEYS = ("waiting", "running", "swapped", "swapped_seqs", "free_gpu_blocks")


def exercise_6(answers) -> None:
    with learner_code("Your breakpoint_answers()"):
        got = answers()
    assert isinstance(got, dict) and set(got) == set(_ANSWER_KEYS), (
        f"breakpoint_answers() should return a dict with the keys {list(_ANSWER_KEYS)}, "
        f"got {got!r:.200}"
    )
    states = scenario_states()
    target = _target(states)
    want = states[target]
    after = states[target + 1]
    for key in _ANSWER_KEYS:
        if got[key] == want[key]:
            continue
        hint = {
            "waiting": "p queue_request_ids(self.scheduler)['waiting']",
            "running": "p queue_request_ids(self.scheduler)['running']: request ids, in "
            "queue order",
            "swapped": "request ids, in queue order (the first one swapped out is first): "
            "p queue_request_ids(self.scheduler)['swapped']",
            "swapped_seqs": "count sequences, not requests: a request with n=2 has two. "
            "p [len(sg.get_seqs()) for sg in self.scheduler.swapped]",
            "free_gpu_blocks": "p self.scheduler.block_manager.get_num_free_gpu_blocks(), "
            "at the breakpoint: blocks, not tokens",
        }[key]
        if key == "free_gpu_blocks" and got[key] == after[key]:
            hint = ("that is the count after the step ran (`next` or `return` moved on); "
                    "read it where the breakpoint stops, at the start of step()")
        if key == "free_gpu_blocks" and got[key] == want[key] * 4:
            hint = "that is tokens (4 per block); the question asks for blocks"
        if key == "swapped" and sorted(got[key]) == sorted(want[key]):
            hint = ("the right requests in the wrong order: a queue keeps the order in which "
                    "requests entered it (the one swapped out first is first)")
        raise AssertionError(
            f"At the start of step {target} (the first with two requests swapped out), "
            f"your {key} is {got[key]!r}, which is not what the engine holds there. "
            f"Hint: {hint}."
        )
    passed(DAY, 6)

"""Checkers for Day 1, the map (labs/day1_the_map.ipynb).

Each `exercise_k` runs the learner's code on the notebook's own `LLM` (the
shipped story model) and compares it with what the engine itself does:
`LLM.generate` for outputs, the `StepRecord` every observed step carries for
the per-step counts. It prints one line when everything agrees, or raises
AssertionError saying what was expected, what came back and where to look.
A NotImplementedError from an unfinished exercise propagates unchanged.
"""

from __future__ import annotations

import itertools
from typing import Any

from minivllm import LLM, SamplingParams
from minivllm.outputs import RequestOutput
from tools.labs.checks._common import passed

PROMPTS = ["Once upon a time", "The little dog", "Lily was a kind girl"]
# Different lengths, so the requests finish in another order than they came.
MAX_TOKENS = [24, 5, 12]
_SUMMARY_KEYS = {"prompt_tokens", "output_tokens", "finish_reason", "text"}
_ids = itertools.count()
DAY = 1


def _greedy(max_tokens: int, **kwargs: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


def _reference(llm: LLM, prompts, params) -> list[RequestOutput]:
    return llm.generate(prompts, params, use_tqdm=False)


def _abort_leftovers(engine, request_ids) -> None:
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


def exercise_1(make_params, summarize, llm: LLM) -> None:
    params = make_params()
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
    assert params.stop == ["."], (
        f"make_params() should stop at the first full stop: stop=['.'] (or stop='.'), "
        f"got stop={params.stop!r}"
    )
    for run_params in (params, _greedy(5)):
        for out in _reference(llm, PROMPTS, run_params):
            got = summarize(out)
            want = _summary(out)
            assert isinstance(got, dict) and set(got) == _SUMMARY_KEYS, (
                f"summarize should return a dict with the keys {sorted(_SUMMARY_KEYS)}, "
                f"got {got!r}"
            )
            for key in ("prompt_tokens", "output_tokens", "finish_reason", "text"):
                hint = {
                    "prompt_tokens": "count out.prompt_token_ids (the BOS token included), "
                    "not characters or words",
                    "output_tokens": "count out.outputs[0].token_ids: tokens, not characters "
                    "or words",
                    "finish_reason": "read out.outputs[0].finish_reason: 'stop' for a stop "
                    "string or EOS, 'length' for max_tokens",
                    "text": "the prompt followed by the generated text: out.prompt + "
                    "out.outputs[0].text (the stop string itself is not in the text)",
                }[key]
                assert got[key] == want[key], (
                    f"For the prompt {out.prompt!r} with max_tokens={run_params.max_tokens}, "
                    f"stop={run_params.stop!r}: {key} should be {want[key]!r}, got "
                    f"{got[key]!r}. Hint: {hint}."
                )
    passed(DAY, 1)


# Exercise 2 ---------------------------------------------------------------------


def exercise_2(run_engine, llm: LLM) -> None:
    params = [_greedy(m) for m in MAX_TOKENS]
    want = _reference(llm, PROMPTS, params)
    engine = llm.llm_engine
    got = run_engine(engine, PROMPTS, params)
    leftover = engine.get_num_unfinished_requests()
    if leftover:
        engine.abort_request([sg.request_id for sg in engine.scheduler.waiting])
        engine.abort_request([sg.request_id for sg in engine.scheduler.running])
        while engine.has_unfinished_requests():
            engine.step()
    assert leftover == 0, (
        f"After run_engine returned, the engine still had {leftover} unfinished request(s). "
        "Hint: keep calling engine.step() while engine.has_unfinished_requests()."
    )
    assert isinstance(got, list) and all(isinstance(o, RequestOutput) for o in got), (
        f"run_engine should return a list of RequestOutput, got {type(got).__name__}"
        + (f" of {sorted({type(o).__name__ for o in got})}" if isinstance(got, list) else "")
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
    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def on_add_request(self, engine, seq_group) -> None:
        pass

    def on_step(self, engine, record) -> None:
        meta = record.seq_group_metadata_list
        self.rows.append(
            {
                "prefills": sum(len(m.seq_data) for m in meta if m.is_prompt),
                "decodes": sum(len(m.seq_data) for m in meta if not m.is_prompt),
                "tokens": len(record.batch.input_ids),
                "schedule_ms": record.schedule_ms,
                "execute_ms": record.execute_ms,
                "process_ms": record.process_ms,
            }
        )


def _staggered_run(engine, observers) -> None:
    """A and B arrive, two steps pass, C arrives: step 2 mixes C's prefill
    with A's and B's decodes (the default fcfs policy)."""
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


def exercise_3(step_log_cls, llm: LLM) -> None:
    engine = llm.llm_engine
    mine, ref = step_log_cls(), _ReferenceLog()
    _staggered_run(engine, [ref, mine])
    rows = getattr(mine, "rows", None)
    assert isinstance(rows, list), "StepLog should keep its rows in a list, `self.rows`"
    assert len(rows) == len(ref.rows), (
        f"The run took {len(ref.rows)} steps but your StepLog has {len(rows)} rows. "
        "Hint: append exactly one row in each on_step call (and none in on_add_request)."
    )
    for n, (got, want) in enumerate(zip(rows, ref.rows, strict=True)):
        assert isinstance(got, dict) and set(got) == set(want), (
            f"Row {n} should be a dict with the keys {sorted(want)}, got {got!r}"
        )
        for key, hint in (
            ("prefills", "count the sequences of the groups whose metadata has is_prompt"),
            ("decodes", "count the sequences of the groups that are not prompts"),
            ("tokens", "the number of tokens in the model's input: len(record.batch.input_ids)"
             " (a prefill brings all its prompt tokens, a decode one)"),
        ):
            assert got[key] == want[key], (
                f"Step {n}: {key} should be {want[key]}, got {got[key]} (the whole row should "
                f"read {_stable(want)}). Hint: {hint}."
            )
        for key in ("schedule_ms", "execute_ms", "process_ms"):
            assert got[key] == want[key], (
                f"Step {n}: {key} should be the StepRecord's own {key} ({want[key]:.3f}), "
                f"got {got[key]!r}. Hint: the engine times the phases for you: record.{key}."
            )
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


def exercise_4(my_step, llm: LLM, max_steps: int = 100) -> None:
    params = [_greedy(m) for m in MAX_TOKENS]
    want = _reference(llm, PROMPTS, params)
    engine = llm.llm_engine
    tag = next(_ids)
    ids = [f"day1-ex4-{tag}-{i}" for i in range(len(PROMPTS))]
    spy = _NoWholeSteps()
    engine.add_step_observer(spy)
    finished: dict[str, RequestOutput] = {}
    steps = 0
    try:
        for rid, prompt, p in zip(ids, PROMPTS, params, strict=True):
            engine.add_request(rid, prompt, p)
        while engine.has_unfinished_requests() and steps < max_steps:
            result = my_step(engine)
            steps += 1
            assert not spy.called, (
                "my_step called engine.step(): write the three phases yourself, calling "
                "engine.scheduler.schedule(), engine.worker.execute_model(...) and "
                "engine._process_model_outputs(...)."
            )
            assert isinstance(result, tuple) and len(result) == 2, (
                f"my_step should return (request_outputs, timings), got {result!r:.120}"
            )
            outputs, timings = result
            assert isinstance(timings, dict) and set(timings) == set(_PHASES), (
                f"timings should be a dict with the keys {list(_PHASES)}, got {timings!r}"
            )
            bad = {k: v for k, v in timings.items() if not isinstance(v, float) or v < 0}
            assert not bad, (
                f"Each timing should be a float >= 0 (milliseconds), got {bad}. Hint: "
                "time.perf_counter() differences, times 1000."
            )
            for out in outputs:
                if out.finished:
                    finished[out.request_id] = out
        assert steps < max_steps or not engine.has_unfinished_requests(), (
            f"After {max_steps} calls of my_step the requests were still unfinished. Hint: "
            "the third phase, engine._process_model_outputs(output, scheduler_outputs), is "
            "what appends each sampled token and finishes the requests."
        )
    finally:
        engine.remove_step_observer(spy)
        _abort_leftovers(engine, ids)
    missing = [rid for rid in ids if rid not in finished]
    assert not missing, (
        f"No finished RequestOutput came back for {missing}. Hint: return what "
        "_process_model_outputs returns."
    )
    for rid, w in zip(ids, want, strict=True):
        g = finished[rid]
        assert list(g.outputs[0].token_ids) == list(w.outputs[0].token_ids), (
            f"For {w.prompt!r}, engine.step() gives tokens {list(w.outputs[0].token_ids)}, your "
            f"my_step gave {list(g.outputs[0].token_ids)}. Hint: pass the scheduler's block "
            "moves (blocks_to_swap_in, blocks_to_swap_out, blocks_to_copy) and its metadata "
            "list to worker.execute_model, in that order."
        )
    passed(DAY, 4)

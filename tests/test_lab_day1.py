"""Day 1's checkers reject every catalogued mistake with the message that
names it, and pass the solution and a differently written correct answer.

Each mistake is a flag on a copy of the solution's code (as the Day 13
tests in tests/test_labs.py do); nothing is imported from the notebooks.
"""

from __future__ import annotations

import re
import time

import pytest

from minivllm import LLM, SamplingParams
from tools.labs.checks import day1


@pytest.fixture(scope="module")
def llm():
    return LLM(disable_log_stats=True)


def _passes(capsys, k: int) -> None:
    assert capsys.readouterr().out == f"Day 1, exercise {k}: passed\n"


# Exercise 1 -------------------------------------------------------------------


def _make_params(*, stop_ids=False, keep_stop=False, tokens=30):
    if stop_ids:
        return SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[15])
    return SamplingParams(temperature=0.0, max_tokens=tokens, stop=["."],
                          include_stop_str_in_output=keep_stop)


def _summarize(output, *, no_bos=False, chars=False, words=False, text_only=False,
               reason_of_request=False):
    completion = output.outputs[0]
    output_tokens = len(completion.token_ids)
    if chars:
        output_tokens = len(completion.text)
    if words:
        output_tokens = len(completion.text.split())
    return {
        "prompt_tokens": len(output.prompt_token_ids) - no_bos,
        "output_tokens": output_tokens,
        "finish_reason": output.finish_reason if reason_of_request else completion.finish_reason,
        "text": completion.text if text_only else output.prompt + completion.text,
    }


def _summarize_other(output):
    """Correct, written otherwise: one completion, unpacked."""
    (completion,) = output.outputs[:1]
    return dict(text=f"{output.prompt}{completion.text}", finish_reason=completion.finish_reason,
                output_tokens=len(list(completion.token_ids)),
                prompt_tokens=len(list(output.prompt_token_ids)))


@pytest.mark.parametrize("params, summary, message", [
    ({"stop_ids": True}, {}, "a stop *string* such as '.' goes in `stop`"),
    ({"keep_stop": True}, {}, "leave include_stop_str_in_output at False"),
    ({"tokens": 31}, {}, "at most 30 new tokens"),
    ({}, {"no_bos": True}, "the BOS token (id 0) the tokenizer puts first"),
    ({}, {"chars": True}, "that is the generated text's characters"),
    ({}, {"words": True}, "that is the generated text's words"),
    ({}, {"text_only": True}, "that is the generated text alone"),
    ({}, {"reason_of_request": True}, "belong to each completion, `output.outputs[0]`"),
])
def test_exercise_1_rejects(llm, params, summary, message):
    with pytest.raises(AssertionError, match=re.escape(message)):
        day1.exercise_1(lambda: _make_params(**params), lambda o: _summarize(o, **summary), llm)


@pytest.mark.parametrize("summarize", [_summarize, _summarize_other])
def test_exercise_1_passes(llm, summarize, capsys):
    day1.exercise_1(lambda: SamplingParams(temperature=0, max_tokens=30, stop="."), summarize,
                    llm)
    _passes(capsys, 1)


# Exercise 2 -------------------------------------------------------------------


def _run_engine(engine, prompts, params, *, finish_order=False, every_output=False,
                last_step=False, same_id=False, first_params=False, stop_early=False):
    request_ids = ["same" if same_id else f"t-{i}" for i in range(len(prompts))]
    for i, (request_id, prompt) in enumerate(zip(request_ids, prompts, strict=True)):
        engine.add_request(request_id, prompt, params[0] if first_params else params[i])
    finished, seen, last = {}, [], []
    steps = 0
    while engine.has_unfinished_requests() and not (stop_early and steps == 3):
        last = engine.step()
        steps += 1
        seen += last
        for output in last:
            if output.finished:
                finished[output.request_id] = output
    if every_output:
        return seen
    if last_step:
        return last
    if finish_order:
        return list(finished.values())
    return [finished[request_id] for request_id in request_ids]


def _run_engine_other(engine, prompts, params):
    """Correct, written otherwise: numbered ids, sorted at the end."""
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params[i])
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    return sorted(done, key=lambda o: int(o.request_id))


@pytest.mark.slow
@pytest.mark.parametrize("mistake, message", [
    ("finish_order", "come back in the order of the prompts"),
    ("every_output", "keep only the outputs with output.finished"),
    ("last_step", "not only the last"),
    ("same_id", "each request needs an id of its own"),
    ("first_params", "pass each prompt's own SamplingParams"),
    ("stop_early", "a request id that never finished"),
])
def test_exercise_2_rejects(llm, mistake, message):
    with pytest.raises(AssertionError, match=re.escape(message)):
        day1.exercise_2(lambda e, p, s: _run_engine(e, p, s, **{mistake: True}), llm)
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.mark.slow
@pytest.mark.parametrize("answer", [_run_engine, _run_engine_other])
def test_exercise_2_passes(llm, answer, capsys):
    day1.exercise_2(answer, llm)
    _passes(capsys, 2)


# Exercise 3 -------------------------------------------------------------------


def _step_log(*, groups=False, queues=False, queues_after=False, meta_tokens=False,
              prompt_tokens=False, own_timer=False, seconds=False, bad_field=False):
    class StepLog:
        def __init__(self):
            self.rows = []
            self.last = time.perf_counter()

        def on_add_request(self, engine, seq_group):
            pass

        def on_step(self, engine, record):
            meta = record.seq_group_metadata_list
            prefills = sum(len(m.seq_data) for m in meta if m.is_prompt)
            decodes = sum(len(m.seq_data) for m in meta if not m.is_prompt)
            tokens = len(record.batch.input_ids)
            if groups:
                prefills = sum(1 for m in meta if m.is_prompt)
                decodes = sum(1 for m in meta if not m.is_prompt)
            if queues:
                prefills = len(record.queues_before["waiting"])
                decodes = len(record.queues_before["running"])
            if queues_after:
                left = [r for r in record.queues_before["waiting"]
                        if r not in {sg.request_id for sg in engine.scheduler.waiting}]
                prefills = len(left)
                decodes = len(record.queues_before["running"])
            if meta_tokens:
                tokens = len(meta)
            if prompt_tokens:
                tokens = sum(len(d.prompt_token_ids) for m in meta if m.is_prompt
                             for d in m.seq_data.values()) + decodes
            if bad_field:
                tokens = record.num_tokens
            times = {k: getattr(record, k) / (1e3 if seconds else 1)
                     for k in ("schedule_ms", "execute_ms", "process_ms")}
            if own_timer:
                now = time.perf_counter()
                times["execute_ms"] = (now - self.last) * 1e3
                self.last = now
            self.rows.append({"prefills": prefills, "decodes": decodes, "tokens": tokens,
                              **times})

    return StepLog


class _StepLogOther:
    """Correct, written otherwise: from the flattened batch and the outputs."""

    def __init__(self):
        self.rows = []

    def on_add_request(self, engine, seq_group):
        pass

    def on_step(self, engine, record):
        kinds = [m.is_prompt for m in record.seq_group_metadata_list
                 for _ in m.seq_data]
        row = dict(prefills=kinds.count(True), decodes=kinds.count(False),
                   tokens=len(record.batch.input_ids))
        row.update({f"{p}_ms": getattr(record, f"{p}_ms") for p in ("schedule", "execute",
                                                                     "process")})
        self.rows.append(row)


@pytest.mark.parametrize("mistake, message", [
    ("groups", "you counted groups (requests); count sequences"),
    ("queues", "a queue is not the batch"),
    ("queues_after", "a queue is not the batch"),
    ("meta_tokens", "that is the number of groups in the batch"),
    ("prompt_tokens", "with chunked prefill a long prompt is split"),
    ("own_timer", "the engine times the phases for you"),
    ("seconds", "that is the time in seconds"),
    ("bad_field", "Your StepLog raised AttributeError"),
])
def test_exercise_3_rejects(llm, mistake, message):
    with pytest.raises(AssertionError, match=re.escape(message)):
        day1.exercise_3(_step_log(**{mistake: True}), llm)
    assert not llm.llm_engine.step_observers


@pytest.mark.parametrize("answer", [_step_log(), _StepLogOther])
def test_exercise_3_passes(llm, answer, capsys):
    day1.exercise_3(answer, llm)
    _passes(capsys, 3)


# Exercise 4 -------------------------------------------------------------------


def _my_step(engine, *, drop_moves=False, no_swap_out=False, swap_order=False, no_copy=False,
             seconds=False,
             cumulative=False, nanoseconds=False, schedule_twice=False, no_process=False,
             whole_step=False, swapped_keys=False, outputs_attr=False):
    if whole_step:
        return engine.step(), {"schedule": 0.0, "execute": 0.0, "process": 0.0}
    clock = time.perf_counter_ns if nanoseconds else time.perf_counter
    t0 = clock()
    if schedule_twice:
        engine.scheduler.schedule()
    meta, outputs = engine.scheduler.schedule()
    t1 = clock()
    moves = [outputs.blocks_to_swap_in, outputs.blocks_to_swap_out, outputs.blocks_to_copy]
    if drop_moves:
        moves = [[], [], []]
    if swap_order:
        moves[0], moves[1] = moves[1], moves[0]
    if no_copy:
        moves[2] = []
    if no_swap_out:
        moves[1] = []
    if outputs_attr:
        moves[0] = outputs.swap_in
    output = engine.worker.execute_model(meta, *moves)
    t2 = clock()
    request_outputs = [] if no_process else engine._process_model_outputs(output, outputs)
    t3 = clock()
    scale = 1.0 if seconds else (1e-6 if nanoseconds else 1e3)
    start = t0 if cumulative else None
    timings = {
        "schedule": (t1 - t0) * scale,
        "execute": (t2 - (start or t1)) * scale,
        "process": (t3 - (start or t2)) * scale,
    }
    if nanoseconds:
        timings = {k: v * 1e6 for k, v in timings.items()}  # ns counted as if ms
    if swapped_keys:
        timings["schedule"], timings["execute"] = timings["execute"], timings["schedule"]
    return request_outputs, timings


def _my_step_other(engine):
    """Correct, written otherwise: keyword arguments, a loop over the phases."""
    marks = [time.perf_counter()]
    meta, sched = engine.scheduler.schedule()
    marks.append(time.perf_counter())
    out = engine.worker.execute_model(
        seq_group_metadata_list=meta, blocks_to_copy=sched.blocks_to_copy,
        blocks_to_swap_out=sched.blocks_to_swap_out, blocks_to_swap_in=sched.blocks_to_swap_in,
    )
    marks.append(time.perf_counter())
    results = engine._process_step(out, sched, meta)
    marks.append(time.perf_counter())
    names = ["schedule", "execute", "process"]
    return results, {name: 1000 * (b - a)
                     for name, a, b in zip(names, marks, marks[1:], strict=False)}


@pytest.mark.slow
@pytest.mark.parametrize("mistake, message", [
    ("drop_moves", "the scheduler asked the worker for blocks_to_copy=[(3, 6)]"),
    ("no_swap_out", "These moves save the KV cache of a preempted request"),
    ("swap_order", "the lists are in the wrong order"),
    ("no_copy", "copy a block that two sequences of one request (n=2) shared"),
    ("seconds", "those are seconds"),
    ("cumulative", "time each phase from its own start"),
    ("nanoseconds", "not perf_counter_ns"),
    ("schedule_twice", "call it exactly once per step"),
    ("no_process", "is what appends each sampled token"),
    ("whole_step", "my_step called engine.step()"),
    ("swapped_keys", "are the phases under the right keys?"),
    ("outputs_attr", "the block moves are scheduler_outputs.blocks_to_swap_in"),
])
def test_exercise_4_rejects(llm, mistake, message):
    with pytest.raises(AssertionError, match=re.escape(message)):
        day1.exercise_4(lambda engine: _my_step(engine, **{mistake: True}), llm, max_steps=40)
    assert not llm.llm_engine.has_unfinished_requests()
    assert not llm.llm_engine.step_observers


@pytest.mark.slow
@pytest.mark.parametrize("answer", [_my_step, _my_step_other])
def test_exercise_4_passes(llm, answer, capsys):
    day1.exercise_4(answer, llm)
    _passes(capsys, 4)


# Exercises 5 and 6 ------------------------------------------------------------

_BREAK = f"break {day1.ENGINE_FILE}:{day1.STEP_LINE}"
_READ = ["p queue_request_ids(self.scheduler)",
         "p self.scheduler.block_manager.get_num_free_gpu_blocks()"]


def _commands(*, condition="len(self.scheduler.swapped) == 2", no_continue=False):
    where = f"{_BREAK}, {condition}" if condition else _BREAK
    return [where, *([] if no_continue else ["continue"]), *_READ]


def _where_pdb_stops(commands: list[str]) -> list[dict]:
    """What pdb would record for these commands, without running it: the
    scenario's state at each step whose start satisfies the condition."""
    if "continue" not in commands:
        return []
    condition = commands[0].partition(", ")[2] or "True"
    states = day1.scenario_states()
    try:
        return [s for s in states if eval(condition, {"len": len, "self": _Engine(s)})]
    except AttributeError:  # pdb treats a condition that fails as true
        return states


class _Engine:
    def __init__(self, state):
        self.scheduler = type("Scheduler", (), state)


# pdb itself runs in a subprocess (about 5 s): these tests stand in for it with
# the stops it makes (checked by hand: a condition that raises stops at once).
@pytest.mark.parametrize("kwargs, message", [
    ({"condition": None}, "a breakpoint without a condition stops at every step"),
    ({"condition": "len(self.swapped) == 2"}, "the queues belong to `self.scheduler`"),
    ({"condition": "self.scheduler.swapped"}, "*two* requests in self.scheduler.swapped"),
    ({"no_continue": True}, "only `continue` runs it to your breakpoint"),
])
def test_exercise_5_rejects(monkeypatch, kwargs, message):
    monkeypatch.setattr(day1, "_run_pdb", lambda commands: ("", _where_pdb_stops(commands)))
    with pytest.raises(AssertionError, match=re.escape(message)):
        day1.exercise_5(lambda: _commands(**kwargs))


def test_exercise_5_passes_another_condition(monkeypatch, capsys):
    monkeypatch.setattr(day1, "_run_pdb", lambda commands: ("", _where_pdb_stops(commands)))
    day1.exercise_5(lambda: [f"{_BREAK}, len(self.scheduler.swapped) > 1", "continue"])
    _passes(capsys, 5)


@pytest.mark.slow
def test_exercise_5_passes_and_the_session_shows_the_queues(monkeypatch, capsys):
    """One real pdb session: the checker passes it, and its transcript shows
    the stop in LLMEngine.step and the queues printed there."""
    sessions = []

    def run_pdb(commands):
        sessions.append(real_run_pdb(commands))
        return sessions[-1]

    real_run_pdb = day1._run_pdb
    monkeypatch.setattr(day1, "_run_pdb", run_pdb)
    day1.exercise_5(_commands)
    _passes(capsys, 5)
    (transcript, _), = sessions
    assert "llm_engine.py(STEP_LINE)step()" in transcript
    assert "'swapped': ['C', 'B']" in transcript


_ANSWERS = {"waiting": [], "running": ["A"], "swapped": ["C", "B"], "swapped_seqs": 3,
            "free_gpu_blocks": 6}


@pytest.mark.parametrize("wrong, message", [
    ({"swapped": ["B", "C"]}, "the right requests in the wrong order"),
    ({"swapped_seqs": 2}, "count sequences, not requests"),
    ({"free_gpu_blocks": 24}, "that is tokens (4 per block)"),
    ({"free_gpu_blocks": 3}, "that is the count after the step ran"),
    ({"running": ["A", "C"]}, "request ids, in queue order"),
])
def test_exercise_6_rejects(wrong, message):
    with pytest.raises(AssertionError, match=re.escape(message)):
        day1.exercise_6(lambda: {**_ANSWERS, **wrong})


def test_exercise_6_passes(capsys):
    day1.exercise_6(lambda: dict(_ANSWERS))
    _passes(capsys, 6)

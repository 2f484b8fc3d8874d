"""Day 3's checkers reject every catalogued mistake with the message that
names it, and pass the solution and a differently written correct answer.

Each mistake is a flag on a copy of the lab's solution (lessons/INSTRUCTOR.md,
Day 3, lists them); the test asserts the checker's AssertionError names it.
"""

from __future__ import annotations

import re

import pytest

from minivllm.sequence import SequenceStatus
from tools.labs.checks import day3

# Exercise 1: request_states ------------------------------------------------------


def _states(trace, request_id, *, queues_first=False, no_stop=False, from_zero=False,
            finished_first=False, prefill_once=False, none=False):
    if none:
        return None
    arrival = 0 if from_zero else trace.requests[request_id]["arrival_step"]
    states, seen = [], False
    for step in trace.steps[arrival:]:
        mine = [e for e in step["scheduled"] if e["request_id"] == request_id]
        done = any(f["request_id"] == request_id for f in step["finished"])
        queues = step["queues_after"]
        queue = next((q for q in ("waiting", "running", "swapped") if request_id in queues[q]),
                     None)
        if finished_first and done:
            word = "finished"
        elif mine:
            is_prefill = not seen if prefill_once else mine[0]["is_prefill"]
            word = "prefill" if is_prefill else "decode"
            seen = True
        elif queues_first and queue:
            word = queue
        elif any(p["request_id"] == request_id for p in step["preempted"]):
            word = "preempted"
        else:
            word = queue or "finished"
        states.append((step["step"], word))
        if done and not no_stop:
            break
    return states


def _states_other(trace, request_id):
    """Correct, written otherwise: sets of kinds and queues, lists for tuples."""
    out = []
    for step in trace.steps[trace.requests[request_id]["arrival_step"]:]:
        kinds = {e["is_prefill"] for e in step["scheduled"] if e["request_id"] == request_id}
        preempted = {p["request_id"] for p in step["preempted"]}
        where = [q for q, ids in step["queues_after"].items() if request_id in ids]
        if kinds:
            word = "prefill" if True in kinds else "decode"
        elif request_id in preempted:
            word = "preempted"
        else:
            word = where[0] if where else "finished"
        out.append([step["step"], word])
        if request_id in {f["request_id"] for f in step["finished"]}:
            return out
    return out


@pytest.mark.parametrize("mistake, message", [
    ("queues_first", "look at `preempted` before the queues"),
    ("no_stop", "the step whose `finished` names the request: stop there"),
    ("from_zero", "you started at step 0"),
    ("finished_first", "look at `scheduled` before `finished`"),
    ("prefill_once", "take the word from its entry's `is_prefill`"),
    ("none", "returned None"),
])
def test_exercise_1_rejects(mistake, message):
    with pytest.raises(AssertionError, match=re.escape(message)):
        day3.exercise_1(lambda *a: _states(*a, **{mistake: True}))


def test_exercise_1_turns_a_key_error_into_a_hint():
    def states(trace, request_id):
        return [(s["step"], s["state"]) for s in trace.steps]

    with pytest.raises(AssertionError, match=r"raised KeyError(.|\n)*A step is a dict"):
        day3.exercise_1(states)


@pytest.mark.parametrize("answer", [_states, _states_other], ids=["solution", "other"])
def test_exercise_1_passes(answer, capsys):
    day3.exercise_1(answer)
    assert capsys.readouterr().out == "Day 3, exercise 1: passed\n"


# Exercise 2: ttft_steps ------------------------------------------------------------


def _ttft(trace, request_id, *, no_plus_one=False, absolute=False, first_chunk=False,
          int_keys=False, zero_for_none=False):
    arrival = trace.requests[request_id]["arrival_step"]
    for step in trace.steps[arrival:]:
        mine = {e["seq_id"] if int_keys else str(e["seq_id"])
                for e in step["scheduled"] if e["request_id"] == request_id}
        if (mine and first_chunk) or mine & set(step["sampled"]):
            if absolute:
                return step["step"] + 1
            return step["step"] - arrival + (0 if no_plus_one else 1)
    return 0 if zero_for_none else None


def _ttft_other(trace, request_id):
    """Correct, written otherwise: through the tracer's lifecycle view."""
    life = trace.lifecycles()[request_id]
    if life.first_token_step is None:
        return None
    return life.first_token_step + 1 - life.arrival_step


@pytest.mark.parametrize("mistake, message", [
    ("no_plus_one", "you forgot the +1"),
    ("absolute", "you returned a step number"),
    ("first_chunk", "its first prefill chunk"),
    ("int_keys", "`sampled`'s keys are sequence ids as strings"),
    ("zero_for_none", "never sampled a token (it was ignored): return None"),
])
def test_exercise_2_rejects(mistake, message):
    with pytest.raises(AssertionError, match=re.escape(message)):
        day3.exercise_2(lambda *a: _ttft(*a, **{mistake: True}))


@pytest.mark.parametrize("answer", [_ttft, _ttft_other], ids=["solution", "other"])
def test_exercise_2_passes(answer, capsys):
    day3.exercise_2(answer)
    assert capsys.readouterr().out == "Day 3, exercise 2: passed\n"


# Exercise 3: preemptions ----------------------------------------------------------


def _preemptions(trace, request_id, *, from_start=False, first_only=False, step_tokens=False):
    out = []
    for i, step in enumerate(trace.steps):
        for p in step["preempted"]:
            if p["request_id"] != request_id:
                continue
            back_step = back_tokens = None
            for later in trace.steps if from_start else trace.steps[i + 1:]:
                mine = [e for e in later["scheduled"] if e["request_id"] == request_id]
                if mine:
                    back_step = later["step"]
                    back_tokens = mine[0]["num_tokens"]
                    if step_tokens:
                        back_tokens = later["num_batched_tokens"]
                    break
            out.append((step["step"], p["mode"], back_step, back_tokens))
            if first_only:
                return out
    return out


def _preemptions_other(trace, request_id):
    """Correct, written otherwise: index the runs of the request first."""
    runs = {s["step"]: e["num_tokens"] for s in trace.steps for e in s["scheduled"]
            if e["request_id"] == request_id}
    out = []
    for step in trace.steps:
        for p in (p for p in step["preempted"] if p["request_id"] == request_id):
            back = min((n for n in runs if n > step["step"]), default=None)
            out.append([step["step"], p["mode"], back, runs.get(back)])
    return out


@pytest.mark.parametrize("mistake, message", [
    ("from_start", "search from the step after the preemption, not from the start"),
    ("first_only", "you stopped after 1 of the request's"),
    ("step_tokens", "take the `num_tokens` of the request's entry"),
])
def test_exercise_3_rejects(mistake, message):
    with pytest.raises(AssertionError, match=re.escape(message)):
        day3.exercise_3(lambda *a: _preemptions(*a, **{mistake: True}))


@pytest.mark.parametrize("answer", [_preemptions, _preemptions_other], ids=["solution", "other"])
def test_exercise_3_passes(answer, capsys):
    day3.exercise_3(answer)
    assert capsys.readouterr().out == "Day 3, exercise 3: passed\n"


# Exercise 4: TokenCounter -----------------------------------------------------------


def _counter(*, groups=False, skip_empty=False, decode_groups=False, typo=False):
    class TokenCounter:
        def __init__(self):
            self.steps = []

        def on_add_request(self, engine, seq_group):
            pass

        def on_step(self, engine, record):
            batch = record.batch
            if skip_empty and not batch.input_ids:
                return
            if typo:
                batch.num_prefill_token  # noqa: B018 - the typo under test
            metas = record.seq_group_metadata_list
            if groups:
                prompts = sum(m.is_prompt for m in metas)
                self.steps.append((prompts, len(metas) - prompts))
                return
            prefill = batch.num_prefill_tokens
            decode = len(batch.input_ids) - prefill
            if decode_groups:
                decode = sum(not m.is_prompt for m in metas)
            self.steps.append((prefill, decode))

    return TokenCounter


class _CounterOther:
    """Correct, written otherwise: from the groups' token_chunk_size and sequence count."""

    def __init__(self):
        self.steps = []

    def on_add_request(self, engine, seq_group):
        pass

    def on_step(self, engine, record):
        counts = [0, 0]
        for meta in record.seq_group_metadata_list:
            counts[0 if meta.is_prompt else 1] += meta.token_chunk_size * len(meta.seq_data)
        self.steps.append(tuple(counts))


@pytest.mark.parametrize("mistake, message", [
    ("groups", "you counted sequence groups or sequences"),
    ("skip_empty", "you skipped the empty steps"),
    ("decode_groups", "a request with n=2 decodes 2 tokens per step"),
    ("typo", "raised AttributeError"),
])
def test_exercise_4_rejects(mistake, message):
    with pytest.raises(AssertionError, match=re.escape(message)):
        day3.exercise_4(_counter(**{mistake: True}))


@pytest.mark.parametrize("answer", [_counter(), _CounterOther], ids=["solution", "other"])
def test_exercise_4_passes(answer, capsys):
    day3.exercise_4(answer)
    assert capsys.readouterr().out == "Day 3, exercise 4: passed\n"


# Exercise 5: TransitionRecorder ---------------------------------------------------


def _recorder(*, scheduled_only=False, count_from_one=False, per_group=False,
              busy_steps_only=False, drop_finished_first=False):
    class TransitionRecorder:
        def __init__(self):
            self.transitions = []
            self.num_steps = 1 if count_from_one else 0
            self.groups = []
            self.last = {}

        def on_add_request(self, engine, seq_group):
            self.groups.append(seq_group)
            for seq in seq_group.seqs:
                self.last[seq.seq_id] = seq.status

        def on_step(self, engine, record):
            if drop_finished_first:
                self.groups = [g for g in self.groups if not g.is_finished()]
            if scheduled_only:
                groups = [s.seq_group for s in record.scheduler_outputs.scheduled_seq_groups]
            else:
                groups = self.groups
            for group in groups:
                for seq in group.seqs:
                    old = self.last.get(seq.seq_id, SequenceStatus.WAITING)
                    if seq.status != old:
                        self.transitions.append(
                            (self.num_steps, group.request_id, old.name, seq.status.name))
                        self.last[seq.seq_id] = seq.status
                if per_group:
                    self.num_steps += 1
            self.groups = [g for g in self.groups if not g.is_finished()]
            if not per_group and (record.batch.input_ids or not busy_steps_only):
                self.num_steps += 1

    return TransitionRecorder


class _RecorderOther:
    """Correct, written otherwise: statuses by request id, the step from len(history)."""

    def __init__(self):
        self.transitions = []
        self.history = []
        self.groups = {}

    def on_add_request(self, engine, seq_group):
        self.groups[seq_group.request_id] = (seq_group, seq_group.seqs[0].status)

    def on_step(self, engine, record):
        step = len(self.history)
        for rid, (group, old) in list(self.groups.items()):
            new = group.seqs[0].status
            if new != old:
                self.transitions.append((step, rid, old.name, new.name))
                self.groups[rid] = (group, new)
            if new.is_finished(new):
                del self.groups[rid]
        self.history.append(step)


@pytest.mark.parametrize("mistake, message", [
    ("scheduled_only", "you watched only the scheduled groups"),
    ("count_from_one", "your step numbers are off by +1"),
    ("per_group", "your step counter drifts"),
    ("busy_steps_only", "empty steps included"),
    ("drop_finished_first", "the FINISHED_* transitions are missing"),
])
def test_exercise_5_rejects(mistake, message):
    with pytest.raises(AssertionError, match=re.escape(message)):
        day3.exercise_5(_recorder(**{mistake: True}))


@pytest.mark.parametrize("answer", [_recorder(), _RecorderOther], ids=["solution", "other"])
def test_exercise_5_passes(answer, capsys):
    day3.exercise_5(answer)
    assert capsys.readouterr().out == "Day 3, exercise 5: passed\n"

"""The tracer's capture: the engine's step-observer hook, the JSONL writer
and its schema, the reader that checks every trace it loads, the dry-run
executor, and a hand-worked scenario asserted field by field."""

from __future__ import annotations

import ast
import copy
import json
import random
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from minivllm import LLM, SamplingParams
from minivllm.engine import llm_engine, trace_writer
from minivllm.tracer.errors import TraceError
from minivllm.tracer.scenario import SCENARIO_DIR, load_scenario, run_scenario
from minivllm.tracer.schema import SCHEMA_PATH, _compile, _Invalid, check_line, validate_trace
from minivllm.tracer.trace import load_trace
from minivllm.worker.dry_run_worker import dry_run_token

REPO = Path(__file__).resolve().parents[1]


def ids(start: int, n: int) -> dict:
    return {"prompt_token_ids": list(range(start, start + n))}


def seq(request_id: str, status: str, num_tokens: int, num_computed_tokens: int) -> dict:
    """A sequence's entry in a step line's `seqs`."""
    return {
        "request_id": request_id,
        "status": status,
        "num_tokens": num_tokens,
        "num_computed_tokens": num_computed_tokens,
    }


# -- the hand-worked scenario ---------------------------------------------------------


@pytest.fixture(scope="module")
def admission_trace(tiny_model_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("trace") / "admission.jsonl"
    scenario = load_scenario(SCENARIO_DIR / "admission_blocked.yaml")
    run_scenario(scenario, path, tiny_model_dir("llama"), dry_run=True)
    return path


def test_hand_worked_admission_blocked_by_free_blocks(admission_trace):
    # 10 blocks of 16 tokens (watermark int(0.01 * 10) = 0). A: 100 prompt
    # tokens, 3 to generate; B: 50 tokens, 2 to generate; both arrive at step 0.
    trace = load_trace(admission_trace)
    cache = dict(trace.header["cache_config"])
    num_cpu = cache.pop("num_cpu_blocks")  # 4 GiB of swap: depends on the model's layers
    assert cache == {
        "block_size": 16,
        "num_gpu_blocks": 10,
        "watermark_blocks": 0,
        "enable_prefix_caching": False,
    }
    assert trace.header["dry_run"] is True
    assert (trace.header["schema_version"], trace.header["engine"]) == (3, "classic")
    a, b = trace.requests["A"], trace.requests["B"]
    assert (a["arrival_step"], len(a["prompt_token_ids"])) == (0, 100)
    assert (b["arrival_step"], len(b["prompt_token_ids"])) == (0, 50)
    assert len(trace.steps) == 5
    s0, s1, s2, s3, s4 = trace.steps
    none_moved = {"preempted": [], "ignored": [], "swap_in": [], "swap_out": [], "copy": []}

    # Step 0: A needs ceil(100/16) = 7 blocks; the free list hands out 0..6.
    # B needs ceil(50/16) = 4 > the 3 left (7, 8, 9): it waits, though the
    # token budget (2048) and max_num_seqs (256) have room.
    assert s0["queues_before"] == {"waiting": ["A", "B"], "running": [], "swapped": []}
    assert s0["queues_after"] == {"waiting": ["B"], "running": ["A"], "swapped": []}
    (e,) = s0["scheduled"]
    assert (e["request_id"], e["seq_id"], e["is_prefill"], e["num_tokens"]) == ("A", 0, True, 100)
    assert e["token_ids"] == a["prompt_token_ids"]
    assert e["positions"] == list(range(100))
    assert e["slot_mapping"] == list(range(100))  # block i holds slots 16i..16i+15
    assert s0["num_batched_tokens"] == 100
    assert s0["block_tables"] == {"0": [0, 1, 2, 3, 4, 5, 6]}
    assert s0["free_blocks"] == {"gpu": 3, "cpu": num_cpu}
    assert s0["seqs"] == {"0": seq("A", "running", 101, 100), "1": seq("B", "waiting", 50, 0)}
    assert {k: s0[k] for k in none_moved} == none_moved
    assert list(s0["sampled"]) == ["0"] and s0["finished"] == []
    assert s0["prefix_cache"] is None

    # Step 1: A decodes the token step 0 sampled, at position 100: block
    # 100 // 16 = 6, slot 6 * 16 + 100 % 16 = 100. 101 tokens still fit 7
    # blocks (112 slots): no new block. B still sees 3 free blocks.
    assert s1["queues_before"] == s1["queues_after"] == s0["queues_after"]
    (e,) = s1["scheduled"]
    assert (e["seq_id"], e["is_prefill"], e["num_tokens"]) == (0, False, 1)
    assert e["token_ids"] == [s0["sampled"]["0"]]
    assert (e["positions"], e["slot_mapping"]) == ([100], [100])
    assert s1["block_tables"] == s0["block_tables"]
    assert s1["free_blocks"]["gpu"] == 3

    # Step 2: position 101, slot 101. A's third token finishes it (length);
    # its 7 blocks return to the free list, which is now [9, 8, 7, 0, ..., 6].
    (e,) = s2["scheduled"]
    assert e["token_ids"] == [s1["sampled"]["0"]]
    assert (e["positions"], e["slot_mapping"]) == ([101], [101])
    assert s2["finished"] == [{"request_id": "A", "finish_reason": "length"}]
    assert s2["queues_after"] == {"waiting": ["B"], "running": [], "swapped": []}
    assert s2["block_tables"] == {}
    assert s2["free_blocks"]["gpu"] == 10
    # A's sequence is listed once more, finished, since it sampled this step.
    assert s2["seqs"] == {"0": seq("A", "finished", 103, 102), "1": seq("B", "waiting", 50, 0)}
    assert list(s2["sampled"]) == ["0"]

    # Step 3: B is admitted. Blocks are popped from the end of the free
    # list: 6, 5, 4, 3. Position p goes to slot table[p // 16] * 16 + p % 16:
    # 0-15 -> 96-111, 16-31 -> 80-95, 32-47 -> 64-79, 48-49 -> 48-49.
    assert s3["queues_before"] == {"waiting": ["B"], "running": [], "swapped": []}
    assert s3["queues_after"] == {"waiting": [], "running": ["B"], "swapped": []}
    (e,) = s3["scheduled"]
    assert (e["request_id"], e["seq_id"], e["is_prefill"], e["num_tokens"]) == ("B", 1, True, 50)
    assert e["token_ids"] == b["prompt_token_ids"] and e["positions"] == list(range(50))
    expected_slots = [*range(96, 112), *range(80, 96), *range(64, 80), 48, 49]
    assert e["slot_mapping"] == expected_slots
    assert s3["block_tables"] == {"1": [6, 5, 4, 3]}
    assert s3["free_blocks"]["gpu"] == 6

    # Step 4: B decodes position 50 in block table[3] = 3: slot 3 * 16 + 2 = 50,
    # and finishes with its second token; everything is free again.
    (e,) = s4["scheduled"]
    assert (e["positions"], e["slot_mapping"]) == ([50], [50])
    assert e["token_ids"] == [s3["sampled"]["1"]]
    assert s4["finished"] == [{"request_id": "B", "finish_reason": "length"}]
    assert s4["free_blocks"] == {"gpu": 10, "cpu": num_cpu}
    assert s4["queues_after"] == {"waiting": [], "running": [], "swapped": []}
    for step in trace.steps:
        assert all(ms >= 0 for ms in step["timings"].values())


def test_hand_worked_trace_is_valid(admission_trace):
    assert validate_trace(admission_trace) == 1 + 2 + 5  # header, 2 requests, 5 steps


# -- the real engine ----------------------------------------------------------------


def test_real_engine_trace_is_valid_and_is_the_model_input(tiny_model_dir, tmp_path):
    """A preempting, forking run: the trace validates, and each step's batch
    is exactly what the model's forward received."""
    path = tmp_path / "real.jsonl"
    llm = LLM(tiny_model_dir("llama"), trace=str(path), block_size=4, num_gpu_blocks_override=8)
    seen: list[tuple[list[int], list[int]]] = []
    model = llm.llm_engine.worker.model_runner.model
    model.register_forward_pre_hook(
        lambda _module, args: seen.append((args[0].tolist(), args[1].tolist()))
    )
    params = [
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0.8, n=2, max_tokens=6, seed=1, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
    ]
    outs = llm.generate([ids(2, 9), ids(20, 6), ids(40, 7)], params, use_tqdm=False)

    assert validate_trace(path) > 0
    trace = load_trace(path)
    ran = [s for s in trace.steps if s["scheduled"]]
    assert len(ran) == len(seen)
    for step, (input_ids, positions) in zip(ran, seen, strict=True):
        assert [t for e in step["scheduled"] for t in e["token_ids"]] == input_ids
        assert [p for e in step["scheduled"] for p in e["positions"]] == positions
    assert any(s["preempted"] for s in trace.steps)
    # Every generated token appears in `sampled`, forks included.
    owners = trace.seq_owners()
    for out in outs:
        sampled = [
            token
            for step in trace.steps
            for seq_id, token in step["sampled"].items()
            if owners[int(seq_id)] == out.request_id
        ]
        assert sorted(sampled) == sorted(t for c in out.outputs for t in c.token_ids)


def test_environment_variable_traces_and_explicit_trace_wins(
    tiny_model_dir, tmp_path, monkeypatch
):
    env_path, explicit = tmp_path / "env.jsonl", tmp_path / "explicit.jsonl"
    monkeypatch.setenv("MINIVLLM_TRACE", str(env_path))
    llm = LLM(tiny_model_dir("llama"), dry_run=True)
    llm.generate([ids(2, 5)], SamplingParams(max_tokens=3), use_tqdm=False)
    assert [s["step"] for s in load_trace(env_path).steps] == [0, 1, 2]

    env_path.unlink()
    LLM(tiny_model_dir("llama"), dry_run=True, trace=str(explicit))
    assert explicit.exists() and not env_path.exists()


def test_unobserved_step_does_no_tracing_work(tiny_model_dir, monkeypatch):
    """With no observer, step() never flattens the batch, snapshots queues
    or reads the clock for the tracer; with one, it does each once a step."""
    monkeypatch.delenv("MINIVLLM_TRACE", raising=False)
    calls = {"build": 0, "queues": 0}

    def counting(name, original):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return original(*args, **kwargs)

        return wrapper

    build, queues = llm_engine.FlatBatch.build, llm_engine.queue_request_ids
    monkeypatch.setattr(llm_engine.FlatBatch, "build", counting("build", build))
    monkeypatch.setattr(llm_engine, "queue_request_ids", counting("queues", queues))
    llm = LLM(tiny_model_dir("llama"), dry_run=True)
    engine = llm.llm_engine
    assert engine.step_observers == []
    engine.add_request("a", ids(2, 5), SamplingParams(max_tokens=4))
    for _ in range(2):
        engine.step()
    assert calls == {"build": 0, "queues": 0}

    class Recorder:
        def __init__(self):
            self.records, self.added = [], []

        def on_add_request(self, engine, seq_group):
            self.added.append(seq_group.request_id)

        def on_step(self, engine, record):
            self.records.append(record)

    recorder = Recorder()
    engine.add_step_observer(recorder)
    engine.add_request("b", ids(9, 3), SamplingParams(max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()
    # Three observed steps: b's prefill alone (vLLM's default runs no decode
    # beside a prefill), then a and b decode, then a's last token.
    assert calls == {"build": 3, "queues": 3}
    assert recorder.added == ["b"]
    first = recorder.records[0]
    assert first.queues_before == {"waiting": ["b"], "running": ["a"], "swapped": []}
    assert first.batch.input_ids == [9, 10, 11]  # b's prefill only
    assert first.batch.positions == [0, 1, 2]
    assert recorder.records[1].batch.positions == [6, 3]  # a's decode, then b's

    engine.remove_step_observer(recorder)
    engine.add_request("c", ids(2, 3), SamplingParams(max_tokens=2))
    engine.step()
    assert len(recorder.records) == 3


# -- a killed run -------------------------------------------------------------------


@pytest.mark.slow
def test_killed_run_leaves_a_readable_trace(tiny_model_dir, tmp_path):
    """SIGKILL in the middle of a step (after the trace line of step 3, before
    step() returns): no cleanup runs, and every finished step is readable."""
    path = tmp_path / "killed.jsonl"
    script = textwrap.dedent(
        f"""
        import os, signal
        from minivllm import LLM, SamplingParams

        class Killer:
            def on_add_request(self, engine, seq_group):
                pass

            def on_step(self, engine, record):
                if record.batch.positions[-1] >= 12:
                    os.kill(os.getpid(), signal.SIGKILL)

        llm = LLM({tiny_model_dir('llama')!r}, dry_run=True, trace={str(path)!r})
        llm.llm_engine.add_step_observer(Killer())
        llm.generate([{{"prompt_token_ids": list(range(2, 12))}}], SamplingParams(max_tokens=50))
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True)
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    trace = load_trace(path)
    # Step 0 prefills positions 0-9; step k decodes position 9 + k: the
    # killer fires in step 3, after the writer wrote it.
    assert [s["step"] for s in trace.steps] == [0, 1, 2, 3]
    assert validate_trace(path) == 1 + 1 + 4


def test_a_half_written_last_line_is_dropped(admission_trace, tmp_path):
    text = admission_trace.read_text()
    cut = tmp_path / "cut.jsonl"
    cut.write_text(text[: len(text) - 40])  # the last step line loses its end
    trace = load_trace(cut)
    assert trace.truncated and len(trace.steps) == 4
    assert validate_trace(cut) == 1 + 2 + 4
    broken = tmp_path / "broken.jsonl"
    broken.write_text(text.replace('"type":"step"', '"type":step', 1))
    with pytest.raises(ValueError, match=r"broken.jsonl:4: not a JSON line"):
        load_trace(broken)


# -- the dry run --------------------------------------------------------------------


def test_dry_run_loads_no_model_and_runs_every_request_to_max_tokens(tiny_model_dir):
    llm = LLM(tiny_model_dir("llama"), dry_run=True, num_gpu_blocks_override=64)
    worker = llm.llm_engine.worker
    assert worker.model_runner.model is None and worker.cache_engine is None
    # EOS (id 1) and the stop tokens are never drawn: lengths are exact.
    params = SamplingParams(max_tokens=40, stop_token_ids=[5, 6, 7])
    outs = llm.generate([ids(2, 5), ids(30, 17)], params, use_tqdm=False)
    for out in outs:
        tokens = out.outputs[0].token_ids
        assert len(tokens) == 40 and not {1, 5, 6, 7} & set(tokens)
        assert out.outputs[0].finish_reason == "length"


def test_dry_run_tokens_do_not_depend_on_the_batch(tiny_model_dir):
    """The same request gets the same tokens alone or among others, under
    another cache size and policy: its tokens are a function of itself."""
    params = SamplingParams(max_tokens=20)

    def run(engine, requests) -> dict[str, list[int]]:
        for request_id, prompt in requests:
            engine.add_request(request_id, prompt, params)
        tokens = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    tokens[out.request_id] = out.outputs[0].token_ids
        return tokens

    alone = LLM(tiny_model_dir("llama"), dry_run=True).llm_engine
    crowded = LLM(
        tiny_model_dir("llama"),
        dry_run=True,
        block_size=8,
        num_gpu_blocks_override=8,  # preempts
        scheduling_policy="priority",
    ).llm_engine
    mine = run(alone, [("mine", ids(2, 12))])["mine"]
    others = run(crowded, [("x", ids(50, 20)), ("mine", ids(2, 12)), ("y", ids(80, 9))])
    assert crowded.scheduler.num_cumulative_preemption > 0
    assert others["mine"] == mine
    # ...and they are the documented hash of (seed, request, position, previous token).
    vocab = alone.model_config.hf_config.vocab_size
    expected, prev = [], 13  # the prompt's last token, at position 11
    for position in range(11, 31):
        prev = dry_run_token(0, "mine", position, prev, 0, vocab, alone.eos_token_ids)
        expected.append(prev)
    assert mine == expected


def test_dry_run_forks_sample_best_of_draws(tiny_model_dir):
    llm = LLM(tiny_model_dir("llama"), dry_run=True)
    params = SamplingParams(n=3, temperature=1.0, max_tokens=5)
    (out,) = llm.generate([ids(2, 6)], params, use_tqdm=False)
    assert [len(c.token_ids) for c in out.outputs] == [5, 5, 5]
    assert len({c.token_ids[0] for c in out.outputs}) == 3  # three different draws


def test_trace_lines_are_flushed_as_written(tiny_model_dir, tmp_path):
    path = tmp_path / "live.jsonl"
    llm = LLM(tiny_model_dir("llama"), dry_run=True, trace=str(path))
    engine = llm.llm_engine
    engine.add_request("x", ids(2, 4), SamplingParams(max_tokens=3))
    engine.step()
    # Read while the writer is still open: header, request, step 0.
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["type"] for line in lines] == ["header", "request", "step"]
    engine.stop_trace()
    engine.step()
    assert len(path.read_text().splitlines()) == 3


# -- strict JSON ------------------------------------------------------------------


def _refuse(name):
    raise AssertionError(f"{name} in a trace")


def test_writer_writes_strict_json_and_a_non_finite_float_as_null():
    """Python's json would write `Infinity` and `NaN`, which are not JSON.
    (No field is non-finite today: SamplingParams refuses such values.)"""
    line = {"a": float("inf"), "b": [1.5, float("nan"), {"c": float("-inf")}], "d": "x"}
    text = trace_writer._dumps(line)
    assert json.loads(text, parse_constant=_refuse) == {
        "a": None, "b": [1.5, None, {"c": None}], "d": "x"
    }


@pytest.mark.parametrize("token", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_reader_refuses_non_finite_numbers_naming_the_line(admission_trace, tmp_path, token):
    lines = admission_trace.read_text().splitlines(keepends=True)
    step = json.loads(lines[4])
    step["timings"]["execute_ms"] = 12345.5
    lines[4] = json.dumps(step).replace("12345.5", token) + "\n"
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(lines))
    for read in (load_trace, validate_trace):
        with pytest.raises(
            TraceError, match=rf"^{bad}:5: the line has (NaN|Infinity|-Infinity|the number 1e999)"
        ):
            read(bad)


@pytest.mark.parametrize(
    ("text", "message"),
    [("[" * 100_000, "nested too deeply"), ("1" * 5000, "Exceeds the limit")],
)
def test_json_python_cannot_hold_is_refused_naming_the_line(
    admission_trace, tmp_path, text, message
):
    lines = admission_trace.read_text().splitlines(keepends=True)
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(lines[:3] + [text + "\n"] + lines[3:]))
    with pytest.raises(
        TraceError, match=rf"bad.jsonl:4: not a JSON line this tracer can read \(.*{message}"
    ):
        load_trace(bad)


# -- the reader's checks ----------------------------------------------------------


def test_an_empty_trace_is_not_valid(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(
        TraceError, match=r"empty.jsonl: not a trace: no header line \(the file is empty\)"
    ):
        validate_trace(empty)
    cut = tmp_path / "cut.jsonl"
    cut.write_text('{"type": "header", "schema_')
    with pytest.raises(TraceError, match="no header line .its only line is cut short"):
        validate_trace(cut)


def test_json_errors_name_the_line_of_the_file(admission_trace, tmp_path):
    lines = admission_trace.read_text().splitlines(keepends=True)
    lines[2] = lines[2][:30] + "\n"  # line 3 is cut in the middle of a string
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(lines))
    with pytest.raises(TraceError, match=r"bad.jsonl:3: not a JSON line \(.* at column \d+\)$"):
        validate_trace(bad)


def _rewrite(path: Path, out: Path, number: int, change) -> Path:
    """A copy of the trace at `path` with line `number` (1-based) passed
    through `change`, which edits the parsed line in place."""
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    change(lines[number - 1])
    out.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return out


@pytest.mark.parametrize(
    ("number", "change", "message"),
    [
        (2, lambda r: r.update(arrival_step=1), "arrival_step 1, but 0 step lines come before"),
        (4, lambda s: s.update(step=1), "step number 1, expected 0"),
        (4, lambda s: s["sampled"].update({"9": 5}), r"sampled names seqs \[9\] that seqs lacks"),
        (4, lambda s: s["block_tables"]["0"].append(10), r"gpu blocks \[10\], beyond the 10"),
        (4, lambda s: s["free_blocks"].update(gpu=11), "free_blocks.gpu is 11, more than"),
        (
            4,
            lambda s: s["finished"].append({"request_id": "Z", "finish_reason": "stop"}),
            r"request ids \['Z'\] have no request line",
        ),
        (4, lambda s: s.update(num_batched_tokens=99), "num_batched_tokens is not the sum"),
        (1, lambda h: h.update(schema_version=1), "schema_version 1, this tracer reads version 3"),
        (1, lambda h: h.update(type="step"), "a trace starts with its header line"),
        (4, lambda s: s["timings"].pop("execute_ms"), "step line: timings has no 'execute_ms'"),
        (4, lambda s: s.update(colour="red"), "step line has an unknown field 'colour'"),
        (4, lambda s: s["seqs"].update(x={}), 'step line: seqs has a key that is "x", which'),
        (
            4,
            lambda s: s.update(prefix_cache="none"),
            "prefix_cache is a string, expected null or object",
        ),
    ],
)
def test_reader_refuses_what_the_rules_forbid(admission_trace, tmp_path, number, change, message):
    bad = _rewrite(admission_trace, tmp_path / "bad.jsonl", number, change)
    with pytest.raises(TraceError, match=rf"^{bad}:{number}: .*{message}"):
        load_trace(bad)


def test_reader_refuses_a_second_header(admission_trace, tmp_path):
    lines = admission_trace.read_text().splitlines(keepends=True)
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(lines[:3] + lines[:1] + lines[3:]))
    with pytest.raises(TraceError, match=r"bad.jsonl:4: the header is the first line, and only"):
        load_trace(bad)


def _mutants(value, rng):
    """Copies of `value` with one part replaced, removed or added."""
    replacements = [None, "x", -1, 7, 1.5, True, [], {}, [3, 4], {"a": 1}]
    if isinstance(value, dict):
        yield {**value, "unexpected": 1}
        for key, item in value.items():
            yield {k: v for k, v in value.items() if k != key}
            for sub in _mutants(item, rng):
                yield {**value, key: sub}
    elif isinstance(value, list):
        yield value + [rng.choice(replacements)]
        for i, item in enumerate(value[:3]):
            for sub in _mutants(item, rng):
                yield value[:i] + [sub] + value[i + 1 :]
    for replacement in replacements:
        yield copy.deepcopy(replacement)


def test_line_checker_agrees_with_jsonschema(admission_trace, traces_for_schema):
    """The reader's compiled schema accepts and refuses what `jsonschema`,
    the reference implementation of JSON Schema, does."""
    jsonschema = pytest.importorskip("jsonschema")
    validator = jsonschema.Draft202012Validator(json.loads(SCHEMA_PATH.read_text()))
    rng = random.Random(0)
    lines = [
        json.loads(line) for path in traces_for_schema for line in path.read_text().splitlines()
    ]
    cases = lines + rng.sample([m for line in lines[:8] for m in _mutants(line, rng)], 600)
    refused = 0
    for line in cases:
        try:
            check_line(line)
            ours = True
        except _Invalid:
            ours, refused = False, refused + 1
        assert ours == validator.is_valid(line), json.dumps(line)[:300]
    assert 300 < refused < len(cases)


@pytest.fixture
def traces_for_schema(admission_trace, tiny_model_dir, tmp_path):
    """The hand-worked trace and one with swaps, forks and prefix caching."""
    scenario = load_scenario(SCENARIO_DIR / "preempt_swap.yaml")
    path = tmp_path / "swap.jsonl"
    run_scenario(scenario, path, tiny_model_dir("llama"), dry_run=True)
    return [admission_trace, path]


def test_schema_keywords_the_checker_lacks_are_refused():
    with pytest.raises(NotImplementedError, match="maximum"):
        _compile({"type": "integer", "maximum": 3}, {}, {})


def test_a_trace_started_mid_run_describes_the_queued_requests(tiny_model_dir, tmp_path):
    """Requests added before start_trace get request lines (arriving at step
    0), so the steps that name them make a valid trace."""
    llm = LLM(tiny_model_dir("llama"), dry_run=True)
    engine = llm.llm_engine
    engine.add_request("early", ids(2, 6), SamplingParams(max_tokens=8))
    engine.step()
    engine.add_request("waiting", ids(20, 4), SamplingParams(max_tokens=3))
    path = tmp_path / "mid.jsonl"
    engine.start_trace(str(path))
    engine.add_request("late", ids(40, 5), SamplingParams(max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()
    engine.stop_trace()
    trace = load_trace(path)
    assert {rid: r["arrival_step"] for rid, r in trace.requests.items()} == {
        "early": 0,
        "waiting": 0,
        "late": 0,
    }
    assert trace.lifecycles()["early"].num_output_tokens == 7  # one came before the trace


# -- the tracer's layers ---------------------------------------------------------------

# The facts: the trace model and what is derived from it. The views import
# them, never the other way (reference_impl/minivllm/tracer/__init__.py, facts.py).
FACT_MODULES = ("errors", "schema", "trace", "facts")
VIEW_MODULES = ("show", "summary", "notebook", "render", "timeline", "cli", "scenario", "style")


def _imports(path: Path) -> set[str]:
    """The modules `path` imports, at any depth of its code."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            if node.module == "minivllm.tracer":  # `from minivllm.tracer import show`
                names.update(f"minivllm.tracer.{alias.name}" for alias in node.names)
    return names


@pytest.mark.parametrize("module", FACT_MODULES)
def test_the_facts_import_no_view(module):
    imported = _imports(REPO / "reference_impl" / "minivllm" / "tracer" / f"{module}.py")
    tracer = {name.split(".")[2] for name in imported if name.startswith("minivllm.tracer.")}
    assert tracer <= set(FACT_MODULES), f"{module}.py imports {tracer - set(FACT_MODULES)}"
    # Nor what only the views need (the `trace` extra): labs use the facts without it.
    extras = {name.split(".")[0] for name in imported} & {"rich", "graphviz", "matplotlib", "yaml"}
    assert not extras, f"{module}.py imports {extras}"


def test_the_layers_classify_every_tracer_module():
    modules = {p.stem for p in (REPO / "reference_impl" / "minivllm" / "tracer").glob("*.py")}
    assert modules - {"__init__", "__main__"} == set(FACT_MODULES) | set(VIEW_MODULES)


def test_schema_version_is_defined_once():
    from minivllm.tracer import schema

    assert schema.SCHEMA_VERSION == trace_writer.SCHEMA_VERSION
    contract = json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))
    assert contract["$defs"]["header"]["properties"]["schema_version"] == {
        "const": trace_writer.SCHEMA_VERSION
    }
    assigned = [
        p.name
        for p in (REPO / "reference_impl" / "minivllm" / "tracer").glob("*.py")
        if re.search(r"SCHEMA_VERSION\b[^=\n]*=\s*\d", p.read_text(encoding="utf-8"))
    ]
    assert assigned == []


def test_step_record_carries_the_model_input_and_the_forks(tiny_model_dir):
    """The record's batch is the very FlatBatch the model runner turned into
    the model's tensors, and its samples are the engine's own pairing: an
    n=3 prompt's first sample names the parent and the two children forked
    from it, each with the token it got."""
    llm = LLM(tiny_model_dir("llama"))
    engine = llm.llm_engine
    runner = engine.worker.model_runner
    inputs = []
    prepare = runner.prepare_model_input

    def spying_prepare(seq_group_metadata_list):
        inputs.append(prepare(seq_group_metadata_list))
        return inputs[-1]

    runner.prepare_model_input = spying_prepare

    class Recorder:
        records: list = []

        def on_add_request(self, engine, seq_group):
            pass

        def on_step(self, engine, record):
            self.records.append((record, trace_writer._sampled(record)))

    engine.add_step_observer(Recorder())
    params = SamplingParams(n=3, temperature=1.0, max_tokens=3, seed=5, ignore_eos=True)
    engine.add_request("a", ids(2, 5), params)
    forks = []
    original_fork = engine.scheduler.fork_seq
    engine.scheduler.fork_seq = lambda parent, child: (
        forks.append((parent.seq_id, child.seq_id)),
        original_fork(parent, child),
    )[1]
    while engine.has_unfinished_requests():
        engine.step()

    assert len(Recorder.records) == len(inputs) == 3
    for (record, _), model_input in zip(Recorder.records, inputs, strict=True):
        assert record.batch is model_input.batch is record.output.batch
        assert model_input.input_ids.tolist() == record.batch.input_ids
        assert model_input.positions.tolist() == record.batch.positions

    (seq_group,) = [
        s.seq_group for s in Recorder.records[0][0].scheduler_outputs.scheduled_seq_groups
    ]
    parent = seq_group.seqs[0].seq_id
    children = [child for _, child in forks]
    assert forks == [(parent, children[0]), (parent, children[1])]
    first, sampled = Recorder.records[0]
    assert [(seq_id, p) for seq_id, p, _ in first.samples] == [
        (parent, parent),
        (children[0], parent),
        (children[1], parent),
    ]
    assert sampled == {str(seq.seq_id): seq.data.output_token_ids[0] for seq in seq_group.seqs}
    assert [s.output_token for s in first.output[0].samples] == list(sampled.values())
    # Later steps: each sequence samples one token for itself.
    for record, sampled in Recorder.records[1:]:
        assert [(seq_id, p) for seq_id, p, _ in record.samples] == [
            (s, s) for s in [parent, *children]
        ]
        assert sampled == {str(s): t for s, _, t in record.samples}

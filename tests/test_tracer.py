"""The tracer's capture: the engine's step-observer hook, the JSONL writer
and its schema, the dry-run executor, and a hand-worked scenario asserted
field by field."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from minivllm import LLM, SamplingParams
from minivllm.engine import llm_engine
from minivllm.worker.dry_run_worker import dry_run_token
from tools.tracer.scenario import SCENARIO_DIR, load_scenario, run_scenario
from tools.tracer.schema import validate_trace
from tools.tracer.trace import load_trace

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
    assert calls == {"build": 2, "queues": 2}
    assert recorder.added == ["b"]
    first = recorder.records[0]
    assert first.queues_before == {"waiting": ["b"], "running": ["a"], "swapped": []}
    assert first.batch.input_ids[:3] == [9, 10, 11]  # b's prefill comes first
    assert first.batch.positions == [0, 1, 2, 6]  # then a's decode at position 6

    engine.remove_step_observer(recorder)
    engine.add_request("c", ids(2, 3), SamplingParams(max_tokens=2))
    engine.step()
    assert len(recorder.records) == 2


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
        scheduling_policy="prefill_first",
    ).llm_engine
    mine = run(alone, [("mine", ids(2, 12))])["mine"]
    others = run(crowded, [("x", ids(50, 20)), ("mine", ids(2, 12)), ("y", ids(80, 9))])
    assert crowded.scheduler.num_cumulative_preemption > 0
    assert others["mine"] == mine
    # ...and they are the documented hash of (seed, request, position, previous token).
    vocab = alone.model_config.hf_config.vocab_size
    expected, prev = [], 13  # the prompt's last token, at position 11
    for position in range(11, 31):
        prev = dry_run_token(0, "mine", position, prev, 0, vocab, alone.stop_checker.eos_token_ids)
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

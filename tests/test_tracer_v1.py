"""The tracer on the V1 engine (minivllm/v1/): its traces validate (against
the reader and `jsonschema`), record exactly the model's input, show
num_computed_tokens catching up, prefix hits and the free queue's LRU
order, recompute after preemption, and the views show them."""

from __future__ import annotations

import json
import random

import pytest

from minivllm import LLM, SamplingParams
from minivllm.tracer.cli import main
from minivllm.tracer.scenario import SCENARIO_DIR, load_scenario, run_scenario
from minivllm.tracer.schema import SCHEMA_PATH, _Invalid, check_line, validate_trace
from minivllm.tracer.trace import PREFILL, load_trace
from tests.test_tracer import _mutants

BLOCK = 4
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def v1_llm(model: str, trace: str, **kwargs) -> LLM:
    options = dict(block_size=BLOCK, max_model_len=32, max_num_seqs=4, max_num_batched_tokens=16)
    return LLM(model, use_v1=True, trace=trace, **{**options, **kwargs})


def model_of(llm: LLM):
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.model_runner.model


def run(engine, arrivals: dict[int, list[tuple[str, list[int]]]], params=GREEDY) -> dict:
    """Add each step's requests, then step, until all finish; request id -> its outputs' ids."""
    outputs, step = {}, 0
    while step <= max(arrivals) or engine.has_unfinished_requests():
        for rid, prompt in arrivals.get(step, []):
            engine.add_request(rid, {"prompt_token_ids": prompt}, params)
        for out in engine.step():
            outputs[out.request_id] = list(out.outputs[0].token_ids)
        step += 1
    return outputs


PREFIX = list(range(10, 18))  # 2 full blocks shared by A and B


@pytest.fixture(scope="module")
def prefix_run(tiny_model_dir, tmp_path_factory):
    """A computes an 8-token prefix; B arrives 2 steps later with the same
    prefix (a hit of 2 blocks); C shares nothing and is chunked (budget 16)."""
    path = tmp_path_factory.mktemp("v1") / "prefix.jsonl"
    llm = v1_llm(tiny_model_dir("llama"), str(path), num_gpu_blocks_override=24)
    seen: list[tuple[list[int], list[int]]] = []
    model_of(llm).register_forward_pre_hook(
        lambda _m, args: seen.append((args[0].tolist(), args[1].tolist()))
    )
    prompts = {"A": PREFIX + [40, 41, 42], "B": PREFIX + [50, 51], "C": list(range(60, 80))}
    arrivals = {0: [("A", prompts["A"])], 2: [("B", prompts["B"]), ("C", prompts["C"])]}
    outputs = run(llm.llm_engine, arrivals)
    llm.llm_engine.stop_trace()
    return path, prompts, outputs, seen


@pytest.fixture(scope="module")
def preempt_run(tiny_model_dir, tmp_path_factory):
    """Three 8-token prompts growing to 18 tokens (5 blocks each) in 8
    usable blocks: the running queue's tail is preempted and recomputed."""
    path = tmp_path_factory.mktemp("v1") / "preempt.jsonl"
    llm = v1_llm(tiny_model_dir("llama"), str(path), num_gpu_blocks_override=9)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    starts = {"A": 2, "B": 30, "C": 60}
    prompts = {rid: list(range(start, start + 8)) for rid, start in starts.items()}
    outputs = run(llm.llm_engine, {0: list(prompts.items())}, params)
    llm.llm_engine.stop_trace()
    return path, prompts, outputs


def test_v1_trace_validates_and_is_a_v1_trace(prefix_run, preempt_run):
    for path in (prefix_run[0], preempt_run[0]):
        assert validate_trace(path) > 0
        trace = load_trace(path)
        assert trace.header["engine"] == "v1" and trace.header["schema_version"] == 3
        assert trace.header["cache_config"]["num_cpu_blocks"] == 0
        for step in trace.steps:
            check_line(step, "v1")
            with pytest.raises(_Invalid):
                check_line(step, "classic")


def test_v1_lines_agree_with_jsonschema(prefix_run, preempt_run):
    jsonschema = pytest.importorskip("jsonschema")
    validator = jsonschema.Draft202012Validator(json.loads(SCHEMA_PATH.read_text()))
    rng = random.Random(0)
    lines = [
        json.loads(line)
        for path in (prefix_run[0], preempt_run[0])
        for line in path.read_text().splitlines()
    ]
    steps = [line for line in lines if line["type"] == "step"]
    cases = lines + rng.sample([m for line in steps[:4] for m in _mutants(line, rng)], 300)
    refused = 0
    for line in cases:
        try:
            check_line(line)
            ours = True
        except _Invalid:
            ours, refused = False, refused + 1
        assert ours == validator.is_valid(line), json.dumps(line)[:300]
    assert 100 < refused < len(cases)


def test_recorded_batch_is_the_model_input(prefix_run):
    path, prompts, outputs, seen = prefix_run
    trace = load_trace(path)
    ran = [s for s in trace.steps if s["scheduled"]]
    assert len(ran) == len(seen)
    for step, (input_ids, positions) in zip(ran, seen, strict=True):
        assert [t for e in step["scheduled"] for t in e["token_ids"]] == input_ids
        assert [p for e in step["scheduled"] for p in e["positions"]] == positions
        assert step["num_batched_tokens"] == len(input_ids)
        # Rows with several tokens come first (the model runner's order).
        many = [e["num_tokens"] > 1 for e in step["scheduled"]]
        assert many == sorted(many, reverse=True)


def _check_token_ids_and_slots(trace, prompts, outputs):
    """Each request's batch tokens, by position, are its prompt and outputs;
    every position but the last sampled token's is computed, except those of
    its first prefix hit; slots are where the block table says."""
    for rid, prompt in prompts.items():
        tokens = prompt + outputs[rid]
        computed: dict[int, int] = {}
        first_start = None
        for step in trace.steps:
            table = step["block_tables"].get(rid)
            for e in (e for e in step["scheduled"] if e["request_id"] == rid):
                if first_start is None:
                    first_start = e["num_computed_tokens"]
                for token, pos, slot in zip(
                    e["token_ids"], e["positions"], e["slot_mapping"], strict=True
                ):
                    assert tokens[pos] == token
                    assert computed.setdefault(pos, token) == token
                    if table is not None:  # (none after the step that finished it)
                        assert slot == table[pos // BLOCK] * BLOCK + pos % BLOCK
        assert set(computed) | set(range(first_start)) == set(range(len(tokens) - 1))


def test_token_ids_rebuild_prompt_and_outputs_and_slots_follow_block_tables(
    prefix_run, preempt_run
):
    path, prompts, outputs, _ = prefix_run
    _check_token_ids_and_slots(load_trace(path), prompts, outputs)
    path, prompts, outputs = preempt_run
    _check_token_ids_and_slots(load_trace(path), prompts, outputs)


def test_num_computed_tokens_catches_up_by_the_scheduled_tokens(prefix_run, preempt_run):
    for path in (prefix_run[0], preempt_run[0]):
        trace = load_trace(path)
        before: dict[str, int] = {}
        for step in trace.steps:
            after = {r["request_id"]: r for r in step["requests"]}
            scheduled = {e["request_id"]: e for e in step["scheduled"]}
            preempted = {p["request_id"] for p in step["preempted"]}
            for rid, r in after.items():
                if rid in scheduled:
                    e = scheduled[rid]
                    if rid in step["queues_before"]["running"]:
                        assert e["num_computed_tokens"] == before[rid]
                    assert r["num_computed_tokens"] == e["num_computed_tokens"] + e["num_tokens"]
                    assert r["num_tokens"] >= r["num_computed_tokens"]
                elif rid in preempted:
                    assert r["num_computed_tokens"] == 0 and r["status"] == "preempted"
                else:
                    assert r["num_computed_tokens"] == before.get(rid, 0)
                before[rid] = r["num_computed_tokens"]


def test_prefix_hit_and_the_free_queue_order(prefix_run):
    path, prompts, outputs, _ = prefix_run
    trace = load_trace(path)
    # Step 2: B is admitted with A's two prefix blocks: 8 tokens hit, and
    # it computes from position 8. C (20 tokens) shares nothing.
    s2 = trace.steps[2]
    assert s2["queues_before"]["waiting"] == ["B", "C"]
    (b,) = [e for e in s2["scheduled"] if e["request_id"] == "B"]
    assert b["num_computed_tokens"] == 8 and b["positions"][0] == 8
    assert s2["prefix_cache"]["queries"] == len(prompts["B"]) + len(prompts["C"])
    assert s2["prefix_cache"]["hits"] == 8
    assert s2["block_tables"]["B"][:2] == s2["block_tables"]["A"][:2]
    assert trace.lifecycles()["B"].prefix_cache_hit_tokens == 8
    # C's 20 tokens do not fit the budget left: it is chunked.
    (c,) = [e for e in s2["scheduled"] if e["request_id"] == "C"]
    assert c["num_tokens"] < 20

    prev = None
    for step in trace.steps:
        queue = step["free_queue"]["block_ids"]
        assert len(queue) == step["free_blocks"]["gpu"]
        if prev is not None:
            # New blocks come from the head of the free queue (LRU); hits
            # take cached blocks out of its middle.
            old_tables, tables = prev["block_tables"], step["block_tables"]
            hit_blocks, popped = set(), set()
            for e in step["scheduled"]:
                rid = e["request_id"]
                gained = [x for x in tables.get(rid, []) if x not in old_tables.get(rid, [])]
                if rid in step["queues_before"]["waiting"]:
                    hit_blocks.update(tables[rid][: e["num_computed_tokens"] // BLOCK])
                popped.update(x for x in gained if x not in hit_blocks)
            head = [x for x in prev["free_queue"]["block_ids"] if x not in hit_blocks]
            assert popped == set(head[: len(popped)])
            # Finished requests' blocks join the queue last block first: the
            # cached ones at the tail, the others (a partial last block) at the head.
            cached_now = set(step["free_queue"]["cached"])
            for done in step["finished"]:
                rid = done["request_id"]
                still_held = {x for t in step["block_tables"].values() for x in t}
                freed = [x for x in reversed(prev["block_tables"][rid]) if x not in still_held]
                to_tail = [x for x in freed if x in cached_now]
                to_head = [x for x in freed if x not in cached_now]
                at_tail = queue[len(queue) - len(to_tail) :] == to_tail
                assert (at_tail and queue[: len(to_head)] == to_head) or len(step["finished"]) > 1
        prev = step
    # At the end every block is free; the full ones still hold their hash.
    last = trace.steps[-1]
    assert last["free_blocks"]["gpu"] == trace.usable_gpu_blocks
    cached = last["free_queue"]["cached"]
    assert set(s2["block_tables"]["A"][:2]) <= set(cached)
    assert cached == [x for x in last["free_queue"]["block_ids"] if x in set(cached)]
    # ... and they are all behind the uncached ones, which are reused first.
    assert last["free_queue"]["block_ids"][-len(cached) :] == cached


def test_preemption_is_recompute_from_what_the_cache_holds(preempt_run):
    path, prompts, outputs = preempt_run
    trace = load_trace(path)
    preempted = [(s["step"], p) for s in trace.steps for p in s["preempted"]]
    assert preempted and all(p["mode"] == "recompute" for _, p in preempted)
    n, p = preempted[0]
    rid = p["request_id"]
    step = trace.steps[n]
    (entry,) = [r for r in step["requests"] if r["request_id"] == rid]
    assert entry["status"] == "preempted" and entry["num_preemptions"] == 1
    assert entry["num_computed_tokens"] == 0
    assert step["queues_after"]["waiting"][0] == rid
    assert rid not in step["block_tables"]
    # It comes back: looked up as a resumed request, computing its prompt
    # and generated tokens again from what the prefix cache still holds.
    back = next(
        s for s in trace.steps[n + 1 :] if any(e["request_id"] == rid for e in s["scheduled"])
    )
    (e,) = [e for e in back["scheduled"] if e["request_id"] == rid]
    assert e["num_computed_tokens"] % BLOCK == 0
    assert e["positions"][-1] >= len(prompts[rid])  # its outputs are recomputed too
    assert back["prefix_cache"]["preempted_queries"] > 0
    assert trace.lifecycles()[rid].preemptions[0] == (n, "recompute")
    assert all(len(outputs[r]) == 10 for r in prompts)


def test_views_show_v1_fields(prefix_run, preempt_run, tmp_path, capsys):
    prefix, preempt = str(prefix_run[0]), str(preempt_run[0])
    assert main(["validate", preempt]) == 0
    assert main(["show", prefix]) == 0
    out = capsys.readouterr().out
    assert "(V1)" in out and "B 8→" in out and "swap" not in out
    assert main(["show", prefix, "--step", "2"]) == 0
    out = capsys.readouterr().out
    assert "num_computed_tokens catching up" in out and "free queue, next evicted first" in out
    assert "8 of" in out  # the prefix cache's hits
    n = next(s["step"] for s in load_trace(preempt).steps if s["preempted"])
    assert main(["show", preempt, "--step", str(n)]) == 0
    out = capsys.readouterr().out
    assert "(recompute)" in out and "preempted" in out
    assert main(["summary", preempt]) == 0
    out = capsys.readouterr().out
    assert "V1" in out and "computed again" in out and "no swap pool" in out
    assert main(["timeline", preempt, "-o", str(tmp_path / "t.json")]) == 0
    capsys.readouterr()
    assert main(["render", preempt, "--step", "1", "-o", str(tmp_path / "s.svg")]) == 1
    assert "this is a V1 trace" in capsys.readouterr().err
    trace = load_trace(prefix)
    assert "waiting / running</th>" in trace._repr_html_() and trace.step(0)._repr_svg_() is None
    assert trace.lifecycles()["C"].states[0] == (2, PREFILL)


def test_environment_variable_traces_v1_and_multiprocess_is_refused(
    tiny_model_dir, tmp_path, monkeypatch
):
    path = tmp_path / "env.jsonl"
    monkeypatch.setenv("MINIVLLM_TRACE", str(path))
    llm = LLM(
        tiny_model_dir("llama"),
        use_v1=True,
        block_size=BLOCK,
        max_model_len=32,
        num_gpu_blocks_override=16,
    )
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=3), use_tqdm=False)
    trace = load_trace(path)
    assert trace.header["engine"] == "v1" and [s["step"] for s in trace.steps] == [0, 1, 2]
    assert trace.steps[-1]["finished"] == [{"request_id": "0", "finish_reason": "length"}]
    monkeypatch.setenv("MINIVLLM_ENABLE_V1_MULTIPROCESSING", "1")
    with pytest.raises(ValueError, match="multiprocess_mode=False"):
        LLM(tiny_model_dir("llama"), use_v1=True, max_model_len=32, num_gpu_blocks_override=16)


def test_abort_and_a_trace_started_mid_run(tiny_model_dir, tmp_path):
    llm = v1_llm(tiny_model_dir("llama"), None, num_gpu_blocks_override=16)
    engine = llm.llm_engine
    engine.add_request("early", {"prompt_token_ids": [3, 4, 5, 6]}, GREEDY)
    engine.step()
    path = tmp_path / "mid.jsonl"
    engine.start_trace(str(path))
    engine.add_request("late", {"prompt_token_ids": [7, 8]}, GREEDY)
    engine.step()
    engine.abort_request("late")
    while engine.has_unfinished_requests():
        engine.step()
    engine.stop_trace()
    trace = load_trace(path)
    assert {rid: r["arrival_step"] for rid, r in trace.requests.items()} == {"early": 0, "late": 0}
    abort = {"request_id": "late", "finish_reason": "abort"}
    aborted = next(s for s in trace.steps if abort in s["finished"])
    (late,) = [r for r in aborted["requests"] if r["request_id"] == "late"]
    assert late["status"] == "finished_aborted"


def test_scenario_runs_on_v1(tiny_model_dir, tmp_path):
    scenario = load_scenario(SCENARIO_DIR / "prefix_cache.yaml")
    path = tmp_path / "scenario.jsonl"
    steps = run_scenario(
        scenario,
        path,
        tiny_model_dir("llama"),
        engine_overrides={"use_v1": True, "max_model_len": 128},
    )
    trace = load_trace(path)
    assert trace.is_v1 and len(trace.steps) == steps
    # B arrives at step 2 and finds the 64-token system prompt cached.
    assert trace.lifecycles()["B"].prefix_cache_hit_tokens == 64


def test_a_stop_string_is_a_stop_the_engine_core_saw_as_an_abort(tiny_model_dir, tmp_path):
    """The front end finds stop strings and aborts the request in the
    engine core: finish_reason "stop", status finished_aborted."""
    prompt = [{"prompt_token_ids": [3, 4, 5, 6]}]
    plain = v1_llm(tiny_model_dir("llama"), None, num_gpu_blocks_override=16)
    (first,) = plain.generate(prompt, GREEDY, use_tqdm=False)[0].outputs
    # The text of the first two tokens: found before max_tokens ends the request.
    text = plain.get_tokenizer().decode(first.token_ids[:2])
    assert text and text in first.text
    path = tmp_path / "stop.jsonl"
    llm = v1_llm(tiny_model_dir("llama"), str(path), num_gpu_blocks_override=16)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, stop=[text])
    (out,) = llm.generate(prompt, params, use_tqdm=False)
    assert out.outputs[0].finish_reason == "stop"
    last = load_trace(path).steps[-1]
    assert last["finished"] == [{"request_id": "0", "finish_reason": "stop"}]
    assert [r["status"] for r in last["requests"]] == ["finished_aborted"]
    assert last["block_tables"] == {} and last["queues_after"] == {"waiting": [], "running": []}

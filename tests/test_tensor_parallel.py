"""Tensor parallelism end to end: `LLM(..., tensor_parallel_size=2)` with the
multiprocessing executor (rank 1 in a worker process, gloo over 127.0.0.1)
gives the tokens of one worker and of Hugging Face, for every architecture
and under the features that move KV blocks; and the workers never outlive
the engine, whether it shuts down, fails to start, or loses a worker."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from minivllm import LLM, SamplingParams
from minivllm.engine.llm_engine import EngineDeadError
from minivllm.executor.distributed_executor import WorkerDiedError
from minivllm.executor.multiproc_executor import MultiprocessingExecutor
from tests.failing_worker import FailsInWorkers, LlamaThatFailsInWorkers
from tests.hf_oracle import GREEDY as HF_GREEDY
from tests.hf_oracle import assert_matches_hf, make_prompts
from tools.tiny_models import make_tiny_model

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _tokens(llm: LLM, prompts, params=GREEDY) -> list[list[tuple[int, ...]]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[tuple(c.token_ids) for c in o.outputs] for o in outs]


def _workers_gone(executor: MultiprocessingExecutor) -> bool:
    return all(not w.process.is_alive() for w in executor.workers)


@pytest.fixture
def tp_llm():
    """tp_llm(path, **options) -> an LLM on 2 ranks, shut down after the test."""
    made: list[LLM] = []

    def make(path: str, **options) -> LLM:
        llm = LLM(path, tensor_parallel_size=2, disable_log_stats=True, **options)
        made.append(llm)
        return llm

    yield make
    for llm in made:
        executor = llm.llm_engine.model_executor
        executor.shutdown()
        assert _workers_gone(executor)


@pytest.mark.parametrize("arch, overrides", [
    ("llama", {}),  # grouped-query: 4 query heads, 2 KV heads, one of each per rank
    ("llama", {"num_key_value_heads": 1}),  # one KV head, replicated on both ranks
    ("qwen2", {}),
    ("opt", {}),
    ("gpt2", {}),  # q, k, v fused in the checkpoint: split, then sharded
])
def test_two_ranks_give_the_tokens_of_one_and_of_hugging_face(
    arch, overrides, tmp_path, tp_llm
):
    from transformers import AutoModelForCausalLM

    path = make_tiny_model(arch, str(tmp_path / arch), **overrides)
    prompts = make_prompts(300)[:5]
    one = _tokens(LLM(path, disable_log_stats=True), prompts, HF_GREEDY)
    llm = tp_llm(path)
    assert type(llm.llm_engine.model_executor) is MultiprocessingExecutor
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], HF_GREEDY, use_tqdm=False)
    assert [[tuple(c.token_ids) for c in o.outputs] for o in outputs] == one
    assert_matches_hf(AutoModelForCausalLM.from_pretrained(path).eval(), prompts, outputs)


@pytest.mark.parametrize("options", [
    {"preemption_mode": "recompute"},
    {"preemption_mode": "swap"},
    {"enable_prefix_caching": True, "enable_chunked_prefill": True,
     "max_num_batched_tokens": 32, "max_num_seqs": 8},
], ids=["recompute", "swap", "prefix-caching-chunked-prefill"])
def test_block_moves_and_chunks_on_two_ranks(options, tiny_model_dir, tp_llm):
    """A cache too small for the batch preempts; every rank must apply the
    same swaps and copies to its own heads' cache, or tokens diverge."""
    path = tiny_model_dir("llama")
    shared = [7] * 40  # a shared prefix of whole blocks (prefix caching)
    prompts = [shared + p for p in make_prompts(300, seed=1)[:6]]
    params = [GREEDY, SamplingParams(temperature=0.8, seed=5, max_tokens=24, ignore_eos=True, n=2)]
    params = [params[i % 2] for i in range(len(prompts))]
    config = dict(block_size=8, num_gpu_blocks_override=40, **options)
    one = LLM(path, disable_log_stats=True, **config)
    want = _tokens(one, prompts, params)
    llm = tp_llm(path, **config)
    assert _tokens(llm, prompts, params) == want
    if "preemption_mode" in options:
        assert llm.llm_engine.stat_logger.total_preemptions > 0, "the workload must preempt"


def test_seeded_sampling_on_two_ranks_equals_one(tiny_model_dir, tp_llm):
    path = tiny_model_dir("gpt2")
    prompts = make_prompts(300, seed=2)[:4]
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=s, max_tokens=16) for s in range(4)]
    want = _tokens(LLM(path, disable_log_stats=True), prompts, params)
    assert _tokens(tp_llm(path), prompts, params) == want


def test_the_trace_records_the_layout_and_each_steps_collectives(tiny_model_dir, tmp_path,
                                                                 tp_llm):
    """Per decode step the driver broadcasts the step (an object, then 6
    tensors), all-reduces the embedding and twice per layer (2 layers), and
    gathers the logits: 13 collectives, each counted in the trace."""
    from minivllm.tracer import load_trace

    path = tmp_path / "tp.jsonl"
    llm = tp_llm(tiny_model_dir("llama"), trace=str(path))
    _tokens(llm, make_prompts(300)[:2])
    llm.llm_engine.stop_trace()
    trace = load_trace(str(path))  # every read checks the schema
    assert trace.header["parallel_config"] == {
        "tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
    decodes = [s for s in trace.steps if s["scheduled"] and not any(
        e["is_prefill"] for e in s["scheduled"])]
    assert decodes and all(s["collectives"]["calls"] == 1 + 6 + 1 + 2 * 2 + 1 for s in decodes)
    # Two sequences' hidden states (64 float32 each) in every all-reduce, at least.
    assert all(s["collectives"]["bytes"] >= 5 * 2 * 64 * 4 for s in decodes)


@pytest.mark.parametrize("monitor_first", [False, True], ids=["driver-first", "monitor-first"])
def test_a_worker_killed_mid_run_is_reported_and_the_others_stop(tiny_model_dir, monitor_first):
    """Either the driver's next collective fails on the closed connection
    first, or the executor sees the process end before the next step: both
    end in the same report, with no worker left and the group gone."""
    llm = LLM(tiny_model_dir("llama"), tensor_parallel_size=2, disable_log_stats=True)
    executor = llm.llm_engine.model_executor
    worker = executor.workers[0]

    class KillRank1:
        steps = 0

        def on_add_request(self, engine, seq_group):
            pass

        def on_step(self, engine, record):
            self.steps += 1
            if self.steps == 2:
                os.kill(worker.process.pid, signal.SIGKILL)
                worker.process.join()
                if monitor_first:
                    executor.worker_monitor.join(5)

    llm.llm_engine.add_step_observer(KillRank1())
    with pytest.raises(WorkerDiedError,
                       match=r"worker rank 1 \(pid \d+\) died unexpectedly with exit code -9"):
        _tokens(llm, make_prompts(300)[:3])
    assert _workers_gone(executor)
    with pytest.raises(EngineDeadError, match="worker rank 1"):
        _tokens(llm, make_prompts(300)[:1])
    _a_new_engine_starts_in_this_process(tiny_model_dir("llama"))


def test_a_step_failing_on_the_driver_stops_the_workers(tiny_model_dir, monkeypatch):
    """The driver's sampler raises after rank 1 has done its part of the
    step: the engine is dead, its worker process is gone, and a new engine
    forms a group of its own in this process."""
    llm = LLM(tiny_model_dir("llama"), tensor_parallel_size=2, disable_log_stats=True)
    executor = llm.llm_engine.model_executor

    def broken_sampler(*args, **kwargs):
        raise RuntimeError("injected sampler fault")

    monkeypatch.setattr(executor.driver_worker.model_runner, "sampler", broken_sampler)
    with pytest.raises(RuntimeError, match="injected sampler fault"):
        _tokens(llm, make_prompts(300)[:2])
    assert _wait_until(lambda: _workers_gone(executor))
    with pytest.raises(EngineDeadError, match="injected sampler fault"):
        _tokens(llm, make_prompts(300)[:1])
    _a_new_engine_starts_in_this_process(tiny_model_dir("llama"))


def test_a_second_engine_is_refused_while_one_holds_the_group(tiny_model_dir, tp_llm):
    """One process, one group: a second engine (a notebook cell run twice)
    is refused at once instead of waiting for a driver that never comes."""
    first = tp_llm(tiny_model_dir("llama"))
    for tp in (2, 1):
        with pytest.raises(RuntimeError, match="another engine in this process runs with"):
            LLM(tiny_model_dir("llama"), tensor_parallel_size=tp, disable_log_stats=True)
    assert _tokens(first, make_prompts(300)[:1])  # the first one is unharmed


def _a_new_engine_starts_in_this_process(path: str) -> None:
    again = LLM(path, tensor_parallel_size=2, disable_log_stats=True)
    try:
        assert _tokens(again, make_prompts(300)[:1])
    finally:
        again.llm_engine.model_executor.shutdown()


def test_a_worker_that_fails_to_start_is_reported_with_its_rank(tiny_model_dir):
    before = _children()
    with pytest.raises(RuntimeError, match="worker rank 1: RuntimeError: this worker cannot"):
        LLM(tiny_model_dir("llama"), tensor_parallel_size=2, disable_log_stats=True,
            attention_backend=FailsInWorkers)
    assert _wait_until(lambda: _children() <= before)


def test_registered_models_reach_the_workers(tiny_model_dir, monkeypatch):
    """ModelRegistry.register_model in the engine's process holds in every
    worker: rank 1 builds the registered class (which refuses to be built there)."""
    from minivllm import ModelRegistry

    monkeypatch.setattr(ModelRegistry, "_registered", {})
    ModelRegistry.register_model("LlamaForCausalLM", LlamaThatFailsInWorkers)
    assert ModelRegistry.resolve_model_cls("LlamaForCausalLM") is LlamaThatFailsInWorkers
    with pytest.raises(RuntimeError, match="worker rank 1: RuntimeError: the registered model"):
        LLM(tiny_model_dir("llama"), tensor_parallel_size=2, disable_log_stats=True)


def _children() -> set[int]:
    """This process's children, but multiprocessing's resource tracker (one
    per process, started with the first queue, living until exit)."""
    import psutil

    pids = set()
    for child in psutil.Process().children(recursive=True):
        try:
            if "resource_tracker" not in " ".join(child.cmdline()):
                pids.add(child.pid)
        except psutil.NoSuchProcess:
            pass  # it ended while we looked
    return pids


def _wait_until(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


_SCRIPT = textwrap.dedent("""
    import os, signal, sys
    from minivllm import LLM, SamplingParams

    if __name__ == "__main__":
        llm = LLM(sys.argv[1], tensor_parallel_size=2, disable_log_stats=True)
        out = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=4))
        print("pids", *[w.process.pid for w in llm.llm_engine.model_executor.workers], flush=True)
        if sys.argv[2] == "killed":  # a notebook kernel restarted: no clean-up runs
            os.kill(os.getpid(), signal.SIGKILL)
""")


@pytest.mark.parametrize("how", ["exits", "killed"])
def test_no_worker_outlives_its_engine_process(how, tiny_model_dir, tmp_path):
    """A script that ends without shutting the engine down, and one killed
    outright (what a notebook kernel restart does): the workers go too."""
    import psutil

    script = tmp_path / "run.py"
    script.write_text(_SCRIPT)
    result = subprocess.run([sys.executable, str(script), tiny_model_dir("llama"), how],
                            capture_output=True, text=True, timeout=300)
    pids = [int(p) for p in result.stdout.split("pids", 1)[1].split()]
    assert result.returncode == (0 if how == "exits" else -signal.SIGKILL), result.stderr
    assert _wait_until(lambda: not any(psutil.pid_exists(p) for p in pids))


_RAY_SCRIPT = textwrap.dedent("""
    import json, sys
    import ray
    from minivllm import LLM, SamplingParams
    from minivllm.executor.ray_executor import RayExecutor

    if __name__ == "__main__":
        prompts = json.loads(sys.argv[2])
        params = SamplingParams(temperature=0, max_tokens=int(sys.argv[3]), ignore_eos=True)

        def tokens(llm, prompts):
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                use_tqdm=False)
            return [[list(c.token_ids) for c in o.outputs] for o in outs]

        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        llm = LLM(sys.argv[1], tensor_parallel_size=2, distributed_executor_backend="ray",
                  disable_log_stats=True)
        executor = llm.llm_engine.model_executor
        try:
            result = {"executor": type(executor).__name__, "all": tokens(llm, prompts),
                      # the loop restarts after an idle engine
                      "again": tokens(llm, prompts[:2])}
        finally:
            executor.shutdown()
        result["placement_groups"] = [
            pg["state"] for pg in ray.util.placement_group_table().values()]
        ray.shutdown()
        print("result", json.dumps(result), flush=True)
""")


def test_the_ray_executor_gives_the_same_tokens(tiny_model_dir, tmp_path):
    """Rank 1 as a Ray actor on a local Ray instance (2 CPUs: one bundle per
    rank), against one worker in this process. Ray runs in a small process
    of its own: `ray.init` forks its servers from the process that calls it,
    and from a pytest worker of several GB that fork failed under the
    kernel's heuristic overcommit (ENOMEM) in some CI runs, retries or not."""
    pytest.importorskip("ray")
    path = tiny_model_dir("opt")
    prompts = [list(p) for p in make_prompts(300, seed=3)[:4]]
    want = [[list(t) for t in o] for o in _tokens(LLM(path, disable_log_stats=True), prompts)]
    script = tmp_path / "ray_run.py"
    script.write_text(_RAY_SCRIPT)
    max_tokens = GREEDY.max_tokens
    result = subprocess.run(
        [sys.executable, str(script), path, json.dumps(prompts), str(max_tokens)],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    got = json.loads(result.stdout.split("result", 1)[1])
    assert got["executor"] == "RayExecutor"
    assert got["all"] == want and got["again"] == want[:2]
    assert got["placement_groups"] and set(got["placement_groups"]) == {"REMOVED"}

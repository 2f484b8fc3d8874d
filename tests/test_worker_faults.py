"""A fault inside a rank other than the driver, with two ranks on gloo
(rank 1 in a worker process, or a Ray actor): the engine ends clearly dead,
never hung, and the process exits cleanly afterwards.

vLLM v0.6 waits for such a rank in the driver's collective until gloo's
30-minute timeout; here the step fails at once with the rank's error
(`DistributedExecutor._driver_step`, lessons/vllm_differences.md row 73)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

import pytest

from minivllm import LLM, ModelRegistry, SamplingParams
from minivllm.distributed import get_tensor_model_parallel_rank
from minivllm.engine.llm_engine import EngineDeadError
from minivllm.model_executor.models.llama import LlamaForCausalLM

pytestmark = pytest.mark.slow

POISONED_POSITION = 40  # rank 1 raises on a batch that reaches it
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


class LlamaThatRaisesInRank1(LlamaForCausalLM):
    """Rank 1's forward raises on a batch reaching `POISONED_POSITION`, in
    the middle of the driver's step: the driver then waits for rank 1's
    share of the first all-reduce, while rank 1's process lives on."""

    def forward(self, input_ids, positions, *args):
        if get_tensor_model_parallel_rank() == 1 and int(positions.max()) >= POISONED_POSITION:
            raise RuntimeError("injected fault in rank 1's forward")
        return super().forward(input_ids, positions, *args)


def _generate_or_kill_workers(llm: LLM, prompt: list[int], timeout: float = 20.0):
    """llm.generate, given `timeout` seconds. If it hangs, the workers are
    killed (the driver's collective then fails on their closed connections,
    so nothing is left behind) and the test fails."""
    result: Future = Future()

    def run() -> None:
        try:
            result.set_result(llm.generate([{"prompt_token_ids": prompt}], GREEDY,
                                           use_tqdm=False))
        except BaseException as error:  # noqa: BLE001 - handed to the test
            result.set_exception(error)

    threading.Thread(target=run, daemon=True).start()
    try:
        return result.result(timeout)
    except FutureTimeout:
        for worker in llm.llm_engine.model_executor.workers:
            worker.process.kill()
        result.exception(30)
        pytest.fail(f"the step was still waiting {timeout} s after rank 1 raised")


def test_a_worker_raising_mid_step_fails_the_step_with_its_error(tiny_model_dir, monkeypatch):
    """The step fails within seconds with rank 1's error, the engine is dead,
    rank 1's process is gone, and a new engine forms a group of its own."""
    path = tiny_model_dir("llama")
    monkeypatch.setattr(ModelRegistry, "_registered", {})
    ModelRegistry.register_model("LlamaForCausalLM", LlamaThatRaisesInRank1)
    llm = LLM(path, tensor_parallel_size=2, disable_log_stats=True)
    executor = llm.llm_engine.model_executor
    try:
        assert _generate_or_kill_workers(llm, list(range(5, 15)))  # healthy below the position
        start = time.monotonic()
        with pytest.raises(RuntimeError,
                           match=r"worker rank 1: RuntimeError: injected fault in rank 1"):
            _generate_or_kill_workers(llm, list(range(5, 5 + POISONED_POSITION - 2)))
        assert time.monotonic() - start < 10
        assert llm.llm_engine.errored
        with pytest.raises(EngineDeadError, match="worker rank 1: RuntimeError: injected"):
            llm.generate([{"prompt_token_ids": [5, 6]}], GREEDY, use_tqdm=False)
        assert all(not w.process.is_alive() for w in executor.workers)
        # The driver's call given up on ended when rank 1 was stopped, and
        # the group is gone: a new engine forms one of its own.
        assert executor.driver_thread.last_call.done()
    finally:
        executor.shutdown()
    monkeypatch.setattr(ModelRegistry, "_registered", {})
    again = LLM(path, tensor_parallel_size=2, disable_log_stats=True)
    try:
        assert again.generate([{"prompt_token_ids": [5, 6]}], GREEDY, use_tqdm=False)
    finally:
        again.llm_engine.model_executor.shutdown()


_EXITS_AT_LOAD = textwrap.dedent("""
    import multiprocessing, os, sys
    from minivllm import LLM, ModelRegistry
    from minivllm.model_executor.models.llama import LlamaForCausalLM

    class LlamaThatExitsInWorkers(LlamaForCausalLM):
        def __init__(self, config):
            if multiprocessing.parent_process() is not None:
                os._exit(3)  # rank 1, while the driver is still loading its shard
            super().__init__(config)

    if __name__ == "__main__":
        ModelRegistry.register_model("LlamaForCausalLM", LlamaThatExitsInWorkers)
        LLM(sys.argv[1], tensor_parallel_size=2, disable_log_stats=True)
""")


def _run_script(script, *args: str, timeout: float = 50.0) -> subprocess.CompletedProcess:
    """Run a script, failing the test if it outlives `timeout`; it is then
    stopped (a worker process follows its engine's process on its own; the
    Ray script stops Ray itself before, should its step hang)."""
    with subprocess.Popen([sys.executable, str(script), *args], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.terminate()
            try:
                process.communicate(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
            pytest.fail(f"{script.name} was still running after {timeout} s")
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def test_a_script_whose_worker_dies_at_load_exits_with_its_error(tiny_model_dir, tmp_path):
    """The script ends on the engine's error (exit code 1), neither aborted
    by a driver call still running as the interpreter exits (exit code 134,
    "terminate called without an active exception") nor hung joining a
    queue's feeder thread on a lock the dead worker held."""
    script = tmp_path / "exits_at_load.py"
    script.write_text(_EXITS_AT_LOAD)
    result = _run_script(script, tiny_model_dir("llama"))
    assert result.returncode == 1, result.stderr[-3000:]
    assert "worker rank 1 (pid" in result.stderr
    assert "died unexpectedly with exit code 3" in result.stderr


_RAY_RAISES = textwrap.dedent("""
    import json, sys, threading, time
    import ray
    from minivllm import LLM, ModelRegistry, SamplingParams
    from minivllm.distributed import get_tensor_model_parallel_rank
    from minivllm.engine.llm_engine import EngineDeadError
    from minivllm.executor.distributed_executor import WorkerDiedError
    from minivllm.executor.ray_executor import RayExecutor
    from minivllm.model_executor.models.llama import LlamaForCausalLM

    class LlamaThatRaisesInRank1(LlamaForCausalLM):  # the test's, sent to the actor by value
        def forward(self, input_ids, positions, *args):
            if get_tensor_model_parallel_rank() == 1 and int(positions.max()) >= 40:
                raise RuntimeError("injected fault in rank 1's forward")
            return super().forward(input_ids, positions, *args)

    def generate(llm, prompt):
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        return llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)

    if __name__ == "__main__":
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        ModelRegistry.register_model("LlamaForCausalLM", LlamaThatRaisesInRank1)
        llm = LLM(sys.argv[1], tensor_parallel_size=2, distributed_executor_backend="ray",
                  disable_log_stats=True)
        assert isinstance(llm.llm_engine.model_executor, RayExecutor)
        result = {"healthy": len(generate(llm, list(range(5, 15))))}
        start = time.monotonic()
        # Should the step hang, stopping Ray ends rank 1 and with it the wait.
        watchdog = threading.Timer(15, ray.shutdown)
        watchdog.start()
        try:
            generate(llm, list(range(5, 43)))
        except WorkerDiedError as error:
            result["error"] = str(error)
        result["seconds"] = time.monotonic() - start
        watchdog.cancel()
        try:
            generate(llm, [5, 6])
        except EngineDeadError as error:
            result["dead"] = str(error)
        result["placement_groups"] = [
            pg["state"] for pg in ray.util.placement_group_table().values()]
        ray.shutdown()
        print("result", json.dumps(result), flush=True)
""")


def test_a_ray_actor_raising_mid_step_fails_the_step_with_its_error(tiny_model_dir, tmp_path):
    """The same fault in rank 1 as a Ray actor. Ray runs in a process of its
    own, as in test_tensor_parallel.py (it forks its servers from the caller)."""
    pytest.importorskip("ray")
    script = tmp_path / "ray_raises.py"
    script.write_text(_RAY_RAISES)
    result = _run_script(script, tiny_model_dir("llama"), timeout=60)
    assert result.returncode == 0, result.stderr[-3000:]
    got = json.loads(result.stdout.split("result", 1)[1])
    assert got["healthy"] == 1
    assert got["seconds"] < 10, "the step waited for rank 1 until Ray was stopped"
    assert got["error"].startswith("worker rank 1 (a Ray actor) failed:")
    assert "injected fault in rank 1" in got["error"]
    assert "worker rank 1" in got["dead"]
    assert got["placement_groups"] and set(got["placement_groups"]) == {"REMOVED"}

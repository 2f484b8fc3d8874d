"""Code samples of the curriculum (../shared/curriculum/) run on minivllm with
only the import changed: `examples/offline_inference.py` (Day 1's first
command), the Day 3 state-machine exercise (patch `Sequence.set_status` to
print every transition), the Day 3 breakpoint in `LLM._add_request` and
instrumentation of `step()` (`SchedulerOutputs.is_empty()`,
`get_prompt_token_ids()`), and `__version__`."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

import minivllm
from minivllm import LLM, SamplingParams, sequence


def test_the_package_has_a_version_and_pyproject_reads_it():
    assert re.fullmatch(r"\d+\.\d+\.\d+", minivllm.__version__)
    pyproject = open("pyproject.toml").read()
    assert 'version = { attr = "minivllm.__version__" }' in pyproject


@pytest.fixture
def transitions(monkeypatch):
    """The curriculum's patch: print, then call the original set_status."""
    seen: list[tuple[int, str, str]] = []
    original = sequence.Sequence.set_status

    def track_status_change(self, status):
        seen.append((self.seq_id, self.status.name, status.name))
        original(self, status)

    monkeypatch.setattr(sequence.Sequence, "set_status", track_status_change)
    return seen


def test_a_patched_set_status_sees_every_transition(transitions, tiny_model_dir):
    llm = LLM(tiny_model_dir("llama"))
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    llm.generate([[5, 6, 7]], params, use_tqdm=False)
    seq_id = transitions[0][0]
    assert transitions == [
        (seq_id, "WAITING", "RUNNING"),
        (seq_id, "RUNNING", "FINISHED_LENGTH_CAPPED"),
    ]


def test_preemption_transitions_are_seen_too(transitions, tiny_model_dir):
    """A request preempted by RECOMPUTE goes back to WAITING and runs again."""
    llm = LLM(tiny_model_dir("llama"), block_size=4, num_gpu_blocks_override=6)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm.generate([list(range(10, 18)), list(range(20, 28))], params, use_tqdm=False)
    victim = [seq for seq, old, new in transitions if (old, new) == ("RUNNING", "WAITING")]
    assert victim, "the cache of 6 blocks cannot hold both: one is preempted"
    path = [(old, new) for seq, old, new in transitions if seq == victim[0]]
    assert path[:3] == [("WAITING", "RUNNING"), ("RUNNING", "WAITING"), ("WAITING", "RUNNING")]
    assert path[-1] == ("RUNNING", "FINISHED_LENGTH_CAPPED")


def test_the_first_example_runs_on_the_shipped_model():
    result = subprocess.run(
        [sys.executable, "examples/offline_inference.py"], capture_output=True, text=True,
        timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"},
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 4 and all(line.startswith("Prompt: ") for line in lines)
    assert lines[0].startswith("Prompt: 'Once upon a time', Generated text: '")


def test_every_prompt_of_generate_passes_through_add_request(monkeypatch, tiny_model_dir):
    """Day 3's breakpoint: `LLM._add_request` sees each prompt, in order,
    and the id it returns is the one its output comes back with."""
    llm = LLM(tiny_model_dir("llama"))
    seen = []
    original = LLM._add_request

    def spy(self, prompt, params, priority=0):
        request_id = original(self, prompt, params, priority)
        seen.append((request_id, prompt["prompt_token_ids"]))
        return request_id

    monkeypatch.setattr(LLM, "_add_request", spy)
    outputs = llm.generate([[5, 6], [7, 8, 9]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert [tokens for _, tokens in seen] == [[5, 6], [7, 8, 9]]
    assert [o.request_id for o in outputs] == [request_id for request_id, _ in seen]


def test_a_step_can_be_instrumented_as_day_3_does(tiny_model_dir):
    """Day 3 prints, per step, whether the scheduler's output is empty and
    the prompt of each scheduled sequence: with nothing to run, the step is
    empty (and `step()` does not call the workers, as vLLM's); with a
    prompt, it is not."""
    engine = LLM(tiny_model_dir("llama")).llm_engine
    _, outputs = engine.scheduler.schedule()
    assert outputs.is_empty()
    engine.add_request("a", {"prompt_token_ids": [5, 6, 7]}, SamplingParams())
    _, outputs = engine.scheduler.schedule()
    assert not outputs.is_empty()
    [scheduled] = outputs.scheduled_seq_groups
    [seq] = scheduled.seq_group.get_seqs()
    assert seq.get_prompt_token_ids() == seq.data.get_prompt_token_ids() == [5, 6, 7]
    assert (seq.get_prompt_len(), seq.get_output_len()) == (3, 0)


def test_an_empty_step_does_not_call_the_workers(tiny_model_dir, monkeypatch):
    """A step whose only news is an abort schedules nothing: the workers are
    not called (vLLM's `step()` checks `is_empty()`), the abort comes out."""
    engine = LLM(tiny_model_dir("llama")).llm_engine
    calls = []
    original = engine.model_executor.execute_model

    def counting(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(engine.model_executor, "execute_model", counting)
    engine.add_request("b", {"prompt_token_ids": [5, 6, 7]}, SamplingParams())
    engine.abort_request("b")
    [output] = engine.step()
    assert output.finished and output.outputs[0].finish_reason == "abort"
    assert calls == [] and not engine.has_unfinished_requests()
    engine.add_request("c", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=1))
    assert engine.step()[0].finished and len(calls) == 1


@pytest.mark.parametrize("use_v1", [False, True], ids=["classic", "v1"])
def test_the_engine_logs_its_config_and_cache_at_start(tiny_model_dir, caplog, use_v1):
    """Day 3's trace script turns logging on and reads, as from vLLM, the
    engine's config and its KV cache's size before the first step."""
    caplog.set_level("INFO", logger="minivllm")
    llm = LLM(tiny_model_dir("llama"), use_v1=use_v1, block_size=8, max_model_len=64,
              num_gpu_blocks_override=20)
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("minivllm")]
    engine = "a V1 LLM engine" if use_v1 else "an LLM engine"
    assert lines[0].startswith(f"Initializing {engine} (v{minivllm.__version__}) with config: ")
    assert "block_size=8" in lines[0] and "max_seq_len=64" in lines[0]
    if use_v1:  # the null block holds no tokens
        assert lines[1:3] == ["GPU KV cache size: 152 tokens",
                              "Maximum concurrency for 64 tokens per request: 2.38x"]
    else:
        cpu_blocks = llm.llm_engine.cache_config.num_cpu_blocks
        assert lines[1] == f"# GPU blocks: 20, # CPU blocks: {cpu_blocks}"


def test_the_v1_engine_core_in_its_own_process_logs_as_its_front_end(tiny_model_dir):
    """A spawned process starts with no logging set up: the front end hands
    its own (level, format) to the engine core's, whose lines then show."""
    script = (
        "import logging, sys\n"
        "logging.basicConfig(level=logging.INFO, format='%(levelname)s %(name)s: %(message)s')\n"
        "from minivllm import LLM\n"
        "if __name__ == '__main__':\n"
        f"    LLM({tiny_model_dir('llama')!r}, use_v1=True, max_model_len=64)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1", "MINIVLLM_ENABLE_V1_MULTIPROCESSING": "1"},
    )
    assert result.returncode == 0, result.stderr
    assert "INFO minivllm.v1.engine.core: Initializing a V1 LLM engine" in result.stderr
    assert "INFO minivllm.v1.engine.core: GPU KV cache size: " in result.stderr

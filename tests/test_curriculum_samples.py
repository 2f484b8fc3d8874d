"""Code samples of the curriculum (../shared/curriculum/) run on minivllm with
only the import changed: the Day 3 state-machine exercise (patch
`Sequence.set_status` to print every transition) and `__version__`."""

from __future__ import annotations

import re

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

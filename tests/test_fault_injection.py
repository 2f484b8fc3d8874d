"""Faults inside a step: the engine is either still correct or clearly dead.

The scheduler commits a step's decisions (swaps, copy-on-write, prefix-cache
entries) before the worker carries them out, so a step that fails part-way
cannot simply be retried: before this was fixed, an engine kept serving after
such a fault and gave wrong tokens (a swap-out never copied), drifted
logprobs (a copy-on-write never made) or reused never-written KV through the
prefix cache. Now the failing call re-raises the fault and every later call
refuses with `EngineDeadError` naming it.

Each case raises once, at the first call of one point of the step that has
work to do, on a workload that swaps, copies and hits the prefix cache.
"""

from __future__ import annotations

import pytest

from minivllm import LLM, SamplingParams
from minivllm.engine.llm_engine import EngineDeadError


class Fault(Exception):
    """The injected failure."""


SHARED = list(range(30, 46))  # 16 tokens: 4 full blocks the prefix cache can share
PROMPTS = [SHARED + [50, 51], SHARED + [60], list(range(70, 79))]
PARAMS = [
    SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=24, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
    SamplingParams(n=2, temperature=0.8, seed=2, max_tokens=24, ignore_eos=True),
]
ENGINE = dict(block_size=4, num_gpu_blocks_override=24, preemption_mode="swap",
              enable_prefix_caching=True)


# Where a fault is raised: (name, the object, its attribute, whether to wait
# for a call with work to do: block moves are called every step, mostly empty).
POINTS = {
    "allocate": (lambda e: e.scheduler.block_manager, "allocate", False),
    "swap_out": (lambda e: e.worker.cache_engine, "swap_out", True),
    "swap_in": (lambda e: e.worker.cache_engine, "swap_in", True),
    "copy": (lambda e: e.worker.cache_engine, "copy", True),
    "model": (lambda e: e.worker.model_runner.model, "forward", False),
    "sampler": (lambda e: e.worker.model_runner, "sampler", False),
    "detokenize": (lambda e: e.detokenizer, "decode_sequence_inplace", False),
}


def fail_once(llm: LLM, point: str, when: str, monkeypatch) -> list[str]:
    """Make `point` raise `Fault` once, before or after doing its work.
    Returns a list that records that it fired."""
    get_owner, attr, wait_for_work = POINTS[point]
    owner = get_owner(llm.llm_engine)
    original = getattr(owner, attr)
    fired: list[str] = []

    def faulty(*args, **kwargs):
        if fired or (wait_for_work and not args[0]):
            return original(*args, **kwargs)
        if when == "after":
            original(*args, **kwargs)
        fired.append(point)
        raise Fault(f"injected {when} {point}")

    monkeypatch.setattr(owner, attr, faulty)
    return fired


def new_llm(model: str) -> LLM:
    return LLM(model, **ENGINE)


def test_the_workload_reaches_every_point(tiny_model_dir, monkeypatch):
    """Without faults, every point does work (so each case below fires)."""
    llm = new_llm(tiny_model_dir("llama"))
    engine = llm.llm_engine
    calls = {point: 0 for point in POINTS}
    for point, (get_owner, attr, wait_for_work) in POINTS.items():
        owner = get_owner(engine)
        original = getattr(owner, attr)

        def counting(*args, _point=point, _original=original, _wait=wait_for_work, **kwargs):
            calls[_point] += not _wait or bool(args[0])
            return _original(*args, **kwargs)

        monkeypatch.setattr(owner, attr, counting)
    llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert all(calls.values()), calls
    assert engine.scheduler.block_manager.prefix_cache_hit_rate > 0


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("point", list(POINTS))
def test_a_fault_in_a_step_kills_the_engine_loudly(point, when, tiny_model_dir, monkeypatch):
    llm = new_llm(tiny_model_dir("llama"))
    engine = llm.llm_engine
    fired = fail_once(llm, point, when, monkeypatch)
    with pytest.raises(Fault, match=f"injected {when} {point}"):
        llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert fired == [point]
    assert engine.errored
    # Every later call refuses, naming the cause; none returns tokens.
    dead = f"engine is dead: Fault: injected {when} {point}"
    with pytest.raises(EngineDeadError, match=dead):
        llm.generate(PROMPTS[:1], PARAMS[1], use_tqdm=False)
    with pytest.raises(EngineDeadError, match=dead):
        engine.step()
    with pytest.raises(EngineDeadError, match=dead) as info:
        engine.add_request("late", {"prompt_token_ids": SHARED}, PARAMS[1])
    assert isinstance(info.value.__cause__, Fault)
    engine.abort_request("0")  # cleaning up after the failure does not fail again


def test_a_fresh_engine_after_a_dead_one_gives_the_right_tokens(tiny_model_dir, monkeypatch):
    """The remedy the error names: a new engine, whose outputs equal those of
    an engine that never failed."""
    model = tiny_model_dir("llama")
    expected = new_llm(model).generate(PROMPTS, PARAMS, use_tqdm=False)
    dead = new_llm(model)
    fail_once(dead, "swap_out", "before", monkeypatch)
    with pytest.raises(Fault):
        dead.generate(PROMPTS, PARAMS, use_tqdm=False)
    got = new_llm(model).generate(PROMPTS, PARAMS, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in got] == [
        [c.token_ids for c in o.outputs] for o in expected
    ]

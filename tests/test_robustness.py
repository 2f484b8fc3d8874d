"""Defects found by driving the engine the way careless users and broken
environments do, each reproduced here and held fixed:

- an n=2 group whose first sequence stopped, then whose other sequence was
  preempted by RECOMPUTE, was scheduled as a decode (a 20-row query against
  a one-sequence block table): the Numba kernel read out of bounds;
- the kernels and the batch builder now refuse such input instead;
- SWAP preemption with a full CPU pool raised half-way through a step and lost
  every running request;
- a step observer that raised lost the step's final outputs, and an
  `on_add_request` that raised still queued the request;
- `LLM.generate` left the requests it had added in the engine when a later
  prompt was refused or the call was interrupted.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.attention.ops.paged_attn_numba import paged_attention_decode
from minivllm.config import PreemptionMode
from minivllm.sequence import SequenceGroupMetadata, SequenceStatus
from minivllm.worker.cache_engine import CacheEngine
from minivllm.worker.model_runner import FlatBatch
from tests.engine_spies import record_schedules
from tests.kernel_cases import make_decode_case
from tests.test_parallel_sampling import hf_cumulative_logprob

PROMPT_A = list(range(20, 28))  # greedy, long: it fills the cache
PROMPT_B = list(range(40, 46))  # n=2, seeded: the victim
PARAMS_A = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
# logprobs=0: the cumulative logprob is reported (v0.6 gives it only with logprobs).
PARAMS_B = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=24, ignore_eos=True,
                          logprobs=0)


def run_with_first_sequence_stopped(llm: LLM) -> dict:
    """Run A and B; once B has forked and generated 4 tokens, its first
    sequence stops (as the stop checker stops one: status, then its blocks
    freed). Returns the final outputs by request id."""
    engine = llm.llm_engine
    engine.add_request("A", {"prompt_token_ids": PROMPT_A}, PARAMS_A)
    engine.add_request("B", {"prompt_token_ids": PROMPT_B}, PARAMS_B)
    finals, stopped = {}, False
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        group = next((g for g in engine.scheduler.running if g.request_id == "B"), None)
        if not stopped and group and len(group.seqs) == 2 and group.seqs[0].get_output_len() >= 4:
            first = group.seqs[0]
            first.status = SequenceStatus.FINISHED_STOPPED
            engine.scheduler.free_seq(first)
            stopped = True
    assert stopped
    return finals


@pytest.mark.parametrize("backend", ["numba", "torch"])
def test_recompute_of_a_group_whose_first_sequence_finished(backend, tiny_model_dir, hf_model):
    model = tiny_model_dir("llama")
    tight = LLM(model, block_size=4, num_gpu_blocks_override=14, attention_backend=backend)
    schedules = record_schedules(tight)
    got = run_with_first_sequence_stopped(tight)
    # The case under test happened: B, its first sequence finished, was
    # preempted by RECOMPUTE and prefilled again (as a prefill).
    recomputed = [
        sg for _, out in schedules for sg, mode in out.preempted
        if sg.request_id == "B" and mode == PreemptionMode.RECOMPUTE
    ]
    assert recomputed and recomputed[0].seqs[0].is_finished()
    reprefills = [m for md, _ in schedules for m in md if m.request_id == "B" and m.is_prompt]
    # Its first prefill, then one or more re-prefills (vLLM's cautious
    # can_append_slots may preempt it again right after it comes back).
    assert len(reprefills) >= 2 and all(m.token_chunk_size > 10 for m in reprefills[1:])

    roomy = LLM(model, block_size=4, num_gpu_blocks_override=64, attention_backend=backend)
    expected = run_with_first_sequence_stopped(roomy)
    for rid in ("A", "B"):
        assert [c.token_ids for c in got[rid].outputs] == [
            c.token_ids for c in expected[rid].outputs
        ]
    # The survivor's logprobs are those of causal attention over its own tokens.
    survivor = max(got["B"].outputs, key=lambda c: len(c.token_ids))
    assert len(survivor.token_ids) == PARAMS_B.max_tokens
    oracle = hf_cumulative_logprob(hf_model("llama"), PROMPT_B, survivor.token_ids)
    assert survivor.cumulative_logprob == pytest.approx(oracle, abs=1e-3)


# -- the kernels and the batch builder refuse what they cannot read ----------


def numba_args(case):
    out = torch.empty_like(case.query)
    kv = case.kv_cache
    return [out.numpy(), case.query.numpy(), kv[0].numpy(), kv[1].numpy(),
            case.block_tables.numpy(), case.seq_lens.numpy(), case.scale]


def test_numba_kernel_refuses_more_query_rows_than_sequences():
    case = make_decode_case([9], 4, 2, 16, 8)
    args = numba_args(case)
    args[1] = np.repeat(args[1], 22, axis=0)  # a 22-token "decode" of one sequence
    args[0] = np.empty_like(args[1])
    with pytest.raises(ValueError, match="one query row per sequence: query has 22 rows"):
        paged_attention_decode(*args)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda a: a[4].__setitem__((0, 0), 10_000), r"block numbers must be in \[0, "),
        (lambda a: a[4].__setitem__((0, 0), -1), r"block numbers must be in \[0, "),
        (lambda a: a[5].__setitem__(0, 10_000), "needs more than the block tables"),
        (lambda a: a[5].__setitem__(0, 0), "at least 1 token"),
    ],
)
def test_numba_kernel_refuses_out_of_bounds_tables(edit, message):
    args = numba_args(make_decode_case([9, 17], 4, 2, 16, 8))
    edit(args)
    with pytest.raises(ValueError, match=message):
        paged_attention_decode(*args)


@pytest.mark.parametrize(
    ("index", "change", "message"),
    [
        (1, lambda a: a.astype(np.float16), "query must be a C-contiguous float32 array"),
        (2, lambda a: a.astype(np.float64), "key_cache must be a C-contiguous float32"),
        (4, lambda a: a.astype(np.int32), "block_tables must be a C-contiguous int64"),
        (5, lambda a: a.astype(np.int32), "seq_lens must be a C-contiguous int64"),
        (3, lambda a: np.asfortranarray(a), "value_cache .*, got float32, not C-contiguous"),
        (0, lambda a: a.astype(np.float64), "out must be a C-contiguous float32"),
        (1, lambda a: np.repeat(a, 2, axis=2)[:, :, ::2], "query .*, not C-contiguous"),
    ],
)
def test_numba_kernel_refuses_what_it_was_not_compiled_for(index, change, message):
    """The kernel has one signature (so one disk-cache entry per shape): any
    other dtype or layout is refused by name, not left to Numba's type error."""
    args = numba_args(make_decode_case([9, 17], 4, 2, 16, 8))
    args[index] = change(args[index])
    with pytest.raises(ValueError, match=message):
        paged_attention_decode(*args)


def test_batch_builder_refuses_a_multi_token_decode():
    meta = SequenceGroupMetadata(
        request_id="r", is_prompt=False, seq_data={}, sampling_params=SamplingParams(),
        block_tables={}, token_chunk_size=22,
    )
    with pytest.raises(ValueError, match="request r: a decode computes 1 token per sequence"):
        FlatBatch.build([meta], block_size=4)


# -- SWAP with a full CPU pool ----------------------------------------------


@pytest.mark.parametrize("num_cpu_blocks", [0, 2])
def test_swap_without_swap_space_keeps_the_engine_serving(num_cpu_blocks, tiny_model_dir):
    model = tiny_model_dir("llama")
    prompts = [PROMPT_A, PROMPT_B, list(range(60, 70))]
    params = [PARAMS_A, SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=30,
                                       ignore_eos=True), PARAMS_A]
    roomy = LLM(model, block_size=4, num_gpu_blocks_override=64)
    block_bytes = CacheEngine.get_cache_block_size(4, roomy.llm_engine.model_config)
    llm = LLM(model, block_size=4, num_gpu_blocks_override=16, preemption_mode="swap",
              swap_space=num_cpu_blocks * block_bytes / (1 << 30))
    assert llm.llm_engine.cache_config.num_cpu_blocks == num_cpu_blocks
    schedules = record_schedules(llm)
    outs = llm.generate(prompts, params, use_tqdm=False)
    aborted = [sg.request_id for _, out in schedules for sg in out.aborted_seq_groups]
    # The forked group could go nowhere: it is aborted with what it had; the
    # single sequences fell back to RECOMPUTE and finished whole.
    assert aborted
    for out in outs:
        reasons = {c.finish_reason for c in out.outputs}
        assert reasons == ({"abort"} if out.request_id in aborted else {"length"})
    modes = {mode for _, out in schedules for _, mode in out.preempted}
    assert modes <= {PreemptionMode.RECOMPUTE}
    # Nothing leaked, nothing left behind, and the next call works.
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.block_manager.get_num_free_gpu_blocks() == 16
    again = llm.generate([PROMPT_A], PARAMS_A, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == roomy.generate([PROMPT_A], PARAMS_A, use_tqdm=False)[
        0].outputs[0].token_ids


# -- step observers -----------------------------------------------------------


class Raising:
    """A step observer that raises `exc` at its chosen hook."""

    def __init__(self, exc: BaseException, on_step: bool = True) -> None:
        self.exc, self.raise_on_step = exc, on_step

    def on_add_request(self, engine, seq_group) -> None:
        if not self.raise_on_step:
            raise self.exc

    def on_step(self, engine, record) -> None:
        if self.raise_on_step and any(o.finished for o in record.request_outputs):
            raise self.exc


@pytest.mark.parametrize("exc", [RuntimeError("observer bug"), KeyboardInterrupt()])
def test_observer_raising_in_the_final_step_loses_no_output(exc, tiny_model_dir):
    llm = LLM(tiny_model_dir("llama"))
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    expected = llm.generate([PROMPT_A], params, use_tqdm=False)[0].outputs[0].token_ids
    observer = Raising(exc)
    engine.add_step_observer(observer)
    engine.add_request("x", {"prompt_token_ids": PROMPT_A}, params)
    with pytest.raises(type(exc)):
        while True:
            engine.step()
    engine.remove_step_observer(observer)
    outputs = engine.step()  # the final output comes out of the next step
    assert [(o.request_id, o.finished, o.outputs[0].token_ids) for o in outputs] == [
        ("x", True, expected)
    ]
    assert not engine.has_unfinished_requests()


def test_observer_refusing_a_request_does_not_queue_it(tiny_model_dir):
    llm = LLM(tiny_model_dir("llama"))
    engine = llm.llm_engine
    engine.add_step_observer(Raising(RuntimeError("no"), on_step=False))
    with pytest.raises(RuntimeError, match="no"):
        engine.add_request("x", {"prompt_token_ids": PROMPT_A}, SamplingParams())
    assert not engine.has_unfinished_requests()


# -- LLM.generate leaves nothing behind ----------------------------------------


def test_generate_with_a_refused_prompt_leaves_no_orphans(tiny_model_dir):
    llm = LLM(tiny_model_dir("llama"))
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([PROMPT_A, PROMPT_B, [10**6]], params, use_tqdm=False)
    # The two prompts added before the refused one were aborted unrun.
    leftovers = engine.step()
    assert [(o.outputs[0].finish_reason, o.outputs[0].token_ids) for o in leftovers] == [
        ("abort", []), ("abort", [])
    ]
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.block_manager.get_num_free_gpu_blocks() == (
        engine.cache_config.num_gpu_blocks
    )


def test_interrupted_generate_leaves_no_orphans(tiny_model_dir):
    llm = LLM(tiny_model_dir("llama"))
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    expected = llm.generate([PROMPT_B], params, use_tqdm=False)[0].outputs[0].token_ids

    class InterruptAfterTwoSteps:
        steps = 0

        def on_add_request(self, engine, seq_group) -> None:
            pass

        def on_step(self, engine, record) -> None:
            self.steps += 1
            if self.steps == 2:
                raise KeyboardInterrupt

    engine.add_step_observer(InterruptAfterTwoSteps())
    with pytest.raises(KeyboardInterrupt):
        llm.generate([PROMPT_A, PROMPT_A], params, use_tqdm=False)
    engine.step_observers.clear()
    # The next call runs its own prompt only, with the tokens a fresh call gives.
    out = llm.generate([PROMPT_B], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [expected]
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.block_manager.get_num_free_gpu_blocks() == (
        engine.cache_config.num_gpu_blocks
    )


def test_cuda_launchers_refuse_a_mismatched_batch_before_launching():
    """The CUDA entry points check the same contract from shapes alone (no
    GPU memory is read, so it runs here without one)."""
    from minivllm import _custom_ops as ops

    case = make_decode_case([9], 4, 2, 16, 8)
    query = case.query.repeat(22, 1, 1)
    for kernel in (ops.paged_attention_v1, ops.paged_attention_v2):
        with pytest.raises(ValueError, match="one query row per sequence: query has 22 rows"):
            kernel(torch.empty_like(query), query, case.kv_cache[0], case.kv_cache[1],
                   case.block_tables, case.seq_lens, case.scale, 9)
        with pytest.raises(ValueError, match="needs more than the block tables"):
            kernel(torch.empty_like(case.query), case.query, case.kv_cache[0], case.kv_cache[1],
                   case.block_tables, case.seq_lens, case.scale, 10_000)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(sampling_params=5), "sampling_params must be one SamplingParams or a list"),
        (dict(sampling_params=[SamplingParams()]), "sampling_params has 1 entries but there are 2"),
        (dict(priority=5), "priority must be a list with one entry per prompt, got 5"),
        (dict(priority="01"), "priority must be a list with one entry per prompt"),
    ],
)
def test_generate_refuses_per_prompt_arguments_of_the_wrong_shape(kwargs, message, tiny_model_dir):
    llm = LLM(tiny_model_dir("llama"), scheduling_policy="priority")
    with pytest.raises((TypeError, ValueError), match=message):
        llm.generate([PROMPT_A, PROMPT_B], use_tqdm=False, **kwargs)
    assert not llm.llm_engine.has_unfinished_requests()

"""Parallel sampling (n, best_of): forked sequences share the prompt's blocks,
copy a shared block on their first write into it, and each one's logprobs
equal Hugging Face's log_softmax along its own tokens."""

from __future__ import annotations

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.config import PreemptionMode
from tests.engine_spies import record_block_moves, record_schedules
from tests.hf_oracle import poison_kv_cache


def hf_cumulative_logprob(hf, prompt: list[int], tokens: list[int]) -> float:
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + tokens])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return sum(float(logprobs[len(prompt) - 1 + i, t]) for i, t in enumerate(tokens))


@pytest.mark.parametrize(("prompt_len", "num_copies"), [(10, 2), (16, 0)])
def test_forks_copy_on_write_and_match_hf(
    prompt_len, num_copies, tiny_model_dir, hf_model, monkeypatch
):
    # block_size 8: a 10-token prompt leaves its 2nd block partly filled, so
    # the first decode of 2 of the 3 sequences must copy it (the last one
    # writes in place); a 16-token prompt fills its blocks: nothing to copy.
    llm = LLM(tiny_model_dir("llama"), block_size=8, num_gpu_blocks_override=32, swap_space=0.01)
    poison_kv_cache(llm)
    moves = record_block_moves(llm, monkeypatch)
    prompt = list(range(30, 30 + prompt_len))
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True,
                            logprobs=0)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    assert len(moves["copy"]) == num_copies
    assert len(out.outputs) == 3 and len({tuple(c.token_ids) for c in out.outputs}) == 3
    for completion in out.outputs:
        expected = hf_cumulative_logprob(hf_model("llama"), prompt, completion.token_ids)
        assert completion.cumulative_logprob == pytest.approx(expected, abs=1e-3)


def test_fork_allocates_nothing(tiny_model_dir):
    llm = LLM(tiny_model_dir("llama"), block_size=8, num_gpu_blocks_override=32)
    engine = llm.llm_engine
    bm = engine.scheduler.block_manager
    engine.add_request("r", {"prompt_token_ids": list(range(30, 40))}, SamplingParams(n=3, seed=0))
    engine.step()  # prefill the 10 tokens (2 blocks), sample 3 tokens, fork twice
    group = engine.scheduler.running[0]
    assert len(group.seqs) == 3
    assert bm.get_num_free_gpu_blocks() == 32 - 2
    tables = [bm.get_block_table(seq) for seq in group.seqs]
    assert tables == [tables[0]] * 3
    assert [block.ref_count for block in bm.block_tables[group.seqs[0].seq_id]] == [3, 3]
    engine.step()  # the first decode: two copies of the partly filled block
    assert bm.get_num_free_gpu_blocks() == 32 - 4
    assert [bm.block_tables[s.seq_id][0].ref_count for s in group.seqs] == [3, 3, 3]
    assert sorted(bm.block_tables[s.seq_id][1].ref_count for s in group.seqs) == [1, 1, 1]


def test_best_of_keeps_the_n_most_likely(tiny_model_dir):
    llm = LLM(tiny_model_dir("llama"))
    prompt = [[9, 8, 7, 6, 5]]
    params = SamplingParams(n=4, seed=3, max_tokens=8, logprobs=0)
    every = llm.generate(prompt, params, use_tqdm=False)[0]
    # v0.6: the most likely first, each with its place in the group as index.
    scores = [c.cumulative_logprob for c in every.outputs]
    assert scores == sorted(scores, reverse=True)
    assert sorted(c.index for c in every.outputs) == [0, 1, 2, 3]
    best = llm.generate(
        prompt, SamplingParams(n=2, best_of=4, seed=3, max_tokens=8, logprobs=0), use_tqdm=False
    )[0]
    assert [c.token_ids for c in best.outputs] == [c.token_ids for c in every.outputs[:2]]
    assert [c.index for c in best.outputs] == [0, 1]
    # Without logprobs no cumulative logprob, as in v0.6.
    plain = llm.generate(prompt, SamplingParams(n=4, seed=3, max_tokens=8), use_tqdm=False)[0]
    assert [c.cumulative_logprob for c in plain.outputs] == [None] * 4
    assert [c.token_ids for c in plain.outputs] == [c.token_ids for c in every.outputs]


@pytest.mark.parametrize("mode", [None, "recompute"])
def test_forked_groups_preempt_by_swap_with_the_same_tokens(mode, tiny_model_dir, monkeypatch):
    prompts = [list(range(10 + 5 * i, 30 + 5 * i)) for i in range(4)]
    params = [SamplingParams(n=2, seed=i, max_tokens=16, ignore_eos=True) for i in range(4)]
    roomy = LLM(tiny_model_dir("llama"), block_size=8, num_gpu_blocks_override=64)
    expected = [
        [c.token_ids for c in o.outputs] for o in roomy.generate(prompts, params, use_tqdm=False)
    ]

    tight = LLM(
        tiny_model_dir("llama"),
        block_size=8,
        num_gpu_blocks_override=14,
        swap_space=0.01,
        preemption_mode=mode,
    )
    poison_kv_cache(tight)
    moves = record_block_moves(tight, monkeypatch)
    schedules = record_schedules(tight)
    outputs = tight.generate(prompts, params, use_tqdm=False)
    modes = [mode for _, out in schedules for _, mode in out.preempted]
    scheduler = tight.llm_engine.scheduler
    assert [[c.token_ids for c in o.outputs] for o in outputs] == expected
    # Forked groups always swap, even when recompute was asked for.
    assert PreemptionMode.SWAP in modes and moves["swap_out"] and moves["swap_in"]
    assert scheduler.block_manager.get_num_free_gpu_blocks() == 14


def test_seeded_parallel_samples_do_not_depend_on_the_batch(tiny_model_dir):
    llm = LLM(tiny_model_dir("llama"))
    params = SamplingParams(n=3, temperature=0.9, top_k=50, seed=11, max_tokens=10)
    alone = llm.generate([[4, 4, 4, 9]], params, use_tqdm=False)[0]
    batch = llm.generate(
        [[7, 7], [4, 4, 4, 9], [1, 2, 3]],
        [SamplingParams(n=2, max_tokens=5), params, SamplingParams(temperature=0, max_tokens=7)],
        use_tqdm=False,
    )[1]
    assert [c.token_ids for c in batch.outputs] == [c.token_ids for c in alone.outputs]


def test_parallel_sampling_arguments_are_checked(tiny_model_dir):
    with pytest.raises(ValueError, match=r"best_of must be an integer >= n \(3\), got 2"):
        SamplingParams(n=3, best_of=2)
    with pytest.raises(ValueError, match="n and best_of must be 1 when sampling greedily"):
        SamplingParams(temperature=0, n=1, best_of=2)
    llm = LLM(tiny_model_dir("llama"), max_num_seqs=4)
    # Named as the request asked: n, or best_of when it was given beyond n.
    with pytest.raises(
        ValueError, match="n=5 sequences can never run together under max_num_seqs=4"
    ):
        llm.llm_engine.add_request("x", "hi", SamplingParams(n=5))
    with pytest.raises(
        ValueError, match="best_of=5 sequences can never run together under max_num_seqs=4"
    ):
        llm.llm_engine.add_request("x", "hi", SamplingParams(n=2, best_of=5, temperature=1.0))


def test_v1_caps_n_at_max_num_seqs_before_fanning_out(tiny_model_dir):
    """V1 runs each of n completions as a request of its own; n is capped as
    in the classic engine, and refused before any child is made (an n of
    2**63 once froze the front end building its children). n = max_num_seqs
    runs, all children at once."""
    llm = LLM(tiny_model_dir("llama"), use_v1=True, max_num_seqs=4)
    for n in (5, 2**63):
        with pytest.raises(ValueError, match=f"n={n} must be at most max_num_seqs=4"):
            llm.llm_engine.add_request("x", "hi", SamplingParams(n=n, temperature=1.0))
    assert not llm.llm_engine.has_unfinished_requests()
    params = SamplingParams(n=4, temperature=1.0, seed=0, max_tokens=3)
    (out,) = llm.generate("hi", params, use_tqdm=False)
    assert sorted(c.index for c in out.outputs) == [0, 1, 2, 3]

"""The sampler: top-k/top-p against Hugging Face's warpers, the draw against
the distribution it samples, and seeded requests independent of the batch."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from minivllm import LLM, SamplingParams
from minivllm.model_executor.layers.sampler import Sampler, apply_top_k_top_p


@pytest.mark.parametrize("top_k", [-1, 1, 5, 40])
@pytest.mark.parametrize("top_p", [1.0, 0.9, 0.5, 0.05])
def test_top_k_top_p_keep_the_same_tokens_as_hf(top_k, top_p):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 100, generator=g) * 3
    ours = apply_top_k_top_p(
        logits,
        torch.full((16,), 100 if top_k == -1 else top_k),
        torch.full((16,), top_p),
    )
    ref = logits.clone()
    if top_k != -1:
        ref = TopKLogitsWarper(top_k)(None, ref)
    if top_p < 1.0:
        ref = TopPLogitsWarper(top_p)(None, ref)
    assert torch.equal(torch.isfinite(ours), torch.isfinite(ref))
    kept = torch.isfinite(ref)
    assert torch.equal(ours[kept], logits[kept])  # kept logits are untouched


def test_a_row_that_keeps_all_is_untouched_by_its_batchs_truncation():
    """top_p = 1 keeps every token, whatever the other rows ask: a token
    whose float32 probability underflows to 0 keeps its logit (and so its
    logprob) in a batch where another row truncates, as it does alone."""
    logits = torch.tensor([[120.0, 0.0, -5.0, 3.0], [1.0, 2.0, 3.0, 4.0]])
    assert logits[0].softmax(-1)[1:].eq(0).all()  # three probabilities underflow
    out = apply_top_k_top_p(logits, None, torch.tensor([1.0, 0.5]))
    assert torch.equal(out[0], logits[0])
    assert torch.equal(out[1], torch.tensor([-torch.inf, -torch.inf, -torch.inf, 4.0]))


def test_draw_follows_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    g = torch.Generator().manual_seed(0)
    noise = torch.empty(20000, 4).exponential_(generator=g)
    draws = torch.tensor(Sampler._draw(probs.expand(20000, 4), noise))
    freq = torch.bincount(draws, minlength=4).float() / len(draws)
    # Binomial standard error at p=0.5 and n=20000 is 0.0035.
    torch.testing.assert_close(freq, probs, atol=0.015, rtol=0)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(tiny_model_dir("llama"))


def test_seeded_tokens_do_not_depend_on_the_batch(llm):
    prompt = [5, 17, 42, 99, 7]
    seeded = SamplingParams(temperature=0.8, top_p=0.95, seed=1234, max_tokens=24, ignore_eos=True)
    alone = llm.generate([prompt], seeded, use_tqdm=False)[0].outputs[0].token_ids

    others = [[3, 4, 5], [200, 201, 202, 203, 204, 205, 206], [11] * 20]
    other_params = [
        SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0.7, top_k=10, seed=7, max_tokens=10),
        SamplingParams(temperature=0, max_tokens=16),
    ]
    batch = llm.generate(
        [others[0], prompt, others[1], others[2]],
        [other_params[0], seeded, other_params[1], other_params[2]],
        use_tqdm=False,
    )
    assert batch[1].outputs[0].token_ids == alone
    assert len(alone) == 24
    # A different seed gives a different continuation (24 draws at T=0.8).
    other_seed = SamplingParams(
        temperature=0.8, top_p=0.95, seed=99, max_tokens=24, ignore_eos=True
    )
    assert llm.generate([prompt], other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_top_k_1_is_greedy(llm):
    prompt = [9, 8, 7, 6, 5, 4]
    greedy = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    top1 = llm.generate(
        [prompt], SamplingParams(temperature=1.3, top_k=1, max_tokens=12), use_tqdm=False
    )
    assert top1[0].outputs[0].token_ids == greedy[0].outputs[0].token_ids


def test_cumulative_logprob_is_the_sum_of_greedy_logprobs(llm, hf_model):
    prompt = [12, 40, 7, 300]
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=0)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    tokens = out.outputs[0].token_ids
    with torch.no_grad():
        logits = hf_model("llama")(torch.tensor([prompt + tokens])).logits[0]
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    expected = sum(float(logprobs[len(prompt) - 1 + i, t]) for i, t in enumerate(tokens))
    assert out.outputs[0].cumulative_logprob == pytest.approx(expected, abs=1e-4)

"""V1's sampler (`v1/sample/sampler.py`), as vLLM's `vllm/v1/sample/`:
min_tokens and the penalties on every row, greedy rows' argmax, then for
random rows temperature, min-p, top-k and top-p, and the exponential race.

The oracles: Hugging Face's logits processors applied in V1's order, the
hand-worked example of Day 9 (section 4) where the order decides, and the
race run by hand with a copy of each seeded row's generator.
"""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from minivllm.model_executor.layers.sampler import apply_min_p, apply_top_k_top_p
from minivllm.sampling_params import SamplingParams, SamplingType
from minivllm.v1.sample.metadata import SamplingMetadata
from minivllm.v1.sample.sampler import Sampler

VOCAB = 50
STOP_IDS = [3, 7]


def metadata_of(params, prompts, outputs, generators=None, vocab=VOCAB) -> SamplingMetadata:
    """The metadata the runner builds (`GPUModelRunner._sampling_metadata`),
    every stage present, for rows with these parameters and histories."""
    greedy = [p.sampling_type == SamplingType.GREEDY for p in params]
    temperature = [0.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)]
    return SamplingMetadata(
        temperature=torch.tensor(temperature),
        greedy=torch.tensor(greedy),
        all_greedy=all(greedy),
        all_random=not any(greedy),
        top_k=torch.tensor([vocab if p.top_k == -1 else p.top_k for p in params]),
        top_p=torch.tensor([p.top_p for p in params]),
        min_p=torch.tensor([p.min_p for p in params]),
        generators=generators or {},
        min_tokens_banned=[STOP_IDS if len(o) < p.min_tokens else []
                           for p, o in zip(params, outputs, strict=True)],
        allowed_token_ids=[p.allowed_token_ids for p in params],
        logit_bias=[p.logit_bias for p in params],
        bad_words_token_ids={
            i: p.bad_words_token_ids for i, p in enumerate(params) if p.bad_words_token_ids
        },
        presence_penalties=torch.tensor([p.presence_penalty for p in params]),
        frequency_penalties=torch.tensor([p.frequency_penalty for p in params]),
        repetition_penalties=torch.tensor([p.repetition_penalty for p in params]),
        prompt_token_ids=prompts,
        output_token_ids=outputs,
    )


class KeepsProbs(Sampler):
    """The sampler, keeping the distribution its race draws from."""

    def random_sample(self, probs, generators):
        self.probs = probs.clone()
        return super().random_sample(probs, generators)


def hf_v1_chain(logits, prompt, output, p: SamplingParams) -> torch.Tensor:
    """V1's order with Hugging Face's processors: min_tokens, repetition
    penalty, temperature, min-p, top-k, top-p (no presence/frequency here)."""
    ids = torch.tensor([prompt + output])
    scores = logits[None].clone()
    scores = MinNewTokensLengthLogitsProcessor(len(prompt), p.min_tokens, STOP_IDS)(ids, scores)
    scores = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, scores)
    scores = TemperatureLogitsWarper(p.temperature)(ids, scores)
    if p.min_p > 0:
        scores = MinPLogitsWarper(p.min_p)(ids, scores)
    if p.top_k != -1:
        scores = TopKLogitsWarper(p.top_k)(ids, scores)
    if p.top_p < 1:
        scores = TopPLogitsWarper(p.top_p)(ids, scores)
    return scores[0].softmax(dim=-1)


def test_random_rows_draw_from_hfs_chain_in_v1s_order():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, VOCAB, generator=g) * 3
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (5, 1, 12, 7)]
    outputs = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (0, 9, 4, 15)]
    params = [
        SamplingParams(temperature=0.7, top_k=10, top_p=0.8, min_p=0.05),
        SamplingParams(temperature=1.3, min_p=0.1, repetition_penalty=0.8, min_tokens=12),
        SamplingParams(temperature=1.0, top_p=0.6, min_p=0.2, repetition_penalty=1.4),
        SamplingParams(temperature=0.5, top_k=3, min_tokens=20, max_tokens=30),
    ]
    sampler = KeepsProbs()
    tokens = sampler(logits, metadata_of(params, prompts, outputs))
    for row, p in enumerate(params):
        reference = hf_v1_chain(logits[row], prompts[row], outputs[row], p)
        torch.testing.assert_close(sampler.probs[row], reference, atol=1e-6, rtol=0)
        assert reference[tokens[row]] > 0
    assert all(sampler.probs[3, STOP_IDS] == 0)  # min_tokens: no stop token yet


def test_min_p_comes_before_top_p_as_in_vllm_v1():
    """Day 9's example, min_p a little lower (0.45, off the tie at 0.5):
    probabilities [0.4, 0.25, 0.2, 0.1, 0.05], top_p=0.7. Min-p first
    (threshold 0.18) keeps 0.4, 0.25, 0.2, renormalised to 0.47, 0.29, 0.24,
    and top-p then stops after two. Top-p first, the classic chain, keeps
    the three (0.4 + 0.25 < 0.7), and min-p then keeps them all."""
    logits = torch.tensor([[0.4, 0.25, 0.2, 0.1, 0.05]]).log()
    params = [SamplingParams(temperature=1.0, top_p=0.7, min_p=0.45)]
    sampler = KeepsProbs()
    sampler(logits, metadata_of(params, [[0]], [[]], vocab=5))
    assert (sampler.probs[0] > 0).tolist() == [True, True, False, False, False]
    classic = apply_min_p(apply_top_k_top_p(logits, torch.tensor([5]), torch.tensor([0.7])),
                          torch.tensor([0.45]))
    assert torch.isfinite(classic[0]).tolist() == [True, True, True, False, False]


def test_greedy_rows_take_the_argmax_after_the_penalties_and_min_tokens():
    logits = torch.zeros(2, VOCAB)
    logits[:, 7] = 5.0  # a stop token, best by far
    logits[:, 11] = 4.0
    logits[:, 12] = 3.0
    params = [SamplingParams(temperature=0, min_tokens=2),
              SamplingParams(temperature=0, repetition_penalty=2.0)]
    # Row 0 has 1 output (< min_tokens): 7 banned, 11 wins. Row 1 saw 7 and
    # 11 (5 / 2 = 2.5, 4 / 2 = 2): 12 wins.
    tokens = Sampler()(logits, metadata_of(params, [[1], [7]], [[1], [11]]))
    assert tokens.tolist() == [11, 12]


def test_a_seeded_row_draws_its_own_noise_whatever_else_is_in_the_batch():
    """vLLM's `random_sample`: the batch's noise from the shared stream, then
    each seeded row's again from its own generator. A seeded row's token is
    the race run by hand with a copy of its generator, alone or beside other
    rows, greedy or unseeded, in any row."""
    g = torch.Generator().manual_seed(1)
    row_logits = torch.randn(VOCAB, generator=g) * 2
    seeded = SamplingParams(temperature=0.9, seed=42)
    expected = []
    reference = torch.Generator().manual_seed(42)
    probs = (row_logits / 0.9).softmax(dim=-1)
    for _ in range(5):
        expected.append(int((probs / torch.empty(VOCAB).exponential_(generator=reference))
                            .argmax()))
    for others, row in ((0, 0), (2, 0), (3, 2)):
        generator = torch.Generator().manual_seed(42)
        sampler = Sampler(seed=7)
        params = [SamplingParams(temperature=0.8) if i % 2 else SamplingParams(temperature=0)
                  for i in range(others)]
        params.insert(row, seeded)
        logits = torch.randn(len(params), VOCAB, generator=g)
        logits[row] = row_logits
        histories = [[1]] * len(params)
        drawn = [int(sampler(logits, metadata_of(params, histories, [[]] * len(params),
                                                 {row: generator}))[row])
                 for _ in range(5)]
        assert drawn == expected, (others, row)


def test_the_draw_follows_the_distribution():
    """Over many unseeded draws the race picks each token as often as its
    probability says (a chi-square test at a 1e-4 false-alarm rate)."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    probs = logits.softmax(dim=-1)[0]
    sampler = Sampler(seed=3)
    metadata = metadata_of([SamplingParams(temperature=1.0)], [[0]], [[]], vocab=5)
    counts = torch.zeros(5)
    for _ in range(4000):
        counts[sampler(logits, metadata)[0]] += 1
    expected = probs * 4000
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 23.5  # 4 degrees of freedom, p = 1e-4
    assert pytest.approx(float(counts[0] / 4000), abs=0.05) == float(probs[0])


def test_an_all_seeded_batch_leaves_the_shared_stream_alone():
    """Only when some row has no generator is the batch's noise drawn from
    the shared stream (vLLM's `random_sample`): a batch of seeded rows does
    not move it, one unseeded row does."""
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=1.0, seed=2)]
    sampler = Sampler(seed=5)
    before = sampler.generator.get_state()
    generators = {0: torch.Generator().manual_seed(1), 1: torch.Generator().manual_seed(2)}
    sampler(logits, metadata_of(params, [[1], [1]], [[], []], generators))
    assert torch.equal(sampler.generator.get_state(), before)
    params[1] = SamplingParams(temperature=1.0)
    sampler(logits, metadata_of(params, [[1], [1]], [[], []], {0: generators[0]}))
    assert not torch.equal(sampler.generator.get_state(), before)


def test_the_runner_hands_the_sampler_each_rows_parameters(tiny_model_dir, monkeypatch):
    """`GPUModelRunner._sampling_metadata` from the rows' requests: a greedy
    row, a seeded row with every truncation and penalty, a plain random row,
    and min_tokens banning the stop tokens until enough outputs exist (the
    stage no row uses is None). The oracle: the requests' parameters, read
    here by hand."""
    from minivllm import LLM

    seen: list[SamplingMetadata] = []
    original = Sampler.forward

    def spy(self, logits, metadata):
        seen.append(metadata)
        return original(self, logits, metadata)

    monkeypatch.setattr(Sampler, "forward", spy)
    llm = LLM(tiny_model_dir("llama"), use_v1=True, max_model_len=64)
    eos = llm.get_tokenizer().eos_token_id
    params = [
        SamplingParams(temperature=0, max_tokens=3),
        SamplingParams(temperature=0.8, top_k=5, top_p=0.9, min_p=0.05, seed=7, max_tokens=3,
                       repetition_penalty=1.2, presence_penalty=0.5, min_tokens=2,
                       stop_token_ids=[9], logit_bias={11: 2.0}),
        SamplingParams(temperature=1.1, max_tokens=3, allowed_token_ids=[20, 21, 22],
                       bad_words=["ab"]),
    ]
    llm.generate([{"prompt_token_ids": [5, 6, 7 + i]} for i in range(3)], params, use_tqdm=False)
    first = seen[0]  # one step prefills all three: rows in request order
    assert first.temperature.tolist() == pytest.approx([0.0, 0.8, 1.1])
    assert first.greedy.tolist() == [True, False, False]
    assert (first.all_greedy, first.all_random) == (False, False)
    assert first.top_k.tolist() == [vocab_of(llm), 5, vocab_of(llm)]
    assert first.top_p.tolist() == pytest.approx([1.0, 0.9, 1.0])
    assert first.min_p.tolist() == pytest.approx([0.0, 0.05, 0.0])
    assert list(first.generators) == [1]
    assert first.min_tokens_banned == [[], sorted({9, eos}), []]
    assert first.allowed_token_ids == [None, None, [20, 21, 22]]
    assert first.logit_bias == [None, {11: 2.0}, None]
    words = SamplingParams(bad_words=["ab"])
    words.update_from_tokenizer(llm.get_tokenizer())
    assert first.bad_words_token_ids == {2: words.bad_words_token_ids}
    assert first.repetition_penalties.tolist() == pytest.approx([1.0, 1.2, 1.0])
    assert first.presence_penalties.tolist() == pytest.approx([0.0, 0.5, 0.0])
    assert first.prompt_token_ids == [[5, 6, 7], [5, 6, 8], [5, 6, 9]]
    assert all(m.min_tokens_banned[1] == [] for m in seen[2:])  # 2 outputs: no more ban
    assert seen[-1].output_token_ids[0] and len(seen) == 3


def vocab_of(llm) -> int:
    return llm.llm_engine.model_config.hf_config.vocab_size

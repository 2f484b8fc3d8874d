"""The full sampler: penalties, min-p and min_tokens against Hugging Face's
logits processors (and a plain re-implementation where HF has none), the
whole chain in vLLM's order, logprobs and prompt logprobs against the HF
model's own log-softmax, and seeded sampling that ignores the batch."""

from __future__ import annotations

import dataclasses
import math
import shutil

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

from minivllm import LLM, SamplingParams
from minivllm.config import ModelConfig
from minivllm.model_executor.layers.sampler import Sampler, apply_min_p, apply_penalties
from minivllm.model_executor.sampling_metadata import SamplingMetadata, SequenceGroupToSample
from minivllm.sequence import SequenceData

MAX_LOGPROBS = ModelConfig.max_logprobs  # vLLM's default, 20

VOCAB = 50


def random_histories(num_rows: int, seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    """Prompt and output token ids per row, with repeats, some rows empty."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, VOCAB, (int(n),), generator=g).tolist() for n in [5, 1, 12, 7]]
    outputs = [torch.randint(0, VOCAB, (int(n),), generator=g).tolist() for n in [0, 9, 4, 15]]
    return prompts[:num_rows], outputs[:num_rows]


def presence_frequency_reference(logits, outputs, presence, frequency):
    """OpenAI's definition, one token at a time."""
    ref = logits.clone()
    for row, ids in enumerate(outputs):
        for token in set(ids):
            ref[row, token] -= frequency[row] * ids.count(token) + presence[row]
    return ref


@pytest.mark.parametrize("penalty", [0.5, 1.0, 1.3, 2.0])
def test_repetition_penalty_matches_hf(penalty):
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(1)) * 3
    prompts, outputs = random_histories(4)
    zeros = torch.zeros(4)
    ours = apply_penalties(logits, prompts, outputs, zeros, zeros, torch.full((4,), penalty))
    for row in range(4):
        ids = torch.tensor([prompts[row] + outputs[row]])
        ref = RepetitionPenaltyLogitsProcessor(penalty)(ids, logits[row : row + 1].clone())
        torch.testing.assert_close(ours[row], ref[0], atol=1e-5, rtol=0)
    if penalty != 1.0:  # the test can fail: seen tokens really moved
        assert not torch.equal(ours, logits)


def test_presence_and_frequency_penalties_count_output_tokens_only():
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(2)) * 3
    prompts, outputs = random_histories(4)
    presence = torch.tensor([0.0, 1.5, -0.7, 2.0])
    frequency = torch.tensor([0.4, 0.0, 1.2, -2.0])
    ours = apply_penalties(logits, prompts, outputs, presence, frequency, torch.ones(4))
    ref = presence_frequency_reference(logits, outputs, presence, frequency)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)
    # Row 0 has no outputs: its prompt tokens are not penalized.
    assert torch.equal(ours[0], logits[0])


@pytest.mark.parametrize("min_p", [0.0, 0.05, 0.3, 0.9, 1.0])
def test_min_p_keeps_the_same_tokens_as_hf(min_p):
    logits = torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(3)) * 3
    ours = apply_min_p(logits, torch.full((8,), min_p))
    ref = MinPLogitsWarper(min_p)(None, logits.clone()) if min_p > 0 else logits
    assert torch.equal(torch.isfinite(ours), torch.isfinite(ref))
    kept = torch.isfinite(ref)
    assert torch.equal(ours[kept], logits[kept])


# -- the whole chain, through Sampler.forward ---------------------------------

STOP_IDS = [3, 7]


def chain_params() -> list[SamplingParams]:
    """One row each; every row asks for the top MAX_LOGPROBS logprobs."""
    params = [
        # greedy: penalties apply; top-k/top-p/min-p are reset, as in vLLM
        dict(temperature=0, repetition_penalty=1.5, presence_penalty=0.5, min_tokens=3),
        dict(temperature=0.7, top_k=10, top_p=0.8, frequency_penalty=0.3, seed=1),
        dict(temperature=1.3, min_p=0.1, repetition_penalty=0.8, min_tokens=12, seed=2),
        dict(temperature=1.0, top_p=0.5, presence_penalty=-1.0, frequency_penalty=1.0),
    ]
    params = [SamplingParams(**kwargs, logprobs=MAX_LOGPROBS) for kwargs in params]
    for p in params:
        p.all_stop_token_ids = set(STOP_IDS)  # what the engine adds: its EOS ids
    return params


def hf_chain(logits, prompt, output, p: SamplingParams) -> torch.Tensor:
    """vLLM's order with Hugging Face's processors (ours for presence/frequency)."""
    ids = torch.tensor([prompt + output])
    scores = logits[None].clone()
    scores = MinNewTokensLengthLogitsProcessor(len(prompt), p.min_tokens, STOP_IDS)(ids, scores)
    scores = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, scores)
    scores = presence_frequency_reference(
        scores, [output], [p.presence_penalty], [p.frequency_penalty]
    )
    if p.temperature > 0:
        scores = TemperatureLogitsWarper(p.temperature)(ids, scores)
    if p.top_k != -1:
        scores = TopKLogitsWarper(p.top_k)(ids, scores)
    if p.top_p < 1:
        scores = TopPLogitsWarper(p.top_p)(ids, scores)
    if p.min_p > 0:
        scores = MinPLogitsWarper(p.min_p)(ids, scores)
    return torch.log_softmax(scores[0], dim=-1)


def test_sampler_applies_every_step_in_vllm_order():
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(4)) * 3
    prompts, outputs = random_histories(4)
    params, groups = chain_params(), []
    for row, p in enumerate(params):
        data = SequenceData(prompts[row], list(outputs[row]))
        generator = torch.Generator().manual_seed(p.seed) if p.seed is not None else None
        groups.append(SequenceGroupToSample([row], p, generator, {row: data}, [], [row]))
    metadata = SamplingMetadata(groups, torch.arange(4))
    result = Sampler(seed=0)(logits, metadata)

    for row, p in enumerate(params):
        ref = hf_chain(logits[row], prompts[row], outputs[row], p)
        sample = result[row].samples[0]
        assert torch.isfinite(ref[sample.output_token])  # drawn from what the chain keeps
        if p.temperature == 0:
            assert sample.output_token == int(ref.argmax())
        for token, logprob in sample.logprobs.items():
            assert logprob.logprob == pytest.approx(float(ref[token]), abs=1e-5)
        finite = {t for t, lp in sample.logprobs.items() if lp.logprob > float("-inf")}
        top = ref.topk(MAX_LOGPROBS)
        kept_top = {int(t) for t, v in zip(top.indices, top.values, strict=True) if v > -1e30}
        assert finite == kept_top | {sample.output_token}
        if len(outputs[row]) < p.min_tokens:
            assert all(ref[t] == float("-inf") for t in STOP_IDS)
            assert sample.output_token not in STOP_IDS


def test_a_batch_that_truncates_nothing_skips_the_sort(monkeypatch):
    """As vLLM's do_top_p_top_k / do_min_p: with every row greedy (whose
    top-k, top-p and min-p SamplingParams resets) the vocabulary is never
    sorted; one row with top_p < 1 brings the sort back, for the whole batch."""
    from minivllm.model_executor.layers import sampler as sampler_module

    called = []
    for name in ("apply_top_k_top_p", "apply_min_p"):
        real = getattr(sampler_module, name)
        monkeypatch.setattr(sampler_module, name,
                            lambda *a, _n=name, _f=real: called.append(_n) or _f(*a))
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(5))

    def run(*params):
        groups = [SequenceGroupToSample([r], p, None, {r: SequenceData([1, 2], [])}, [], [r])
                  for r, p in enumerate(params)]
        return Sampler(seed=0)(logits, SamplingMetadata(groups, torch.arange(len(params))))

    greedy = SamplingParams(temperature=0, top_p=0.5, min_p=0.2)  # reset: greedy
    out = run(greedy, greedy)
    assert called == []
    assert [o.samples[0].output_token for o in out.outputs] == logits.argmax(-1).tolist()
    run(greedy, SamplingParams(temperature=1.0, top_p=0.9, seed=1))
    assert called == ["apply_top_k_top_p"]


def test_greedy_rows_cost_the_same_operators_at_any_batch():
    """As vLLM's `_sample_with_torch`: one `argmax` over the batch's greedy rows
    and one read back, not a loop over rows (on a GPU each read back per row
    would be a sync: on an H100 that loop took 5.5 ms of a 9.3 ms batch-64 step)."""
    from torch.profiler import ProfilerActivity, profile

    def num_ops(batch: int) -> int:
        logits = torch.randn(batch, VOCAB, generator=torch.Generator().manual_seed(batch))
        groups = [SequenceGroupToSample([r], SamplingParams(temperature=0), None,
                                        {r: SequenceData([1, 2], [])}, [], [r])
                  for r in range(batch)]
        metadata = SamplingMetadata(groups, torch.arange(batch))
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            out = Sampler(seed=0)(logits, metadata)
        assert [o.samples[0].output_token for o in out.outputs] == logits.argmax(-1).tolist()
        return sum(1 for e in prof.events() if e.cpu_parent is None)

    assert num_ops(2) == num_ops(16) == num_ops(64)


# -- min_tokens through the engine --------------------------------------------


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(tiny_model_dir("llama"), block_size=8)


def greedy_ids(llm, prompt, max_tokens):
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize("min_tokens", [4, 8])
def test_min_tokens_holds_off_eos_and_stop_tokens(llm, min_tokens):
    prompt = [40, 41, 42, 43]
    free_run = greedy_ids(llm, prompt, max_tokens=12)
    stop_at = free_run[1]  # make a token the model produces at once end the request
    first = free_run.index(stop_at)
    engine, checker = llm.llm_engine, llm.llm_engine.stop_checker
    saved = checker.eos_token_id, engine.eos_token_ids
    checker.eos_token_id, engine.eos_token_ids = stop_at, {stop_at}
    try:
        for params in (
            SamplingParams(temperature=0, max_tokens=12),
            SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop_at]),
        ):
            out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
            assert out.token_ids == free_run[: first + 1] and out.finish_reason == "stop"

            params = dataclasses.replace(params, min_tokens=min_tokens)
            out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
            assert len(out.token_ids) >= min_tokens
            assert stop_at not in out.token_ids[:min_tokens]
            assert out.token_ids[:first] == free_run[:first]
            if out.finish_reason == "stop":
                assert out.token_ids[-1] == stop_at
    finally:
        checker.eos_token_id, engine.eos_token_ids = saved


# -- logprobs -------------------------------------------------------------------


def hf_logprobs(hf, token_ids: list[int]) -> torch.Tensor:
    """[len, vocab] HF's log-softmax at every position of token_ids."""
    with torch.no_grad():
        logits = hf(torch.tensor([token_ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def assert_position_logprobs(entry, token, row: torch.Tensor, k: int, tokenizer) -> None:
    """entry holds token with HF's logprob and rank, plus HF's top-k, ranked."""
    assert token in entry and len(entry) in (k, k + 1)
    assert entry[token].logprob == pytest.approx(float(row[token]), abs=1e-4)
    # Rank = 1 + tokens strictly more likely; a margin absorbs float noise
    # (the upper bound counts the token itself).
    lp = row[token]
    assert (row > lp + 1e-4).sum() + 1 <= entry[token].rank <= (row > lp - 1e-4).sum()
    top = row.topk(k)
    for rank, (t, v) in enumerate(zip(top.indices.tolist(), top.values.tolist(), strict=True)):
        assert entry[t].logprob == pytest.approx(v, abs=1e-4)
        assert t == token or entry[t].rank == rank + 1
    assert set(entry) == set(top.indices.tolist()) | {token}
    for t, logprob in entry.items():
        alone = tokenizer.decode([t], skip_special_tokens=True)
        if "\ufffd" not in alone:
            assert logprob.decoded_token == alone


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0, max_tokens=8, logprobs=5),
        # temperature 1, no truncation: the processed distribution is the raw one
        SamplingParams(temperature=1.0, seed=3, max_tokens=8, logprobs=3, ignore_eos=True),
    ],
)
def test_logprobs_are_hf_log_softmax(llm, hf_model, params):
    prompt = [12, 40, 7, 300, 5]
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    tokens = out.token_ids
    ref = hf_logprobs(hf_model("llama"), prompt + tokens)
    assert len(out.logprobs) == len(tokens) == 8
    for i, token in enumerate(tokens):
        row = ref[len(prompt) - 1 + i]
        assert_position_logprobs(out.logprobs[i], token, row, params.logprobs, llm.get_tokenizer())
    expected = sum(float(ref[len(prompt) - 1 + i, t]) for i, t in enumerate(tokens))
    assert out.cumulative_logprob == pytest.approx(expected, abs=1e-3)
    if params.temperature:  # the test covers sampled tokens that are not the argmax
        assert any(entry[t].rank > 1 for entry, t in zip(out.logprobs, tokens, strict=True))


@pytest.mark.parametrize("use_v1", [False, True])
def test_a_token_tied_with_others_ranks_and_is_named_as_its_vllm_does(
    tiny_model_dir, hf_model, tmp_path, use_v1
):
    """With the LM head zeroed, every logit is 0: every token ties with all
    the others. Greedy takes token 0 (the first maximum), the tokenizer's
    special `<s>`. v0.6 ranks it 1 (no token is strictly more likely). V1
    counts every token at least as likely, itself included, so it would rank
    last, at the vocabulary's size; but token 0 is also the first of the top
    2 (torch.topk lists ties by index), and V1's entry for a token in both is
    the top one's, ranked 1; alone (logprobs=0) it shows. And with
    skip_special_tokens (the default) v0.6 names it '', V1 by its text."""
    hf = hf_model("llama")
    zeroed = type(hf)(hf.config)
    zeroed.load_state_dict(hf.state_dict())
    with torch.no_grad():
        zeroed.lm_head.weight.zero_()
    path = shutil.copytree(tiny_model_dir("llama"), tmp_path / "zeroed")  # its tokenizer
    zeroed.save_pretrained(path)
    llm = LLM(str(path), use_v1=use_v1, max_model_len=64)
    params = SamplingParams(temperature=0, max_tokens=2, logprobs=2, ignore_eos=True)
    out = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0]
    vocab_size = hf.config.vocab_size
    special = llm.get_tokenizer().convert_ids_to_tokens(0)
    assert out.token_ids == [0, 0] and special == "<s>" and out.text == ""
    for entry in out.logprobs:
        assert entry[0].logprob == pytest.approx(-math.log(vocab_size))
        assert entry[0].rank == 1 and entry[1].rank == 2
        assert entry[0].decoded_token == (special if use_v1 else "")
    # With logprobs=0 the sampled token's own rank shows: V1's counts its ties.
    alone = SamplingParams(temperature=0, max_tokens=2, logprobs=0, ignore_eos=True)
    for entry in llm.generate([[5, 6, 7]], alone, use_tqdm=False)[0].outputs[0].logprobs:
        assert list(entry) == [0] and entry[0].rank == (vocab_size if use_v1 else 1)


def test_no_logprobs_unless_asked(llm):
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert out[0].outputs[0].logprobs is None and out[0].prompt_logprobs is None
    params = SamplingParams(temperature=0, max_tokens=3, logprobs=0, prompt_logprobs=0)
    out = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0]
    # logprobs=0: only the chosen token at each position.
    assert [list(e) for e in out.outputs[0].logprobs] == [[t] for t in out.outputs[0].token_ids]
    assert [None if e is None else list(e) for e in out.prompt_logprobs] == [None, [6], [7]]


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        {},
        {"enable_chunked_prefill": True, "max_num_batched_tokens": 16, "max_num_seqs": 8},
        # Too few blocks for all three: RECOMPUTE preemption prefills again.
        {"num_gpu_blocks_override": 10, "preemption_mode": "recompute"},
    ],
    ids=["whole", "chunked", "recomputed"],
)
def test_prompt_logprobs_are_hf_log_softmax(tiny_model_dir, hf_model, engine_kwargs):
    llm = LLM(tiny_model_dir("llama"), block_size=8, **engine_kwargs)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, 384, (n,), generator=g).tolist() for n in (30, 37, 29)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, prompt_logprobs=4)
    outs = llm.generate(prompts, params, use_tqdm=False)
    if "preemption_mode" in engine_kwargs:
        assert llm.llm_engine.scheduler.num_cumulative_preemption > 0
    for prompt, out in zip(prompts, outs, strict=True):
        ref = hf_logprobs(hf_model("llama"), prompt)
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        for j in range(1, len(prompt)):
            assert_position_logprobs(
                out.prompt_logprobs[j], prompt[j], ref[j - 1], 4, llm.get_tokenizer()
            )


def test_prompt_logprobs_with_prefix_caching_is_refused(tiny_model_dir):
    llm = LLM(tiny_model_dir("llama"), enable_prefix_caching=True)
    with pytest.raises(ValueError, match="prompt_logprobs=2 needs enable_prefix_caching=False"):
        llm.generate([[5, 6, 7]], SamplingParams(prompt_logprobs=2), use_tqdm=False)


# -- seeded sampling with every option -------------------------------------------


def every_option(seed: int) -> SamplingParams:
    return SamplingParams(
        temperature=0.9,
        top_k=40,
        top_p=0.95,
        min_p=0.02,
        presence_penalty=0.6,
        frequency_penalty=0.4,
        repetition_penalty=1.2,
        min_tokens=6,
        seed=seed,
        max_tokens=24,
    )


def test_seeded_sampling_with_every_option_ignores_the_batch(llm):
    prompt = [5, 17, 42, 99, 7]
    alone = llm.generate([prompt], every_option(1234), use_tqdm=False)[0].outputs[0]
    again = llm.generate([prompt], every_option(1234), use_tqdm=False)[0].outputs[0]
    assert again.token_ids == alone.token_ids and len(alone.token_ids) >= 6

    others = [[3, 4, 5], [200, 201, 202, 203, 204, 205, 206], [11] * 20]
    other_params = [
        SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True, presence_penalty=2.0),
        SamplingParams(temperature=0.7, top_k=10, min_p=0.2, seed=7, max_tokens=10),
        SamplingParams(temperature=0, max_tokens=16, repetition_penalty=1.5),
    ]
    batch = llm.generate(
        [others[0], prompt, others[1], others[2]],
        [other_params[0], every_option(1234), other_params[1], other_params[2]],
        use_tqdm=False,
    )
    assert batch[1].outputs[0].token_ids == alone.token_ids
    other_seed = llm.generate([prompt], every_option(99), use_tqdm=False)[0].outputs[0]
    assert other_seed.token_ids != alone.token_ids

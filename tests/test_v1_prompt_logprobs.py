"""`prompt_logprobs` on the V1 engine, as vLLM's `vllm/v1/` computes them: in
the worker, chunk by chunk (`GPUModelRunner._get_prompt_logprobs_dict`),
sent once with the step that finishes the prompt, from the raw logits.

The oracles: Hugging Face's log-softmax of the same checkpoint's logits
(values, ranks, top tokens), the classic engine's prompt logprobs (the
candidates' names), and the same engine run without preemptions.
"""

from __future__ import annotations

import pytest
import torch

from minivllm import LLM, SamplingParams

BS = 4  # block size
BUDGET = 16  # tokens per step, when chunked
K = 3  # top tokens per position
# 1 token: no entry but the first's None. 17 = BUDGET + 1: the first chunk
# fills every position but the last, which comes alone in the next step and
# adds no entry. 33: three chunks.
PROMPTS = [[7], [9, 11], list(range(20, 37)), list(range(40, 73)), list(range(100, 111))]
PARAMS = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=K, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_llama(tiny_model_dir):
    return tiny_model_dir("llama")


def v1_llm(model: str, chunked: bool = True, **options) -> LLM:
    if chunked:
        options.update(enable_chunked_prefill=True, max_num_batched_tokens=BUDGET)
    else:
        options.update(enable_chunked_prefill=False)
    return LLM(model, use_v1=True, block_size=BS, max_model_len=128, **options)


def as_prompts(token_lists):
    return [{"prompt_token_ids": tokens} for tokens in token_lists]


def assert_same_logprobs(got, want, tol=1e-6) -> None:
    assert len(got) == len(want)
    assert got[0] is None and want[0] is None
    for g, w in zip(got[1:], want[1:], strict=True):
        assert g.keys() == w.keys()
        for token_id in w:
            assert g[token_id].logprob == pytest.approx(w[token_id].logprob, abs=tol)
            assert g[token_id].rank == w[token_id].rank


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "whole-prompts"])
def test_prompt_logprobs_equal_hugging_faces(tiny_llama, hf_model, chunked):
    """Each position from the second: the prompt token's logprob and its
    rank (V1's: every token at least as likely counts, itself included),
    and the K most likely tokens ranked 1..K, from HF's logits of the
    position before. The sampled tokens are those of a run without them."""
    outputs = v1_llm(tiny_llama, chunked).generate(as_prompts(PROMPTS), PARAMS, use_tqdm=False)
    hf = hf_model("llama")
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        assert len(output.prompt_logprobs) == len(prompt)
        assert output.prompt_logprobs[0] is None
        with torch.no_grad():
            logits = hf(torch.tensor([prompt])).logits[0].float()
        reference = torch.log_softmax(logits, dim=-1)  # [len(prompt), vocab_size]
        for position in range(1, len(prompt)):
            row, token = reference[position - 1], prompt[position]
            entry = output.prompt_logprobs[position]
            assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
            assert entry[token].rank == int((row >= row[token]).sum())
            top = row.topk(K)
            assert set(entry) == {token, *top.indices.tolist()}
            for rank, (value, top_id) in enumerate(zip(top.values, top.indices, strict=True), 1):
                assert entry[int(top_id)].rank == rank
                assert entry[int(top_id)].logprob == pytest.approx(value.item(), abs=1e-4)
    plain = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    without = v1_llm(tiny_llama, chunked).generate(as_prompts(PROMPTS), plain, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in without]


def test_candidates_are_named_as_the_classic_engine_names_them(tiny_llama):
    """The same values as the classic engine's (prefix caching off there, as
    it must be), and the same names, but for a special token among the
    candidates: V1 names it by its text (the classic engine, as v0.6, by
    what skip_special_tokens leaves: '')."""
    prompts = as_prompts([*PROMPTS, list(range(5, 42))])  # the last has BOS among its top 3
    classic = LLM(tiny_llama, block_size=BS, max_model_len=128, enable_prefix_caching=False)
    want = classic.generate(prompts, PARAMS, use_tqdm=False)
    got = v1_llm(tiny_llama).generate(prompts, PARAMS, use_tqdm=False)
    tokenizer = classic.get_tokenizer()
    special = set(tokenizer.all_special_ids)
    named_specials = 0
    for g, w in zip(got, want, strict=True):
        assert_same_logprobs(g.prompt_logprobs, w.prompt_logprobs, tol=1e-5)
        for g_entry, w_entry in zip(g.prompt_logprobs[1:], w.prompt_logprobs[1:], strict=True):
            for token_id, logprob in g_entry.items():
                if token_id in special:
                    assert logprob.decoded_token == tokenizer.decode([token_id])
                    named_specials += 1
                else:
                    assert logprob.decoded_token == w_entry[token_id].decoded_token
    assert named_specials  # the rule above was exercised


def test_the_prefix_cache_is_written_but_not_read(tiny_llama):
    """A request with prompt logprobs needs the logits of every prompt
    position, so it computes its whole prompt even when its blocks are
    cached (`Request.skip_reading_prefix_cache`); the blocks it fills are
    cached for the requests after it."""
    llm = v1_llm(tiny_llama)
    prompt = as_prompts([PROMPTS[3]])
    plain = SamplingParams(temperature=0, max_tokens=2)
    assert llm.generate(prompt, plain, use_tqdm=False)[0].num_cached_tokens == 0
    with_logprobs = llm.generate(prompt, PARAMS, use_tqdm=False)[0]
    assert with_logprobs.num_cached_tokens == 0
    fresh = v1_llm(tiny_llama).generate(prompt, PARAMS, use_tqdm=False)[0]
    assert_same_logprobs(with_logprobs.prompt_logprobs, fresh.prompt_logprobs)
    assert llm.generate(prompt, plain, use_tqdm=False)[0].num_cached_tokens == 32  # 8 blocks


def test_a_request_preempted_in_and_after_its_prompt_gets_each_position_once(
    tiny_llama, monkeypatch
):
    """Preempted after its first chunk, a request computes its prompt again
    from position 0 and fills the same entries; preempted after its prompt,
    it recomputes the prompt but sends no prompt logprobs again. Either way:
    the logprobs and tokens of a run left alone, each position once."""
    prompts = as_prompts(PROMPTS[2:4])  # 17 and 33 tokens: several chunks
    params = SamplingParams(temperature=0, max_tokens=6, prompt_logprobs=K, ignore_eos=True)
    want = v1_llm(tiny_llama).generate(prompts, params, use_tqdm=False)

    llm = v1_llm(tiny_llama)
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    preempted: list[tuple[str, int]] = []
    original = scheduler._preempt_request

    def spy(request, *timestamp):
        preempted.append((request.request_id, request.num_computed_tokens))
        original(request, *timestamp)

    monkeypatch.setattr(scheduler, "_preempt_request", spy)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    finished, steps, outputs_seen, resets = {}, 0, 0, 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        steps += 1
        outputs_seen += len(outputs)
        finished.update({o.request_id: o for o in outputs if o.finished})
        if steps == 1 or (outputs_seen >= 4 and resets == 1):  # mid-prompt; then mid-decode
            assert engine.reset_prefix_cache(reset_running_requests=True) is True
            resets += 1
    # Step 1 computed 16 tokens of request 0's 17: mid-prompt. At the second
    # reset both had outputs, so both had finished their prompts.
    assert preempted[0] == ("0", 16)
    assert sorted(r for r, n in preempted[1:] if n >= len(PROMPTS[2 + int(r)])) == ["0", "1"]
    for i, expected in enumerate(want):
        got = finished[str(i)]
        assert_same_logprobs(got.prompt_logprobs, expected.prompt_logprobs)
        assert got.outputs[0].token_ids == expected.outputs[0].token_ids

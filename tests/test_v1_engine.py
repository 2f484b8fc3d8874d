"""The V1 engine (minivllm/v1/) end to end: its greedy tokens equal Hugging
Face's for every architecture, with long prompts chunked, with preemption
and with prefix hits; it agrees with the classic engine on the same
requests; seeded sampling does not depend on the batch; and what it cannot
do is refused up front."""

from __future__ import annotations

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.engine.llm_engine import EngineDeadError
from minivllm.v1.core.sched.scheduler import Scheduler as V1Scheduler
from minivllm.v1.engine.detokenizer import IncrementalDetokenizer
from minivllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch
from minivllm.v1.worker.gpu_model_runner import GPUModelRunner
from tests.hf_oracle import GREEDY, MAX_TOKENS, assert_matches_hf, make_prompts
from tools.tiny_models import ARCHS


def engine_core(llm: LLM):
    return llm.llm_engine.engine_core.engine_core


def poison_v1_kv_cache(llm: LLM) -> None:
    """NaN in every slot: reading one this run did not write shows in the output."""
    for layer in engine_core(llm).model_executor.driver_worker.gpu_cache:
        layer.fill_(float("nan"))


def count_preemptions(monkeypatch) -> list[str]:
    preempted: list[str] = []
    original = V1Scheduler._preempt_request

    def spy(self, request, *timestamp):
        preempted.append(request.request_id)
        original(self, request, *timestamp)

    monkeypatch.setattr(V1Scheduler, "_preempt_request", spy)
    return preempted


def assert_all_blocks_free(llm: LLM) -> None:
    core = engine_core(llm)
    pool = core.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
    assert not core.scheduler.requests and not core.scheduler.running


@pytest.mark.parametrize("arch", ARCHS)
def test_v1_greedy_matches_hf_with_long_prompts_chunked(arch, tiny_model_dir, hf_model):
    # A 24-token budget: the 33- and 60-token prompts take 2 and 3 steps.
    llm = LLM(tiny_model_dir(arch), use_v1=True, block_size=8, max_model_len=128,
              num_gpu_blocks_override=160, max_num_batched_tokens=24, max_num_seqs=8)
    poison_v1_kv_cache(llm)
    prompts = make_prompts(llm.llm_engine.model_config.hf_config.vocab_size)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_matches_hf(hf_model(arch), prompts, outputs)
    assert sum(len(o.outputs[0].token_ids) == MAX_TOKENS for o in outputs) >= 4
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("arch", ARCHS)
def test_v1_preemption_matches_hf(arch, tiny_model_dir, hf_model, monkeypatch):
    # 13 blocks of 8 (one the null block) hold 96 tokens: the longest
    # request alone needs 60 + 32 = 92, so the batch of 8 must preempt.
    llm = LLM(tiny_model_dir(arch), use_v1=True, block_size=8, max_model_len=96,
              num_gpu_blocks_override=13)
    poison_v1_kv_cache(llm)
    preempted = count_preemptions(monkeypatch)
    prompts = make_prompts(llm.llm_engine.model_config.hf_config.vocab_size)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_matches_hf(hf_model(arch), prompts, outputs)
    assert preempted, "the workload was meant to preempt"
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_v1_equals_the_classic_engine_with_prefix_hits(arch, tiny_model_dir):
    """Requests sharing a 40-token system prompt: V1 finds its full blocks in
    the cache (5 blocks of 8; the hit is capped below the prompt's length),
    the classic engine with prefix caching computes the same tokens."""
    model = tiny_model_dir(arch)
    vocab = LLM(model, num_gpu_blocks_override=8).llm_engine.model_config.hf_config.vocab_size
    g = torch.Generator().manual_seed(3)
    system = torch.randint(2, vocab, (40,), generator=g).tolist()
    prompts = [system + torch.randint(2, vocab, (n,), generator=g).tolist() for n in (1, 5, 9, 0)]
    prompts[-1] = system  # exactly 5 full blocks: the last one is recomputed
    classic = LLM(model, block_size=8, enable_prefix_caching=True)
    v1 = LLM(model, use_v1=True, block_size=8, max_model_len=128)
    first = [{"prompt_token_ids": prompts[0]}]
    rest = [{"prompt_token_ids": p} for p in prompts[1:]]
    expected = [o.outputs[0].token_ids for o in classic.generate(first + rest, GREEDY,
                                                                 use_tqdm=False)]
    v1.generate(first, GREEDY, use_tqdm=False)  # fills the cache
    outputs = v1.generate(rest, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected[1:]
    # 40 shared tokens = 5 full blocks; the 40-token prompt may use only 4
    # (its last token must be computed).
    assert [o.num_cached_tokens for o in outputs] == [40, 40, 32]
    assert_all_blocks_free(v1)


def test_seeded_sampling_does_not_depend_on_the_batch(tiny_model_dir):
    model = tiny_model_dir("llama")
    llm = LLM(model, use_v1=True, max_model_len=128)
    vocab = llm.llm_engine.model_config.hf_config.vocab_size
    prompts = [{"prompt_token_ids": p} for p in make_prompts(vocab)]
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=20, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=25, ignore_eos=True)
    alone = llm.generate([prompts[3]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    for batch in ([0, 3], [3, 5, 6, 7], [1, 2, 3, 4, 5]):
        params = [seeded if i == 3 else other for i in batch]
        outs = llm.generate([prompts[i] for i in batch], params, use_tqdm=False)
        assert outs[batch.index(3)].outputs[0].token_ids == alone, batch
    # The classic engine draws a seeded request's tokens the same way.
    classic = LLM(model, max_model_len=128).generate([prompts[3]], seeded, use_tqdm=False)
    assert classic[0].outputs[0].token_ids == alone


def test_a_request_in_a_finished_ones_row_samples_by_its_own_parameters(
    tiny_model_dir, monkeypatch
):
    """The runner keeps its sampling metadata while the same requests sample
    from the same rows (`GPUModelRunner._step_sampling_metadata`). C arrives
    as greedy A finishes, takes A's row, and the step samples the same rows
    as the one before: only the batch's version tells the metadata apart.
    Every request must sample as it does alone (seeded sampling does not
    depend on the batch), and the metadata must have been reused in between,
    or this would test nothing."""
    llm = LLM(tiny_model_dir("llama"), use_v1=True, max_model_len=128)
    params = {
        "A": SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
        "B": SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True),
        "C": SamplingParams(temperature=0.7, top_k=5, seed=3, max_tokens=6, ignore_eos=True),
    }
    prompts = {name: {"prompt_token_ids": [5 + i, 9, 13 + i]} for i, name in enumerate(params)}
    alone = {
        name: llm.generate([prompts[name]], params[name], use_tqdm=False)[0].outputs[0].token_ids
        for name in params
    }
    built: list[int] = []  # the steps that built their metadata
    build, step = GPUModelRunner._sampling_metadata, [0]

    def counting(self, *args):
        built.append(step[0])
        return build(self, *args)

    monkeypatch.setattr(GPUModelRunner, "_sampling_metadata", counting)
    engine, tokens = llm.llm_engine, {}
    for name in "AB":
        engine.add_request(name, prompts[name], params[name])
    joined = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] = out.outputs[0].token_ids
            if out.request_id == "A" and out.finished:
                engine.add_request("C", prompts["C"], params["C"])
                joined = step[0] + 1
        step[0] += 1
    assert tokens == alone
    assert joined in built  # C's first step built its own
    assert len(built) < step[0] / 2  # and most steps reused the last one


def test_the_batch_version_moves_exactly_when_a_row_changes_hands():
    """`InputBatch.version`, what the runner's cached metadata is keyed on:
    it moves when a request is added, removed, moved by `condense` or
    swapped, and not when a row only grows by a token."""
    batch = InputBatch(max_num_reqs=4, max_model_len=16, max_num_blocks_per_req=4, block_size=4)

    def state(req_id: str) -> CachedRequestState:
        return CachedRequestState(req_id, [1, 2, 3], SamplingParams(), None, [1], 0, [])

    versions = [batch.version]
    for req_id in "abc":
        batch.add_request(state(req_id))
        versions.append(batch.version)
    batch.append_token(0, 7)
    versions.append(batch.version)  # a token: no change
    batch.remove_request("a")
    versions.append(batch.version)
    batch.condense()  # c moves into a's row
    versions.append(batch.version)
    batch.swap_states(0, 1)
    versions.append(batch.version)
    batch.remove_request("x")  # not in the batch: no change
    versions.append(batch.version)
    moved = [b > a for a, b in zip(versions[:-1], versions[1:], strict=True)]
    assert moved == [True, True, True, False, True, True, True, False]
    assert batch.req_ids == ["b", "c"]


def test_n_fans_out_into_children_seeded_seed_plus_index(tiny_model_dir):
    llm = LLM(tiny_model_dir("llama"), use_v1=True, max_model_len=128)
    prompt = {"prompt_token_ids": [5, 6, 7, 8, 9]}
    params = SamplingParams(n=3, temperature=1.0, seed=100, max_tokens=12, ignore_eos=True)
    [output] = llm.generate([prompt], params, use_tqdm=False)
    assert [c.index for c in output.outputs] == [0, 1, 2]
    for i, completion in enumerate(output.outputs):
        one = SamplingParams(temperature=1.0, seed=100 + i, max_tokens=12, ignore_eos=True)
        assert completion.token_ids == llm.generate([prompt], one, use_tqdm=False)[0].outputs[
            0].token_ids
    assert len({tuple(c.token_ids) for c in output.outputs}) == 3


def test_children_of_n_ban_eos_before_min_tokens_as_a_single_request_does():
    """Each child's sampler bans the same stop tokens (EOS included) before
    min_tokens as the request would alone."""
    engine = LLM(use_v1=True).llm_engine
    params = SamplingParams(n=2, temperature=1.0, min_tokens=3, max_tokens=5)
    engine.add_request("pair", "Once", params)
    engine.add_request("one", "Once", SamplingParams(temperature=1.0, min_tokens=3, max_tokens=5))
    states = engine.output_processor.request_states
    eos = engine.tokenizer.eos_token_id
    assert eos in states["one"].params.all_stop_token_ids
    for child in ("0_pair", "1_pair"):
        assert states[child].params.all_stop_token_ids == states["one"].params.all_stop_token_ids


def test_stop_strings_and_texts_equal_the_classic_engine():
    """The shipped story model: stop strings found in the front end cut the
    text where the classic engine's stop checker does."""
    prompts = ["Once upon a time", "The little dog", "A girl named Lily"]
    params = [
        SamplingParams(temperature=0, max_tokens=60, stop=["friend"]),
        SamplingParams(temperature=0, max_tokens=60, stop=[" was", "Poppy"],
                       include_stop_str_in_output=True),
        SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[13]),
    ]
    classic = LLM().generate(prompts, params, use_tqdm=False)
    v1 = LLM(use_v1=True).generate(prompts, params, use_tqdm=False)
    for a, b in zip(classic, v1, strict=True):
        ca, cb = a.outputs[0], b.outputs[0]
        assert (cb.text, cb.token_ids, cb.finish_reason, cb.stop_reason) == (
            ca.text, ca.token_ids, ca.finish_reason, ca.stop_reason)
    assert v1[0].outputs[0].stop_reason == "friend"


def test_streamed_text_holds_back_a_possible_stop_string():
    """While running, the last len(longest stop) - 1 characters are not shown
    (vLLM V1's hold-back), so a stop string is never shown, then taken back."""
    detok = IncrementalDetokenizer(None, SamplingParams(stop=["prince", "ab"]), [5])
    detok.output_text = "once a pri"
    assert detok.get_next_output_text(finished=False) == "once "  # 10 - (6 - 1) characters
    assert detok.get_next_output_text(finished=True) == "once a pri"
    kept = IncrementalDetokenizer(
        None, SamplingParams(stop=["prince"], include_stop_str_in_output=True), [5]
    )
    kept.output_text = "once a pri"  # the stop string stays in the text: nothing to hide
    assert kept.get_next_output_text(finished=False) == "once a pri"

    engine = LLM(use_v1=True).llm_engine
    params = SamplingParams(temperature=0, max_tokens=60, stop=["prince"])
    engine.add_request("r", "Once upon a time", params)
    seen = []
    while engine.has_unfinished_requests():
        seen += [(o.outputs[0].text, o.finished) for o in engine.step()]
    final_text, finished = seen[-1]
    assert finished and all(not f for _, f in seen[:-1])
    # Every streamed text is a prefix of the final one: nothing shown was taken back.
    assert all(final_text.startswith(text) for text, _ in seen)
    assert "prince" not in final_text and "curious" in final_text  # the text before it


def test_logprobs_are_the_raw_model_distribution(tiny_model_dir, hf_model):
    """V1 returns logprobs of the raw logits (vLLM's default raw_logprobs),
    not of the temperature-scaled distribution: checked against HF's forward."""
    llm = LLM(tiny_model_dir("llama"), use_v1=True, max_model_len=128)
    prompt = [3, 17, 29, 41, 8]
    params = SamplingParams(temperature=0.5, seed=1, max_tokens=6, logprobs=3, ignore_eos=True)
    [out] = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    completion = out.outputs[0]
    hf = hf_model("llama")
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + completion.token_ids])).logits[0].float()
    ref = torch.log_softmax(logits, dim=-1)
    for i, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs,
                                           strict=True)):
        row = ref[len(prompt) - 1 + i]
        assert entry[token].logprob == pytest.approx(float(row[token]), abs=1e-4)
        top3 = row.topk(3).indices.tolist()
        assert set(top3) <= set(entry) and len(entry) <= 4
    assert completion.cumulative_logprob == pytest.approx(
        sum(e[t].logprob for t, e in zip(completion.token_ids, completion.logprobs, strict=True)))


def test_abort_frees_the_request_and_the_others_go_on(tiny_model_dir):
    model = tiny_model_dir("llama")
    llm = LLM(model, use_v1=True, max_model_len=128)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    engine.add_request("a", {"prompt_token_ids": [4, 5, 6]}, params)
    engine.add_request("b", {"prompt_token_ids": [7, 8, 9, 10]}, params)
    for _ in range(3):
        engine.step()
    engine.abort_request("a")
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert list(finished) == ["b"]
    alone = llm.generate([{"prompt_token_ids": [7, 8, 9, 10]}], params, use_tqdm=False)[0]
    assert finished["b"].outputs[0].token_ids == alone.outputs[0].token_ids
    assert_all_blocks_free(llm)
    engine.add_request("a", {"prompt_token_ids": [4]}, params)  # the id is free again


def test_a_failed_step_kills_the_engine_instead_of_serving_wrong_tokens(
    tiny_model_dir, monkeypatch
):
    llm = LLM(tiny_model_dir("llama"), use_v1=True, max_model_len=128)
    engine = llm.llm_engine
    engine.add_request("a", {"prompt_token_ids": [4, 5, 6]}, GREEDY)
    engine.step()

    def fail(self, scheduler_output):
        raise RuntimeError("injected fault")

    monkeypatch.setattr(GPUModelRunner, "execute_model", fail)
    with pytest.raises(RuntimeError, match="injected fault"):
        engine.step()
    with pytest.raises(EngineDeadError, match="injected fault"):
        engine.step()
    with pytest.raises(EngineDeadError):
        engine.add_request("b", "hello", GREEDY)
    engine.abort_request("a")  # does nothing on a dead engine, and does not raise


@pytest.mark.parametrize(
    "options, params, match",
    [
        ({}, SamplingParams(n=1, best_of=2, temperature=1), "best_of=2 is not supported by the V1"),
        ({"preemption_mode": "swap"}, None, "preemption_mode='swap': V1 preempts by recompute"),
        ({"dry_run": True}, None, "dry_run=True runs on the classic engine only"),
        ({"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}, None,
         "tensor_parallel_size=2: minivllm's V1 engine runs on one device"),
        ({"scheduler_cls": "tests.engine_spies.RecordingScheduler"}, None,
         "is not a V1 scheduler"),
        ({"num_gpu_blocks_override": 4, "max_model_len": 128, "block_size": 16}, None,
         "too few for one request of max_model_len=128"),
    ],
)
def test_what_v1_cannot_do_is_refused_up_front(tiny_model_dir, options, params, match):
    kwargs = {"max_model_len": 128, **options}
    if params is None:
        with pytest.raises(ValueError, match=match):
            LLM(tiny_model_dir("llama"), use_v1=True, **kwargs)
        return
    llm = LLM(tiny_model_dir("llama"), use_v1=True, **kwargs)
    with pytest.raises(ValueError, match=match):
        llm.llm_engine.add_request("r", "hello", params)
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize("max_tokens", [None, 16])
def test_a_prompt_filling_max_model_len_is_refused_and_one_shorter_runs(
    tiny_model_dir, max_tokens
):
    """vLLM's V1 refuses a prompt of exactly max_model_len tokens (no room for
    an output token; tests/v1/e2e/test_context_length.py): refused up front,
    the engine alive. One token shorter, the request gets its one token and
    finishes by length."""
    llm = LLM(tiny_model_dir("llama"), use_v1=True, block_size=8, max_model_len=32)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    with pytest.raises(ValueError, match="'full': the prompt has 32 tokens, which with at least "
                                         "1 output token is longer than max_model_len=32"):
        engine.add_request("full", {"prompt_token_ids": [5] * 32}, params)
    assert not engine.has_unfinished_requests()
    (out,) = llm.generate([{"prompt_token_ids": [5] * 31}], params, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 1 and out.outputs[0].finish_reason == "length"
    assert_all_blocks_free(llm)


def test_an_abort_that_arrives_during_a_step_takes_the_requests_output_away(
    tiny_model_dir, monkeypatch
):
    """vLLM's EngineCore applies aborts that came in while the model ran
    (its aborts queue) before it makes the step's outputs: the aborted
    request gets nothing from that step, and is gone; the other request's
    tokens are those it gets alone. The abort is put where EngineCoreProc's
    input thread puts it, while the model runs."""
    llm = LLM(tiny_model_dir("llama"), use_v1=True, max_model_len=128)
    core = engine_core(llm)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    alone = llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)
    for rid, prompt in (("a", [9, 10, 11, 12]), ("b", [5, 6, 7])):
        llm.llm_engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    core.step()  # both prefilled
    execute = core.model_executor.execute_model

    def abort_a_meanwhile(scheduler_output):
        output = execute(scheduler_output)
        core.aborts_queue.put_nowait(["a"])
        return output

    monkeypatch.setattr(core.model_executor, "execute_model", abort_a_meanwhile)
    outputs, ran = core.step()
    assert ran and [o.request_id for o in outputs.outputs] == ["b"]
    assert "a" not in core.scheduler.requests and "a" in core.scheduler.finished_req_ids
    monkeypatch.setattr(core.model_executor, "execute_model", execute)
    core.abort_requests(["a"])  # the input queue's copy: nothing left to do
    tokens = [*outputs.outputs[0].new_token_ids]
    while core.scheduler.has_unfinished_requests():
        tokens += [t for o in core.step()[0].outputs for t in o.new_token_ids]
    assert len(tokens) == params.max_tokens - 1  # b's first token came at the prefill step
    assert tokens == alone[0].outputs[0].token_ids[1:]

"""The user-facing API (vLLM's): LLM.generate input forms, the LLMEngine step
loop, stopping rules, abort, metrics, and clear errors for bad input."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from minivllm import LLM, LLMEngine, SamplingParams
from minivllm.sequence import SequenceStatus
from tools.tiny_models import make_tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=10)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(tiny_model_dir("llama"), block_size=8)


def greedy_ids(llm, prompt, max_tokens=10):
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids


def test_generate_accepts_every_prompt_form_and_keeps_order(llm):
    tok = llm.get_tokenizer()
    texts = ["Hello, my name is", "The capital of France is", "Once upon a time"]
    ids = [tok.encode(t) for t in texts]
    by_text = llm.generate(texts, GREEDY, use_tqdm=False)
    by_ids = llm.generate(ids, GREEDY, use_tqdm=False)
    by_dict = llm.generate([{"prompt_token_ids": i} for i in ids], GREEDY, use_tqdm=False)
    single = llm.generate(texts[1], GREEDY, use_tqdm=False)
    assert [o.prompt for o in by_text] == texts
    assert [o.prompt_token_ids for o in by_ids] == ids
    tokens = [o.outputs[0].token_ids for o in by_text]
    assert tokens == [o.outputs[0].token_ids for o in by_ids]
    assert tokens == [o.outputs[0].token_ids for o in by_dict]
    assert single[0].outputs[0].token_ids == tokens[1]
    # Text is the detokenized output tokens.
    assert by_text[0].outputs[0].text == tok.decode(tokens[0], skip_special_tokens=True)
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in by_text)


def test_generate_takes_one_sampling_params_per_prompt(llm):
    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    outs = llm.generate(
        prompts,
        [SamplingParams(temperature=0, max_tokens=3), SamplingParams(temperature=0, max_tokens=7)],
        use_tqdm=False,
    )
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 7]
    with pytest.raises(ValueError, match="sampling_params has 1 entries but there are 2 prompts"):
        llm.generate(prompts, [GREEDY], use_tqdm=False)


def test_progress_bar(llm, capsys):
    llm.generate([[1, 2, 3]], GREEDY, use_tqdm=True)
    assert "Processed prompts" in capsys.readouterr().err
    llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    assert "Processed prompts" not in capsys.readouterr().err


def test_engine_step_loop_like_vllm(llm):
    engine = llm.llm_engine
    assert isinstance(engine, LLMEngine)
    engine.add_request("a", "Hello, my name is", SamplingParams(temperature=0, max_tokens=4))
    engine.add_request(
        "b", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=2)
    )
    steps = []
    while engine.has_unfinished_requests():
        steps.append(
            {o.request_id: (len(o.outputs[0].token_ids), o.finished) for o in engine.step()}
        )
    # Both prefill in step 1; b finishes after 2 tokens, a after 4.
    assert steps == [
        {"a": (1, False), "b": (1, False)},
        {"a": (2, False), "b": (2, True)},
        {"a": (3, False)},
        {"a": (4, True)},
    ]


def test_stop_token_ids_and_eos(llm):
    prompt = [40, 41, 42, 43]
    free_run = greedy_ids(llm, prompt, max_tokens=10)
    stop_at = free_run[4]
    first = free_run.index(stop_at)
    out = llm.generate(
        [prompt],
        SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_at]),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.token_ids == free_run[: first + 1]  # the stop token is kept
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_at)

    # Treat that token as EOS: generation stops there unless ignore_eos.
    engine, checker = llm.llm_engine, llm.llm_engine.stop_checker
    saved = checker.eos_token_id, engine.eos_token_ids
    checker.eos_token_id, engine.eos_token_ids = stop_at, {stop_at}
    try:
        out = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0]
        assert (out.token_ids, out.finish_reason, out.stop_reason) == (
            free_run[: first + 1],
            "stop",
            None,
        )
        params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
        out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        assert (out.token_ids, out.finish_reason) == (free_run, "length")
    finally:
        checker.eos_token_id, engine.eos_token_ids = saved


def test_max_model_len_caps_generation(tiny_model_dir):
    llm = LLM(tiny_model_dir("llama"), max_model_len=20)
    out = llm.generate(
        [list(range(2, 17))], SamplingParams(temperature=0, max_tokens=32), use_tqdm=False
    )
    assert len(out[0].outputs[0].token_ids) == 5  # 15 prompt + 5 = 20
    assert out[0].outputs[0].finish_reason == "length"


def test_abort_frees_blocks_at_once(tiny_model_dir):
    llm = LLM(tiny_model_dir("llama"), block_size=8, max_num_seqs=2)
    engine = llm.llm_engine
    bm = engine.scheduler.block_manager
    total = bm.num_total_gpu_blocks
    params = SamplingParams(temperature=0, max_tokens=20)
    engine.add_request("keep", {"prompt_token_ids": list(range(2, 30))}, params)
    engine.add_request("drop", {"prompt_token_ids": list(range(2, 30))}, params)
    engine.add_request("queued", {"prompt_token_ids": [3, 4]}, params)
    engine.step()
    # max_num_seqs=2: keep and drop run (28 tokens = 4 blocks of 8 each), queued waits.
    assert [sg.request_id for sg in engine.scheduler.waiting] == ["queued"]
    assert bm.get_num_free_gpu_blocks() == total - 8
    engine.abort_request("queued")
    assert bm.get_num_free_gpu_blocks() == total - 8
    engine.abort_request("drop")
    assert bm.get_num_free_gpu_blocks() == total - 4
    outputs = {o.request_id: o for o in engine.step()}
    assert outputs["drop"].finished and outputs["drop"].outputs[0].finish_reason == "abort"
    assert len(outputs["drop"].outputs[0].token_ids) == 1
    assert outputs["queued"].finished and outputs["queued"].outputs[0].finish_reason == "abort"
    assert not outputs["keep"].finished
    while engine.has_unfinished_requests():
        for o in engine.step():
            assert o.request_id == "keep"
    assert bm.get_num_free_gpu_blocks() == total


def test_metrics_are_ordered(llm):
    out = llm.generate([[7, 8, 9]], GREEDY, use_tqdm=False)[0]
    m = out.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time


def test_cpu_dtype_auto_is_float32(llm):
    assert llm.llm_engine.model_config.dtype == torch.float32
    model = llm.llm_engine.worker.model_runner.model
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_request_larger_than_the_cache_is_ignored_not_retried(tiny_model_dir):
    llm = LLM(tiny_model_dir("llama"), block_size=8, num_gpu_blocks_override=3)
    outs = llm.generate(
        [list(range(2, 40)), [5, 6, 7]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False
    )
    # 38 tokens need 5 blocks of 8; the cache has 3.
    assert outs[0].outputs[0].token_ids == [] and outs[0].outputs[0].finish_reason == "length"
    assert outs[1].outputs[0].token_ids == greedy_ids(llm, [5, 6, 7], max_tokens=4)


# -- bad input ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -0.1}, "temperature must be >= 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0.0"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\], got 1.5"),
        ({"top_k": 0}, "top_k must be -1 .* got 0"),
        ({"top_k": -2}, "top_k must be -1 .* got -2"),
        ({"max_tokens": 0}, "max_tokens must be None or an integer >= 1, got 0"),
        ({"n": 0}, "n must be an integer >= 1, got 0"),
        ({"n": 2, "temperature": 0}, "n and best_of must be 1 when sampling greedily"),
        ({"stop_token_ids": [-3]}, r"stop_token_ids must be non-negative integers, got \[-3\]"),
        ({"seed": 1.5}, "seed must be None or a 64-bit integer.*, got 1.5"),
    ],
)
def test_sampling_params_reject_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_bad_prompts_leave_submitted_requests_intact(llm):
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=5)
    expected = greedy_ids(llm, [10, 11, 12], max_tokens=5)
    engine.add_request("good", {"prompt_token_ids": [10, 11, 12]}, params)
    max_len = engine.model_config.max_model_len
    with pytest.raises(
        ValueError, match=f"prompt has {max_len + 1} tokens, longer than max_model_len={max_len}"
    ):
        engine.add_request("long", {"prompt_token_ids": [5] * (max_len + 1)}, params)
    with pytest.raises(ValueError, match="Request id 'good' is already in use"):
        engine.add_request("good", {"prompt_token_ids": [4, 5]}, params)
    with pytest.raises(ValueError, match="the prompt is empty"):
        engine.add_request("empty", {"prompt_token_ids": []}, params)
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 384\)"):
        engine.add_request("oov", {"prompt_token_ids": [1, 999]}, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert {o.request_id for o in outputs} == {"good"}
    assert outputs[-1].outputs[0].token_ids == expected
    engine.add_request("good", {"prompt_token_ids": [4, 5]}, params)  # finished: id is free
    while engine.has_unfinished_requests():
        engine.step()


def test_missing_model_path_says_what_it_looked_for(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match=f"{missing}.*config.json"):
        LLM(str(missing))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        LLM(str(tmp_path / "empty"))


def test_unknown_engine_argument_is_named():
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['blok_size'\]"):
        LLM("unused", blok_size=16)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"block_size": 12}, "block_size must be a power of two from 1 to 128, got 12"),
        ({"max_num_seqs": 0}, "max_num_seqs must be an integer >= 1, got 0"),
        ({"preemption_mode": "evict"}, "preemption_mode must be None or one of"),
        (
            {"tensor_parallel_size": 3},
            r"heads \(4\) must be divisible by tensor_parallel_size \(3\)",
        ),
        (
            {"max_model_len": 100000},
            "max_model_len must be between 1 and the model's context length 512",
        ),
        (
            {"max_model_len": 64, "max_num_batched_tokens": 32},
            r"max_num_batched_tokens \(32\) is smaller",
        ),
        ({"dtype": "int8"}, "dtype must be 'auto', one of .*, got 'int8'"),
    ],
)
def test_bad_engine_arguments(tiny_model_dir, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(tiny_model_dir("llama"), **kwargs)


def test_unsupported_architecture_lists_the_supported(tiny_model_dir, tmp_path):
    path = tmp_path / "foo"
    shutil.copytree(tiny_model_dir("llama"), path)
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["FooForCausalLM"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="'FooForCausalLM' is not supported.*LlamaForCausalLM"):
        LLM(str(path))


def test_finished_states_map_to_vllm_reasons():
    assert SequenceStatus.get_finished_reason(SequenceStatus.FINISHED_STOPPED) == "stop"
    assert SequenceStatus.get_finished_reason(SequenceStatus.FINISHED_LENGTH_CAPPED) == "length"
    assert SequenceStatus.get_finished_reason(SequenceStatus.FINISHED_ABORTED) == "abort"
    assert SequenceStatus.get_finished_reason(SequenceStatus.RUNNING) is None


def test_a_vocabulary_that_does_not_split_over_the_ranks_is_refused_up_front(tmp_path):
    """400 tokens pad to 448 rows (a multiple of 64), which 3 ranks cannot
    share: refused from the config, before any worker starts."""
    path = make_tiny_model(
        "llama", str(tmp_path / "vocab-400"), vocab_size=400, hidden_size=96,
        num_attention_heads=6, num_key_value_heads=3,
    )
    message = r"vocabulary \(400 tokens, padded to 448 rows\) must split evenly over"
    with pytest.raises(ValueError, match=message):
        LLM(path, tensor_parallel_size=3)

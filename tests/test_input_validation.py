"""Bad input is refused up front, and what is accepted runs.

Every bad value given to `SamplingParams`, `LLM(...)` / `EngineArgs` or
`LLMEngine.add_request` raises a ValueError, or a TypeError for a wrong type
(`WrongTypeError` is both), whose message names the field and the value,
before anything is queued. Each case here was a defect: a value that passed
and then failed inside `step()` (a poison pill: every later step failed
too), hung the engine, produced NaN, was silently coerced, or failed deep
inside torch with a message that named nothing.
"""

from __future__ import annotations

import itertools
import pathlib
import re
import shutil

import numpy as np
import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.config import DeviceConfig, PreemptionMode
from minivllm.engine.arg_utils import EngineArgs
from minivllm.worker.cache_engine import CacheEngine
from minivllm.worker.worker import Worker

NAN, INF = float("nan"), float("inf")
PROBE = {"prompt_token_ids": [5, 6, 7, 8]}
GREEDY = SamplingParams(temperature=0, max_tokens=4)
_probe_numbers = itertools.count()


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(tiny_model_dir("llama"), attention_backend="torch", block_size=8)


def run(engine, request_id, prompt, params, max_steps=200):
    """Add one request and step until the engine is idle; its final output."""
    engine.add_request(request_id, prompt, params)
    final = None
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                final = out
    assert not engine.has_unfinished_requests(), "the engine did not finish"
    return final


def assert_refused(error, *words):
    """A ValueError or TypeError whose message contains each of `words`."""
    assert isinstance(error, (ValueError, TypeError)), repr(error)
    for word in words:
        assert word in str(error), f"{word!r} not in {str(error)!r}"


def assert_idle_and_unpoisoned(engine, expected):
    """Nothing left queued, and the probe gives what it gives on a fresh engine."""
    assert not engine.has_unfinished_requests()
    assert not engine._live_request_ids
    out = run(engine, f"probe-{next(_probe_numbers)}", PROBE, GREEDY)
    assert out.outputs[0].token_ids == expected


@pytest.fixture(scope="module")
def probe_ids(tiny_model_dir):
    fresh = LLM(tiny_model_dir("llama"), attention_backend="torch", block_size=8)
    return run(fresh.llm_engine, "probe", PROBE, GREEDY).outputs[0].token_ids


# -- SamplingParams --------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "shown"),
    [
        # Poison pills: accepted, then a TypeError inside step() (torch.topk
        # took True as k; the detokenizer refused None / "x").
        ({"logprobs": True}, "True"),
        ({"prompt_logprobs": True}, "True"),
        ({"skip_special_tokens": None}, "None"),
        ({"skip_special_tokens": "x"}, "'x'"),
        # Silent coercions: a string is true, True is 1, 1.5 rounds up.
        ({"ignore_eos": "no"}, "'no'"),
        ({"include_stop_str_in_output": 1}, "1"),
        ({"stop_token_ids": [True]}, "[True]"),
        ({"stop_token_ids": [1.5]}, "[1.5]"),
        ({"max_tokens": 1.5}, "1.5"),
        ({"max_tokens": NAN}, "nan"),
        ({"n": True}, "True"),
        ({"best_of": 2.0}, "2.0"),
        ({"top_k": True}, "True"),
        ({"min_tokens": False}, "False"),
        ({"seed": True}, "True"),
        ({"seed": "7"}, "'7'"),
        # Errors that named nothing ('<' not supported ..., 'int' is not iterable).
        ({"temperature": "1"}, "'1'"),
        ({"temperature": None}, "None"),
        ({"top_p": None}, "None"),
        ({"top_k": "5"}, "'5'"),
        ({"min_p": "0.1"}, "'0.1'"),
        ({"presence_penalty": None}, "None"),
        ({"frequency_penalty": "1"}, "'1'"),
        ({"repetition_penalty": [1.0]}, "[1.0]"),
        ({"min_tokens": None}, "None"),
        ({"n": "2"}, "'2'"),
        ({"stop_token_ids": 5}, "5"),
        ({"stop_token_ids": "12"}, "'12'"),
        ({"stop": 5}, "5"),
    ],
)
def test_sampling_params_refuse_wrong_types(kwargs, shown):
    (name,) = kwargs
    with pytest.raises(TypeError) as info:
        SamplingParams(**kwargs)
    assert_refused(info.value, name, f"got {shown}")
    assert isinstance(info.value, ValueError)  # as before, and as vLLM raises


@pytest.mark.parametrize(
    "kwargs",
    [
        # NaN gave token 0 over and over with NaN logprobs; inf was taken.
        {"temperature": NAN},
        {"temperature": INF},
        # Finite, but inf in the sampler's float32: -inf / inf is NaN.
        {"temperature": 1e39},
        # (NaN top_p, min_p, presence and repetition penalties were refused
        # already: guards.)
        {"top_p": NAN},
        {"min_p": NAN},
        {"presence_penalty": NAN},
        {"repetition_penalty": NAN},
        {"frequency_penalty": -INF},
        {"repetition_penalty": INF},
        {"repetition_penalty": 1e-50},  # 0 in float32
        {"temperature": 10**400},  # too large even for a float
        # torch.Generator.manual_seed overflowed inside add_request.
        {"seed": 2**64},
        {"seed": -(2**63) - 1},
        {"seed": 10**5000},  # the message must not try to print 5000 digits
        # Not Unicode text: the tokenizer raised a TypeError when the request came.
        {"bad_words": ["fine", "\ud800"]},
    ],
)
def test_sampling_params_refuse_non_finite_and_out_of_range(kwargs):
    (name,) = kwargs
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    assert_refused(info.value, name, "got")
    assert len(str(info.value)) < 300


def test_sampling_params_keep_vllm_defaults_and_accept_numpy_numbers():
    default = SamplingParams()
    assert (default.n, default.best_of, default.temperature, default.max_tokens) == (1, 1, 1.0, 16)
    p = SamplingParams(
        n=np.int64(2),
        temperature=np.float32(0.5),
        top_k=np.int32(5),
        max_tokens=np.int64(4),
        seed=np.uint64(2**64 - 1),
        stop_token_ids=(np.int64(3),),
        presence_penalty=1,
    )
    # Stored as plain Python numbers (torch.Generator refuses numpy integers).
    assert type(p.n) is int and type(p.top_k) is int and type(p.seed) is int
    assert type(p.temperature) is float and type(p.presence_penalty) is float
    assert p.stop_token_ids == [3] and type(p.stop_token_ids[0]) is int
    assert SamplingParams(seed=-(2**63)).seed == -(2**63)
    assert SamplingParams(stop_token_ids=None).stop_token_ids == []


def test_extreme_accepted_seeds_run(llm):
    engine = llm.llm_engine
    for seed in (2**64 - 1, -(2**63)):
        params = SamplingParams(seed=seed, max_tokens=3)
        first = run(engine, f"seed-{seed}-a", PROBE, params).outputs[0].token_ids
        again = run(engine, f"seed-{seed}-b", PROBE, params).outputs[0].token_ids
        assert len(first) == 3 and first == again


# -- add_request -----------------------------------------------------------------


def test_request_id_must_be_a_string(llm, probe_ids):
    engine = llm.llm_engine
    for request_id in (5, None, b"x", ("a",)):
        with pytest.raises(TypeError) as info:
            engine.add_request(request_id, PROBE, GREEDY)
        assert_refused(info.value, "request_id", repr(request_id))
    assert_idle_and_unpoisoned(engine, probe_ids)


@pytest.mark.parametrize(
    ("prompt", "words"),
    [
        ({"prompt_token_ids": [1.5]}, ["prompt_token_ids", "1.5", "position 0"]),
        ({"prompt_token_ids": [5, "5"]}, ["prompt_token_ids", "'5'", "position 1"]),
        ({"prompt_token_ids": [True, 5]}, ["prompt_token_ids", "True"]),
        ({"prompt_token_ids": [[1, 2]]}, ["prompt_token_ids", "[1, 2]"]),
        ({"prompt_token_ids": [NAN]}, ["prompt_token_ids", "nan"]),
        ({"prompt_token_ids": "1 2"}, ["prompt_token_ids", "'1 2'"]),
        ({"prompt_token_ids": 5}, ["prompt_token_ids", "5"]),
        ({"prompt_token_ids": None}, ["prompt_token_ids", "None"]),
        ({"prompt_token_ids": {5, 6}}, ["prompt_token_ids"]),
        ({"prompt_token_ids": torch.tensor([1.0, 2.0])}, ["prompt_token_ids", "1.0"]),
        ({"prompt": 5}, ["'prompt'", "5"]),
        ({"prompt": None}, ["prompt must be"]),
        ({"prompt_token_ids": [5], "prompt": 7}, ["'prompt'", "7"]),
        ({"prompt_token_ids": [5], "promt": "x"}, ["unknown keys", "'promt'"]),
        ({}, ["prompt must be", "{}"]),
        (5, ["prompt must be", "5"]),
        (None, ["prompt must be", "None"]),
        ([5, 6], ["prompt must be", "[5, 6]"]),
        # A lone surrogate is no character: the tokenizer raised a TypeError.
        ("Once \ud800", ["prompt must be valid Unicode text", "'Once \\ud800'", "character 5"]),
        ({"prompt": "\udc80"}, ["'prompt' must be valid Unicode text", "character 0"]),
    ],
)
def test_bad_prompts_are_refused_naming_the_field(llm, probe_ids, prompt, words):
    engine = llm.llm_engine
    with pytest.raises((ValueError, TypeError)) as info:
        engine.add_request("bad", prompt, GREEDY)
    assert_refused(info.value, *words)
    assert_idle_and_unpoisoned(engine, probe_ids)


def test_numpy_and_tensor_token_ids_are_ints(llm, probe_ids):
    engine = llm.llm_engine
    ids = PROBE["prompt_token_ids"]
    for i, form in enumerate(
        [
            np.array(ids),
            np.array(ids, dtype=np.int32),
            [np.int64(t) for t in ids],
            torch.tensor(ids),
            tuple(ids),
            range(5, 9),
        ]
    ):
        out = run(engine, f"ids-{i}", {"prompt_token_ids": form}, GREEDY)
        assert out.prompt_token_ids == ids and type(out.prompt_token_ids[0]) is int
        assert out.outputs[0].token_ids == probe_ids
    # LLM.generate's list of token-id lists: numpy integers were not taken
    # for token ids, and the list went on to add_request as a prompt.
    outs = llm.generate([[np.int64(t) for t in ids], ids], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [probe_ids, probe_ids]
    with pytest.raises(TypeError, match=r"prompt_token_ids must be integers.*1\.5"):
        llm.generate([[5, 1.5]], GREEDY, use_tqdm=False)
    with pytest.raises(TypeError, match="prompts must be .*got None"):
        llm.generate(None, GREEDY, use_tqdm=False)
    assert_idle_and_unpoisoned(engine, probe_ids)


def test_params_and_arrival_time_are_checked(llm, probe_ids):
    engine = llm.llm_engine
    for params in (None, {"temperature": 0}, "greedy"):
        with pytest.raises(TypeError) as info:
            engine.add_request("p", PROBE, params)
        assert_refused(info.value, "params must be a SamplingParams")
    for arrival_time in ("now", NAN, INF, True):
        with pytest.raises((ValueError, TypeError)) as info:
            engine.add_request("t", PROBE, GREEDY, arrival_time=arrival_time)
        assert_refused(info.value, "arrival_time", repr(arrival_time))
    assert_idle_and_unpoisoned(engine, probe_ids)


def test_stop_token_ids_past_the_vocabulary_are_refused(llm, probe_ids):
    # The sampler bans stop tokens before min_tokens by indexing the logits:
    # id 1000 of a 384-token vocabulary raised IndexError inside step().
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=[1000], seed=0)
    with pytest.raises(ValueError) as info:
        engine.add_request("s", PROBE, params)
    assert_refused(info.value, "stop_token_ids [1000]", "vocabulary [0, 384)")
    # Stop tokens covering the whole vocabulary leave nothing to sample.
    everything = SamplingParams(max_tokens=4, min_tokens=1, stop_token_ids=list(range(384)))
    with pytest.raises(ValueError, match="cover the whole vocabulary"):
        engine.add_request("all", PROBE, everything)
    assert_idle_and_unpoisoned(engine, probe_ids)


def test_priority_must_be_an_int(tiny_model_dir):
    llm = LLM(tiny_model_dir("llama"), attention_backend="torch", scheduling_policy="priority")
    engine = llm.llm_engine
    # None was queued; sorting the queue by priority then failed in every step.
    for priority in (None, 1.5, "1", True, NAN):
        with pytest.raises(TypeError) as info:
            engine.add_request("x", PROBE, GREEDY, priority=priority)
        assert_refused(info.value, "priority", repr(priority))
    assert not engine.has_unfinished_requests()
    engine.add_request("low", PROBE, GREEDY, priority=np.int64(5))
    engine.add_request("high", {"prompt_token_ids": [9, 10]}, GREEDY, priority=-1)
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert sorted(finished) == ["high", "low"]
    # Under another policy a priority is refused too, naming it.
    fcfs = LLM(tiny_model_dir("llama"), attention_backend="torch").llm_engine
    with pytest.raises(TypeError, match="priority"):
        fcfs.add_request("x", PROBE, GREEDY, priority=None)
    with pytest.raises(ValueError, match="priority=1 needs scheduling_policy='priority'"):
        fcfs.add_request("x", PROBE, GREEDY, priority=1)


# -- LLM(...) / EngineArgs -----------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "shown"),
    [
        # Hangs: NaN compared False with everything, and generate spun forever.
        ({"max_num_seqs": NAN}, "nan"),
        ({"max_num_batched_tokens": NAN}, "nan"),
        # Silent coercions.
        ({"max_num_seqs": 1.5}, "1.5"),
        ({"max_num_seqs": True}, "True"),
        ({"max_model_len": 100.5}, "100.5"),
        ({"max_num_batched_tokens": 4096.0}, "4096.0"),
        ({"preemption_mode": 5}, "5"),
        ({"tensor_parallel_size": 1.0}, "1.0"),
        ({"tensor_parallel_size": True}, "True"),
        ({"enable_prefix_caching": "yes"}, "'yes'"),
        ({"enable_chunked_prefill": 1}, "1"),
        ({"disable_log_stats": None}, "None"),
        ({"enforce_eager": "no"}, "'no'"),
        ({"trust_remote_code": "no"}, "'no'"),
        ({"dry_run": 1}, "1"),
        # torch.empty TypeErrors and '<' not supported, naming nothing.
        ({"block_size": 16.0}, "16.0"),
        ({"block_size": True}, "True"),
        ({"num_gpu_blocks_override": 1.5}, "1.5"),
        ({"max_seq_len_to_capture": 8192.0}, "8192.0"),
        ({"kv_cache_memory_bytes": 1e9}, "1000000000.0"),
        ({"kv_cache_memory_bytes": "1GB"}, "'1GB'"),
        ({"swap_space": "4"}, "'4'"),
        ({"gpu_memory_utilization": None}, "None"),
        ({"seed": 1.5}, "1.5"),
        ({"seed": "0"}, "'0'"),
        ({"model": 5}, "5"),
        ({"tokenizer": 5}, "5"),
        ({"dtype": ["float32"]}, "['float32']"),
        ({"device": None}, "None"),
        ({"scheduling_policy": None}, "None"),
        ({"attention_backend": 5}, "5"),
        ({"trace": 3}, "3"),  # open(3) would have written into file descriptor 3
        ({"trace": True}, "True"),
    ],
)
def test_engine_options_refuse_wrong_types(tiny_model_dir, kwargs, shown):
    (name,) = kwargs
    with pytest.raises(TypeError) as info:
        LLM(**{"model": tiny_model_dir("llama"), **kwargs})
    assert_refused(info.value, name, shown)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"swap_space": NAN}, ["swap_space", "nan"]),
        ({"swap_space": INF}, ["swap_space", "inf"]),
        ({"seed": 2**64}, ["seed", "18446744073709551616"]),
        ({"dtype": torch.int8}, ["dtype", "torch.int8"]),
        # (Refused already: guards.)
        ({"swap_space": -1}, ["swap_space", "-1"]),
        ({"gpu_memory_utilization": NAN}, ["gpu_memory_utilization", "nan"]),
        ({"tensor_parallel_size": 3}, ["tensor_parallel_size (3)", "divisible"]),
        ({"tensor_parallel_size": 0}, ["tensor_parallel_size", "0"]),
        ({"distributed_executor_backend": "threads"}, ["executor_backend", "'threads'"]),
        ({"tensor_parallel_size": 2, "dry_run": True}, ["tensor_parallel_size=2", "dry_run"]),
        ({"kv_cache_memory_bytes": 0}, ["kv_cache_memory_bytes", "0"]),
        ({"max_num_batched_tokens": 0}, ["max_num_batched_tokens", "0"]),
        ({"max_model_len": 0}, ["max_model_len", "0"]),
        ({"max_seq_len_to_capture": 0}, ["max_seq_len_to_capture", "0"]),
        # Pools larger than this machine: torch failed to allocate them, or
        # the block manager listed 2**50 free blocks.
        ({"swap_space": 1e9}, ["swap_space=1000000000.0 GiB", "memory"]),
        ({"num_gpu_blocks_override": 2**50}, ["num_gpu_blocks_override", "memory"]),
        ({"kv_cache_memory_bytes": 2**70}, ["kv_cache_memory_bytes", "memory"]),
        ({"num_gpu_blocks_override": 2**50, "dry_run": True}, ["num_gpu_blocks_override"]),
        ({"swap_space": 1e12, "dry_run": True}, ["swap_space"]),
    ],
)
def test_engine_options_refuse_bad_values(tiny_model_dir, kwargs, words):
    with pytest.raises(ValueError) as info:
        LLM(tiny_model_dir("llama"), attention_backend="torch", **kwargs)
    assert_refused(info.value, *words)


def test_engine_options_accept_their_types(tiny_model_dir, probe_ids):
    llm = LLM(
        pathlib.Path(tiny_model_dir("llama")),
        tokenizer=pathlib.Path(tiny_model_dir("llama")),
        attention_backend="torch",
        block_size=np.int64(8),
        seed=np.int64(3),
        max_num_seqs=np.int32(4),
        swap_space=1,  # an int number of GiB
        gpu_memory_utilization=1,
        dtype=torch.float32,
        preemption_mode=PreemptionMode.SWAP,
    )
    config = llm.llm_engine.engine_config
    assert type(config.cache_config.block_size) is int and config.model_config.seed == 3
    assert config.cache_config.swap_space == 1.0
    assert config.scheduler_config.preemption_mode is PreemptionMode.SWAP
    assert run(llm.llm_engine, "p", PROBE, GREEDY).outputs[0].token_ids == probe_ids
    # EngineArgs used directly checks the same, in the same place.
    with pytest.raises(TypeError, match="block_size must be a power of two.*16.0"):
        EngineArgs(model=tiny_model_dir("llama"), block_size=16.0).create_engine_config()


@pytest.mark.parametrize("value", ["abc", "nan", "-1", "0", "inf", ""])
def test_bad_cpu_kv_cache_space_variable_is_named(tiny_model_dir, monkeypatch, value):
    monkeypatch.setenv("MINIVLLM_CPU_KVCACHE_SPACE", value)
    with pytest.raises(
        ValueError, match=f"MINIVLLM_CPU_KVCACHE_SPACE.*got {re.escape(repr(value))}"
    ):
        LLM(tiny_model_dir("llama"), attention_backend="torch")


def test_huge_cpu_kv_cache_space_variable_is_named(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("MINIVLLM_CPU_KVCACHE_SPACE", "1e9")
    with pytest.raises(ValueError, match="MINIVLLM_CPU_KVCACHE_SPACE.*memory"):
        LLM(tiny_model_dir("llama"), attention_backend="torch")


def test_gpu_budget_is_the_allowed_share_less_what_is_in_use(tiny_model_dir, monkeypatch):
    """The budget on a GPU: total x gpu_memory_utilization, less all the
    memory in use (vLLM v0.6 subtracts only its own worker's: row 90). Memory
    that another engine still holds leaves no room (tools/bench/step_split.py
    met it on an H200), and the refusal says how much was in use. Only the
    budget is asked for here, so the card is stood in for: nothing is
    allocated."""
    config = EngineArgs(model=tiny_model_dir("llama"), swap_space=0).create_engine_config()
    worker = Worker(config.model_config, config.cache_config, DeviceConfig("cpu"))
    worker.device = torch.device("cuda")
    block_bytes = CacheEngine.get_cache_block_size(16, config.model_config)
    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (60 * gib, 100 * gib))
    assert worker.determine_num_available_blocks() == ((90 - 40) * gib // block_bytes, 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (5 * gib, 100 * gib))
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0\.9 of 100 GiB, 95 GiB "
                                         r"already in use.*holds no block"):
        worker.determine_num_available_blocks()


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_corrupt_weights_name_the_file(tiny_model_dir, tmp_path, damage):
    path = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama"), path)
    weights = path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(
        {"truncate": data[: len(data) // 2], "garbage": b"not safetensors" * 4, "empty": b""}[
            damage
        ]
    )
    with pytest.raises(ValueError, match=re.escape(str(weights))):
        LLM(str(path), attention_backend="torch")


def test_refused_engine_options_leave_no_trace(tiny_model_dir, probe_ids):
    """A construction that fails half way (after the model config) leaves the
    process as it was: torch's default dtype, and a new engine's output."""
    dtype = torch.get_default_dtype()
    for kwargs in ({"dtype": torch.int8}, {"kv_cache_memory_bytes": 2**70}, {"block_size": 3}):
        with pytest.raises(ValueError):
            LLM(tiny_model_dir("llama"), attention_backend="torch", **kwargs)
    assert torch.get_default_dtype() == dtype
    fresh = LLM(tiny_model_dir("llama"), attention_backend="torch", block_size=8)
    assert run(fresh.llm_engine, "p", PROBE, GREEDY).outputs[0].token_ids == probe_ids


def test_wrong_type_error_is_both():
    from minivllm.utils import WrongTypeError

    assert issubclass(WrongTypeError, TypeError) and issubclass(WrongTypeError, ValueError)


@pytest.mark.parametrize("use_v1", [False, True], ids=["classic", "v1"])
def test_max_logprobs_is_the_engines_limit(tiny_model_dir, use_v1):
    """vLLM's `max_logprobs` engine option (20 by default): above it a
    request is refused when added, naming the field and the option, and
    leaves nothing behind; an engine with a higher limit returns that many."""
    model = tiny_model_dir("llama")
    engine = LLM(model, use_v1=use_v1, max_model_len=64).llm_engine
    for name in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=f"{name} must be at most max_logprobs=20 .*got 21"):
            engine.add_request("r", [5, 6, 7], SamplingParams(**{name: 21}))
        assert not engine.has_unfinished_requests()
    wide = LLM(model, use_v1=use_v1, max_model_len=64, max_logprobs=30, enable_prefix_caching=False)
    [out] = wide.generate([[5, 6, 7]], SamplingParams(max_tokens=2, logprobs=25,
                                                      prompt_logprobs=30), use_tqdm=False)
    assert all(len(position) in (25, 26) for position in out.outputs[0].logprobs)
    assert all(len(position) in (30, 31) for position in out.prompt_logprobs[1:])
    with pytest.raises(ValueError, match="max_logprobs must be an integer >= 0, got -1"):
        LLM(model, use_v1=use_v1, max_logprobs=-1)
    # A limit above the vocabulary does not let a request ask past it (the
    # top-k of the logits would fail inside a step and kill the engine).
    vocab = wide.llm_engine.model_config.hf_config.vocab_size
    huge = LLM(model, use_v1=use_v1, max_model_len=64, max_logprobs=vocab + 100).llm_engine
    with pytest.raises(ValueError, match=f"logprobs must be at most the vocabulary's {vocab} "):
        huge.add_request("r", [5, 6, 7], SamplingParams(logprobs=vocab + 1))
    assert not huge.has_unfinished_requests() and not huge.errored

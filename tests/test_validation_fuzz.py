"""Fuzzing the user-facing inputs: anything is either refused up front,
naming the field, or runs exactly as it runs on a fresh engine.

Hypothesis draws `SamplingParams` fields, `LLM(...)` options and
`add_request` arguments from their valid values mixed with junk of every
type: None, bools, small and 64-bit-overflowing ints, floats with NaN and
inf, strings, lists, numpy numbers. For each draw:

- a refusal must be a ValueError or TypeError whose message names one of
  the fields given (or the request argument at fault), and leave nothing
  queued;
- an accepted request must run to the end inside a bounded number of steps,
  with no NaN logprob, and give exactly what a fresh engine gives for the
  same request (greedy or seeded requests; an unseeded random one draws from
  the engine's stream, so it only has to run).

One long-lived engine receives every drawn request, valid or not; at the
end it must hold no request and answer a fixed probe exactly like a fresh
engine: no input may poison it.
"""

from __future__ import annotations

import itertools
import math
import re

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minivllm import LLM, SamplingParams
from minivllm.config import PreemptionMode
from minivllm.sampling_params import SamplingType

NAN, INF = float("nan"), float("inf")
VOCAB = 384  # the tiny models' vocabulary
PROBE = {"prompt_token_ids": [5, 6, 7, 8]}
GREEDY = SamplingParams(temperature=0, max_tokens=4)
MAX_STEPS = 300
# The engine every fuzzed request goes through, and each fresh one it is
# compared with: max_model_len keeps max_tokens=None short.
ENGINE = dict(
    attention_backend="torch",
    max_model_len=16,
    block_size=8,
    num_gpu_blocks_override=64,
    swap_space=0.01,
)
FUZZ = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])


def junk(strings: bool = True) -> st.SearchStrategy:
    """Values of every type, mostly wrong for any one field."""
    options = [
        st.none(),
        st.booleans(),
        st.integers(-3, 3),
        st.integers(2**63, 2**70),
        st.integers(-(2**70), -(2**63) - 1),
        st.just(10**400),
        st.floats(allow_nan=True, allow_infinity=True),
        st.sampled_from([NAN, INF, -INF, 1e39, 1e-50, 1.5, -0.0, 2.0]),
        st.lists(st.integers(-2, VOCAB + 10), max_size=3),
        st.lists(st.floats(), max_size=2),
        st.sampled_from([[None], [True], ["a"], {}, {"x": 1}, (1,), b"x"]),
        st.integers(-2, 5).map(np.int64),
        st.floats(-1, 2).map(np.float32),
    ]
    if strings:
        options.append(st.text(max_size=4))
        options.append(st.sampled_from(["1", "0.5", "nan", "True", "auto", "fcfs"]))
    return st.one_of(options)


SAMPLING_FIELDS = {
    "n": st.integers(1, 2),
    "best_of": st.integers(1, 3),
    "temperature": st.one_of(st.sampled_from([0, 0.0, 0.7, 1, 1.5]), st.floats(0, 3)),
    "top_p": st.floats(0.05, 1),
    "top_k": st.sampled_from([-1, 1, 5, 50, 10**6]),
    "min_p": st.floats(0, 0.5),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2),
    "seed": st.integers(-(2**63), 2**64 - 1),
    "max_tokens": st.integers(1, 4),
    "min_tokens": st.integers(0, 3),
    "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=3),
    "ignore_eos": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "spaces_between_special_tokens": st.booleans(),
    "logprobs": st.one_of(st.none(), st.integers(0, 20)),
    "prompt_logprobs": st.one_of(st.none(), st.integers(0, 20)),
    "stop": st.one_of(st.none(), st.sampled_from(["a", "the", ["x", "e"], ("o",)])),
    "logit_bias": st.one_of(
        st.none(), st.dictionaries(st.integers(0, VOCAB - 1), st.floats(-100, 100), max_size=3)
    ),
    "allowed_token_ids": st.one_of(st.none(), st.lists(st.integers(0, VOCAB - 1), min_size=1,
                                                      max_size=4)),
    "bad_words": st.one_of(
        st.none(), st.lists(st.sampled_from(["a", "the", " x", "once upon", "é"]), max_size=3)
    ),
}

ENGINE_FIELDS = {
    "block_size": st.sampled_from([1, 2, 4, 8, 16, 32, 64, 128]),
    "gpu_memory_utilization": st.floats(0.05, 1),
    "kv_cache_memory_bytes": st.integers(10**5, 10**8),
    "swap_space": st.floats(0, 0.05),
    "num_gpu_blocks_override": st.integers(1, 100),
    "enable_prefix_caching": st.booleans(),
    "max_num_seqs": st.integers(1, 300),
    "max_num_batched_tokens": st.one_of(st.none(), st.integers(1, 4096)),
    "preemption_mode": st.sampled_from([None, "swap", "recompute", PreemptionMode.RECOMPUTE]),
    "enable_chunked_prefill": st.booleans(),
    "scheduling_policy": st.sampled_from(["fcfs", "priority"]),
    "disable_log_stats": st.booleans(),
    "tensor_parallel_size": st.just(1),
    "enforce_eager": st.booleans(),
    "max_seq_len_to_capture": st.integers(1, 10_000),
    "compilation_level": st.just(0),  # compiling takes seconds: its checks are fuzzed as junk
    "seed": st.integers(-(2**63), 2**64 - 1),
    "max_model_len": st.one_of(st.none(), st.integers(1, 512)),
    "dtype": st.sampled_from(
        ["auto", "float32", "float", "float16", "half", "bfloat16", torch.float32, torch.float64]
    ),
    "device": st.just("cpu"),
    "dry_run": st.booleans(),
    "trust_remote_code": st.booleans(),
    "attention_backend": st.just("torch"),
}
# Junk for these is never a string: a string is a path to write the trace
# to, a hub id to download, or a module to import.
NO_STRING_JUNK = ("model", "tokenizer", "trace", "scheduler_cls", "block_manager_cls")

TEXTS = ["Hello, my name is", "The capital of France is", "Once upon a time", "a"]
token_ids = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8)
valid_prompts = st.one_of(
    st.sampled_from(TEXTS),
    st.sampled_from(TEXTS).map(lambda t: {"prompt": t}),
    token_ids.map(lambda ids: {"prompt_token_ids": ids}),
    token_ids.map(lambda ids: {"prompt_token_ids": np.array(ids)}),
    st.tuples(token_ids, st.sampled_from(TEXTS)).map(
        lambda p: {"prompt_token_ids": p[0], "prompt": p[1]}
    ),
)
bad_prompts = st.one_of(
    junk(),
    junk().map(lambda v: {"prompt_token_ids": v}),
    junk().map(lambda v: {"prompt": v}),
    st.lists(junk(), min_size=1, max_size=3).map(lambda v: {"prompt_token_ids": v}),
)


@st.composite
def with_one_junk(
    draw,
    fields: dict[str, st.SearchStrategy],
    extra: tuple[str, ...] = (),
    required: dict[str, st.SearchStrategy] | None = None,
):
    """Some fields (all of `required`) at valid values; about 40% of the
    time one field (any, or one of `extra`) set to junk instead."""
    required = required or {}
    optional = {k: v for k, v in fields.items() if k not in required}
    kwargs = draw(st.fixed_dictionaries(required, optional=optional))
    if draw(st.integers(0, 99)) < 40:
        name = draw(st.sampled_from(sorted(fields) + list(extra)))
        kwargs[name] = draw(junk(strings=name not in NO_STRING_JUNK))
    return kwargs


def sometimes(rare: st.SearchStrategy, otherwise: st.SearchStrategy) -> st.SearchStrategy:
    """`rare` about one draw in eight, else `otherwise`. (one_of would pick
    each half the time; hypothesis favours the ends of a range, so the rare
    window is in the middle.)"""
    return st.integers(0, 99).flatmap(lambda k: rare if 40 <= k < 52 else otherwise)


def names_one_of(error: BaseException, names) -> bool:
    message = str(error)
    return any(re.search(rf"(?<!\w){re.escape(name)}(?!\w)", message) for name in names)


def assert_refusal(error: BaseException, names) -> None:
    assert isinstance(error, (ValueError, TypeError)), repr(error)
    assert names_one_of(error, names), f"{error!r} names none of {sorted(names)}"


def run_to_end(engine, request_id):
    """Step until the engine is idle; the request's final output."""
    final = None
    for _ in range(MAX_STEPS):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished and out.request_id == request_id:
                final = out
    assert not engine.has_unfinished_requests(), f"still running after {MAX_STEPS} steps"
    assert final is not None
    return final


def comparable(out):
    """What must not differ between two engines: everything but timing."""
    return out.prompt, out.prompt_token_ids, out.prompt_logprobs, out.outputs


def assert_no_nan(out) -> None:
    for completion in out.outputs:
        # (V1 gives None without logprobs, as vLLM V1 does.)
        assert completion.cumulative_logprob is None or not math.isnan(
            completion.cumulative_logprob
        )
        for position in completion.logprobs or []:
            assert not any(math.isnan(lp.logprob) for lp in position.values())
    for position in out.prompt_logprobs or []:
        assert not any(math.isnan(lp.logprob) for lp in (position or {}).values())


def probe(engine, request_id="probe"):
    engine.add_request(request_id, PROBE, GREEDY)
    return comparable(run_to_end(engine, request_id))


@pytest.mark.parametrize("use_v1", [False, True], ids=["classic", "v1"])
def test_fuzzed_requests_are_refused_or_run_like_on_a_fresh_engine(tiny_model_dir, use_v1):
    model = tiny_model_dir("llama")
    engine_options = {**ENGINE, "use_v1": use_v1}
    engine = LLM(model, **engine_options).llm_engine
    request_numbers = itertools.count()
    seen = {"refused": 0, "compared": 0, "ran": 0}

    @settings(FUZZ, max_examples=60)
    @given(
        # Mostly seeded, so that random sampling compares with a fresh
        # engine; a few tokens (the default 16 is slow here).
        kwargs=with_one_junk(
            SAMPLING_FIELDS,
            required={
                "seed": sometimes(st.none(), SAMPLING_FIELDS["seed"]),
                "max_tokens": SAMPLING_FIELDS["max_tokens"],
            },
        ),
        prompt=sometimes(bad_prompts, otherwise=valid_prompts),
        request_id=sometimes(junk(), otherwise=st.none()),
        priority=sometimes(junk(), otherwise=st.sampled_from([0, np.int64(0)])),
    )
    def check(kwargs, prompt, request_id, priority):
        if request_id is None:  # most requests: a fresh id
            request_id = f"req-{next(request_numbers)}"
        try:
            params = SamplingParams(**kwargs)
        except (ValueError, TypeError) as e:
            assert_refusal(e, kwargs)
            seen["refused"] += 1
            return
        try:
            engine.add_request(request_id, prompt, params, priority=priority)
        except (ValueError, TypeError) as e:
            assert_refusal(e, {"request_id", "priority", "prompt", "prompt_token_ids", *kwargs})
            assert not engine.has_unfinished_requests()
            seen["refused"] += 1
            return
        out = run_to_end(engine, request_id)
        assert_no_nan(out)
        assert len(out.outputs) == params.n
        if params.sampling_type == SamplingType.RANDOM:
            seen["ran"] += 1
            return
        fresh = LLM(model, **engine_options).llm_engine
        fresh.add_request(request_id, prompt, params, priority=priority)
        assert comparable(out) == comparable(run_to_end(fresh, request_id))
        seen["compared"] += 1

    check()
    # Both kinds were exercised (not a guarantee hypothesis must give, but
    # with 60 draws a run without either would say the strategies broke).
    assert seen["refused"] and seen["compared"], seen
    # Not poisoned: idle, and the probe answers like a fresh engine.
    assert not engine.has_unfinished_requests() and not engine._live_request_ids
    assert probe(engine) == probe(LLM(model, **engine_options).llm_engine)


def test_fuzzed_engine_options_are_refused_or_run_like_a_fresh_engine(tiny_model_dir):
    model = tiny_model_dir("llama")
    default_dtype = torch.get_default_dtype()
    baseline = probe(LLM(model, attention_backend="torch").llm_engine)
    seen = {"refused": 0, "ran": 0}

    @settings(FUZZ, max_examples=40)
    @given(options=with_one_junk(ENGINE_FIELDS, extra=NO_STRING_JUNK))
    def check(options):
        kwargs = {"model": model, "attention_backend": "torch", "swap_space": 0.01, **options}
        try:
            llm = LLM(**kwargs)
        except (ValueError, TypeError) as e:
            assert_refusal(e, options)
            seen["refused"] += 1
            return
        engine = llm.llm_engine
        try:
            engine.add_request("probe", PROBE, GREEDY)
        except ValueError as e:  # e.g. a prompt longer than max_model_len
            assert_refusal(e, options)
            assert not engine.has_unfinished_requests()
            seen["refused"] += 1
            return
        out = run_to_end(engine, "probe")
        assert_no_nan(out)
        assert comparable(out) == probe(LLM(**kwargs).llm_engine)
        seen["ran"] += 1

    check()
    assert seen["refused"] and seen["ran"], seen
    # No refused construction left anything behind.
    assert torch.get_default_dtype() == default_dtype
    assert probe(LLM(model, attention_backend="torch").llm_engine) == baseline


@pytest.mark.parametrize("field", sorted(SAMPLING_FIELDS))
def test_every_sampling_field_refuses_junk_types(field):
    """The deterministic core of the fuzz: a string, a list and NaN are
    wrong for every field but `stop` (which takes strings and lists)."""
    for value in ("1", [object()], NAN):
        if field == "stop" and value == "1":
            continue
        with pytest.raises((ValueError, TypeError), match=rf"^{field} "):
            SamplingParams(**{field: value})

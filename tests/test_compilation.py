"""The compiled model path (`compilation_level`, minivllm/compilation/) and the
decode-batch padding CUDA graphs need (worker/model_runner.py).

The oracle is always the eager engine on the same checkpoint: compiled, the
engine must produce the same greedy tokens; padded, the real rows of a decode
step the same logits, and the KV cache must change only at the real rows'
slots. Compilations are counted (`compilation_counter`), never timed.
"""

from __future__ import annotations

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.attention.kv_cache import PAD_SLOT_ID
from minivllm.compilation import CompilationLevel, compilation_counter, set_forward_context
from minivllm.engine.arg_utils import EngineArgs
from minivllm.worker.model_runner import (
    _BATCH_SIZES_TO_CAPTURE,
    _get_graph_batch_size,
    _get_max_graph_batch_size,
)
from tests.hf_oracle import poison_kv_cache
from tools.tiny_models import ARCHS, make_tiny_model

# Requests arrive in waves while earlier ones decode, prompts longer than a
# step's token budget are chunked, and outputs end at different lengths: the
# steps mix prefill chunks and decodes, and the batch grows and shrinks:
# steps of 16, 14, 8, 5, 4, 2 and 1 tokens, decode-only ones of 5, 4, 2 and 1.
WAVES = [  # (step at which the wave arrives, [(prompt length, max_tokens)])
    (0, [(5, 14), (11, 3)]),
    (2, [(23, 9), (3, 17), (8, 6)]),
    (7, [(30, 5), (4, 12)]),
]


def prompt_ids(length: int, salt: int) -> list[int]:
    return [2 + (salt * 37 + 11 * i) % 300 for i in range(length)]


def make_llm(model_dir: str, level: int, backend: str = "torch", **options) -> LLM:
    """Chunked prefill in steps of 16 tokens (mixed steps), unless `options` say otherwise."""
    options = {"enable_chunked_prefill": True, "max_num_batched_tokens": 16, **options}
    return LLM(
        model_dir, compilation_level=level, attention_backend=backend, block_size=8,
        num_gpu_blocks_override=64, swap_space=0.01, max_num_seqs=8, **options,
    )


def model_runner(llm: LLM):
    """The classic engine's ModelRunner, or V1's GPUModelRunner."""
    engine = llm.llm_engine
    if hasattr(engine, "worker"):
        return engine.worker.model_runner
    return engine.engine_core.engine_core.model_executor.driver_worker.model_runner


def spy_on_forward(llm: LLM) -> list[tuple[int, int, int]]:
    """Record (tokens, prefills, decode tokens) of every forward the runner makes."""
    runner = model_runner(llm)
    forward, steps = runner.model_forward, []

    def recording(input_ids, positions, kv_caches, attn_metadata):
        steps.append(
            (input_ids.shape[0], attn_metadata.num_prefills, attn_metadata.num_decode_tokens)
        )
        return forward(input_ids, positions, kv_caches, attn_metadata)

    runner.model_forward = recording
    return steps


def run_waves(llm: LLM) -> dict[str, list[int]]:
    """Step the engine, adding each wave when its step comes; greedy tokens by request."""
    engine, tokens, step = llm.llm_engine, {}, 0
    pending = list(WAVES)
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, wave = pending.pop(0)
            for length, max_tokens in wave:
                rid = str(len(tokens))
                tokens[rid] = []
                params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
                engine.add_request(rid, {"prompt_token_ids": prompt_ids(length, int(rid))}, params)
        for out in engine.step():
            tokens[out.request_id] = list(out.outputs[0].token_ids)
        step += 1
    return tokens


def check_steps_vary(steps: list[tuple[int, int, int]]) -> None:
    """The schedule really is varied, or the no-recompile check proves little."""
    sizes = {n for n, _, _ in steps}
    decode_only = {n for n, p, _ in steps if p == 0}
    assert 1 in sizes and len(sizes) >= 6, sizes
    assert len(decode_only) >= 4, decode_only
    assert any(p and d for _, p, d in steps), "no step mixed a prefill chunk and decodes"


@pytest.fixture(scope="module")
def eager_tokens(tiny_model_dir):
    return run_waves(make_llm(tiny_model_dir("llama"), CompilationLevel.NO_COMPILATION))


def check_compiled_run(
    model_dir: str, level: int, backend: str, eager_tokens, **options
) -> None:
    models_seen = compilation_counter.num_models_seen
    llm = make_llm(model_dir, level, backend, **options)
    assert compilation_counter.num_models_seen == models_seen + 1  # the runner compiles
    steps = spy_on_forward(llm)
    before = compilation_counter.clone()
    tokens = run_waves(llm)
    assert tokens == eager_tokens
    check_steps_vary(steps)
    # One graph for all those shapes (none if an earlier engine of these
    # shapes compiled it), even if torch's thread count changed under it
    # (Numba's OpenMP layer, launched by the first Numba decode, sets the
    # shared OpenMP thread count to NUMBA_NUM_THREADS): the graph has no
    # guard on it (compilation/wrapper.py).
    assert compilation_counter.num_graphs_seen - before.num_graphs_seen <= 1
    # Warmed up: the same schedule again, every size and mix, compiles nothing.
    with compilation_counter.expect(num_graphs_seen=0, num_inductor_compilations=0):
        assert run_waves(llm) == eager_tokens


@pytest.mark.slow  # Inductor compiles the tiny model in 10-20 s on one thread, cold
@pytest.mark.parametrize("backend", ["torch", "numba"])
def test_piecewise_greedy_equals_eager_and_compiles_once(
    tiny_model_dir, eager_tokens, backend
):
    check_compiled_run(tiny_model_dir("llama"), CompilationLevel.PIECEWISE, backend, eager_tokens)


def test_dynamo_once_greedy_equals_eager_and_captures_once(tiny_model_dir, eager_tokens):
    check_compiled_run(tiny_model_dir("llama"), CompilationLevel.DYNAMO_ONCE, "torch", eager_tokens)


def test_dynamo_as_is_greedy_equals_eager(tiny_model_dir, eager_tokens):
    """Level 1 lets TorchDynamo recompile as it likes (first shape static):
    only the tokens are checked."""
    llm = make_llm(tiny_model_dir("llama"), CompilationLevel.DYNAMO_AS_IS)
    assert run_waves(llm) == eager_tokens


@pytest.mark.parametrize(
    "level",
    [
        CompilationLevel.DYNAMO_ONCE,
        pytest.param(CompilationLevel.PIECEWISE, marks=pytest.mark.slow),
    ],
)
def test_v1_compiled_greedy_equals_v1_eager_and_compiles_once(tiny_model_dir, level):
    """V1's runner compiles the same way (vLLM's V1 compiles by default; ours
    is eager unless asked): its own schedule (prefix caching on, the batch
    reordered with prefills first) gives the eager V1 engine's tokens, from
    one graph."""
    model_dir = tiny_model_dir("llama")
    v1 = {"use_v1": True, "max_model_len": 128}  # V1 wants room for one longest request
    want = run_waves(make_llm(model_dir, CompilationLevel.NO_COMPILATION, **v1))
    check_compiled_run(model_dir, level, "numba", want, **v1)


@pytest.mark.parametrize("arch", [a for a in ARCHS if a != "llama"])
def test_every_architecture_compiles_to_one_graph(tiny_model_dir, arch):
    """Every model traces whole (DYNAMO_ONCE refuses graph breaks), and runs
    its attention layers on their own caches: the tokens are eager's."""
    model_dir = tiny_model_dir(arch)
    want = run_waves(make_llm(model_dir, CompilationLevel.NO_COMPILATION))
    llm = make_llm(model_dir, CompilationLevel.DYNAMO_ONCE)
    before = compilation_counter.clone()
    assert run_waves(llm) == want
    assert compilation_counter.num_graphs_seen - before.num_graphs_seen <= 1


def test_small_steps_on_one_thread_share_the_graph(tmp_path):
    """A compiled engine runs its small steps on one thread, as the eager one
    does (worker/cpu_threads.py), from the graph its other steps run: the
    graph has no guard on torch's thread count. Shapes no other test
    compiles, so that the count starts from nothing: with the guard, the
    first step on the other thread count would compile a second graph."""
    model_dir = make_tiny_model("llama", str(tmp_path / "m"), intermediate_size=80)
    want = run_waves(make_llm(model_dir, CompilationLevel.NO_COMPILATION))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        llm = make_llm(model_dir, CompilationLevel.DYNAMO_ONCE)
        llm.llm_engine.worker.one_thread_max_tokens = 4
        runner, seen = model_runner(llm), []
        forward = runner.model_forward

        def recording(input_ids, *args):
            seen.append((input_ids.shape[0], torch.get_num_threads()))
            return forward(input_ids, *args)

        runner.model_forward = recording
        before = compilation_counter.clone()
        assert run_waves(llm) == want
    finally:
        torch.set_num_threads(threads)
    assert [n for n, _ in seen if n <= 4] and [n for n, _ in seen if n > 4]
    assert all(t == (1 if n <= 4 else 2) for n, t in seen), seen
    assert compilation_counter.num_graphs_seen - before.num_graphs_seen == 1


def test_a_second_engine_with_other_constants_compiles_its_own_graph(tmp_path):
    """Only the global-state guard is dropped: the graph bakes in the
    norms' epsilon, a Python float, and its guard sends a model of the same
    shapes but another epsilon to a graph of its own, with its own tokens."""
    level = CompilationLevel.DYNAMO_ONCE
    first = make_tiny_model("llama", str(tmp_path / "a"), rms_norm_eps=1e-6)
    second = make_tiny_model("llama", str(tmp_path / "b"), rms_norm_eps=0.5)
    first_tokens = run_waves(make_llm(first, level))
    before = compilation_counter.clone()
    tokens = run_waves(make_llm(second, level))
    assert compilation_counter.num_graphs_seen - before.num_graphs_seen == 1
    assert tokens == run_waves(make_llm(second, CompilationLevel.NO_COMPILATION))
    assert tokens != first_tokens


def test_more_engines_than_torchs_default_recompile_limit_each_compile(tmp_path):
    """TorchDynamo keeps 8 graphs of a function by default, then fails a
    full-graph compile: ten engines on ten shapes of one model class each
    get a graph of their own (RECOMPILE_LIMIT) and their eager tokens.
    (Sizes no other test here compiles: this file runs in one process.)"""
    prompt = [{"prompt_token_ids": [5, 6, 7]}]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    before = compilation_counter.clone()
    for i in range(10):
        model_dir = make_tiny_model("llama", str(tmp_path / str(i)), intermediate_size=36 + 4 * i)
        compiled = make_llm(model_dir, CompilationLevel.DYNAMO_ONCE).generate(prompt, params)
        eager = make_llm(model_dir, CompilationLevel.NO_COMPILATION).generate(prompt, params)
        assert compiled[0].outputs[0].token_ids == eager[0].outputs[0].token_ids
    assert compilation_counter.num_graphs_seen - before.num_graphs_seen == 10


def test_a_second_engine_reuses_the_graph_with_its_own_weights(tmp_path):
    """The weights are graph inputs: an engine on other weights of the same
    shapes runs the first one's compiled code, and gets its own tokens."""
    level = CompilationLevel.DYNAMO_ONCE
    first = make_tiny_model("llama", str(tmp_path / "a"), seed=1)
    second = make_tiny_model("llama", str(tmp_path / "b"), seed=2)
    run_waves(make_llm(first, level))
    with compilation_counter.expect(num_graphs_seen=0):
        tokens = run_waves(make_llm(second, level))
    assert tokens == run_waves(make_llm(second, CompilationLevel.NO_COMPILATION))
    assert tokens != run_waves(make_llm(first, CompilationLevel.NO_COMPILATION))


# -- options ---------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [4, -1, "3", 2.0, True, None])
def test_a_bad_compilation_level_is_refused(tiny_model_dir, value):
    with pytest.raises((ValueError, TypeError), match=r"compilation_level must be one of 0 "):
        EngineArgs(model=tiny_model_dir("llama"), compilation_level=value).create_engine_config()


def test_compilation_with_tensor_parallelism_is_refused(tiny_model_dir):
    args = EngineArgs(model=tiny_model_dir("llama"), compilation_level=3, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="one worker only"):
        args.create_engine_config()


def test_compilation_options_reach_the_runner(tiny_model_dir):
    config = EngineArgs(
        model=tiny_model_dir("llama"), compilation_level=2, enforce_eager=False
    ).create_engine_config()
    assert config.model_config.compilation_level == 2
    assert config.model_config.enforce_eager is False
    assert EngineArgs().compilation_level == CompilationLevel.NO_COMPILATION  # off by default


# -- padding a decode batch to a captured size ----------------------------------------------


def test_graph_batch_sizes_are_vllms():
    assert _BATCH_SIZES_TO_CAPTURE[:5] == [1, 2, 4, 8, 16] and _BATCH_SIZES_TO_CAPTURE[-1] == 256
    assert [_get_graph_batch_size(b) for b in (1, 2, 3, 4, 5, 8, 9, 100, 256)] == [
        1, 2, 4, 4, 8, 8, 16, 104, 256,
    ]
    for b in range(1, 257):  # always the smallest captured size that holds b
        assert _get_graph_batch_size(b) == min(s for s in _BATCH_SIZES_TO_CAPTURE if s >= b)
    assert [_get_max_graph_batch_size(n) for n in (1, 3, 64, 100, 1000)] == [1, 4, 64, 104, 256]


def decode_step(llm: LLM, prompts: list[list[int]]):
    """Prefill `prompts`, then schedule (without running) their first decode step."""
    engine = llm.llm_engine
    for i, prompt in enumerate(prompts):
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    engine.step()
    seq_group_metadata_list, scheduler_outputs = engine.scheduler.schedule()
    assert all(not m.is_prompt for m in seq_group_metadata_list)
    return seq_group_metadata_list


def logits_of(runner, model_input, kv_caches) -> torch.Tensor:
    with torch.inference_mode(), set_forward_context(
        model_input.attn_metadata, kv_caches, runner.attn_layers, runner.packed_layers
    ):
        hidden = runner.model_forward(
            model_input.input_ids, model_input.positions, kv_caches, model_input.attn_metadata
        )
        return runner.model.compute_logits(hidden[model_input.selected_token_indices])


@pytest.mark.parametrize("backend", ["torch", "numba"])
@pytest.mark.parametrize("graph_batch_size", [None, 8])  # None: _get_graph_batch_size(3) = 4
def test_a_padded_decode_batch_changes_nothing_but_its_real_rows(
    tiny_model_dir, backend, graph_batch_size
):
    llm = make_llm(tiny_model_dir("llama"), 0, backend, enable_chunked_prefill=False,
                   max_num_batched_tokens=None)
    poison_kv_cache(llm)  # a padding row reading or writing a stray slot would show
    meta = decode_step(llm, [prompt_ids(n, n) for n in (5, 13, 9)])
    runner = model_runner(llm)
    size = graph_batch_size or _get_graph_batch_size(len(meta))
    plain = runner.prepare_model_input(meta)
    padded = runner.prepare_model_input(meta, graph_batch_size=size)

    real = plain.attn_metadata.slot_mapping
    assert padded.input_ids.shape == (size,)
    assert padded.attn_metadata.slot_mapping.tolist() == real.tolist() + [PAD_SLOT_ID] * (size - 3)
    assert padded.attn_metadata.seq_lens[3:] == [1] * (size - 3)
    assert torch.equal(padded.selected_token_indices, plain.selected_token_indices)
    assert padded.batch == plain.batch  # the step's record: only the real rows

    cache = llm.llm_engine.worker.gpu_cache
    before = [layer.clone() for layer in cache]
    cache_plain = [layer.clone() for layer in cache]
    want = logits_of(runner, plain, cache_plain)
    got = logits_of(runner, padded, cache)
    assert got.shape == want.shape == (3, llm.llm_engine.model_config.hf_config.vocab_size)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got.argmax(-1), want.argmax(-1))

    # Bytes: outside the three real slots, every layer's cache is as it was
    # (NaN included); at them, what the unpadded step wrote.
    for layer_before, layer_after, layer_plain in zip(before, cache, cache_plain, strict=True):
        flat = [t.view(2, -1, *t.shape[3:]) for t in (layer_before, layer_after, layer_plain)]
        others = torch.ones(flat[0].shape[1], dtype=torch.bool)
        others[real] = False
        assert torch.equal(flat[1][:, others].view(torch.int32),
                           flat[0][:, others].view(torch.int32))
        torch.testing.assert_close(flat[1][:, real], flat[2][:, real], rtol=1e-5, atol=1e-5)
        assert torch.isfinite(flat[1][:, real]).all()


def test_padding_refuses_what_a_graph_cannot_take(tiny_model_dir):
    llm = make_llm(tiny_model_dir("llama"), 0, enable_chunked_prefill=False,
                   max_num_batched_tokens=None)
    meta = decode_step(llm, [prompt_ids(n, n) for n in (5, 13, 9)])
    runner = llm.llm_engine.worker.model_runner
    with pytest.raises(ValueError, match="cannot pad a batch of 3 sequences down to 2"):
        runner.prepare_model_input(meta, graph_batch_size=2)
    engine = llm.llm_engine
    engine.add_request("late", {"prompt_token_ids": prompt_ids(4, 1)}, SamplingParams())
    mixed, _ = engine.scheduler.schedule()
    assert any(m.is_prompt for m in mixed)
    with pytest.raises(ValueError, match="only a decode batch is padded"):
        runner.prepare_model_input(mixed, graph_batch_size=8)

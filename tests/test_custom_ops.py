"""The `CustomOp` layers' CPU kernels against their `forward_native` reference
(model_executor/custom_op.py, model_executor/layers/cpu_ops_numba.py)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from minivllm import LLM, SamplingParams
from minivllm.model_executor.layers.layernorm import RMSNorm
from minivllm.model_executor.layers.rotary_embedding import RotaryEmbedding
from tests.hf_oracle import make_prompts

HEAD_SIZE = 32


def rotary(max_position: int = 256) -> RotaryEmbedding:
    config = LlamaConfig(hidden_size=4 * HEAD_SIZE, num_attention_heads=4)
    return RotaryEmbedding(HEAD_SIZE, max_position, config)


def split_qkv(num_tokens: int, num_heads: int, num_kv_heads: int, seed: int = 0):
    """q and k as the model hands them over: views of one fused projection,
    each row strided by the whole [q | k | v] width."""
    q_size, kv_size = num_heads * HEAD_SIZE, num_kv_heads * HEAD_SIZE
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, generator=gen)
    q, k, _ = qkv.split([q_size, kv_size, kv_size], dim=-1)
    return q, k


@pytest.mark.parametrize("num_tokens,num_heads,num_kv_heads", [(1, 4, 4), (7, 4, 2), (65, 8, 1)])
def test_rotary_kernel_gives_the_native_bits(num_tokens, num_heads, num_kv_heads):
    rope = rotary()
    q, k = split_qkv(num_tokens, num_heads, num_kv_heads)
    q_in, k_in = q.clone(), k.clone()
    positions = torch.randint(0, 256, (num_tokens,), generator=torch.Generator().manual_seed(1))
    want_q, want_k = rope.forward_native(positions, q, k)
    got_q, got_k = rope.forward_cpu(positions, q, k)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert got_q.is_contiguous() and got_k.is_contiguous()  # what attention reads without a copy
    assert torch.equal(q, q_in) and torch.equal(k, k_in)  # the inputs are left as they were


def test_rotary_kernel_refuses_a_position_past_its_cache():
    rope = rotary(max_position=16)
    q, k = split_qkv(2, 4, 2)
    with pytest.raises(IndexError, match="outside the rotary cache"):
        rope.forward_cpu(torch.tensor([3, 16]), q, k)
    with pytest.raises(IndexError, match="outside the rotary cache"):
        rope.forward_cpu(torch.tensor([-1, 0]), q, k)


def norm_and_inputs(num_tokens: int, hidden: int = 96):
    gen = torch.Generator().manual_seed(num_tokens)
    norm = RMSNorm(hidden, eps=1e-5)
    norm.weight.data = torch.randn(hidden, generator=gen)
    return norm, 3 * torch.randn(num_tokens, hidden, generator=gen), torch.randn(
        num_tokens, hidden, generator=gen
    )


@pytest.mark.parametrize("num_tokens", [1, 5, 64])
def test_rms_norm_kernel_matches_native_within_float32_rounding(num_tokens):
    """Only the sum of squares is added in another order: a few float32 steps."""
    norm, x, residual = norm_and_inputs(num_tokens)
    want = norm.forward_native(x.clone())
    got = norm.forward_cpu(x)
    torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
    want_out, want_residual = norm.forward_native(x.clone(), residual.clone())
    got_out, got_residual = norm.forward_cpu(x.clone(), residual.clone())
    assert torch.equal(got_residual, want_residual)  # x + residual: one rounding either way
    torch.testing.assert_close(got_out, want_out, rtol=2e-6, atol=2e-6)


def test_fused_rms_norm_works_in_place_as_vllms():
    norm, x, residual = norm_and_inputs(3)
    x_in, residual_in = x.clone(), residual.clone()
    out, new_residual = norm.forward_cpu(x, residual)
    assert out.data_ptr() == x.data_ptr() and new_residual.data_ptr() == residual.data_ptr()
    assert torch.equal(new_residual, x_in + residual_in)


def test_rms_norm_kernel_gives_a_row_the_same_bits_alone_and_in_a_batch():
    norm, x, residual = norm_and_inputs(9)
    batch = norm.forward_cpu(x)
    fused, _ = norm.forward_cpu(x.clone(), residual.clone())
    for i in range(len(x)):
        assert torch.equal(norm.forward_cpu(x[i : i + 1].clone()), batch[i : i + 1])
        alone, _ = norm.forward_cpu(x[i : i + 1].clone(), residual[i : i + 1].clone())
        assert torch.equal(alone, fused[i : i + 1])


def test_other_dtypes_and_layouts_run_the_native_code():
    norm, x, residual = norm_and_inputs(4)
    half = x.to(torch.bfloat16)
    assert torch.equal(norm(half), norm.forward_native(half))
    strided = x.t().contiguous().t()  # the same values, column-major
    assert torch.equal(norm(strided), norm.forward_native(strided))
    rope = rotary()
    q, k = split_qkv(3, 4, 2)
    positions = torch.tensor([0, 5, 9], dtype=torch.int32)
    want = rope.forward_native(positions, q, k)
    got = rope(positions, q, k)  # int32 positions: the native path
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def outcome(fn):
    """What a call gives: its tensors, or the type of what it raised."""
    try:
        return fn()
    except Exception as error:  # noqa: BLE001 - the type is the outcome
        return type(error)


def assert_same_outcome(got, want):
    if isinstance(want, type):
        assert got is want
    else:
        for g, w in zip(got if isinstance(got, tuple) else (got,),
                        want if isinstance(want, tuple) else (want,), strict=True):
            torch.testing.assert_close(g, w, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("case", [
    "wider rows than the weight", "a residual broadcast over the rows",
    "a column-major residual", "one row as a vector", "x that requires grad",
])
def test_rms_norm_runs_what_its_kernel_cannot_read_natively(case):
    """The kernel checks no bounds: every shape it was not written for goes
    to the native code, which computes it (or raises) as it always did."""
    norm, x, residual = norm_and_inputs(4)
    args = {
        "wider rows than the weight": (torch.randn(2, 2 * x.shape[1]),),
        "a residual broadcast over the rows": (x, residual[:1]),
        "a column-major residual": (x, residual.t().contiguous().t()),
        "one row as a vector": (x[0],),
        "x that requires grad": (x.clone().requires_grad_(),),
    }[case]

    def call(forward):
        return outcome(lambda: forward(*(a.clone() for a in args)))

    assert_same_outcome(call(norm), call(norm.forward_native))


@pytest.mark.parametrize("case", [
    "fewer positions than rows", "more positions than rows", "a key of part of a head",
    "half-precision rows", "contiguous rows", "positions as a column",
])
def test_rotary_runs_what_its_kernel_cannot_read_natively(case):
    rope = rotary()
    q, k = split_qkv(4, 4, 2)
    positions = torch.tensor([0, 3, 7, 250])
    args = {
        "fewer positions than rows": (positions[:2], q, k),
        "more positions than rows": (torch.cat([positions, positions]), q, k),
        "a key of part of a head": (positions, q, k[:, : HEAD_SIZE + HEAD_SIZE // 2]),
        "half-precision rows": (positions, q.half(), k.half()),
        "contiguous rows": (positions, q.contiguous(), k.contiguous()),
        "positions as a column": (positions[:, None], q, k),
    }[case]
    assert_same_outcome(outcome(lambda: rope(*args)), outcome(lambda: rope.forward_native(*args)))


def test_the_engine_gives_the_same_tokens_with_and_without_the_cpu_kernels(
    tiny_model_dir, monkeypatch
):
    """Through every layer of a model: the first layer's plain norm, the
    fused norms carrying the residual, the final norm, rotary at every
    position. Greedy tokens equal, and their logprobs within float32 noise."""
    llm = LLM(tiny_model_dir("llama"), num_gpu_blocks_override=64)
    prompts = make_prompts(llm.llm_engine.model_config.hf_config.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=1, ignore_eos=True)
    with_kernels = llm.generate(prompts, params, use_tqdm=False)
    for layer in (RMSNorm, RotaryEmbedding):
        monkeypatch.setattr(layer, "forward_cpu", layer.forward_native)
    native = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(with_kernels, native, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].cumulative_logprob == pytest.approx(
            b.outputs[0].cumulative_logprob, abs=1e-4
        )


def test_torch_compile_traces_the_native_forward():
    """Under TorchDynamo the layers must be plain operators that Inductor can
    fuse: a Numba call would break the graph, which `fullgraph` refuses."""
    norm, x, residual = norm_and_inputs(4)
    compiled = torch.compile(norm, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x.clone()), norm.forward_native(x.clone()))
    rope = rotary()
    q, k = split_qkv(3, 4, 2)
    positions = torch.tensor([0, 5, 9])
    got = torch.compile(rope, fullgraph=True, backend="eager")(positions, q, k)
    assert torch.equal(got[0], rope.forward_native(positions, q, k)[0])

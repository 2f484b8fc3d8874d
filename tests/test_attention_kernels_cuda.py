"""The CUDA kernels of `csrc/`, each test run twice: on a GPU and emulated.

Both decode versions against the PyTorch reference over dtypes, head sizes,
block sizes, GQA ratios and long random contexts; the cache kernels exactly;
and the engine with the `cuda` backend against the `torch` backend.

The `device` fixture runs every test

- on "cuda" (marker `cuda`: skipped without a GPU and CuPy), and
- on "cpu" inside `minivllm.cuda_emu.emulated_custom_ops()` (id `emulated`): the
  same `.cu` sources behind the same launchers of `_custom_ops.py`, every CUDA
  thread a CPU fiber. This is how a machine without a GPU executes them.
  Contexts are shorter there, because the emulator is slow.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from transformers import LlamaConfig

from minivllm import LLM, SamplingParams, cuda_emu
from minivllm import _custom_ops as ops
from minivllm.attention import selector
from minivllm.model_executor.layers.layernorm import RMSNorm
from minivllm.model_executor.layers.rotary_embedding import RotaryEmbedding
from tests.kernel_cases import lengths_around_blocks, make_decode_case
from tools.tiny_models import make_tiny_model

# (atol, rtol): outputs are rounded to the dtype, so allow about one unit in
# the last place of each.
TOLERANCE = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (1e-3, 1e-3),
    torch.bfloat16: (1e-2, 1.6e-2),
}
DTYPES = pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"]
)


@pytest.fixture(
    params=[
        pytest.param("cuda", marks=pytest.mark.cuda),
        pytest.param("cpu", marks=pytest.mark.slow, id="emulated"),
    ]
)
def device(request, monkeypatch):
    if request.param == "cuda":
        yield "cuda"
        return
    if cuda_emu.compiler() is None:
        pytest.skip("the CUDA emulator needs a C++ compiler (g++, or $CXX)")
    # The emulator stands in for the GPU and CuPy that the selector asks for.
    monkeypatch.setattr(selector, "_cuda_problems", lambda *args: [])
    with cuda_emu.emulated_custom_ops():
        yield "cpu"


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def check(version: str, case, dtype, launch=None) -> None:
    """The kernel on `case` against the reference; `launch`, a case with the
    same inputs but a wider block table, is what the kernel runs on, with
    max_seq_len = the table's width (a CUDA graph's launch)."""
    out = torch.empty_like(case.query)
    kernel = ops.paged_attention_v1 if version == "v1" else ops.paged_attention_v2
    max_seq_len = int(case.seq_lens.max())
    run = case
    if launch is not None:
        run, max_seq_len = launch, launch.block_tables.shape[1] * launch.kv_cache.shape[2]
    kv = run.kv_cache
    kernel(out, run.query, kv[0], kv[1], run.block_tables, run.seq_lens, run.scale, max_seq_len)
    synchronize(out.device.type)
    assert not out.isnan().any(), "the kernel read a slot no sequence owns"
    # The reference computes in float32 from the same half-precision inputs.
    expected = case.reference()
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("version", ["v1", "v2"])
@DTYPES
@pytest.mark.parametrize("head_size", ops.SUPPORTED_HEAD_SIZES)
@pytest.mark.parametrize("block_size", ops.SUPPORTED_BLOCK_SIZES)
def test_paged_attention_short_contexts(device, version, dtype, head_size, block_size):
    """Lengths around block boundaries, GQA 4:1."""
    case = make_decode_case(
        lengths_around_blocks(block_size), 8, 2, head_size, block_size, dtype, device=device
    )
    check(version, case, dtype)


@pytest.mark.parametrize("version", ["v1", "v2"])
@DTYPES
@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 8), (8, 2), (16, 1)])
@pytest.mark.parametrize("block_size", ops.SUPPORTED_BLOCK_SIZES)
def test_paged_attention_long_random_contexts(
    device, version, dtype, num_heads, num_kv_heads, block_size
):
    """Up to 7 sequences of random lengths up to 4500 on a GPU, up to 1100
    emulated: several v2 partitions either way."""
    longest = 4500 if device == "cuda" else 1100
    rng = random.Random(f"{version} {dtype} {num_heads} {num_kv_heads} {block_size}")
    seq_lens = [rng.randint(1, longest) for _ in range(rng.randint(1, 7))]
    seq_lens[0] = longest
    case = make_decode_case(
        seq_lens, num_heads, num_kv_heads, 128, block_size, dtype, len(seq_lens), device
    )
    check(version, case, dtype)


@pytest.mark.parametrize("version", ["v1", "v2"])
@DTYPES
def test_paged_attention_launched_for_a_longer_context(device, version, dtype):
    """As a CUDA graph launches them (worker/cuda_graph_runner.py): sized for
    2048 tokens of context (v2: 4 partitions), run on sequences of 1-700,
    with a block table 2048 tokens wide whose columns past each sequence
    hold stale block numbers. Partitions and blocks past a sequence's end
    must be skipped."""
    block_size = 16
    case = make_decode_case(
        lengths_around_blocks(block_size) + [700], 8, 2, 64, block_size, dtype, device=device
    )
    g = torch.Generator().manual_seed(7)
    num_blocks = case.kv_cache.shape[1]
    wide = torch.randint(0, num_blocks, (len(case.seq_lens), 2048 // block_size), generator=g)
    wide[:, : case.block_tables.shape[1]] = case.block_tables.cpu()
    check(version, case, dtype, launch=dataclasses.replace(case, block_tables=wide.to(device)))


@DTYPES
def test_reshape_and_cache_is_exact(device, dtype):
    num_blocks, block_size, num_kv_heads, head_size = 10, 16, 2, 64
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_size).to(device, dtype)
    expected = kv_cache.clone()
    # K and V as the model hands them: views into one fused qkv projection.
    qkv = torch.randn(7, 3 * num_kv_heads * head_size).to(device, dtype)
    key = qkv[:, num_kv_heads * head_size : 2 * num_kv_heads * head_size]
    value = qkv[:, 2 * num_kv_heads * head_size :]
    key = key.view(7, num_kv_heads, head_size)
    value = value.view(7, num_kv_heads, head_size)
    slots = torch.tensor([5, -1, 16, 17, 159, -1, 40], device=device)
    ops.reshape_and_cache(key, value, kv_cache, slots)
    synchronize(device)
    flat = expected.view(2, num_blocks * block_size, num_kv_heads, head_size)
    keep = slots >= 0
    flat[0, slots[keep]] = key[keep]
    flat[1, slots[keep]] = value[keep]
    assert torch.equal(kv_cache, expected)


@DTYPES
def test_copy_blocks_is_exact(device, dtype):
    layers = [torch.randn(2, 12, 8, 2, 64).to(device, dtype) for _ in range(3)]
    expected = [t.clone() for t in layers]
    pairs = [(3, 7), (0, 11), (5, 2)]
    ops.copy_blocks(layers, pairs)
    synchronize(device)
    for t in expected:
        for src, dst in pairs:
            t[:, dst] = t[:, src]
    for got, want in zip(layers, expected, strict=True):
        assert torch.equal(got, want)


# The layers' kernels (layernorm_kernels.cu, pos_encoding_kernels.cu) ----------


@DTYPES
@pytest.mark.parametrize(
    "num_tokens,hidden_size,scale,eps",
    [(1, 64, 3.0, 1e-5), (5, 100, 3.0, 1e-5), (9, 256, 3.0, 1e-5), (6, 64, 1e-2, 1e-2)],
)
def test_rms_norm_kernels_match_the_layers_pytorch_code(
    device, dtype, num_tokens, hidden_size, scale, eps
):
    """Against RMSNorm.forward_native, with the layer's own weight (a
    parameter that requires grad, which DLPack must be handed detached):
    rows not a multiple of a block's 4, a width not a multiple of a warp's
    32, and rows so small that epsilon weighs. The fused add is one
    rounding in both, so the new residual is exact; the norm sums in another
    order."""
    torch.manual_seed(0)
    layer = RMSNorm(hidden_size, eps=eps).to(device=device, dtype=dtype)
    with torch.no_grad():
        layer.weight.uniform_(0.5, 1.5)
    x = torch.randn(num_tokens, hidden_size, device=device, dtype=dtype) * scale
    residual = torch.randn(num_tokens, hidden_size, device=device, dtype=dtype) * scale
    atol, rtol = TOLERANCE[dtype]
    with torch.no_grad():
        got = layer.forward_cuda(x.clone())
        synchronize(device)
        torch.testing.assert_close(got, layer.forward_native(x.clone()), atol=atol, rtol=rtol)
        normed, summed = layer.forward_cuda(x.clone(), residual.clone())
        synchronize(device)
        want_normed, want_summed = layer.forward_native(x.clone(), residual.clone())
    assert torch.equal(summed, want_summed)
    torch.testing.assert_close(normed, want_normed, atol=atol, rtol=rtol)


def test_rms_norm_kernels_write_only_their_rows(device):
    """5 rows in a buffer of 8 (the last block's fourth warp has no row): the
    rows past the end keep their NaNs, in both kernels."""
    weight = torch.ones(64, device=device)
    x = torch.randn(8, 64, device=device)
    out = torch.full((8, 64), float("nan"), device=device)
    ops.rms_norm(out[:5], x[:5], weight, 1e-5)
    residual = torch.full((8, 64), float("nan"), device=device)
    residual[:5] = 1.0
    fused_input = x.clone()
    fused_input[5:] = float("nan")
    ops.fused_add_rms_norm(fused_input[:5], residual[:5], weight, 1e-5)
    synchronize(device)
    assert not out[:5].isnan().any() and out[5:].isnan().all()
    assert not fused_input[:5].isnan().any() and fused_input[5:].isnan().all()
    assert residual[5:].isnan().all()


@DTYPES
@pytest.mark.parametrize("num_heads,num_kv_heads,head_size", [(4, 2, 64), (2, 1, 128)])
def test_rotary_kernel_matches_the_layers_pytorch_code(
    device, dtype, num_heads, num_kv_heads, head_size
):
    """Against RotaryEmbedding.forward_native: q and k as strided views of
    one fused qkv row, as the attention layer passes them, then k from a
    tensor of another row stride. In 16-bit dtypes every product and sum is
    rounded as PyTorch rounds it, so the bits agree; in float32 the compiler
    may fuse a multiply and an add (one rounding fewer)."""
    torch.manual_seed(0)
    config = LlamaConfig(rope_theta=10000.0, max_position_embeddings=512)
    layer = RotaryEmbedding(head_size, 512, config).to(device)
    num_tokens = 7
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_size, device=device)
    qkv = qkv.to(dtype)
    q = qkv[:, : num_heads * head_size]
    k_views = [
        qkv[:, num_heads * head_size : (num_heads + num_kv_heads) * head_size],
        torch.randn(num_tokens, 3 * num_kv_heads * head_size, device=device).to(dtype)[
            :, : num_kv_heads * head_size
        ],
    ]
    positions = torch.tensor([0, 1, 5, 100, 101, 511, 3], device=device)
    atol, rtol = TOLERANCE[dtype] if dtype == torch.float32 else (0, 0)
    for k in k_views:
        got_q, got_k = layer.forward_cuda(positions, q, k)
        synchronize(device)
        want_q, want_k = layer.forward_native(positions, q, k)
        torch.testing.assert_close(got_q, want_q, atol=atol, rtol=rtol)
        torch.testing.assert_close(got_k, want_k, atol=atol, rtol=rtol)
        assert got_q.is_contiguous() and got_k.is_contiguous()


def test_engine_tokens_with_the_layers_kernels_equal_their_pytorch_code(
    device, tmp_path, monkeypatch
):
    """float32, greedy and seeded: the engine with RMSNorm and the rotary
    embedding on their CUDA kernels gives the tokens it gives with their
    PyTorch code. On a GPU the switch is CuPy's presence; emulated, the
    layers' CPU forward is pointed at one or the other."""
    model = make_tiny_model(
        "llama", str(tmp_path / "m"), hidden_size=256, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=512,
    )
    prompts = [[(5 * i + 11 * j) % 300 + 2 for j in range(n)] for i, n in enumerate([1, 17, 70])]
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)] * 2 + [
        SamplingParams(temperature=0.8, seed=3, max_tokens=24, ignore_eos=True)
    ]
    results = {}
    for forward in ("forward_cuda", "forward_native"):
        with monkeypatch.context() as patch:
            if device == "cpu":
                for layer in (RMSNorm, RotaryEmbedding):
                    patch.setattr(layer, "forward_cpu", getattr(layer, forward))
            elif forward == "forward_native":
                patch.setattr(ops, "cupy_available", lambda: False)
            llm = LLM(model, device=device, dtype="float32", block_size=16,
                      kv_cache_memory_bytes=64 << 20, max_num_seqs=8)
            outs = llm.generate(prompts, params, use_tqdm=False)
            results[forward] = [o.outputs[0].token_ids for o in outs]
            del llm
    assert results["forward_cuda"] == results["forward_native"]


@pytest.mark.parametrize("use_v1", [False, True], ids=["classic", "v1"])
@pytest.mark.parametrize("chunked", [False, True], ids=["whole-prefills", "chunked-prefill"])
def test_engine_cuda_backend_matches_torch_backend(device, chunked, use_v1, tmp_path):
    """float32, so the two backends differ only by summation order: greedy and
    seeded sampling (n=2, which exercises copy_blocks in the classic engine)
    give the same tokens. Chunked prefill mixes decodes with a longer prefill
    in one step, whose length must not size the decode kernels' launch. V1
    runs the same backends through its own runner (never yet on a GPU before
    this case was added: the emulated run is the only one so far)."""
    # head_size 64 (a kernel size), GQA 4:2, random weights with clear greedy winners.
    model = make_tiny_model(
        "llama", str(tmp_path / "m"), hidden_size=256, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=512,
    )
    prompts = [[(5 * i + 11 * j) % 300 + 2 for j in range(n)] for i, n in enumerate([1, 17, 70])]
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    pair = SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=20, ignore_eos=True)
    results = {}
    for backend in ("torch", "cuda"):
        # A fixed cache: by gpu_memory_utilization the first engine, still
        # alive while the second is made, would leave it none.
        llm = LLM(
            model, device=device, dtype="float32", attention_backend=backend, block_size=16,
            enable_chunked_prefill=chunked, max_num_batched_tokens=32 if chunked else None,
            max_num_seqs=8, kv_cache_memory_bytes=64 << 20, use_v1=use_v1,
        )
        outs = llm.generate(prompts + prompts[1:2], [greedy] * 3 + [pair], use_tqdm=False)
        results[backend] = [[c.token_ids for c in o.outputs] for o in outs]
    assert results["cuda"] == results["torch"]

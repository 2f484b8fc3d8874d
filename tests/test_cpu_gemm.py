"""The CPU's packed linear layers (model_executor/layers/utils.py): the
oneDNN product by a weight packed once equals `F.linear`, the reference, to
float32 rounding; the few-row kernel (gemv_numba.py) gives oneDNN's bits, and
a layer it does not match keeps oneDNN; a row's result does not depend on
the rest of the batch; the loader packs every projection and the LM head of
a float32 model on a CPU, and a compiled model multiplies by them through
its opaque op."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from minivllm import LLM, SamplingParams
from minivllm.compilation import CompilationLevel
from minivllm.model_executor.layers import gemv_numba
from minivllm.model_executor.layers import utils as gemm_utils
from minivllm.model_executor.layers.gemv_numba import GEMV_MAX_ROWS, block_weight, gemv
from minivllm.model_executor.layers.linear import LinearBase
from minivllm.model_executor.layers.utils import (
    dispatch_cpu_unquantized_gemm,
    few_row_kernel_pays,
    same_bits,
    supports_packed_cpu_gemm,
    unquantized_gemm,
)

pytestmark = pytest.mark.skipif(
    not supports_packed_cpu_gemm(torch.empty(1, 1)), reason="needs an x86 CPU with oneDNN"
)


@pytest.fixture(params=[True, False], ids=["kernel", "onednn"])
def few_rows_by(request, monkeypatch):
    """Each of the two ways a few rows are multiplied, whichever this
    machine's timing picks: the few-row kernel, or oneDNN inside a batch."""
    monkeypatch.setattr(gemm_utils, "few_row_kernel_pays", lambda: request.param)
    return request.param


def layer_of(weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Module:
    layer = nn.Module()
    layer.weight = nn.Parameter(weight, requires_grad=False)
    layer.bias = bias
    dispatch_cpu_unquantized_gemm(layer)
    return layer


# (tokens, in, out): one decode row, a decode batch, a prefill; odd sizes too.
SHAPES = [(1, 64, 96), (8, 512, 1024), (37, 100, 3), (256, 192, 384)]


@pytest.mark.parametrize("tokens, in_features, out_features", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_packed_product_equals_f_linear(tokens, in_features, out_features, with_bias):
    g = torch.Generator().manual_seed(tokens * 1000 + out_features)
    weight = torch.randn(out_features, in_features, generator=g) / in_features**0.5
    bias = torch.randn(out_features, generator=g) if with_bias else None
    x = torch.randn(tokens, in_features, generator=g)
    layer = layer_of(weight, bias)
    assert layer.packed_weight is not None
    got = unquantized_gemm(layer, x, bias)
    assert got.shape == (tokens, out_features)
    torch.testing.assert_close(got, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    # A view of a wider tensor (a split of a fused projection's output) too.
    wide = torch.randn(tokens, 2 * in_features, generator=g)
    torch.testing.assert_close(
        unquantized_gemm(layer, wide[:, :in_features], bias),
        F.linear(wide[:, :in_features], weight, bias), rtol=1e-5, atol=1e-5,
    )


def onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """oneDNN's packed product, called directly (never the few-row kernel)."""
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


# (in, out): in past one and two of oneDNN's 1024-long chunks; out not a
# multiple of the kernel's 64 columns.
GEMV_SHAPES = [(512, 1024), (1376, 512), (2100, 130), (64, 3)]


@pytest.mark.parametrize("in_features, out_features", GEMV_SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_few_row_kernel_gives_onednns_bits(in_features, out_features, with_bias):
    """Bit for bit, for 1 to GEMV_MAX_ROWS rows, what oneDNN gives them in a
    batch of 64: the kernel sums in oneDNN's order for batches (gemv_numba.py).
    (Not oneDNN's product of the rows alone: on some CPUs it sums one row in
    another order.) F.linear, which sums in another, differs in the last
    bits but not more."""
    g = torch.Generator().manual_seed(in_features + out_features)
    weight = torch.randn(out_features, in_features, generator=g) / in_features**0.5
    bias = torch.randn(out_features, generator=g) if with_bias else None
    blocked = block_weight(weight)
    x = torch.randn(64, in_features, generator=g)
    batch = onednn(x, weight, bias)
    for rows in range(1, GEMV_MAX_ROWS + 1):
        got = gemv(x[:rows], blocked, bias, out_features)
        assert same_bits(got, batch[:rows]), rows
        torch.testing.assert_close(got, F.linear(x[:rows], weight, bias), rtol=1e-5, atol=1e-5)


def test_the_kernel_refuses_what_it_would_read_past():
    """Compiled code checks no bounds: a row of the wrong width or dtype, a
    bias of the wrong length, or more outputs than the blocks hold is refused
    before the kernel runs, naming what it got."""
    blocked = block_weight(torch.randn(8, 64))
    x = torch.randn(1, 64)
    for bad in (torch.randn(1, 65), torch.randn(1, 64, dtype=torch.float64), torch.randn(64)):
        with pytest.raises(ValueError, match="gemv multiplies float32 rows of 64, got"):
            gemv(bad, blocked, None, 8)
    for bias in (torch.randn(7), torch.randn(8, dtype=torch.float64)):
        with pytest.raises(ValueError, match=r"the bias must be float32 of shape \(8,\), got"):
            gemv(x, blocked, bias, 8)
    with pytest.raises(ValueError, match=r"out_features must be in \(0, 64\], got 65"):
        gemv(x, blocked, None, 65)


def test_same_bits_tells_negative_zero_from_zero():
    assert same_bits(torch.tensor([0.0, 1.5]), torch.tensor([0.0, 1.5]))
    assert not same_bits(torch.tensor([-0.0]), torch.tensor([0.0]))


def test_a_layer_the_kernel_does_not_match_keeps_onednn(monkeypatch):
    """A kernel that sums in another order than this oneDNN (here, chunks of
    512 instead of 1024) fails the loader's check, and the layer multiplies
    by oneDNN for every batch, so a row alone keeps its bits."""
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(96, 1376, generator=g) * 0.05
    x = torch.randn(8, 1376, generator=g)
    monkeypatch.setattr(gemm_utils, "few_row_kernel_pays", lambda: True)  # as if faster here
    assert layer_of(weight).gemv_weight is not None  # the right order passes
    monkeypatch.setattr(gemv_numba, "ONEDNN_K_CHUNK", 512)
    assert not same_bits(gemv(x[:1], block_weight(weight), None, 96), onednn(x, weight)[:1])
    layer = layer_of(weight)
    assert layer.packed_weight is not None and layer.gemv_weight is None
    assert same_bits(unquantized_gemm(layer, x), onednn(x, weight))


@pytest.mark.parametrize("odd_rows", [0, 1, 3])
def test_onednn_pads_only_the_row_counts_it_sums_in_another_order(monkeypatch, odd_rows):
    """The loader finds, per layer, the fewest rows oneDNN sums in its
    batches' order (`_onednn_min_rows`), and only fewer rows are padded to
    it. A stand-in oneDNN sums 1 to `odd_rows` rows in another order
    (F.linear's), as the real one sums a lone row of more than 1024 inputs
    on our Intel VM: with the padding, every row keeps its batch bits."""
    real = gemm_utils._packed_product
    calls = []

    def stand_in(x, packed, bias):
        calls.append(x.shape[0])
        if x.shape[0] <= odd_rows:
            return F.linear(x, packed.to_dense(), bias)
        return real(x, packed, bias)

    g = torch.Generator().manual_seed(2)
    weight = torch.randn(200, 300, generator=g) * 0.05
    monkeypatch.setattr(gemm_utils, "_packed_product", stand_in)
    monkeypatch.setattr(gemm_utils, "few_row_kernel_pays", lambda: False)
    layer = layer_of(weight)
    assert layer.gemv_weight is None and layer.onednn_min_rows == odd_rows + 1
    x = torch.randn(64, 300, generator=g)
    whole = real(x, layer.packed_weight, None)
    assert not same_bits(F.linear(x[:1], weight), whole[:1])  # the other order shows
    for rows in range(1, GEMV_MAX_ROWS + 1):
        calls.clear()
        assert same_bits(unquantized_gemm(layer, x[:rows]), whole[:rows]), rows
        assert calls == [max(rows, odd_rows + 1)]  # padded only below odd_rows + 1


@pytest.mark.parametrize("in_features", [512, 1376])
def test_a_row_alone_equals_the_row_in_any_batch(in_features, few_rows_by):
    """Bit for bit, whatever the batch size: the property seeded sampling's
    batch invariance rests on (F.linear has it not: one row goes to gemv).
    Up to GEMV_MAX_ROWS rows the few-row kernel or oneDNN inside a batch
    computes, above it oneDNN."""
    g = torch.Generator().manual_seed(0)
    layer = layer_of(torch.randn(1024, in_features, generator=g) * 0.05)
    assert (layer.gemv_weight is not None) == few_rows_by
    x = torch.randn(130, in_features, generator=g)
    whole = unquantized_gemm(layer, x)
    for size in (1, 2, 3, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 1, 8, 17, 64, 129):
        assert same_bits(unquantized_gemm(layer, x[:size]), whole[:size]), size
    alone = torch.cat([unquantized_gemm(layer, x[i : i + 1]) for i in range(len(x))])
    assert same_bits(alone, whole)


def test_the_kernel_leaves_torchs_thread_count():
    """Numba's pool sets the OpenMP thread count to its own size when it
    starts; a process on 1 thread (a tensor-parallel rank's) must stay so."""
    layer = layer_of(torch.randn(256, 128) * 0.05)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        unquantized_gemm(layer, torch.randn(1, 128))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)


def test_what_is_not_packed_keeps_f_linear():
    for weight in (torch.randn(8, 4, dtype=torch.bfloat16), torch.randn(8, 4, dtype=torch.float64)):
        layer = layer_of(weight)
        assert layer.packed_weight is None and layer.gemv_weight is None
        x = torch.randn(3, 4, dtype=weight.dtype)
        assert torch.equal(unquantized_gemm(layer, x), F.linear(x, weight))
    plain = nn.Module()
    plain.weight = torch.randn(8, 4)  # never dispatched: F.linear
    x = torch.ones(2, 4)
    assert torch.equal(unquantized_gemm(plain, x), F.linear(x, plain.weight))


def packed_layers(llm: LLM) -> tuple[list[bool], bool]:
    """Whether each linear layer, and the LM head, is packed, with the
    few-row kernel's blocked weight where this machine uses the kernel."""
    model = llm.llm_engine.worker.model_runner.model

    def both(m: nn.Module) -> bool:
        blocked = getattr(m, "gemv_weight", None) is not None
        return getattr(m, "packed_weight", None) is not None and blocked == few_row_kernel_pays()

    packed = [both(m) for m in model.modules() if isinstance(m, LinearBase)]
    heads = [m.lm_head for m in model.modules() if hasattr(m, "lm_head")]
    assert len(heads) == 1  # the model's (a compiled model's too, inside its wrapper)
    return packed, both(heads[0])


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_the_loader_packs_every_projection_and_the_head(tiny_model_dir, hf_model, arch):
    """Every linear layer and the LM head (GPT-2's is its tied embedding),
    and the packed engine's greedy tokens are HF's."""
    llm = LLM(tiny_model_dir(arch), block_size=8)
    linears, head = packed_layers(llm)
    assert linears and all(linears) and head
    prompt = [5, 9, 14, 3, 27]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ours = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    with torch.inference_mode():
        hf = hf_model(arch).generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=12, min_new_tokens=12,
            eos_token_id=None, pad_token_id=0,
        )
    assert list(ours.outputs[0].token_ids) == hf[0, len(prompt):].tolist()


def test_a_compiled_model_multiplies_by_the_packed_weights(tiny_model_dir):
    """Compiled, every projection is the opaque `cpu_packed_linear` (TorchDynamo
    cannot trace the packed tensor; an F.linear in its place would run, only
    slower, so the op is counted), and the tokens are the eager engine's."""
    model_dir = tiny_model_dir("llama")
    prompt = {"prompt_token_ids": [5, 9, 14, 3, 27]}
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    eager = LLM(model_dir, block_size=8).generate([prompt], params, use_tqdm=False)[0]
    llm = LLM(model_dir, block_size=8, compilation_level=CompilationLevel.DYNAMO_ONCE)
    linears, head = packed_layers(llm)
    assert linears and all(linears) and head
    llm.generate([prompt], params, use_tqdm=False)  # compiles (tracing calls the op too)
    with torch.profiler.profile() as profile:
        ours = llm.generate([prompt], params, use_tqdm=False)[0]
    calls = sum(e.count for e in profile.key_averages() if e.key == "minivllm::cpu_packed_linear")
    # One call per projection per forward (the LM head runs eagerly, after the graph).
    assert calls == len(linears) * params.max_tokens
    assert ours.outputs[0].token_ids == eager.outputs[0].token_ids

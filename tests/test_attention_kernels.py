"""The paged-attention kernels that run without a GPU, against the PyTorch reference.

- the Numba CPU kernel (`ops/paged_attn_numba.py`) over a sweep of shapes;
- the numba.cuda teaching kernel in Numba's CUDA simulator (a subprocess,
  since the simulator must be switched on before numba is imported);
- the CUDA sources compiled to PTX for sm_80 and sm_90, every template
  instantiation the loader can ask for: by nvcc, and by NVRTC (the compiler
  CuPy uses at run time) with the loader's own options and name expressions;
- the engine with attention_backend="numba" against "torch", and the
  backend selection errors.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
import textwrap

import numba
import numpy as np
import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm import _custom_ops as ops
from minivllm.attention.backends.numba_paged import (
    MIN_ROWS_PER_THREAD,
    NumbaPagedAttention,
    kernel_threads,
)
from minivllm.attention.backends.torch_paged import TorchPagedAttention
from minivllm.attention.layer import Attention
from minivllm.attention.ops.paged_attn_numba import (
    exp_nonpositive,
    paged_attention_decode,
    prefetch,
)
from minivllm.attention.selector import get_attn_backend
from minivllm.utils import numba_threads
from tests import nvrtc
from tests.kernel_cases import lengths_around_blocks, make_decode_case

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_numba_kernel(case) -> torch.Tensor:
    out = torch.empty_like(case.query)
    paged_attention_decode(
        out.numpy(),
        case.query.numpy(),
        case.kv_cache[0].numpy(),
        case.kv_cache[1].numpy(),
        case.block_tables.numpy(),
        case.seq_lens.numpy(),
        case.scale,
    )
    return out


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (8, 1)])
@pytest.mark.parametrize("head_size", [16, 80])
def test_numba_kernel_matches_reference(block_size, num_heads, num_kv_heads, head_size):
    case = make_decode_case(
        lengths_around_blocks(block_size), num_heads, num_kv_heads, head_size, block_size
    )
    out = run_numba_kernel(case)
    assert not out.isnan().any(), "the kernel read a slot no sequence owns"
    torch.testing.assert_close(out, case.reference(), atol=1e-5, rtol=1e-5)


def test_numba_kernel_detects_a_wrong_block_table():
    """The comparison has teeth: pointing the last block-table entry at another
    (readable) block changes the output."""
    case = make_decode_case([40], 4, 2, 16, 16, seed=3)
    expected = case.reference()
    assert case.block_tables[0, 2] != case.block_tables[0, 0]
    case.block_tables[0, 2] = case.block_tables[0, 0]
    out = run_numba_kernel(case)
    assert not out.isnan().any()
    assert not torch.allclose(out, expected, atol=1e-3)


def test_prefetch_is_llvms_prefetch_instruction():
    """The kernel's `prefetch` compiles to LLVM's prefetch (a hint the CPU may
    drop), not to a load or to nothing; the kernel's results are held equal
    to the reference above with it."""

    @numba.njit
    def prefetch_every_line(a):
        for i in range(0, a.size, 16):
            prefetch(a, i)

    a = np.arange(4096, dtype=np.float32).reshape(64, 64)
    prefetch_every_line(a)
    assert np.array_equal(a, np.arange(4096, dtype=np.float32).reshape(64, 64))
    assert "call void @llvm.prefetch" in "".join(prefetch_every_line.inspect_llvm().values())


def test_the_kernels_exp_is_maths_exp_to_the_last_bits():
    """`exp_nonpositive` against float64 exp over every range a softmax meets
    (scores minus their max, so <= 0): within 1.5e-7 relative (about one
    float32 step), 1 at 0, NaN kept, and the loop over a row is vectorised
    in float32 (SIMD multiplies of floats, none of doubles, which would take
    twice the instructions), which is the reason it exists."""

    @numba.njit(fastmath={"reassoc", "contract"})
    def row_exp(x, out):
        for i in range(x.size):
            out[i] = exp_nonpositive(x[i])

    rng = np.random.default_rng(0)
    x = np.concatenate([
        -np.abs(rng.standard_normal(200_000) * 20), -np.linspace(0, 87, 100_001),
        -rng.uniform(0, 1e-3, 10_000),
    ]).clip(-87, 0).astype(np.float32)
    out = np.empty_like(x)
    row_exp(x, out)
    want = np.exp(x.astype(np.float64))
    assert np.max(np.abs(out - want) / want) < 1.5e-7
    nan_and_zero = np.array([np.nan, 0.0, -100.0], dtype=np.float32)
    row_exp(nan_and_zero, out[:3])
    assert np.isnan(out[0]) and out[1] == 1.0 and 0 < out[2] < 2e-38
    llvm = "".join(row_exp.inspect_llvm().values())
    assert re.search(r"fmul[a-z ]* <\d+ x float>", llvm)
    assert not re.search(r"f(mul|add|sub)[a-z ]* <\d+ x double>", llvm)


SIMULATOR_SCRIPT = textwrap.dedent(
    """
    import numpy as np
    from day4_paged_attn_numba_cuda import paged_attention_v1
    from tests.kernel_cases import lengths_around_blocks, make_decode_case

    # (block_size, num_heads, num_kv_heads, head_size, num_threads)
    for bs, nh, nkv, hs, nt in [(8, 2, 1, 32, 64), (16, 4, 2, 80, 64), (32, 2, 2, 32, 128)]:
        case = make_decode_case(lengths_around_blocks(bs), nh, nkv, hs, bs, seed=bs)
        out = paged_attention_v1(
            case.query.numpy(), case.kv_cache[0].numpy(), case.kv_cache[1].numpy(),
            case.block_tables.numpy(), case.seq_lens.numpy(), case.scale, num_threads=nt,
        )
        np.testing.assert_allclose(out, case.reference().numpy(), atol=1e-5, rtol=1e-5)
        print("ok", bs, nh, nkv, hs, nt)
    """
)


@pytest.mark.slow
def test_teaching_kernel_in_cuda_simulator():
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    # The teaching copy sits beside the Day 4 lesson that uses it.
    lessons = os.path.join(REPO, "lessons")
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(REPO, "reference_impl"), REPO, lessons])
    result = subprocess.run(
        [sys.executable, "-c", SIMULATOR_SCRIPT],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("ok") == 3


SOURCES = ["paged_attention.cu", "cache_kernels.cu", "layernorm_kernels.cu",
           "pos_encoding_kernels.cu"]


def kernel_names(source: str) -> list[str]:
    """Every kernel instantiation of `source` the loader can request, once each
    (the reduce kernel does not depend on the block size)."""
    names: list[str] = []
    for dtype in ops.CUDA_DTYPES:
        if source == "paged_attention.cu":
            for head_size in ops.SUPPORTED_HEAD_SIZES:
                for block_size in ops.SUPPORTED_BLOCK_SIZES:
                    names += ops.paged_attention_kernel_names(dtype, head_size, block_size)
        elif source == "cache_kernels.cu":
            names += ops.cache_kernel_names(dtype)
        elif source == "layernorm_kernels.cu":
            names += ops.layernorm_kernel_names(dtype)
        else:
            names += ops.pos_encoding_kernel_names(dtype)
    return list(dict.fromkeys(names))


def instantiation_source(source: str) -> str:
    """A .cu file that includes `source` and takes the address of every kernel
    instantiation, so nvcc compiles each of them."""
    body = "\n".join(f"  (void)&{name};" for name in kernel_names(source))
    return f'#include "{source}"\nvoid instantiate_all() {{\n{body}\n}}\n'


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc (the CUDA toolkit) is not installed")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("source", SOURCES)
def test_cuda_sources_compile_to_ptx(tmp_path, arch, source):
    wrapper = tmp_path / f"all_{source}"
    wrapper.write_text(instantiation_source(source))
    ptx = tmp_path / "out.ptx"
    cmd = ["nvcc", "--ptx", "-std=c++17", f"-arch={arch}", f"-I{ops.CSRC_DIR}", str(wrapper)]
    result = subprocess.run(cmd + ["-o", str(ptx)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "warning" not in result.stderr.lower(), result.stderr
    text = ptx.read_text()
    assert f".target {arch}" in text
    assert text.count(".entry") == len(kernel_names(source))


@pytest.mark.skipif(
    nvrtc.find_library() is None, reason="libnvrtc not found (pip install nvidia-cuda-nvrtc)"
)
@pytest.mark.parametrize("arch", ["compute_80", "compute_90"])
@pytest.mark.parametrize("source", SOURCES)
def test_loader_sources_compile_with_nvrtc(arch, source):
    """What CuPy's RawModule does on a GPU, minus the GPU: NVRTC compiles the
    source with the loader's options and finds every name expression."""
    names = kernel_names(source)
    code = (ops.CSRC_DIR / source).read_text()
    options = (*ops.NVRTC_OPTIONS, f"--gpu-architecture={arch}")
    ptx, lowered = nvrtc.compile_to_ptx(nvrtc.find_library(), code, source, options, names)
    assert f".target sm_{arch.removeprefix('compute_')}" in ptx
    entries = {line.split()[2].rstrip("(") for line in ptx.splitlines() if ".entry" in line}
    assert entries == set(lowered.values())
    assert len(entries) == len(names)


# The engine with each backend ------------------------------------------------


FIRST_NUMBA_KERNEL_IN_ONE_THREAD = """
import torch
from minivllm.attention.backends.numba_paged import NumbaPagedAttention
torch.set_num_threads(1)
kv = torch.randn(2, 4, 16, 2, 16)
query = torch.randn(1, 4, 16)
NumbaPagedAttention(4, 16, 0.25, 2).forward_decode(
    query, kv, torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long), 1
)
print(torch.get_num_threads())
"""


def test_the_numba_pool_leaves_torch_threads_as_they_were():
    """Numba's OpenMP pool sets the thread count as it starts (first kernel
    of a process); torch's runtime must keep the count it was given."""
    run = subprocess.run(
        [sys.executable, "-c", FIRST_NUMBA_KERNEL_IN_ONE_THREAD],
        env={**os.environ, "NUMBA_NUM_THREADS": "2"}, capture_output=True, text=True, timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["1"]


def test_kernel_threads_by_hand():
    """One thread per MIN_ROWS_PER_THREAD K/V rows, at least one."""
    n = MIN_ROWS_PER_THREAD
    assert kernel_threads(0) == kernel_threads(n - 1) == 1
    assert kernel_threads(2 * n) == 2 and kernel_threads(100 * n) == 100


def test_numba_threads_takes_at_most_torchs_threads_and_numbas_pool():
    """A kernel runs on what it asks, capped by torch's count (a tensor-parallel
    rank's share) and Numba's pool; torch's count is left as it was."""
    pool, threads = numba.config.NUMBA_NUM_THREADS, torch.get_num_threads()
    try:
        for torch_threads in (1, 2):
            torch.set_num_threads(torch_threads)
            cap = min(torch_threads, pool)
            for asked, expected in ((None, cap), (1, 1), (10**6, cap)):
                with numba_threads(asked):
                    assert numba.get_num_threads() == expected, (torch_threads, asked)
                assert torch.get_num_threads() == torch_threads
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="needs 2 Numba threads")
def test_the_numba_kernel_gives_the_same_bits_on_one_thread_and_two():
    """The thread count changes with the batch (kernel_threads); a
    sequence's output must not."""
    case = make_decode_case([1, 17, 64, 200, 33, 9], 8, 2, 32, 16, seed=3)
    outs = []
    for threads in (1, 2):
        numba.set_num_threads(threads)
        out = torch.empty_like(case.query)
        paged_attention_decode(
            out.numpy(), case.query.numpy(), case.kv_cache[0].numpy(),
            case.kv_cache[1].numpy(), case.block_tables.numpy(), case.seq_lens.numpy(), 0.17,
        )
        outs.append(out)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("num_heads,num_kv_heads,head_size", [(8, 4, 64), (6, 2, 48), (4, 4, 80)])
def test_a_sequences_bits_do_not_depend_on_its_batch(num_heads, num_kv_heads, head_size):
    """Each sequence alone, then all in one batch: the same bits. One
    sequence alone is split over KV heads when threads are idle; in the
    batch it is one item. Seeded sampling is batch-invariant only if this holds."""
    case = make_decode_case([5, 300, 16, 129, 1, 77], num_heads, num_kv_heads, head_size, 16)
    threads = numba.get_num_threads()
    numba.set_num_threads(min(2, numba.config.NUMBA_NUM_THREADS))
    try:
        together = run_numba_kernel(case)
        alone = [run_numba_kernel(one_sequence(case, i)) for i in range(len(case.seq_lens))]
    finally:
        numba.set_num_threads(threads)
    for i, out in enumerate(alone):
        assert torch.equal(out[0], together[i]), f"sequence {i} changed with its batch"


def one_sequence(case, i: int):
    """Sequence `i` of a decode case, alone, on the same cache."""
    return dataclasses.replace(
        case,
        query=case.query[i : i + 1],
        block_tables=case.block_tables[i : i + 1],
        seq_lens=case.seq_lens[i : i + 1],
    )


@pytest.mark.parametrize("num_heads,num_kv_heads,head_size", [(4, 4, 16), (8, 2, 64), (6, 2, 48)])
@pytest.mark.parametrize(
    "context_len,q_len", [(0, 1), (0, 37), (0, 256), (16, 16), (23, 40), (100, 1)]
)
def test_numba_backend_prefill_matches_reference(
    num_heads, num_kv_heads, head_size, context_len, q_len
):
    """The SDPA prefill against the reference's, with and without a cached
    context (prefix caching, chunked prefill), on a cache whose slots past the
    sequence are poisoned (kernel_cases): a wrong causal alignment or a read
    past `seq_len` shows as a large error or a NaN."""
    seq_len = context_len + q_len
    case = make_decode_case([seq_len], num_heads, num_kv_heads, head_size, 8, seed=seq_len)
    query = torch.randn(q_len, num_heads, head_size, generator=torch.Generator().manual_seed(1))
    args = (query, case.kv_cache, case.block_tables, context_len, seq_len)
    impl_args = (num_heads, head_size, head_size**-0.5, num_kv_heads)
    out = NumbaPagedAttention(*impl_args).forward_prefill(*args)
    reference = TorchPagedAttention(*impl_args).forward_prefill(*args)
    torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5)


def test_engine_numba_backend_matches_torch(tiny_model_dir):
    """Greedy tokens with the Numba decode kernel equal the reference backend's,
    for plain, GQA and multi-block sequences (block_size 8, up to 60 + 24 tokens)."""
    model = tiny_model_dir("llama")  # 4 query heads, 2 KV heads
    prompts = [[(7 * i + 3 * j) % 300 + 2 for j in range(n)] for i, n in enumerate([1, 9, 31, 60])]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outputs = {}
    for backend in ("torch", "numba"):
        llm = LLM(model, attention_backend=backend, block_size=8)
        impl_class = NumbaPagedAttention if backend == "numba" else TorchPagedAttention
        model_modules = llm.llm_engine.worker.model_runner.model.modules()
        impls = [m.impl for m in model_modules if isinstance(m, Attention)]
        assert impls and all(type(impl) is impl_class for impl in impls)
        outs = llm.generate(prompts, params, use_tqdm=False)
        outputs[backend] = [o.outputs[0].token_ids for o in outs]
    assert outputs["numba"] == outputs["torch"]


def test_default_backend_on_cpu_is_the_numba_kernel(monkeypatch):
    monkeypatch.delenv("MINIVLLM_ATTENTION_BACKEND", raising=False)
    assert get_attn_backend(None, "cpu", torch.float32, 64, 16).get_name() == "numba"
    # Numba has no bfloat16: the reference serves it.
    assert get_attn_backend(None, "cpu", torch.bfloat16, 64, 16).get_name() == "torch"


def test_backend_from_environment(monkeypatch):
    monkeypatch.setenv("MINIVLLM_ATTENTION_BACKEND", "torch")
    assert get_attn_backend(None, "cpu", torch.float32, 64, 16).get_name() == "torch"
    # An explicit argument wins over the environment.
    assert get_attn_backend("numba", "cpu", torch.float32, 64, 16).get_name() == "numba"
    monkeypatch.setenv("MINIVLLM_ATTENTION_BACKEND", "flash")
    with pytest.raises(ValueError, match=r"attention_backend must be one of .*'flash'"):
        get_attn_backend(None, "cpu", torch.float32, 64, 16)


def test_numba_backend_refuses_bfloat16():
    with pytest.raises(ValueError, match=r"attention_backend='numba'.*bfloat16"):
        get_attn_backend("numba", "cpu", torch.bfloat16, 64, 16)


@pytest.mark.skipif(torch.cuda.is_available(), reason="tests the error on a machine without a GPU")
def test_cuda_backend_without_gpu_says_what_is_missing():
    with pytest.raises(RuntimeError) as info:
        get_attn_backend("cuda", "cpu", torch.float32, 64, 16)
    message = str(info.value)
    assert "attention_backend='cuda' needs" in message
    assert "torch.cuda.is_available() is False" in message
    try:
        import cupy  # noqa: F401
    except ImportError:
        assert "pip install -e '.[cuda]'" in message
    assert "attention_backend='numba'" in message  # and what to use instead


def test_cuda_backend_lists_unsupported_shapes():
    with pytest.raises(RuntimeError, match=r"head_size in .* \(the model's is 24\).*block_size"):
        get_attn_backend("cuda", "cpu", torch.float32, 24, 64)


def test_engine_rejects_unknown_backend(tiny_model_dir):
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        LLM(tiny_model_dir("llama"), attention_backend="xformers")


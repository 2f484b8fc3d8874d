"""The CPU emulator of `reference_impl/minivllm/cuda_emu/` on small kernels with known answers,
and on the mistakes it exists to catch (the real kernels run in it in
test_attention_kernels_cuda.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from minivllm import cuda_emu

pytestmark = pytest.mark.skipif(
    cuda_emu.compiler() is None, reason="the CUDA emulator needs a C++ compiler (g++, or $CXX)"
)

KERNELS = r"""
#include "dtypes.cuh"

__global__ void shuffle_xor(float* out, int lane_mask) {
  out[threadIdx.x] = __shfl_xor_sync(FULL_MASK, static_cast<float>(threadIdx.x), lane_mask);
}

// Thread t reads what thread t + 1 wrote: correct only with the barrier.
template <bool BARRIER>
__global__ void neighbour(float* out) {
  __shared__ float s[128];
  s[threadIdx.x] = static_cast<float>(threadIdx.x + blockIdx.x);
  if (BARRIER) __syncthreads();
  out[blockIdx.x * 128 + threadIdx.x] = s[(threadIdx.x + 1) % 128];
}

__global__ void divergent_shuffle(float* out) {
  float x = static_cast<float>(threadIdx.x);
  if (threadIdx.x % 32 < 16) x = __shfl_xor_sync(FULL_MASK, x, 1);
  out[threadIdx.x] = x;
}

__global__ void divergent_syncthreads(float* out) {
  if (threadIdx.x < 64) __syncthreads();
  out[threadIdx.x] = 1.f;
}

__global__ void fill_dynamic(float* out, int n) {
  extern __shared__ float buf[];
  buf[threadIdx.x] = static_cast<float>(n);
  __syncthreads();
  out[threadIdx.x] = buf[threadIdx.x];
}

template <typename T>
__global__ void round_trip(float* out, const float* in, int n) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) out[i] = to_float(from_float<T>(in[i]));
}
"""

NAMES = (
    "shuffle_xor",
    "neighbour<true>",
    "neighbour<false>",
    "divergent_shuffle",
    "divergent_syncthreads",
    "fill_dynamic",
    "round_trip<fp16_t>",
    "round_trip<bf16_t>",
)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    path = tmp_path_factory.mktemp("emu") / "kernels.cu"
    path.write_text(KERNELS)
    return str(path)


def kernel(source: str, name: str, seed: int = 0) -> cuda_emu.EmulatedKernel:
    return cuda_emu.EmulatedModule(source, NAMES, seed).get_function(name)


@pytest.mark.parametrize("lane_mask", [1, 2, 16, 31])
def test_shuffle_xor_exchanges_within_each_warp(source, lane_mask):
    out = torch.full((128,), -1.0)
    kernel(source, "shuffle_xor")((1,), (128,), (out, np.int32(lane_mask)))
    lanes = torch.arange(128)
    assert torch.equal(out, ((lanes // 32) * 32 + (lanes % 32 ^ lane_mask)).float())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_barrier_publishes_shared_memory_in_any_order(source, seed):
    out = torch.empty(3 * 128)
    kernel(source, "neighbour<true>", seed)((3,), (128,), (out,))
    t = torch.arange(128)
    expected = torch.cat([((t + 1) % 128 + b).float() for b in range(3)])
    assert torch.equal(out, expected)


def test_a_missing_barrier_shows_as_order_dependence(source):
    """Without the barrier the result depends on the order the fibers run in,
    which the seed changes: the symptom of a race."""
    outs = []
    for seed in (0, 1, 2):
        out = torch.empty(3 * 128)
        kernel(source, "neighbour<false>", seed)((3,), (128,), (out,))
        outs.append(out)
    assert not all(torch.equal(outs[0], o) for o in outs[1:])


@pytest.mark.parametrize(
    "name, message",
    [
        ("divergent_shuffle", "0 threads wait in __syncthreads, 64 in __shfl_xor_sync"),
        ("divergent_syncthreads", "64 threads wait in __syncthreads, 0 in __shfl_xor_sync"),
    ],
)
def test_divergent_barriers_are_reported(source, name, message):
    with pytest.raises(RuntimeError, match=f"block \\(0, 0, 0\\): divergent barrier: {message}"):
        kernel(source, name)((1,), (128,), (torch.empty(128),))


def test_dynamic_shared_memory_has_the_launch_size(source):
    out = torch.empty(128)
    kernel(source, "fill_dynamic")((1,), (128,), (out, np.int32(7)), shared_mem=128 * 4)
    assert torch.equal(out, torch.full((128,), 7.0))
    with pytest.raises(RuntimeError, match="wrote past the 256 bytes of dynamic shared memory"):
        kernel(source, "fill_dynamic")((1,), (128,), (out, np.int32(7)), shared_mem=64 * 4)


def test_arguments_are_checked_against_the_signature(source):
    fill = kernel(source, "fill_dynamic")
    out = torch.empty(128)
    with pytest.raises(TypeError, match=r"argument 1 is a 4-byte integer, got int64 \(pass np"):
        fill((1,), (128,), (out, np.int64(7)), shared_mem=512)
    with pytest.raises(TypeError, match="argument 1 is a 4-byte integer, got float32"):
        fill((1,), (128,), (out, np.float32(7)), shared_mem=512)
    with pytest.raises(TypeError, match="argument 0 points to 4-byte floats, got a torch.int64"):
        fill((1,), (128,), (torch.empty(128, dtype=torch.int64), np.int32(7)), shared_mem=512)
    with pytest.raises(TypeError, match="argument 0 points to 4-byte floats, got a torch.float16"):
        fill((1,), (128,), (out.half(), np.int32(7)), shared_mem=512)
    with pytest.raises(TypeError, match="takes 2 arguments, got 1"):
        fill((1,), (128,), (out,), shared_mem=512)


@pytest.mark.parametrize("dtype, name", [(torch.float16, "fp16_t"), (torch.bfloat16, "bf16_t")])
def test_16_bit_conversions_round_like_torch(source, dtype, name):
    """The emulator's conversions (dtypes.cuh) round to nearest, ties to
    even, as the PTX cvt.rn instructions and torch do."""
    gen = torch.Generator().manual_seed(0)
    values = torch.cat(
        [
            torch.randn(2000, generator=gen) * 10.0 ** torch.randint(-8, 6, (2000,), generator=gen),
            torch.tensor([0.0, -0.0, 1.0, 65504.0, 70000.0, 1e-8, float("inf"), -float("inf")]),
            # exactly halfway between two representable values of each type
            torch.tensor([1 + 2**-11, 1 + 3 * 2**-11, 1 + 2**-8, 1 + 3 * 2**-8]),
        ]
    )
    out = torch.empty_like(values)
    kernel(source, f"round_trip<{name}>")((1,), (128,), (out, values, np.int32(len(values))))
    assert torch.equal(out, values.to(dtype).float())

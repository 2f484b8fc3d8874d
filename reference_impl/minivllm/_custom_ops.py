"""The CUDA kernels of `csrc/`, compiled at run time with CuPy.

vLLM builds its kernels ahead of time into a torch extension and
`vllm/_custom_ops.py` wraps them. Ours are compiled on first use by NVRTC
through CuPy's `RawModule`, so the `.cu` files stay plain sources a lesson can
read and a learner can edit and re-run without a build step:

- each template instantiation (dtype, head size, block size, ...) is named by
  its C++ expression, compiled once per process and cached;
- torch tensors are handed to CuPy through DLPack, so nothing is copied;
- kernels are launched on torch's current CUDA stream, so they are ordered
  with the surrounding torch work.

CuPy is the optional `[cuda]` extra; nothing here is imported on CPU-only
runs except by the backend selector's error messages.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch

from minivllm.attention.kv_cache import check_decode_args

# reference_impl/csrc/, which the package links as csrc/ and a wheel holds as package data.
CSRC_DIR = Path(__file__).resolve().parent / "csrc"

# What the kernels are instantiated for; anything else is refused up front.
CUDA_DTYPES = {torch.float32: "float", torch.float16: "fp16_t", torch.bfloat16: "bf16_t"}
SUPPORTED_HEAD_SIZES = (64, 80, 96, 112, 128, 256)
SUPPORTED_BLOCK_SIZES = (8, 16, 32)
NUM_THREADS = 128  # four warps per thread block
PARTITION_SIZE = 512  # v2: tokens per partition
# v1 keeps a float per context token in shared memory; 48 KiB is what a kernel
# may use without opting in to more.
V1_MAX_SEQ_LEN = 8192
# NVRTC's options (CuPy adds the GPU's architecture).
NVRTC_OPTIONS = ("-std=c++17", f"-I{CSRC_DIR}")

CUPY_MISSING = (
    "the 'cuda' attention backend needs CuPy, which is not installed: "
    "pip install -e '.[cuda]' (it installs cupy-cuda13x; on a CUDA 12 driver "
    "install cupy-cuda12x instead)"
)


def paged_attention_kernel_names(dtype: torch.dtype, head_size: int, block_size: int) -> list[str]:
    """The template instantiations one (dtype, head size, block size) needs."""
    t = CUDA_DTYPES[dtype]
    return [
        f"paged_attention_v1_kernel<{t}, {head_size}, {block_size}, {NUM_THREADS}>",
        f"paged_attention_v2_kernel<{t}, {head_size}, {block_size}, {NUM_THREADS}, "
        f"{PARTITION_SIZE}>",
        f"paged_attention_v2_reduce_kernel<{t}, {head_size}, {NUM_THREADS}, {PARTITION_SIZE}>",
    ]


def cache_kernel_names(dtype: torch.dtype) -> list[str]:
    t = CUDA_DTYPES[dtype]
    return [f"reshape_and_cache_kernel<{t}>", f"copy_blocks_kernel<{t}>"]


def layernorm_kernel_names(dtype: torch.dtype) -> list[str]:
    t = CUDA_DTYPES[dtype]
    return [f"rms_norm_kernel<{t}>", f"fused_add_rms_norm_kernel<{t}>"]


def pos_encoding_kernel_names(dtype: torch.dtype) -> list[str]:
    return [f"rotary_embedding_kernel<{CUDA_DTYPES[dtype]}>"]


@functools.cache
def cupy_available() -> bool:
    """Whether CuPy imports: the layers' CUDA kernels (`CustomOp.forward_cuda`)
    need it, whatever the attention backend, and without it a GPU runs their
    PyTorch code."""
    try:
        import cupy  # noqa: F401
    except ImportError:
        return False
    return True


def _cupy():
    try:
        import cupy
    except ImportError as e:
        raise RuntimeError(CUPY_MISSING) from e
    return cupy


@functools.cache
def _module(source: str, name_expressions: tuple[str, ...]):
    """Compile `csrc/<source>` for the given instantiations (once per process)."""
    cupy = _cupy()
    code = (CSRC_DIR / source).read_text()
    return cupy.RawModule(code=code, options=NVRTC_OPTIONS, name_expressions=name_expressions)


def _kernel(source: str, name_expressions: list[str], name: str):
    return _module(source, tuple(name_expressions)).get_function(name)


def dlpack_view(t: torch.Tensor) -> torch.Tensor:
    """`t` as a launch exports it to DLPack: detached, since torch refuses to
    export a tensor that requires grad (a layer's weight does). No copy.
    The emulator's launches go through it too."""
    return t.detach()


def _as_cupy(cupy, t: torch.Tensor):
    """A CuPy view of `t` (DLPack, no copy). CuPy has no bfloat16, and the
    kernels only need the address, so 16-bit floats travel as int16."""
    t = dlpack_view(t)
    if t.dtype in (torch.float16, torch.bfloat16):
        t = t.view(torch.int16)
    return cupy.from_dlpack(t)


def _launch(kernel, grid: tuple[int, ...], args: tuple, shared_mem: int = 0) -> None:
    """Run `kernel` on torch's current stream; tensors go through DLPack."""
    cupy = _cupy()
    with cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
        cupy_args = tuple(_as_cupy(cupy, a) if isinstance(a, torch.Tensor) else a for a in args)
        kernel(grid, (NUM_THREADS,), cupy_args, shared_mem=shared_mem)


def _check_decode_args(
    query, key_cache, block_tables, seq_lens, max_seq_len: int
) -> tuple[int, int, int, int]:
    """Validate shapes and dtypes against the kernels' contract (without
    reading GPU memory); returns (num_seqs, num_heads, head_size, block_size)."""
    check_decode_args(query.shape, key_cache.shape, block_tables.shape, seq_lens.shape, max_seq_len)
    num_seqs, num_heads, head_size = query.shape
    _, block_size, num_kv_heads, cache_head_size = key_cache.shape
    if query.dtype not in CUDA_DTYPES or key_cache.dtype != query.dtype:
        raise ValueError(
            f"paged attention supports {sorted(str(d) for d in CUDA_DTYPES)} with the same dtype "
            f"for query and cache, got query {query.dtype} and cache {key_cache.dtype}"
        )
    if head_size not in SUPPORTED_HEAD_SIZES or cache_head_size != head_size:
        raise ValueError(f"head_size must be one of {SUPPORTED_HEAD_SIZES}, got {head_size}")
    if block_size not in SUPPORTED_BLOCK_SIZES:
        raise ValueError(f"block_size must be one of {SUPPORTED_BLOCK_SIZES}, got {block_size}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if not (query.is_contiguous() and key_cache.is_contiguous()):
        raise ValueError("query and the KV cache must be contiguous")
    if block_tables.dtype != torch.int64 or seq_lens.dtype != torch.int64:
        raise ValueError("block_tables and seq_lens must be int64 tensors")
    return num_seqs, num_heads, head_size, block_size


def paged_attention_v1(
    out: torch.Tensor,  # [num_seqs, num_heads, head_size]
    query: torch.Tensor,  # [num_seqs, num_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq], int64
    seq_lens: torch.Tensor,  # [num_seqs], int64, each >= 1
    scale: float,
    max_seq_len: int,
) -> None:
    """Decode attention, one thread block per (head, sequence)."""
    num_seqs, num_heads, head_size, block_size = _check_decode_args(
        query, key_cache, block_tables, seq_lens, max_seq_len
    )
    if max_seq_len > V1_MAX_SEQ_LEN:
        raise ValueError(
            f"paged_attention_v1 holds the whole context in shared memory: max_seq_len "
            f"{max_seq_len} > {V1_MAX_SEQ_LEN}; use paged_attention_v2"
        )
    names = paged_attention_kernel_names(query.dtype, head_size, block_size)
    kernel = _kernel("paged_attention.cu", names, names[0])
    padded_len = -(-max_seq_len // block_size) * block_size
    args = (out, query, key_cache, value_cache, block_tables, seq_lens,
            np.int32(key_cache.shape[2]), np.int32(block_tables.shape[1]), np.float32(scale))
    _launch(kernel, (num_heads, num_seqs), args, shared_mem=padded_len * 4)


def paged_attention_v2(
    out: torch.Tensor,  # [num_seqs, num_heads, head_size]
    query: torch.Tensor,  # [num_seqs, num_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq], int64
    seq_lens: torch.Tensor,  # [num_seqs], int64, each >= 1
    scale: float,
    max_seq_len: int,
) -> None:
    """Decode attention split into PARTITION_SIZE-token partitions, then reduced."""
    num_seqs, num_heads, head_size, block_size = _check_decode_args(
        query, key_cache, block_tables, seq_lens, max_seq_len
    )
    names = paged_attention_kernel_names(query.dtype, head_size, block_size)
    max_parts = -(-max_seq_len // PARTITION_SIZE)
    f32 = dict(dtype=torch.float32, device=query.device)
    exp_sums = torch.empty(num_seqs, num_heads, max_parts, **f32)
    max_logits = torch.empty(num_seqs, num_heads, max_parts, **f32)
    tmp_out = torch.empty(num_seqs, num_heads, max_parts, head_size, **f32)
    args = (exp_sums, max_logits, tmp_out, query, key_cache, value_cache, block_tables, seq_lens,
            np.int32(key_cache.shape[2]), np.int32(block_tables.shape[1]), np.float32(scale))
    partition_kernel = _kernel("paged_attention.cu", names, names[1])
    _launch(partition_kernel, (num_heads, num_seqs, max_parts), args, PARTITION_SIZE * 4)
    reduce_kernel = _kernel("paged_attention.cu", names, names[2])
    args = (out, exp_sums, max_logits, tmp_out, seq_lens, np.int32(max_parts))
    _launch(reduce_kernel, (num_heads, num_seqs), args, shared_mem=max_parts * 4)


def reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
    slot_mapping: torch.Tensor,  # [num_tokens], int64; negative = padding
) -> None:
    """Write the step's new K/V into their slots (twin of kv_cache.write_to_kv_cache)."""
    num_tokens, num_kv_heads, head_size = key.shape
    for name, t in (("key", key), ("value", value)):
        if t.stride(2) != 1 or t.stride(1) != head_size:
            raise ValueError(f"{name} rows must be contiguous [num_kv_heads, head_size]")
    if num_tokens == 0:
        return
    names = cache_kernel_names(kv_cache.dtype)
    kernel = _kernel("cache_kernels.cu", names, names[0])
    args = (key, value, kv_cache[0], kv_cache[1], slot_mapping,
            np.int32(key.stride(0)), np.int32(value.stride(0)), np.int32(num_kv_heads * head_size))
    _launch(kernel, (num_tokens,), args)


def copy_blocks(kv_caches: list[torch.Tensor], pairs: list[tuple[int, int]]) -> None:
    """Copy-on-write: copy block src onto block dst in every layer, K and V."""
    if not pairs:
        return
    device = kv_caches[0].device
    _, num_blocks, block_size, num_kv_heads, head_size = kv_caches[0].shape
    addresses = torch.tensor([c.data_ptr() for c in kv_caches], dtype=torch.int64, device=device)
    mapping = torch.tensor(pairs, dtype=torch.int64, device=device)  # [num_pairs, 2]
    names = cache_kernel_names(kv_caches[0].dtype)
    kernel = _kernel("cache_kernels.cu", names, names[1])
    block_numel = block_size * num_kv_heads * head_size
    args = (addresses, mapping, np.int64(num_blocks), np.int32(block_numel))
    _launch(kernel, (len(kv_caches), len(pairs)), args)


# -- the layers' kernels (model_executor/layers: RMSNorm, RotaryEmbedding) ----

ROWS_PER_BLOCK = NUM_THREADS // 32  # layernorm_kernels.cu: one warp per token row


def rms_norm(
    out: torch.Tensor,  # [num_tokens, hidden_size]
    input: torch.Tensor,  # [num_tokens, hidden_size]
    weight: torch.Tensor,  # [hidden_size]
    epsilon: float,
) -> None:
    """out = RMSNorm(input) (twin of RMSNorm.forward_native); all contiguous, one dtype."""
    _launch_norm(0, out, input, weight, epsilon)


def fused_add_rms_norm(
    input: torch.Tensor,  # [num_tokens, hidden_size]: becomes the norm
    residual: torch.Tensor,  # [num_tokens, hidden_size]: becomes input + residual
    weight: torch.Tensor,  # [hidden_size]
    epsilon: float,
) -> None:
    """In place, as vLLM's: residual += input, then input = RMSNorm(residual)."""
    _launch_norm(1, input, residual, weight, epsilon)


def _launch_norm(
    index: int, first: torch.Tensor, second: torch.Tensor, weight: torch.Tensor, epsilon: float
) -> None:
    """layernorm_kernels.cu's kernel `index` (in layernorm_kernel_names'
    order) on two [num_tokens, hidden_size] tensors, one warp per row."""
    num_tokens, hidden_size = second.shape
    if num_tokens == 0:
        return
    names = layernorm_kernel_names(second.dtype)
    kernel = _kernel("layernorm_kernels.cu", names, names[index])
    args = (first, second, weight, np.float32(epsilon), np.int32(num_tokens), np.int32(hidden_size))
    _launch(kernel, (-(-num_tokens // ROWS_PER_BLOCK),), args)


def rotary_embedding(
    positions: torch.Tensor,  # [num_tokens], int64
    query: torch.Tensor,  # [num_tokens, num_heads * head_size], unit stride within a row
    key: torch.Tensor,  # [num_tokens, num_kv_heads * head_size], unit stride within a row
    head_size: int,
    cos_cache: torch.Tensor,  # [max_position, head_size / 2], float32
    sin_cache: torch.Tensor,  # [max_position, head_size / 2], float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotated query and key, as new contiguous tensors (twin of
    RotaryEmbedding.forward_native)."""
    num_tokens = positions.shape[0]
    query_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    key_out = torch.empty(key.shape, dtype=key.dtype, device=key.device)
    if num_tokens == 0:
        return query_out, key_out
    names = pos_encoding_kernel_names(query.dtype)
    kernel = _kernel("pos_encoding_kernels.cu", names, names[0])
    args = (query_out, key_out, query, key, positions, cos_cache, sin_cache,
            np.int32(query.stride(0)), np.int32(key.stride(0)),
            np.int32(query.shape[1] // head_size), np.int32(key.shape[1] // head_size),
            np.int32(head_size))
    _launch(kernel, (num_tokens,), args)
    return query_out, key_out

"""Decode-attention benchmark: the paged kernels against their baselines.

On a GPU (fp16, 32 query heads, 8 KV heads, head size 128, block size 16), for
each batch x context: CUDA paged_attention v1 and v2, the PyTorch gather
reference, and `scaled_dot_product_attention` over the same K/V stored
contiguously (the non-paged baseline). It prints time, achieved bandwidth
(bytes of K, V, Q and output moved / time), the fraction of the GPU's peak
bandwidth, and the kernel's speed-up over each baseline.

On a CPU (float32, 8 query heads, 2 KV heads, head size 64): the Numba kernel
against the PyTorch reference, and its bandwidth as a fraction of this
machine's read bandwidth, measured in the same run (tools/bench/machine.py).

Each sequence's blocks are scattered over the pool, as a busy engine's are
(`--block-order shuffled`, the default); `--block-order in-order` gives each
sequence consecutive blocks, which shows what the scattering costs: a CPU's
prefetchers follow a stream within a 4 KB page, and every jump to another
block starts a new one (the Numba kernel asks for the next block ahead,
`prefetch` in ops/paged_attn_numba.py). Each kernel runs several times on
the same inputs, so a small case is read from the caches after the first
call: the engine reads every layer's K/V from memory once per step, which
`python -m tools.bench.roofline` measures.

    python -m tools.bench.attention                 # CPU, or GPU if there is one
    python -m tools.bench.attention --device cpu --json out.json
    python -m tools.bench.attention --block-order in-order

Every ratio is measured in the same run on the same inputs.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from minivllm.attention.backends.torch_paged import TorchPagedAttention
from tools.bench import machine
from tools.bench.common import print_table

# Nominal HBM bandwidth (bytes/s) by device-name fragment.
PEAK_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12, "L40": 0.864e12}


def make_inputs(
    batch, context, num_heads, num_kv_heads, head_size, block_size, dtype, device, shuffled=True
):
    """A block pool holding every sequence's context, and its block tables:
    the blocks in a random order (`shuffled`), or each sequence's consecutive."""
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq
    gen = torch.Generator(device=device).manual_seed(0)
    kv_cache = torch.randn(
        2, num_blocks, block_size, num_kv_heads, head_size, generator=gen, device=device
    ).to(dtype)
    if shuffled:
        order = torch.randperm(num_blocks, generator=gen, device=device)
    else:
        order = torch.arange(num_blocks, device=device)
    block_tables = order.view(batch, blocks_per_seq)
    seq_lens = torch.full((batch,), context, dtype=torch.int64, device=device)
    query = torch.randn(batch, num_heads, head_size, generator=gen, device=device).to(dtype)
    return query, kv_cache, block_tables, seq_lens


def moved_bytes(batch, context, num_heads, num_kv_heads, head_size, dtype) -> int:
    """K and V read once per KV head, Q read and the output written once."""
    elem = torch.tensor([], dtype=dtype).element_size()
    kv = 2 * batch * context * num_kv_heads * head_size * elem
    return kv + 2 * batch * num_heads * head_size * elem


def time_it(fn: Callable[[], object], device: str, repeats: int) -> float:
    """Median seconds per call, after a warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def bench_gpu(batches, contexts, repeats, shuffled=True) -> list[dict]:
    from minivllm import _custom_ops as ops

    nh, nkv, hs, bs, dtype = 32, 8, 128, 16, torch.float16
    name = torch.cuda.get_device_name()
    peak = next((v for k, v in PEAK_BANDWIDTH.items() if k in name), None)
    ref = TorchPagedAttention(nh, hs, hs**-0.5, nkv)
    rows = []
    for batch in batches:
        for context in contexts:
            q, kv, tables, lens = make_inputs(
                batch, context, nh, nkv, hs, bs, dtype, "cuda", shuffled
            )
            out = torch.empty_like(q)
            args = (out, q, kv[0], kv[1], tables, lens, hs**-0.5, context)
            # The same K/V, contiguous per sequence: [batch, kv_heads, context, head_size].
            k = kv[0][tables].view(batch, -1, nkv, hs)[:, :context].transpose(1, 2).contiguous()
            v = kv[1][tables].view(batch, -1, nkv, hs)[:, :context].transpose(1, 2).contiguous()
            q4 = q.unsqueeze(2)  # [batch, heads, 1, head_size]
            t = {
                "v1": time_it(partial(ops.paged_attention_v1, *args), "cuda", repeats)
                if context <= ops.V1_MAX_SEQ_LEN
                else float("nan"),
                "v2": time_it(partial(ops.paged_attention_v2, *args), "cuda", repeats),
                "torch_gather": time_it(
                    partial(ref.forward_decode, q, kv, tables, lens, context), "cuda", repeats
                ),
                "sdpa_contiguous": time_it(
                    partial(F.scaled_dot_product_attention, q4, k, v, enable_gqa=True),
                    "cuda",
                    repeats,
                ),
            }
            gbytes = moved_bytes(batch, context, nh, nkv, hs, dtype)
            best = min(t["v1"], t["v2"]) if context <= ops.V1_MAX_SEQ_LEN else t["v2"]
            row = dict(batch=batch, context=context, **{f"{n}_ms": s * 1e3 for n, s in t.items()})
            row["v2_GBps"] = gbytes / t["v2"] / 1e9
            row["v2_peak_fraction"] = gbytes / t["v2"] / peak if peak else float("nan")
            row["best_vs_torch_gather"] = t["torch_gather"] / best
            row["v2_vs_sdpa"] = t["v2"] / t["sdpa_contiguous"]
            rows.append(row)
            del kv, k, v
            torch.cuda.empty_cache()
    return rows


def bench_cpu(batches, contexts, repeats, shuffled=True) -> list[dict]:
    from minivllm.attention.backends.numba_paged import NumbaPagedAttention

    nh, nkv, hs, bs, dtype = 8, 2, 64, 16, torch.float32
    ref = TorchPagedAttention(nh, hs, hs**-0.5, nkv)
    fast = NumbaPagedAttention(nh, hs, hs**-0.5, nkv)
    bandwidth = machine.read_bandwidth().per_second
    rows = []
    for batch in batches:
        for context in contexts:
            q, kv, tables, lens = make_inputs(
                batch, context, nh, nkv, hs, bs, dtype, "cpu", shuffled
            )
            args = (q, kv, tables, lens, context)
            t_ref = time_it(partial(ref.forward_decode, *args), "cpu", repeats)
            t_numba = time_it(partial(fast.forward_decode, *args), "cpu", repeats)
            gbytes = moved_bytes(batch, context, nh, nkv, hs, dtype)
            rows.append(
                dict(
                    batch=batch,
                    context=context,
                    numba_ms=t_numba * 1e3,
                    torch_gather_ms=t_ref * 1e3,
                    numba_GBps=gbytes / t_numba / 1e9,
                    numba_bandwidth_fraction=gbytes / t_numba / bandwidth,
                    numba_vs_torch_gather=t_ref / t_numba,
                )
            )
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None)
    parser.add_argument("--batches", type=int, nargs="+")
    parser.add_argument("--contexts", type=int, nargs="+")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument(
        "--block-order", choices=["shuffled", "in-order"], default="shuffled",
        help="each sequence's blocks scattered over the pool, or consecutive",
    )
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    shuffled = args.block_order == "shuffled"
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda":
        batches = args.batches or [1, 8, 32, 64, 128, 256]
        contexts = args.contexts or [512, 1024, 2048, 4096, 8192]
        rows = bench_gpu(batches, contexts, args.repeats or 20, shuffled)
        machine = torch.cuda.get_device_name()
    else:
        batches = args.batches or [1, 8, 32]
        contexts = args.contexts or [256, 1024, 2048]
        rows = bench_cpu(batches, contexts, args.repeats or 5, shuffled)
        machine = f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
    print(f"decode attention on {machine}, blocks {args.block_order}")
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "machine": machine, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

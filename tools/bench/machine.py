"""This machine's speed limits, measured: memory bandwidth and matmul peak.

A kernel's time has two floors: the bytes it must move divided by the memory
bandwidth, and the FLOPs it must do divided by the arithmetic peak (the
roofline). Decode attention does about one multiply-add per byte of KV cache
it reads, so its floor is the bandwidth; a benchmark that reports "achieved
GB/s" needs the machine's own figure to compare with. Nominal figures from a
data sheet are for the best case (every channel populated, nothing else
running); these are measured here, now, with what else is running.

    from tools.bench import machine
    bw = machine.read_bandwidth()            # a Rate: .per_second in bytes/s
    peak = machine.matmul_peak()             # a Rate: .per_second in FLOP/s
    print(bw, peak, machine.ridge_point(peak.per_second, bw.per_second))

    python -m tools.bench.machine            # the CPU, and the GPU if there is one

Every figure is the *best* of a few repeats: the run least disturbed by other
processes, i.e. the closest to what the hardware can do. Buffers are far
larger than the CPU's caches (256 MiB by default), so the bytes come from
DRAM (or HBM), not from a cache.
"""

from __future__ import annotations

import argparse
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from minivllm.model_executor.layers.utils import supports_packed_cpu_gemm

DEFAULT_BYTES = 256 * 2**20  # far past any CPU's last-level cache


@dataclass(frozen=True)
class Rate:
    """`work` units (bytes or FLOPs) done in `seconds`, the best of `repeats` runs."""

    what: str  # "read", "copy", "matmul"
    work: float  # bytes moved, or FLOPs done, per run
    seconds: float  # the shortest run
    unit: str  # "B" or "FLOP"
    device: str = "cpu"
    repeats: int = 1

    @property
    def per_second(self) -> float:
        """Bytes/s or FLOP/s."""
        return self.work / self.seconds

    def __str__(self) -> str:
        return f"{self.what} on {self.device}: {format_rate(self.per_second, self.unit)}"


def format_rate(per_second: float, unit: str) -> str:
    """12.3e9 B/s -> '12.3 GB/s'; 4.5e12 FLOP/s -> '4.50 TFLOP/s' (decimal prefixes)."""
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if per_second >= scale:
            value = per_second / scale
            return f"{value:.3g} {prefix}{unit}/s"
    return f"{per_second:.3g} {unit}/s"


def copy_traffic(nbytes: int) -> int:
    """A copy of `nbytes` moves twice that: every byte is read once and written once."""
    return 2 * nbytes


def matmul_flops(m: int, n: int, k: int) -> int:
    """[m, k] @ [k, n]: m * n dot products of length k, a multiply and an add each."""
    return 2 * m * n * k


def ridge_point(peak_flops: float, bandwidth: float) -> float:
    """The arithmetic intensity (FLOPs per byte) at which the two floors meet:
    a kernel below it is memory-bound, above it compute-bound."""
    return peak_flops / bandwidth


def synchronize(device: str) -> None:
    """Wait for the device's queued work (a no-op on the CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def best_seconds(
    fn: Callable[[], object],
    repeats: int = 5,
    device: str = "cpu",
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """The shortest wall time of `repeats` calls of `fn`, after one untimed
    warm-up call (first-touch page faults, allocator growth, lazy init).
    On a GPU each call is synchronised so that its work is inside the timing."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    fn()
    synchronize(device)
    best = float("inf")
    for _ in range(repeats):
        start = clock()
        fn()
        synchronize(device)
        best = min(best, clock() - start)
    return best


def _buffer(nbytes: int, device: str) -> torch.Tensor:
    """A float32 buffer of about `nbytes` (rounded down to whole floats), written
    once so that every page is really mapped before anything is timed."""
    if nbytes < 4:
        raise ValueError(f"need at least 4 bytes, got {nbytes}")
    return torch.ones(nbytes // 4, dtype=torch.float32, device=device)


def read_bandwidth(nbytes: int = DEFAULT_BYTES, device: str = "cpu", repeats: int = 5) -> Rate:
    """Bytes/s for reading: the sum of a float32 buffer of `nbytes`, whose one
    add per 4 bytes is far below any machine's arithmetic speed. This is the
    figure to hold decode attention against: it mostly reads."""
    x = _buffer(nbytes, device)
    seconds = best_seconds(lambda: x.sum(), repeats, device)
    return Rate("read", x.nbytes, seconds, "B", str(device), repeats)


def copy_bandwidth(nbytes: int = DEFAULT_BYTES, device: str = "cpu", repeats: int = 5) -> Rate:
    """Bytes/s for copying a buffer of `nbytes` into another: read plus write
    traffic (`copy_traffic`), the figure STREAM calls "copy"."""
    src = _buffer(nbytes, device)
    dst = torch.empty_like(src)
    seconds = best_seconds(lambda: dst.copy_(src), repeats, device)
    return Rate("copy", copy_traffic(src.nbytes), seconds, "B", str(device), repeats)


def matmul_peak(
    n: int = 1024, dtype: torch.dtype = torch.float32, device: str = "cpu", repeats: int = 3
) -> Rate:
    """FLOP/s of an [n, n] @ [n, n] matmul in `dtype`: close to the arithmetic
    peak for large n (use n >= 4096 and float16/bfloat16 on a GPU).

    By the faster of torch's matmul and, where the model's linear layers use
    it, oneDNN's packed product (model_executor/layers/utils.py): torch's
    matmul calls MKL, which on some CPUs takes a slower path (on an AMD
    Zen 5 VM, half the packed product's rate), and a peak below what the
    model's own products reach would make every fraction of it wrong."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    seconds = best_seconds(lambda: a @ b, repeats, device)
    if supports_packed_cpu_gemm(b):
        packed = torch.ops.mkldnn._reorder_linear_weight(b.t().contiguous(), None)

        def packed_product() -> torch.Tensor:  # a @ b, b packed as a linear weight
            return torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], "")

        seconds = min(seconds, best_seconds(packed_product, repeats, device))
    return Rate("matmul", matmul_flops(n, n, n), seconds, "FLOP", str(device), repeats)


def describe(device: str = "cpu") -> str:
    """The machine in one line: the processor and threads, or the GPU's name."""
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads"


def measure(device: str = "cpu", nbytes: int = DEFAULT_BYTES) -> dict[str, Rate]:
    """Read and copy bandwidth and the matmul peak of one device."""
    is_gpu = torch.device(device).type == "cuda"
    return {
        "read": read_bandwidth(nbytes, device),
        "copy": copy_bandwidth(nbytes, device),
        "matmul": matmul_peak(4096 if is_gpu else 1024, torch.float16 if is_gpu else torch.float32,
                              device),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=DEFAULT_BYTES // 2**20, help="buffer size")
    args = parser.parse_args(argv)
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        rates = measure(device, args.mib * 2**20)
        print(describe(device))
        for rate in rates.values():
            print(f"  {rate}")
        ridge = ridge_point(rates["matmul"].per_second, rates["read"].per_second)
        print(f"  ridge point: {ridge:.1f} FLOPs per byte read")


if __name__ == "__main__":
    main()

"""Small CPU steps on one thread: what a sleeping thread pool costs.

minivllm's OpenMP threads sleep as soon as a parallel region ends
(OMP_WAIT_POLICY=PASSIVE, envs.py), because spinning threads make a shared
machine crawl. The price: every parallel region must wake the sleeping
threads first. A decode step of one sequence runs about 30 of them (each
linear layer's product, the LM head's, the decode attention), and on our
2-vCPU VMs a wake-up costs tens of microseconds, about what a small product
takes. So a step of a few tokens ran faster on one thread than on two. On
the AMD VM, 20M model, decode steps of 1 sequence took 4.5-4.9 ms on one
thread against 6.4-6.7 on two, 1.2-1.3x faster at 4 sequences, 1.1-1.2x at
8, level at 16; from 24 on two threads won (1.2x at 64). Spinning threads
(OMP_WAIT_POLICY=ACTIVE, or a spin count) made one sequence's steps faster
still (3.3-4.1 ms), but with one other busy process on the machine they
took 11-92 ms, and batch-64 steps 2.5-12x longer, where one thread kept
its 4.5-4.9 ms.

vLLM's CPU backend has no such switch. It binds its OpenMP threads to
cores set aside for it (VLLM_CPU_OMP_THREADS_BIND) and, with Intel's
OpenMP preloaded as its install guide advises, lets each thread spin 1 ms
after a region before it sleeps (KMP_BLOCKTIME=1, vllm/platforms/cpu.py),
so its wake-ups are cheap. That suits a server that owns its cores, not a
laptop or a shared VM running notebooks.

Where two threads start to pay depends on the machine and the model (a
large model's products are long enough that a wake-up is lost in them), so
the worker times it once per model at load, on the model's own products
(`one_thread_max_tokens`), as the loader times the few-row kernel
(`few_row_kernel_pays`). Only speed rides on it: the same check first makes
sure one thread gives every product the bits the full pool gives it (the
Numba kernels are written so that threads change no bit), so a sequence's
tokens do not depend on whether its step ran on one thread or several.
Tensor-parallel ranks keep their threads (`Worker.load_model`): each
would time its own threshold, and one rank switching alone would hold the
others up at every all-reduce. A compiled model switches too: from
DYNAMO_ONCE up its graph carries no guard on the thread count
(compilation/wrapper.py), so the switch compiles nothing (DYNAMO_AS_IS keeps
every guard and compiles a graph per thread count, as that level may).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from minivllm.model_executor.layers.utils import same_bits, unquantized_gemm

# Step sizes (tokens) the load-time check tries, smallest first.
STEP_TOKENS_TRIED = (1, 2, 4, 8, 16, 32)
# How much faster one thread must be to be used: where the two tie (about 8
# rows for the 20M model on our AMD VM), timing noise alone would decide.
ONE_THREAD_MARGIN = 0.95


@contextmanager
def set_threads(num_threads: int) -> Iterator[None]:
    """torch's (and so the Numba kernels', `numba_threads`) thread count
    inside the block; put back after."""
    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextmanager
def step_threads(num_tokens: int, one_thread_max_tokens: int) -> Iterator[None]:
    """The step's thread count: one for a step of at most
    `one_thread_max_tokens` tokens, the process's own otherwise."""
    if num_tokens > one_thread_max_tokens or torch.get_num_threads() == 1:
        yield
        return
    with set_threads(1):
        yield


def largest_one_thread_win(sizes: tuple[int, ...], faster_alone: Callable[[int], bool]) -> int:
    """The largest of `sizes` up to which one thread was faster at every
    size tried, smallest first (0: not even at the first)."""
    best = 0
    for n in sizes:
        if not faster_alone(n):
            break
        best = n
    return best


def one_thread_max_tokens(layers: list[nn.Module], device: torch.device) -> int:
    """The most tokens a step may have and still run on one thread (0: never).

    Timed on `layers` (the model's packed linear layers, in order: a decode
    step's products), for each size of STEP_TOKENS_TRIED: every product on
    one thread and on the process's threads, best of 5, interleaved; one
    thread must be ONE_THREAD_MARGIN faster.
    0 on a GPU, with one thread already, without packed layers, or where
    one thread gives any product other bits than the pool."""
    threads = torch.get_num_threads()
    if device.type != "cpu" or threads == 1 or not layers:
        return 0
    g = torch.Generator().manual_seed(0)
    inputs = {
        n: [torch.randn(n, layer.weight.shape[1], generator=g) for layer in layers]
        for n in STEP_TOKENS_TRIED
    }

    def products(n: int) -> list[torch.Tensor]:
        return [unquantized_gemm(layer, x) for layer, x in zip(layers, inputs[n], strict=True)]

    with torch.inference_mode():
        with set_threads(1):
            alone = {n: products(n) for n in STEP_TOKENS_TRIED}
        pooled = {n: products(n) for n in STEP_TOKENS_TRIED}
        for n in STEP_TOKENS_TRIED:
            if not all(same_bits(a, b) for a, b in zip(alone[n], pooled[n], strict=True)):
                return 0

        def faster_alone(n: int) -> bool:
            best = {1: float("inf"), threads: float("inf")}
            for _ in range(5):
                for num_threads in best:  # interleaved, so a busy spell hits both
                    with set_threads(num_threads):
                        start = time.perf_counter()
                        products(n)
                        best[num_threads] = min(best[num_threads], time.perf_counter() - start)
            return best[1] < ONE_THREAD_MARGIN * best[threads]

        return largest_one_thread_win(STEP_TOKENS_TRIED, faster_alone)

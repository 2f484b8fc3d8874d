"""Run a function on N ranks of a real `torch.distributed` world (gloo on
127.0.0.1, one thread per rank) and collect what each returns: the tests of
the parallel layers and the day 14 checkers use it."""

from __future__ import annotations

import multiprocessing as mp
import traceback
from collections.abc import Callable
from typing import Any

from minivllm.utils import get_open_port


def _rank_main(fn, rank: int, world_size: int, port: int, results, args) -> None:
    import torch

    from minivllm.distributed import (
        destroy_distributed_environment,
        destroy_model_parallel,
        ensure_model_parallel_initialized,
        init_distributed_environment,
    )

    torch.set_num_threads(1)
    try:
        init_distributed_environment(world_size, rank, f"tcp://127.0.0.1:{port}", backend="gloo")
        ensure_model_parallel_initialized(world_size)
        results.put((rank, True, fn(rank, *args)))
    except BaseException:  # noqa: BLE001 - sent to the test, which fails with it
        results.put((rank, False, traceback.format_exc()))
    finally:
        destroy_model_parallel()
        destroy_distributed_environment()


def run_ranks(fn: Callable[..., Any], *args: Any, world_size: int = 2,
              timeout: float = 120) -> list[Any]:
    """fn(rank, *args) on every rank (fn must be importable: a module-level
    function); the list of their results by rank. Results must be plain
    Python or numpy (not tensors, whose shared memory dies with the process).
    A rank that raises fails the call with its traceback; no process outlives it."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = get_open_port()
    procs = [
        ctx.Process(target=_rank_main, args=(fn, rank, world_size, port, results, args))
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    try:
        got = dict()
        for _ in procs:
            rank, ok, value = results.get(timeout=timeout)
            if not ok:
                raise AssertionError(f"rank {rank} failed:\n{value}")
            got[rank] = value
        return [got[rank] for rank in range(world_size)]
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()

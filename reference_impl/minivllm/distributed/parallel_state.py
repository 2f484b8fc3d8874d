"""Who this process is in the tensor-parallel group, and the group's collectives.

As in vLLM, every worker process first joins one `torch.distributed` world
(`init_distributed_environment`), then the tensor-parallel group is carved
out of it (`ensure_model_parallel_initialized`). Layers never talk to
`torch.distributed` directly: they ask `get_tp_group()` (a `GroupCoordinator`)
for their rank and world size and call its collectives, through the
functions of `communication_op.py`.

The backend is gloo on CPU and NCCL on GPU. Gloo carries CPU tensors only,
so on a GPU vLLM keeps a second, gloo group beside the NCCL one for Python
objects (`cpu_group`); with gloo the two are the same group.

Deliberate difference from vLLM: with one worker no process group is
created at all, and asking for the rank or world size before initialisation
answers 0 and 1, so a model can be built in a notebook or a test without
setting up a distributed world (vLLM asserts that the group exists).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class CollectiveStats:
    """What this rank's collectives have cost so far (`tools/bench/tp.py`
    reads the driver's per step). Time includes waiting for the slowest rank."""

    calls: int = 0
    bytes: int = 0  # tensor bytes this rank put into collectives
    seconds: float = 0.0

    def __sub__(self, earlier: CollectiveStats) -> CollectiveStats:
        """What was spent since `earlier` (a copy of these counters)."""
        return CollectiveStats(
            self.calls - earlier.calls, self.bytes - earlier.bytes, self.seconds - earlier.seconds
        )


@dataclass
class GroupCoordinator:
    """A process group and this process's place in it (vLLM's class of the
    same name). With a world of one, every collective returns its input."""

    ranks: list[int]  # global ranks of the group's members, in group order
    rank: int  # this process's global rank
    device_group: dist.ProcessGroup | None  # tensors (gloo or NCCL); None alone
    cpu_group: dist.ProcessGroup | None  # Python objects (always gloo)
    stats: CollectiveStats = field(default_factory=CollectiveStats)

    @contextmanager
    def _counted(self, tensor: torch.Tensor | None = None) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.stats.calls += 1
        self.stats.bytes += 0 if tensor is None else tensor.numel() * tensor.element_size()
        self.stats.seconds += time.perf_counter() - start

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def rank_in_group(self) -> int:
        return self.ranks.index(self.rank)

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    def all_reduce(self, input_: torch.Tensor) -> torch.Tensor:
        """The elementwise sum over the group, on every rank (in place)."""
        if self.world_size == 1:
            return input_
        with self._counted(input_):
            dist.all_reduce(input_, group=self.device_group)
        return input_

    def all_gather(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's tensor, concatenated along `dim` in rank order, on every rank."""
        if self.world_size == 1:
            return input_
        parts = [torch.empty_like(input_) for _ in range(self.world_size)]
        with self._counted(input_):
            dist.all_gather(parts, input_.contiguous(), group=self.device_group)
        return torch.cat(parts, dim=dim)

    def gather(self, input_: torch.Tensor, dst: int = 0, dim: int = -1) -> torch.Tensor | None:
        """Every rank's tensor concatenated along `dim` on rank `dst` (in the
        group); None elsewhere. The logits go to the driver this way: only it samples."""
        if self.world_size == 1:
            return input_
        input_ = input_.contiguous()
        parts = None
        if self.rank_in_group == dst:
            parts = [torch.empty_like(input_) for _ in range(self.world_size)]
        with self._counted(input_):
            dist.gather(input_, parts, dst=self.ranks[dst], group=self.device_group)
        return torch.cat(parts, dim=dim) if parts is not None else None

    def broadcast(self, input_: torch.Tensor, src: int = 0) -> torch.Tensor:
        if self.world_size > 1:
            with self._counted(input_):
                dist.broadcast(input_, src=self.ranks[src], group=self.device_group)
        return input_

    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        """A picklable object from rank `src` to every rank."""
        if self.world_size == 1:
            return obj
        box = [obj if self.rank_in_group == src else None]
        with self._counted():
            dist.broadcast_object_list(box, src=self.ranks[src], group=self.cpu_group)
        return box[0]

    def broadcast_tensor_dict(
        self, tensor_dict: dict[str, Any] | None = None, src: int = 0
    ) -> dict[str, Any]:
        """A dict of tensors and plain values from rank `src` to every rank.

        The keys, the plain values and each tensor's dtype and shape travel as
        one pickled object; then each tensor's bytes travel with a broadcast of
        its own, so large tensors are never pickled (vLLM does the same to send
        the step's inputs from the driver to the other workers).
        """
        if self.world_size == 1:
            return tensor_dict or {}
        if self.rank_in_group == src:
            assert tensor_dict is not None, "the source rank must give the dict"
            metadata = [
                (key, (value.dtype, value.shape) if isinstance(value, torch.Tensor) else None,
                 None if isinstance(value, torch.Tensor) else value)
                for key, value in tensor_dict.items()
            ]
            self.broadcast_object(metadata, src)
            for value in tensor_dict.values():
                if isinstance(value, torch.Tensor):
                    self.broadcast(value.contiguous(), src)
            return tensor_dict
        result: dict[str, Any] = {}
        for key, tensor_meta, value in self.broadcast_object(None, src):
            if tensor_meta is None:
                result[key] = value
                continue
            dtype, shape = tensor_meta
            result[key] = self.broadcast(torch.empty(shape, dtype=dtype, device=_device()), src)
        return result

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.cpu_group)


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if _BACKEND == "nccl" else (
        torch.device("cpu")
    )


_WORLD: GroupCoordinator | None = None
_TP: GroupCoordinator | None = None
_BACKEND = "gloo"


def init_distributed_environment(
    world_size: int = 1,
    rank: int = 0,
    distributed_init_method: str = "env://",
    local_rank: int = -1,
    backend: str = "gloo",
) -> None:
    """Join the world of `world_size` processes (all reach each other at
    `distributed_init_method`, e.g. tcp://127.0.0.1:PORT). A world of one
    creates no process group."""
    global _WORLD, _BACKEND
    if _WORLD is not None:
        if _WORLD.world_size != world_size:
            raise RuntimeError(
                f"the distributed world has {_WORLD.world_size} processes already; "
                f"cannot join one of {world_size}"
            )
        return
    _BACKEND = backend
    if world_size > 1:
        dist.init_process_group(
            backend, init_method=distributed_init_method, world_size=world_size, rank=rank
        )
        if backend == "nccl" and local_rank >= 0:
            torch.cuda.set_device(local_rank)
    group = dist.group.WORLD if world_size > 1 else None
    _WORLD = GroupCoordinator(list(range(world_size)), rank, group, group)


def ensure_model_parallel_initialized(tensor_model_parallel_size: int) -> None:
    """Carve the tensor-parallel groups out of the world: consecutive ranks
    [0, tp), [tp, 2 tp), ... form one group each (vLLM's layout; without
    pipeline parallelism the world is one group)."""
    global _TP
    if _WORLD is None:
        raise RuntimeError("init_distributed_environment() must come first")
    if _TP is not None:
        if _TP.world_size != tensor_model_parallel_size:
            raise RuntimeError(
                f"tensor parallelism is initialised with size {_TP.world_size}, "
                f"not {tensor_model_parallel_size}"
            )
        return
    world_size, rank = _WORLD.world_size, _WORLD.rank
    if world_size % tensor_model_parallel_size:
        raise ValueError(
            f"world size {world_size} is not a multiple of tensor_model_parallel_size "
            f"{tensor_model_parallel_size}"
        )
    mine = None
    for start in range(0, world_size, tensor_model_parallel_size):
        ranks = list(range(start, start + tensor_model_parallel_size))
        # Every rank must create every group, in the same order (torch's rule).
        device_group = dist.new_group(ranks, backend=_BACKEND) if len(ranks) > 1 else None
        cpu_group = (
            dist.new_group(ranks, backend="gloo")
            if len(ranks) > 1 and _BACKEND != "gloo" else device_group
        )
        if rank in ranks:
            mine = GroupCoordinator(ranks, rank, device_group, cpu_group)
    _TP = mine


def model_parallel_is_initialized() -> bool:
    return _TP is not None


def get_tp_group() -> GroupCoordinator:
    """This process's tensor-parallel group; a group of one before initialisation."""
    return _TP if _TP is not None else GroupCoordinator([0], 0, None, None)


def get_tensor_model_parallel_world_size() -> int:
    return get_tp_group().world_size


def get_tensor_model_parallel_rank() -> int:
    return get_tp_group().rank_in_group


def destroy_model_parallel() -> None:
    global _TP
    _TP = None


def destroy_distributed_environment() -> None:
    """Leave the world (so a new engine in the same process can start another)."""
    global _WORLD
    _WORLD = None
    if dist.is_initialized():
        dist.destroy_process_group()

"""Spies the engine tests install on a live `LLM`, to see what each step did
without changing it: what the scheduler decided, and which blocks moved."""

from __future__ import annotations

from minivllm import LLM
from minivllm.core.scheduler import Scheduler, SchedulerOutputs
from minivllm.sequence import SequenceGroupMetadata

Schedule = tuple[list[SequenceGroupMetadata], SchedulerOutputs]


def record_schedules(llm: LLM) -> list[Schedule]:
    """Every later `Scheduler.schedule()` result, one entry per step."""
    scheduler = llm.llm_engine.scheduler
    schedules: list[Schedule] = []
    original = scheduler.schedule

    def schedule() -> Schedule:
        schedules.append(original())
        return schedules[-1]

    scheduler.schedule = schedule
    return schedules


def batch_shapes(schedules: list[Schedule]) -> list[list[tuple[bool, int, bool]]]:
    """Per step: (is_prompt, token_chunk_size, do_sample) of each scheduled group."""
    return [[(m.is_prompt, m.token_chunk_size, m.do_sample) for m in md] for md, _ in schedules]


def prefill_tokens(schedules: list[Schedule]) -> list[int]:
    """Per step: the prefill tokens handed to the model."""
    return [sum(m.token_chunk_size for m in md if m.is_prompt) for md, _ in schedules]


def record_block_moves(llm: LLM, monkeypatch) -> dict[str, list[tuple[int, int]]]:
    """The (src, dst) block pairs the worker copies, swaps in and swaps out."""
    cache_engine = llm.llm_engine.worker.cache_engine
    moves: dict[str, list[tuple[int, int]]] = {"copy": [], "swap_in": [], "swap_out": []}
    for name in moves:
        original = getattr(cache_engine, name)

        def spy(pairs, _name=name, _original=original):
            moves[_name] += pairs
            _original(pairs)

        monkeypatch.setattr(cache_engine, name, spy)
    return moves


class RecordingScheduler(Scheduler):
    """A Scheduler that counts its steps; importable by name for `scheduler_cls`."""

    steps = 0

    def schedule(self):
        RecordingScheduler.steps += 1
        return super().schedule()

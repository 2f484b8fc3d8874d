"""Step observers: how a tool watches the engine work, step by step.

`LLMEngine.add_step_observer` registers an object with two methods:
`on_add_request(engine, seq_group)` when a request is queued, and
`on_step(engine, record)` at the end of every `step()`, with a `StepRecord`
of what the step did. The tracer (`engine/trace_writer.py`, viewed with
`minivllm/tracer/`) is one. With no observer registered, `step()` takes its
plain path: no record, no stopwatch, no copies.

The record holds the engine's own objects, not copies: an observer reads
them inside `on_step` and keeps only what it has converted. The state after
the step (queues, block tables, free blocks) is read from the engine itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from minivllm.core.scheduler import Scheduler, SchedulerOutputs
from minivllm.distributed.parallel_state import CollectiveStats
from minivllm.model_executor.layers.sampler import SamplerOutput
from minivllm.outputs import RequestOutput
from minivllm.sequence import SequenceGroup, SequenceGroupMetadata
from minivllm.worker.model_runner import FlatBatch

if TYPE_CHECKING:
    from minivllm.engine.llm_engine import LLMEngine


def queue_request_ids(scheduler: Scheduler) -> dict[str, list[str]]:
    """The request ids in each of the scheduler's queues, in queue order."""
    return {
        "waiting": [sg.request_id for sg in scheduler.waiting],
        "running": [sg.request_id for sg in scheduler.running],
        "swapped": [sg.request_id for sg in scheduler.swapped],
    }


@dataclass
class StepRecord:
    """One `LLMEngine.step()`: the scheduler's decisions, the model's input
    and output, and how long each phase took.

    queues_before: `queue_request_ids` as the step began.
    batch: the model input as plain lists, the very `FlatBatch` the worker
        built and ran the model on (empty when nothing ran).
    output: one entry per scheduled group, in batch order.
    samples: (seq_id, parent_seq_id, token) for each token sampled, in
        sampling order: the sequence that received the token is the parent
        itself or a child forked from it at a prompt's first sample.
    request_outputs: what `step()` returned.
    *_ms: wall time of the schedule, execute (block moves and the model)
        and process (new tokens, stop checks, frees, stats) phases.
    collectives: with several tensor-parallel workers, the driver's
        collectives during the execute phase (calls, bytes, seconds); None
        with one worker.
    """

    queues_before: dict[str, list[str]]
    seq_group_metadata_list: list[SequenceGroupMetadata]
    scheduler_outputs: SchedulerOutputs
    batch: FlatBatch
    output: SamplerOutput
    samples: list[tuple[int, int, int]]
    request_outputs: list[RequestOutput]
    schedule_ms: float
    execute_ms: float
    process_ms: float
    collectives: CollectiveStats | None = None


class StepObserver(Protocol):
    def on_add_request(self, engine: LLMEngine, seq_group: SequenceGroup) -> None: ...

    def on_step(self, engine: LLMEngine, record: StepRecord) -> None: ...

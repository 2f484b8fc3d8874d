"""Step observers of V1's `LLMEngine` (the classic engine's hook,
engine/step_observer.py, for V1's step).

`LLMEngine.add_step_observer` registers an object with two methods:
`on_add_request(engine, request_id)` once the engine core has queued a
request (each child of an `n > 1` request apart; the id is the engine
core's, which is the user's unless another live request held it:
`InputProcessor.assign_request_id`), and `on_step(engine, record)` at the
end of every `step()`, with a `V1StepRecord` of what it did. The tracer's
V1 writer (v1/engine/trace_writer.py) is one. With no observer, `step()`
takes its plain path: no record, no stopwatch.

Observing needs the engine core in this process (`InprocClient`): the
observed step runs its three phases itself (schedule, execute, update), as
`EngineCore.step` does, timing each, and reads the scheduler, the KV-cache
manager and the model runner's input directly. The record holds the
engine's own objects, not copies: read them inside `on_step`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from minivllm.outputs import RequestOutput
from minivllm.v1.core.sched.output import SchedulerOutput
from minivllm.v1.core.sched.scheduler import Scheduler
from minivllm.v1.engine import EngineCoreOutputs
from minivllm.v1.outputs import ModelRunnerOutput
from minivllm.v1.worker.gpu_model_runner import StepInputs

if TYPE_CHECKING:
    from minivllm.v1.engine.llm_engine import LLMEngine


def queue_request_ids(scheduler: Scheduler) -> dict[str, list[str]]:
    """The request ids in V1's two queues, in queue order."""
    return {
        "waiting": [r.request_id for r in scheduler.waiting],
        "running": [r.request_id for r in scheduler.running],
    }


@dataclass
class V1StepRecord:
    """One V1 `LLMEngine.step()`.

    queues_before: `queue_request_ids` as the step began.
    scheduler_output: what the scheduler decided (None: it had no requests,
        so the step did nothing, as `EngineCore.step`).
    inputs: the model's input, the very arrays the model runner built
        (None: the model did not run).
    model_output: the sampled tokens, by batch row (None with no step).
    outputs: the engine core's outputs (new tokens, finish reasons, stats).
    stopped_by_string: request ids the front end found a stop string in
        and aborted in the engine core at the end of the step.
    request_outputs: what `step()` returned.
    *_ms: wall time of the scheduler's schedule, the model's execute, the
        scheduler's update_from_output, and the front end's processing of
        the outputs (detokenize, stop strings, those aborts).
    """

    queues_before: dict[str, list[str]]
    scheduler_output: SchedulerOutput | None
    inputs: StepInputs | None
    model_output: ModelRunnerOutput | None
    outputs: EngineCoreOutputs
    stopped_by_string: list[str]
    request_outputs: list[RequestOutput]
    schedule_ms: float
    execute_ms: float
    update_ms: float
    process_ms: float


class V1StepObserver(Protocol):
    def on_add_request(self, engine: LLMEngine, request_id: str) -> None: ...

    def on_step(self, engine: LLMEngine, record: V1StepRecord) -> None: ...

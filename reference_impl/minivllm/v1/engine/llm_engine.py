"""V1's `LLMEngine` (vLLM's `vllm/v1/engine/llm_engine.py`): the classic
engine's interface (`add_request`, `step`, `abort_request`) over V1's split:

    add_request: InputProcessor (tokenize, check) -> EngineCoreRequest
                 under an internal id -> OutputProcessor (a RequestState)
                 and the engine core
    step:        engine core step (schedule, execute, update) -> token ids
                 -> OutputProcessor (text, stop strings) -> RequestOutputs

`LLM(..., use_v1=True)` (or MINIVLLM_USE_V1=1) runs on it. As the classic
engine, it dies with a step that fails part-way: every later call raises
`EngineDeadError` rather than serve tokens from a half-updated state.

The engine core runs in this process (`InprocClient`: `step` runs one
step) or, with `multiprocess_mode=True` or
MINIVLLM_ENABLE_V1_MULTIPROCESSING=1, in a process of its own
(`SyncMPClient`: it steps on its own and `step` takes the next outputs;
its death, a SIGKILL say, is an `EngineDeadError` here).

Outputs carry the user's request id; the engine core knows each request by
an internal one (`InputProcessor.assign_request_id`): the user's id when it
is free and the engine core is in this process, else with a random suffix.

Tools watch the steps through step observers (v1/engine/step_observer.py);
the tracer's V1 writer (v1/engine/trace_writer.py) is one: `trace=PATH`,
`start_trace(PATH)` or MINIVLLM_TRACE. Observing needs the engine core in
this process; the multiprocess one refuses it.
"""

from __future__ import annotations

import time

from minivllm import envs
from minivllm.config import EngineConfig
from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.llm_engine import EngineDeadError, engine_dead_error
from minivllm.inputs import PromptType
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams
from minivllm.transformers_utils.tokenizer import get_tokenizer
from minivllm.utils import check_bool
from minivllm.v1.engine import EngineCoreOutputs, EngineCoreRequest
from minivllm.v1.engine.core import get_scheduler_cls
from minivllm.v1.engine.core_client import EngineCoreClient, InprocClient
from minivllm.v1.engine.input_processor import InputProcessor
from minivllm.v1.engine.output_processor import (
    OutputProcessor,
    OutputProcessorOutput,
    ParentRequest,
    fan_out,
)
from minivllm.v1.engine.step_observer import V1StepObserver, V1StepRecord, queue_request_ids
from minivllm.v1.engine.trace_writer import V1TraceWriter
from minivllm.v1.metrics.loggers import StatLoggerManager
from minivllm.v1.metrics.stats import iteration_stats_of


def check_v1_config(engine_config: EngineConfig) -> None:
    """Refuse, naming the option, what only the classic engine has."""
    model_config, scheduler_config = engine_config.model_config, engine_config.scheduler_config
    if model_config.dry_run:
        raise ValueError("dry_run=True runs on the classic engine only (use_v1=False)")
    if scheduler_config.preemption_mode is not None and (
        scheduler_config.preemption_mode.value == "swap"
    ):
        raise ValueError(
            "preemption_mode='swap': V1 preempts by recompute only (prefix caching makes "
            "recomputing cheap); leave preemption_mode unset, or use the classic engine"
        )
    get_scheduler_cls(scheduler_config)  # refuses a classic replacement
    block_manager_cls = scheduler_config.block_manager_cls
    if not block_manager_cls.__module__.startswith("minivllm.core."):
        raise ValueError(
            f"block_manager_cls={block_manager_cls.__qualname__} replaces the classic engine's "
            "block manager; V1 has its KVCacheManager (minivllm/v1/core/)"
        )


def resolve_multiprocess_mode(multiprocess_mode: bool | None) -> bool:
    """Where the engine core runs: `multiprocess_mode` if given, else
    $MINIVLLM_ENABLE_V1_MULTIPROCESSING ("1" or "0"), else in this process
    (vLLM's default is a process of its own: see envs.py for why ours is not)."""
    if multiprocess_mode is not None:
        return check_bool("multiprocess_mode", multiprocess_mode, "None, True or False")
    raw = envs.MINIVLLM_ENABLE_V1_MULTIPROCESSING
    if raw in (None, "0"):
        return False
    if raw == "1":
        return True
    raise ValueError(
        f"The environment variable MINIVLLM_ENABLE_V1_MULTIPROCESSING must be 0 or 1, got {raw!r}"
    )


_NO_OBSERVING_MP = (
    "tracing (and any step observer) reads the V1 engine core in this process; this engine "
    "runs it in a process of its own: pass multiprocess_mode=False (or set "
    "MINIVLLM_ENABLE_V1_MULTIPROCESSING=0) to trace V1"
)


class LLMEngine:
    def __init__(
        self,
        engine_config: EngineConfig,
        log_stats: bool = False,
        multiprocess_mode: bool | None = None,
        trace: str | None = None,
    ) -> None:
        check_v1_config(engine_config)
        multiprocess_mode = resolve_multiprocess_mode(multiprocess_mode)
        trace = trace or envs.MINIVLLM_TRACE
        if trace and multiprocess_mode:
            raise ValueError(_NO_OBSERVING_MP)
        self.engine_config = engine_config
        self.model_config = engine_config.model_config
        self.log_stats = log_stats
        self.tokenizer = get_tokenizer(
            self.model_config.tokenizer, self.model_config.trust_remote_code
        )
        self.input_processor = InputProcessor(engine_config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.engine_core = EngineCoreClient.make_client(
            multiprocess_mode=multiprocess_mode,
            asyncio_mode=False,
            engine_config=engine_config,
        )
        self.multiprocess_mode = multiprocess_mode
        self.dead_error: BaseException | None = None
        # Totals over the engine's life, from each step's SchedulerStats
        # (the benchmarks read them; vLLM's stat loggers keep the like).
        self.total_scheduled_tokens = 0
        self.total_preemptions = 0
        # With log_stats, every step is recorded and vLLM's throughput line
        # logged every few seconds (vLLM's `logger_manager`).
        self.stat_loggers: StatLoggerManager | None = None
        if log_stats:
            caching = engine_config.cache_config.enable_prefix_caching
            self.stat_loggers = StatLoggerManager(log_stats, caching)
        self.step_observers: list[V1StepObserver] = []
        # Outputs of a step whose observer raised: the next step returns them.
        self._undelivered: list[RequestOutput] = []
        self.trace_writer: V1TraceWriter | None = None
        if trace:
            self.start_trace(trace)

    @classmethod
    def from_engine_args(
        cls,
        engine_args: EngineArgs,
        trace: str | None = None,
        multiprocess_mode: bool | None = None,
    ) -> LLMEngine:
        return cls(
            engine_args.create_engine_config(),
            log_stats=not engine_args.disable_log_stats,
            multiprocess_mode=multiprocess_mode,
            trace=trace,
        )

    def get_tokenizer(self):
        return self.tokenizer

    # -- requests -----------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> str:
        """Check and queue a request; `n > 1` becomes n child requests.
        Returns its internal id (as vLLM's does). Another live request may
        have the same `request_id`. An add that fails part-way (an observer
        that raises, a dead engine core) leaves nothing of the request."""
        self._check_alive()
        prompt_text, request = self.input_processor.process_inputs(
            request_id, prompt, params, arrival_time, priority
        )
        # In this process the engine core holds exactly the front end's live
        # requests; in its own, outputs of ended ones may still be on their way.
        in_use = None if self.multiprocess_mode else self.output_processor.is_request_active
        self.input_processor.assign_request_id(request, in_use)
        try:
            for child, parent, index in fan_out(request):
                self._add_child(child, prompt_text, parent, index)
        except BaseException:
            aborted = self.output_processor.abort_requests([request.request_id], internal=True)
            if self.dead_error is None:
                self.engine_core.abort_requests(aborted)
            raise
        return request.request_id

    def _add_child(
        self,
        request: EngineCoreRequest,
        prompt: str | None,
        parent: ParentRequest | None,
        index: int,
    ) -> None:
        """One request the engine core runs: to the front end, the engine
        core, then the observers (which read it in the engine core)."""
        self.output_processor.add_request(request, prompt, parent, index)
        try:
            self.engine_core.add_request(request)
        except EngineDeadError as exc:  # the engine core's process is gone
            self.dead_error = exc
            raise
        for observer in self.step_observers:
            observer.on_add_request(self, request.request_id)

    def abort_request(self, request_id: str | list[str], internal: bool = False) -> None:
        """Drop requests now (no final output, as vLLM V1): every live
        request with a user's id given (`internal`: the engine's ids, as
        `add_request` returns them). Ids unknown or finished are ignored; on
        a dead engine this does nothing."""
        if self.dead_error is not None:
            return
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        self.engine_core.abort_requests(self.output_processor.abort_requests(ids, internal))

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests() or bool(self._undelivered)

    def get_num_unfinished_requests(self) -> int:
        """Requests not finished, as the classic engine counts them: one for
        a request with n > 1."""
        return self.output_processor.get_num_unfinished_user_requests()

    @property
    def _live_request_ids(self) -> set[str]:
        """The users' ids of the live requests: the classic engine's set of
        the same name, which tests read on either engine."""
        return set(self.output_processor.external_req_ids)

    # -- the step -------------------------------------------------------------

    @property
    def errored(self) -> bool:
        return self.dead_error is not None

    def _check_alive(self) -> None:
        if self.dead_error is not None:
            cause = self.dead_error
            if isinstance(cause, EngineDeadError):  # the engine core's process died
                raise EngineDeadError(str(cause)) from cause
            raise engine_dead_error(cause)

    def step(self) -> list[RequestOutput]:
        self._check_alive()
        record = None
        try:
            if self.step_observers:
                processed, record = self._observed_step()
            else:
                processed = self._process_outputs(self.engine_core.get_output())
        except BaseException as exc:
            self.dead_error = exc
            self.engine_core.shutdown()
            raise
        request_outputs = self._undelivered + processed.request_outputs
        self._undelivered = []
        if record is not None:
            # After the step is complete: an observer that raises leaves the
            # engine alive, and the next step returns this one's outputs.
            try:
                for observer in self.step_observers:
                    observer.on_step(self, record)
            except BaseException:
                self._undelivered = request_outputs
                raise
        return request_outputs

    def _process_outputs(self, outputs: EngineCoreOutputs) -> OutputProcessorOutput:
        """The front end's half of a step: text, stop strings, stats."""
        iteration_stats = None
        if self.stat_loggers is not None:  # before the processor marks first tokens
            states = self.output_processor.request_states
            iteration_stats = iteration_stats_of(outputs.outputs, states)
        processed = self.output_processor.process_outputs(outputs.outputs, iteration_stats)
        if outputs.scheduler_stats is not None:
            self.total_scheduled_tokens += outputs.scheduler_stats.num_scheduled_tokens
            self.total_preemptions += outputs.scheduler_stats.num_preempted_reqs
        self.engine_core.abort_requests(processed.reqs_to_abort)
        if iteration_stats is not None:
            self.stat_loggers.record(
                outputs.scheduler_stats, iteration_stats, processed.request_outputs
            )
        return processed

    def _observed_step(self) -> tuple[OutputProcessorOutput, V1StepRecord]:
        """`EngineCore.step`'s three phases run here, each timed, then the
        front end's, and a `V1StepRecord` of them."""
        core = self.engine_core.engine_core
        scheduler = core.scheduler
        runner = core.model_executor.driver_worker.model_runner
        queues_before = queue_request_ids(scheduler)
        scheduler_output = model_output = inputs = None
        outputs = EngineCoreOutputs()
        start = scheduled = executed = time.perf_counter()
        if scheduler.has_requests():
            scheduler_output = scheduler.schedule()
            scheduled = time.perf_counter()
            model_output = core.model_executor.execute_model(scheduler_output)
            inputs = runner.last_inputs
            executed = time.perf_counter()
            outputs = scheduler.update_from_output(scheduler_output, model_output)
        updated = time.perf_counter()
        processed = self._process_outputs(outputs)
        done = time.perf_counter()
        record = V1StepRecord(
            queues_before=queues_before,
            scheduler_output=scheduler_output,
            inputs=inputs,
            model_output=model_output,
            outputs=outputs,
            stopped_by_string=list(processed.reqs_to_abort),
            request_outputs=processed.request_outputs,
            schedule_ms=(scheduled - start) * 1e3,
            execute_ms=(executed - scheduled) * 1e3,
            update_ms=(updated - executed) * 1e3,
            process_ms=(done - updated) * 1e3,
        )
        return processed, record

    # -- watching the steps -------------------------------------------------

    def add_step_observer(self, observer: V1StepObserver) -> None:
        if not isinstance(self.engine_core, InprocClient):
            raise ValueError(_NO_OBSERVING_MP)
        self.step_observers.append(observer)

    def remove_step_observer(self, observer: V1StepObserver) -> None:
        self.step_observers.remove(observer)

    def start_trace(self, path: str) -> V1TraceWriter:
        """Write this engine's trace to `path` (JSON Lines, engine "v1";
        format: minivllm/tracer/SCHEMA.md), replacing any trace it was
        writing. View it with `minivllm-trace show PATH`."""
        if not isinstance(self.engine_core, InprocClient):
            raise ValueError(_NO_OBSERVING_MP)
        self.stop_trace()
        self.trace_writer = V1TraceWriter(str(path), self)
        self.add_step_observer(self.trace_writer)
        return self.trace_writer

    def stop_trace(self) -> None:
        if self.trace_writer is not None:
            self.remove_step_observer(self.trace_writer)
            self.trace_writer.close()
            self.trace_writer = None

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Empty the engine core's prefix cache; True if it was emptied.
        Refused while requests run, unless `reset_running_requests`, which
        preempts them: they finish all the same, recomputed (see
        `Scheduler.reset_prefix_cache`). With log_stats, the hit rate
        starts again."""
        return self.engine_core.reset_prefix_cache(reset_running_requests)

    def shutdown(self) -> None:
        """Stop the engine core (its process, if it has one); also done when
        the engine is garbage collected or the interpreter exits."""
        self.engine_core.shutdown()

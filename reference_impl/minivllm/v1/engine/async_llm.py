"""`AsyncLLM`: V1's engine for a server (vLLM's `vllm/v1/engine/async_llm.py`).

The classic `AsyncLLMEngine` steps an `LLMEngine` from a background task.
`AsyncLLM` has no loop that steps: the engine core steps by itself in its
own process (`EngineCoreProc`, always: `AsyncMPClient`), and this process
only does the front end's work, on the event loop:

    generate():      InputProcessor (an internal id) -> OutputProcessor
                     state with a queue for the request -> add_request_async
                     to the engine core; then yield from the queue until
                     finished.
    output_handler:  one task: get_output_async (a step's token ids)
                     -> OutputProcessor (text, stop strings; each
                     RequestOutput into its request's queue); requests a
                     stop string ended are aborted in the engine core.

So tokenizing and detokenizing overlap the model's forward pass instead of
waiting for it. A generator closed or cancelled early aborts its request,
in the OutputProcessor and in the engine core. If the engine core dies,
every waiting generator, and every later call, raises `EngineDeadError`.

The engine core runs ahead: when the front end ends a request (a stop
string, an abort), outputs of the steps it already ran are on their way.
So each request has an internal id, the user's plus a random suffix
(`InputProcessor.assign_request_id`): a new request reusing a user's id
never receives them. Outputs carry the user's id; `abort` takes it.

It is the server's `EngineClient` (engine/protocol.py) on V1, as the
classic `AsyncLLMEngine` is on the classic engine: `minivllm serve
--use-v1` serves from it. Its stat loggers (`add_logger`: the server's
Prometheus one) are shown every step's `SchedulerStats` and outputs,
built into the classic engine's `Stats` (v1/metrics/loggers.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator

from minivllm.config import EngineConfig
from minivllm.engine.arg_utils import AsyncEngineArgs, EngineArgs
from minivllm.engine.llm_engine import EngineDeadError
from minivllm.engine.protocol import EngineClient, StepStatLogger
from minivllm.inputs import PromptType
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams
from minivllm.transformers_utils.tokenizer import get_tokenizer
from minivllm.v1.engine import EngineCoreRequest
from minivllm.v1.engine.core_client import AsyncMPClient, EngineCoreClient
from minivllm.v1.engine.input_processor import InputProcessor
from minivllm.v1.engine.llm_engine import check_v1_config
from minivllm.v1.engine.output_processor import (
    OutputProcessor,
    RequestOutputCollector,
    fan_out,
)
from minivllm.v1.metrics.loggers import StatLoggerManager
from minivllm.v1.metrics.stats import iteration_stats_of

logger = logging.getLogger(__name__)


class AsyncLLM(EngineClient):
    def __init__(self, engine_config: EngineConfig, log_stats: bool = False) -> None:
        check_v1_config(engine_config)
        self.engine_config = engine_config
        self.model_config = engine_config.model_config
        self.log_stats = log_stats
        self.tokenizer = get_tokenizer(
            self.model_config.tokenizer, self.model_config.trust_remote_code
        )
        self.input_processor = InputProcessor(engine_config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        # Always in a process of its own, as vLLM's AsyncLLM.
        self.engine_core: AsyncMPClient = EngineCoreClient.make_client(
            multiprocess_mode=True, asyncio_mode=True, engine_config=engine_config
        )
        self.output_handler: asyncio.Task | None = None
        self._dead_error: EngineDeadError | None = None
        # Shown every step's stats (the server's Prometheus logger); with
        # log_stats, also vLLM's periodic throughput line.
        self.stat_loggers = StatLoggerManager(
            log_stats, engine_config.cache_config.enable_prefix_caching
        )

    @classmethod
    def from_engine_args(cls, engine_args: AsyncEngineArgs | EngineArgs) -> AsyncLLM:
        return cls(engine_args.create_engine_config(), log_stats=not engine_args.disable_log_stats)

    def get_tokenizer(self):
        return self.tokenizer

    def get_model_config(self):
        return self.model_config

    # -- state --------------------------------------------------------------------

    @property
    def is_running(self) -> bool:
        """The output handler runs, or has yet to start (vLLM's rule)."""
        running = self.output_handler is None or not self.output_handler.done()
        return running and not self.errored

    @property
    def errored(self) -> bool:
        """The engine core is gone: it failed, died, or was shut down."""
        return self._dead_error is not None or self.engine_core.resources.engine_dead

    @property
    def is_stopped(self) -> bool:
        return self.errored

    @property
    def dead_error(self) -> EngineDeadError | None:
        """Why the engine core is gone (None while it serves)."""
        if not self.errored:
            return None
        return self._dead_error or self.engine_core.resources.dead_error()

    async def check_health(self) -> None:
        if self.errored:
            raise self.dead_error

    # -- statistics ---------------------------------------------------------------

    def add_logger(self, name: str, stat_logger: StepStatLogger) -> None:
        self.stat_loggers.add_logger(name, stat_logger)

    def remove_logger(self, name: str) -> None:
        self.stat_loggers.remove_logger(name)

    async def do_log_stats(self) -> None:
        """Show every stat logger the last step's state now, with no outputs."""
        self.stat_loggers.log_current()

    # -- requests -----------------------------------------------------------------

    async def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> RequestOutputCollector:
        """Check the request and send it to the engine core; returns where
        its outputs will arrive. `n > 1` becomes n child requests. Another
        live request may have the same `request_id` (as in vLLM)."""
        if self.errored:
            raise self.dead_error
        prompt_text, request = self.input_processor.process_inputs(
            request_id, prompt, params, arrival_time, priority
        )
        self.input_processor.assign_request_id(request, None)  # the core is apart
        self._run_output_handler()
        queue = RequestOutputCollector(request.sampling_params.output_kind, request.request_id)
        await self._add_fanned_out(request, prompt_text, queue)
        return queue

    async def _add_fanned_out(
        self, request: EngineCoreRequest, prompt: str | None, queue: RequestOutputCollector
    ) -> None:
        """The request's children to the OutputProcessor and the engine
        core. Undone if anything fails or the caller is cancelled part-way:
        children already sent would otherwise run for no one."""
        try:
            for child, parent, index in fan_out(request):
                self.output_processor.add_request(child, prompt, parent, index, queue)
                await self.engine_core.add_request_async(child)
        except BaseException:
            aborted = self.output_processor.abort_requests([request.request_id], internal=True)
            if not self.errored:
                await self.engine_core.abort_requests_async(aborted)
            raise

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams,
        request_id: str,
        priority: int = 0,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Run one request; yields its cumulative `RequestOutput` as steps
        produce them, the last with `finished` set. Closing the generator
        early (or cancelling the task reading it) aborts the request: this
        one, by its internal id, not another that shares its `request_id`."""
        queue: RequestOutputCollector | None = None
        try:
            queue = await self.add_request(request_id, prompt, sampling_params, priority=priority)
            finished = False
            while not finished:
                # Take what is there without yielding to the loop first.
                output = queue.get_nowait() or await queue.get()
                finished = output.finished
                yield output
        except EngineDeadError:
            raise
        except BaseException:
            # Cancelled, closed, or failed; nothing to do if add_request
            # refused it (it undoes what it did) or it was aborted already.
            if queue is not None:
                await self.abort(queue.request_id, internal=True)
            raise

    async def abort(self, request_id: str | list[str], internal: bool = False) -> None:
        """Abort every live request with a user's id given (`internal`: the
        engine's own ids; a parent's means its children) in the
        OutputProcessor and the engine core. A generator still reading
        gets a last output, finished with finish_reason "abort" and the
        tokens so far, as in current vLLM (the classic AsyncLLMEngine's
        raises asyncio.CancelledError, as v0.6's). Unknown or finished ids
        are ignored."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        aborted = self.output_processor.abort_requests(ids, internal)
        await self.engine_core.abort_requests_async(aborted)
        if not self.output_processor.has_unfinished_requests():
            self.stat_loggers.record_idle()  # the engine core may not step again to say so

    # -- the prefix cache ---------------------------------------------------------

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Empty the engine core's prefix cache; True if it was emptied.
        Refused while requests run, unless `reset_running_requests`, which
        preempts them: their streams go on, recomputed (see
        `Scheduler.reset_prefix_cache`). The stat loggers' hit rate starts
        again from the next step."""
        return await self.engine_core.reset_prefix_cache_async(reset_running_requests)

    # -- the output handler -------------------------------------------------------

    def _run_output_handler(self) -> None:
        """Start the task that moves outputs from the engine core to the
        requests' queues (once; it runs until the engine core dies). It
        holds what it needs, not `self`, so the AsyncLLM can be collected.
        An AsyncLLM serves one event loop: a request on another is refused,
        since no output would ever reach it."""
        if self.output_handler is not None:
            if self.output_handler.get_loop() is not asyncio.get_running_loop():
                raise RuntimeError(
                    "this AsyncLLM serves the event loop it was first used on; its output "
                    "handler is a task there, so a request on another event loop would never "
                    "get an output: make one AsyncLLM per event loop"
                )
            return
        self.output_handler = asyncio.get_running_loop().create_task(
            output_handler(self.engine_core, self.output_processor, self.stat_loggers),
            name="AsyncLLM.output_handler",
        )

    def shutdown(self) -> None:
        """Stop the engine core; requests still waiting raise EngineDeadError."""
        self.engine_core.shutdown()
        error = self.engine_core.resources.dead_error()
        self._dead_error = self._dead_error or error
        self.output_processor.propagate_error(error)
        if self.output_handler is not None and not self.output_handler.done():
            self.output_handler.cancel()


async def output_handler(
    engine_core: AsyncMPClient,
    output_processor: OutputProcessor,
    stat_loggers: StatLoggerManager,
) -> None:
    try:
        while True:
            outputs = await engine_core.get_output_async()
            iteration_stats = iteration_stats_of(outputs.outputs, output_processor.request_states)
            # Each RequestOutput goes into its request's queue; outputs of
            # requests ended meanwhile (by internal id) are dropped.
            processed = output_processor.process_outputs(outputs.outputs, iteration_stats)
            await engine_core.abort_requests_async(processed.reqs_to_abort)
            stat_loggers.record(outputs.scheduler_stats, iteration_stats, processed.request_outputs)
            if processed.reqs_to_abort and not output_processor.has_unfinished_requests():
                stat_loggers.record_idle()  # stopped by a string: the core counts it running
    except Exception as error:
        if not isinstance(error, EngineDeadError):
            # A bug here, not in the engine core; but with no handler no
            # request could finish: the engine is dead all the same.
            logger.exception("AsyncLLM output_handler failed.")
            engine_core.resources.mark_dead(
                f"AsyncLLM's output handler failed: {type(error).__name__}: {error}"
            )
            error = engine_core.resources.dead_error()
        output_processor.propagate_error(error)

"""`AsyncLLM`: V1's engine for a server (vLLM's `vllm/v1/engine/async_llm.py`).

The classic `AsyncLLMEngine` steps an `LLMEngine` from a background task.
`AsyncLLM` has no loop that steps: the engine core steps by itself in its
own process (`EngineCoreProc`, always: `AsyncMPClient`), and this process
only does the front end's work, on the event loop:

    generate():      InputProcessor -> OutputProcessor state + a queue for
                     the request -> add_request_async to the engine core;
                     then yield from the request's queue until finished.
    output_handler:  one task: get_output_async (a step's token ids)
                     -> OutputProcessor (text, stop strings) -> each
                     RequestOutput into its request's queue; requests a
                     stop string ended are aborted in the engine core.

So tokenizing and detokenizing overlap the model's forward pass instead of
waiting for it. A generator closed or cancelled early aborts its request,
in the OutputProcessor and in the engine core. If the engine core dies,
every waiting generator, and every later call, raises `EngineDeadError`.

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
from minivllm.v1.engine.core_client import AsyncMPClient, EngineCoreClient
from minivllm.v1.engine.input_processor import InputProcessor
from minivllm.v1.engine.llm_engine import check_v1_config
from minivllm.v1.engine.output_processor import OutputProcessor, fan_out
from minivllm.v1.metrics.loggers import StatLoggerManager
from minivllm.v1.metrics.stats import IterationStats

logger = logging.getLogger(__name__)


class RequestOutputCollector:
    """One request's outputs, from the output handler to its generator
    (vLLM's name). Outputs are cumulative, so if the generator falls behind
    only the newest is kept: a slow reader skips outputs, never text. An
    exception takes the place of any output and is raised to the reader."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.output: RequestOutput | BaseException | None = None
        self.ready = asyncio.Event()

    def put(self, output: RequestOutput | BaseException) -> None:
        if self.output is None or isinstance(output, BaseException):
            self.output = output
        elif not isinstance(self.output, BaseException):
            self.output = output  # newer and cumulative: replaces the unread one
        self.ready.set()

    async def get(self) -> RequestOutput:
        while self.output is None:
            await self.ready.wait()
        return self._take()

    def get_nowait(self) -> RequestOutput | None:
        return None if self.output is None else self._take()

    def _take(self) -> RequestOutput:
        output, self.output = self.output, None
        self.ready.clear()
        if isinstance(output, BaseException):
            raise output
        return output


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
        # Per request (the parent's id for n > 1): where its outputs go.
        self.request_queues: dict[str, RequestOutputCollector] = {}
        self.output_handler: asyncio.Task | None = None
        self._dead_error: EngineDeadError | None = None
        # Shown every step's stats (the server's Prometheus logger); with
        # log_stats, also vLLM's periodic throughput line.
        self.stat_loggers = StatLoggerManager(log_stats)

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
        its outputs will arrive. `n > 1` becomes n child requests."""
        if self.errored:
            raise self.dead_error
        prompt_text, request = self.input_processor.process_inputs(
            request_id, prompt, params, arrival_time, priority, set(self.request_queues)
        )
        queue = self.request_queues[request_id] = RequestOutputCollector(request_id)
        self._run_output_handler()
        for child, parent, index in fan_out(request):
            self.output_processor.add_request(child, prompt_text, parent, index)
            await self.engine_core.add_request_async(child)
        return queue

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams,
        request_id: str,
        priority: int = 0,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Run one request; yields its cumulative `RequestOutput` as steps
        produce them, the last with `finished` set. Closing the generator
        early (or cancelling the task reading it) aborts the request."""
        queue: RequestOutputCollector | None = None
        try:
            queue = await self.add_request(request_id, prompt, sampling_params, priority=priority)
            finished = False
            while not finished:
                # Take what is there without yielding to the loop first.
                output = queue.get_nowait() or await queue.get()
                finished = output.finished
                yield output
        except (asyncio.CancelledError, GeneratorExit):
            if queue is not None:
                await self.abort(request_id)
            raise
        except EngineDeadError:
            raise
        except ValueError:  # refused by the InputProcessor: nothing was queued
            raise
        except Exception:
            await self.abort(request_id)
            raise

    async def abort(self, request_id: str | list[str]) -> None:
        """Abort requests (and, for a parent id, its children) in the
        OutputProcessor and the engine core. No final output is made: a
        generator still reading raises asyncio.CancelledError, as with the
        classic AsyncLLMEngine. Unknown or finished ids are ignored."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            queue = self.request_queues.pop(rid, None)
            if queue is not None:
                queue.put(asyncio.CancelledError())
        await self.engine_core.abort_requests_async(self.output_processor.abort_requests(ids))
        if not self.output_processor.has_unfinished_requests():
            self.stat_loggers.record_idle()  # the engine core may not step again to say so

    # -- the output handler -------------------------------------------------------

    def _run_output_handler(self) -> None:
        """Start the task that moves outputs from the engine core to the
        requests' queues (once; it runs until the engine core dies). It
        holds what it needs, not `self`, so the AsyncLLM can be collected."""
        if self.output_handler is not None:
            return
        self.output_handler = asyncio.get_running_loop().create_task(
            output_handler(
                self.engine_core, self.output_processor, self.request_queues, self.stat_loggers
            ),
            name="AsyncLLM.output_handler",
        )

    def shutdown(self) -> None:
        """Stop the engine core; requests still waiting raise EngineDeadError."""
        self.engine_core.shutdown()
        error = self.engine_core.resources.dead_error()
        self._dead_error = self._dead_error or error
        propagate_error(self.request_queues, error)
        if self.output_handler is not None and not self.output_handler.done():
            self.output_handler.cancel()


async def output_handler(
    engine_core: AsyncMPClient,
    output_processor: OutputProcessor,
    request_queues: dict[str, RequestOutputCollector],
    stat_loggers: StatLoggerManager,
) -> None:
    try:
        while True:
            outputs = await engine_core.get_output_async()
            iteration_stats = make_iteration_stats(outputs.outputs, output_processor)
            processed = output_processor.process_outputs(outputs.outputs)
            for request_output in processed.request_outputs:
                rid = request_output.request_id
                queue = (
                    request_queues.pop(rid, None)
                    if request_output.finished
                    else request_queues.get(rid)
                )
                if queue is not None:
                    queue.put(request_output)
            await engine_core.abort_requests_async(processed.reqs_to_abort)
            stat_loggers.record(
                outputs.scheduler_stats, iteration_stats, processed.request_outputs
            )
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
        propagate_error(request_queues, error)


def make_iteration_stats(outputs, output_processor: OutputProcessor) -> IterationStats:
    """The front end's token counts of one step, read before the
    OutputProcessor takes the outputs (vLLM counts them inside it): a
    request with no first token yet is prefilling."""
    stats = IterationStats()
    for output in outputs:
        state = output_processor.request_states.get(output.request_id)
        if state is not None:  # not aborted meanwhile
            stats.update_from_output(
                len(output.new_token_ids),
                state.metrics.first_token_time is None,
                len(state.prompt_token_ids),
            )
    return stats


def propagate_error(request_queues: dict[str, RequestOutputCollector], error: Exception) -> None:
    """Every waiting generator raises `error`."""
    for queue in request_queues.values():
        queue.put(error)
    request_queues.clear()

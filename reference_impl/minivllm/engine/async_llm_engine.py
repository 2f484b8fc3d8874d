"""`AsyncLLMEngine`: the engine behind the API server.

A server handles many clients at once on one asyncio event loop. Each
client's handler calls `generate()`, an async generator that yields the
request's `RequestOutput` after every step it took part in (cumulative text
and tokens, like the final output of `LLM.generate`). One background task,
`run_engine_loop`, drives the single `LLMEngine`: while requests are in
flight it steps it, and when none are it sleeps until one arrives.

Handlers and the loop meet in a `RequestTracker`. A handler never calls the
`LLMEngine`: `generate` queues its request there, and an abort (the client
went away) queues the request id. At the start of every step the loop takes
both queues, calls `LLMEngine.add_request` / `abort_request`, steps, and puts
each output into its request's `AsyncStream`, which the handler is reading.
So the engine is touched by one party at a time, between steps, and an
abort frees the request's blocks before the very next schedule.

If a step raises, the engine's state can no longer be trusted (see
llm_engine.py): the loop ends, every request in flight or queued gets that
exception from its generator instead of waiting forever, and every later
`generate` raises `AsyncEngineDeadError`. `errored` says so (the server's
/health answers 503).

Where ours differs from vLLM v0's, and why:
- The whole `LLMEngine.step()` runs in a worker thread
  (`asyncio.to_thread`). vLLM schedules and processes outputs on the event
  loop and hands only the model's forward pass to a thread (its executor's
  `execute_model_async`). Our `step()` is one call, not split into awaitable
  phases, and running it off the loop keeps the loop free to accept
  requests and write streams while the model runs.
- One engine: no pipeline-parallel virtual engines, no Ray.
- The tracker's queues are plain lists: only the event loop's thread
  touches them.
- Stat loggers (`add_logger`; the server's Prometheus one) are called here
  after each step with its `Stats` and outputs: `LLMEngine` keeps its own
  `StatLogger` for the periodic log line.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Callable

from minivllm.engine.arg_utils import AsyncEngineArgs
from minivllm.engine.llm_engine import LLMEngine, PromptType
from minivllm.engine.protocol import EngineClient, StepStatLogger
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class AsyncEngineDeadError(RuntimeError):
    """The background loop has stopped (a step failed, or it was shut down):
    no request can run any more (vLLM has the same error)."""


_STOP = object()  # what a stream's queue holds after its last output


class AsyncStream:
    """One request's outputs, from the loop to the handler reading them.

    `cancel` is called if the reader goes away before the end (the handler
    closed the generator, or its task was cancelled), so the request is
    aborted rather than left to run for no one.
    """

    def __init__(self, request_id: str, cancel: Callable[[str], None]) -> None:
        self.request_id = request_id
        self._cancel = cancel
        self._queue: asyncio.Queue = asyncio.Queue()
        self._finished = False

    def put(self, item: RequestOutput) -> None:
        if not self._finished:
            self._queue.put_nowait(item)

    def finish(self, exception: BaseException | None = None) -> None:
        """No more outputs; the reader gets `exception` after those queued."""
        if not self._finished:
            self._finished = True
            self._queue.put_nowait(_STOP if exception is None else exception)

    @property
    def finished(self) -> bool:
        return self._finished

    async def generator(self) -> AsyncGenerator[RequestOutput, None]:
        try:
            while True:
                item = await self._queue.get()
                if item is _STOP:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        except (GeneratorExit, asyncio.CancelledError):
            if not self._finished:
                self._cancel(self.request_id)
            raise


class RequestTracker:
    """The hand-off between the handlers and the engine loop: new requests
    and aborts wait here for the next step, and each step's outputs are
    routed to their request's stream."""

    def __init__(self) -> None:
        self._request_streams: dict[str, AsyncStream] = {}  # in the engine
        self._new_requests: list[tuple[AsyncStream, dict]] = []  # not yet
        self._aborted_requests: set[str] = set()
        self.new_requests_event = asyncio.Event()

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._request_streams or any(
            stream.request_id == request_id for stream, _ in self._new_requests
        )

    def __len__(self) -> int:
        return len(self._request_streams) + len(self._new_requests)

    def add_request(self, request_id: str, **engine_add_request_kwargs) -> AsyncStream:
        """Queue a request for the next step; returns the stream of its outputs."""
        if request_id in self:
            raise ValueError(
                f"Request id {request_id!r} is already in use by an unfinished request"
            )
        stream = AsyncStream(request_id, self.abort_request)
        self._new_requests.append((stream, {"request_id": request_id, **engine_add_request_kwargs}))
        self.new_requests_event.set()
        return stream

    def abort_request(self, request_id: str, exception: BaseException | None = None) -> None:
        """Abort a request at the next step. Its stream ends now: with
        `exception` if given, else with asyncio.CancelledError (as vLLM's)."""
        self._aborted_requests.add(request_id)
        stream = self._request_streams.pop(request_id, None)
        if stream is not None:
            stream.finish(exception or asyncio.CancelledError())

    def process_request_output(self, request_output: RequestOutput) -> None:
        """Hand a step's output to its stream (none if it was aborted meanwhile)."""
        request_id = request_output.request_id
        if request_output.finished:
            stream = self._request_streams.pop(request_id, None)
        else:
            stream = self._request_streams.get(request_id)
        if stream is not None:
            stream.put(request_output)
            if request_output.finished:
                stream.finish()

    def process_exception(self, request_id: str, exception: BaseException) -> None:
        """The engine refused a request: its reader gets the error."""
        stream = self._request_streams.pop(request_id, None)
        if stream is not None:
            stream.finish(exception)

    def propagate_exception(self, exception: BaseException) -> None:
        """Fail every request, in the engine or still queued, with `exception`."""
        streams = list(self._request_streams.values()) + [s for s, _ in self._new_requests]
        self._request_streams.clear()
        self._new_requests.clear()
        for stream in streams:
            stream.finish(exception)

    def get_new_and_aborted_requests(self) -> tuple[list[dict], set[str]]:
        """Take the queues: the add_request kwargs of each new request, and
        the ids to abort. A request aborted before it reached the engine is
        dropped here and never added."""
        aborted, self._aborted_requests = self._aborted_requests, set()
        new_requests = []
        for stream, request in self._new_requests:
            if stream.request_id in aborted:
                aborted.discard(stream.request_id)
                stream.finish(asyncio.CancelledError())
            else:
                self._request_streams[stream.request_id] = stream
                new_requests.append(request)
        self._new_requests = []
        return new_requests, aborted

    def has_new_requests(self) -> bool:
        return bool(self._new_requests)

    async def wait_for_new_requests(self) -> None:
        if not self.has_new_requests():
            await self.new_requests_event.wait()
        self.new_requests_event.clear()


class AsyncLLMEngine(EngineClient):
    """An `LLMEngine` driven by a background asyncio task (see the module's
    docstring). The loop starts with the first request, on the event loop
    that makes it, and stops for good when that event loop ends. It is the
    server's `EngineClient` (engine/protocol.py) on the classic engine.

    `log_requests`: log a line when a request is added and when it ends.
    """

    def __init__(self, engine: LLMEngine, log_requests: bool = False) -> None:
        self.engine = engine
        self.log_requests = log_requests
        self.stat_loggers: dict[str, StepStatLogger] = {}
        self.background_loop: asyncio.Task | None = None
        self._request_tracker: RequestTracker | None = None
        # Why the loop stopped: a step's exception, or AsyncEngineDeadError
        # after shutdown_background_loop (None: it may run).
        self._errored_with: BaseException | None = None

    @classmethod
    def from_engine_args(
        cls, engine_args: AsyncEngineArgs, trace: str | None = None
    ) -> AsyncLLMEngine:
        log_requests = not getattr(engine_args, "disable_log_requests", True)
        return cls(LLMEngine.from_engine_args(engine_args, trace=trace), log_requests)

    # -- state --------------------------------------------------------------

    @property
    def is_running(self) -> bool:
        return self.background_loop is not None and not self.background_loop.done()

    @property
    def errored(self) -> bool:
        """A step failed: the engine refuses all work (vLLM's name)."""
        return self._errored_with is not None and not isinstance(
            self._errored_with, AsyncEngineDeadError
        )

    @property
    def is_stopped(self) -> bool:
        """The loop has ended, by a failed step or by a shutdown."""
        return self._errored_with is not None

    @property
    def dead_error(self) -> BaseException | None:
        """The exception that killed the loop, if any."""
        return self._errored_with if self.errored else None

    def _check_alive(self) -> None:
        cause = self._errored_with
        if cause is None:
            return
        if isinstance(cause, AsyncEngineDeadError):
            raise AsyncEngineDeadError(str(cause))
        raise AsyncEngineDeadError(
            f"the engine loop died: {type(cause).__name__}: {cause}. A step failed part-way, "
            "so the engine's queues and KV cache can no longer be trusted; restart the server."
        ) from cause

    def get_tokenizer(self):
        return self.engine.get_tokenizer()

    def get_model_config(self):
        return self.engine.model_config

    def add_logger(self, name: str, stat_logger: StepStatLogger) -> None:
        if name in self.stat_loggers:
            raise KeyError(f"a stat logger named {name!r} is already added")
        self.stat_loggers[name] = stat_logger

    def remove_logger(self, name: str) -> None:
        del self.stat_loggers[name]

    async def do_log_stats(self) -> None:
        """Show every stat logger the last step's `Stats` (before the first
        step, the current state's), with no outputs."""
        stats = self.engine.get_stats()
        for stat_logger in self.stat_loggers.values():
            stat_logger.log(stats, [])

    # -- the background loop -------------------------------------------------

    def start_background_loop(self) -> None:
        self._check_alive()
        if self.is_running:
            raise RuntimeError("the background loop is already running")
        self._request_tracker = RequestTracker()
        self.background_loop = asyncio.get_running_loop().create_task(self.run_engine_loop())
        self.background_loop.add_done_callback(self._on_loop_done)

    def shutdown_background_loop(self) -> None:
        """Stop the loop for good (a server's shutdown); requests still in
        flight get AsyncEngineDeadError. A step already running in its
        thread finishes there, unseen."""
        if self._errored_with is None:
            self._errored_with = AsyncEngineDeadError("the engine was shut down")
        if self.background_loop is not None:
            self.background_loop.cancel()

    def shutdown(self) -> None:
        """`EngineClient.shutdown`: the loop's, for good."""
        self.shutdown_background_loop()

    def _on_loop_done(self, task: asyncio.Task) -> None:
        """The loop only ends by an exception or a cancel: fail every request
        that is still waiting, so no client hangs."""
        if task.cancelled():
            error = self._errored_with or AsyncEngineDeadError("the engine loop was cancelled")
            self._errored_with = error
        else:
            error = task.exception()
            logger.error("Engine background loop failed", exc_info=error)
            self._errored_with = error
        if self._request_tracker is not None:
            self._request_tracker.propagate_exception(error)

    async def run_engine_loop(self) -> None:
        """Step while requests are in flight; sleep until a new one comes."""
        has_requests_in_progress = False
        while True:
            if not has_requests_in_progress:
                await self._request_tracker.wait_for_new_requests()
            has_requests_in_progress = await self.engine_step()
            await asyncio.sleep(0)  # let handlers run between steps

    async def engine_step(self) -> bool:
        """Hand the queued requests and aborts to the engine and run one step
        (in a thread). Returns whether requests remain in flight."""
        tracker = self._request_tracker
        new_requests, aborted = tracker.get_new_and_aborted_requests()
        for request in new_requests:
            try:
                self.engine.add_request(**request)
            except Exception as e:  # refused: nothing was queued, the rest go on
                tracker.process_exception(request["request_id"], e)
            else:
                if self.log_requests:
                    logger.info("Added request %s.", request["request_id"])
        if aborted:
            self.engine.abort_request(sorted(aborted))
            if self.log_requests:
                logger.info("Aborted request(s) %s.", ", ".join(sorted(aborted)))
        if not self.engine.has_unfinished_requests():
            return False
        request_outputs = await asyncio.to_thread(self.engine.step)
        for request_output in request_outputs:
            tracker.process_request_output(request_output)
            if self.log_requests and request_output.finished:
                logger.info("Finished request %s.", request_output.request_id)
        stats = self.engine.get_stats()
        for stat_logger in self.stat_loggers.values():
            stat_logger.log(stats, request_outputs)
        return self.engine.has_unfinished_requests()

    # -- requests -------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> AsyncStream:
        """Queue a request for the loop (starting it if need be); the engine
        checks it at the next step, and a refusal (ValueError / TypeError)
        comes out of the stream."""
        self._check_alive()
        if not self.is_running:
            self.start_background_loop()
        return self._request_tracker.add_request(
            request_id,
            prompt=prompt,
            params=params,
            # Now, not when the loop gets to it: the wait counts in the latency.
            arrival_time=time.time() if arrival_time is None else arrival_time,
            priority=priority,
        )

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams,
        request_id: str,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Run one request; yields its `RequestOutput` after every step it
        took part in, the last with `finished` set. Closing the generator
        early (or cancelling the task reading it) aborts the request."""
        stream = self.add_request(request_id, prompt, sampling_params, arrival_time, priority)
        async with contextlib.aclosing(stream.generator()) as outputs:
            async for output in outputs:
                yield output

    async def abort(self, request_id: str) -> None:
        """Abort a request: its blocks are freed at the next step, and its
        generator raises asyncio.CancelledError. Unknown or finished ids are
        ignored."""
        self._check_alive()
        if self._request_tracker is not None:
            self._request_tracker.abort_request(request_id)

    async def check_health(self) -> None:
        """Raises AsyncEngineDeadError if the engine can no longer serve."""
        self._check_alive()

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
both queues, calls `LLMEngine.abort_request`, then `add_request`, steps, and
puts each output into its request's `AsyncStream`, which the handler is
reading. So the engine is touched by one party at a time, between steps,
and an abort frees the request's blocks before the very next schedule.

An id is free again as soon as its request is aborted, so a client may
abort "a" and send a new "a" before the next step. Aborts go to the engine
before new requests, and the engine keeps an aborted id until the step that
returns its final output: the new "a" enters one step later, and the abort
can only ever reach the old one. An abort of a request still queued just
takes it out of the queue.

If a step raises, the engine's state can no longer be trusted (see
llm_engine.py): the loop ends, every request in flight or queued gets that
exception from its generator instead of waiting forever, and every later
`generate` raises `AsyncEngineDeadError`. `errored` says so (the server's
/health answers 503). A step that hangs (a stuck collective, a deadlock)
ends the same way after MINIVLLM_ENGINE_ITERATION_TIMEOUT_S (default 60 s),
with a TimeoutError: its clients fail instead of waiting for ever behind a
/health that still answers 200.

The loop runs on the event loop of the first request. When that event loop
ends (an `asyncio.run` returns), the loop is cancelled: a graceful stop, as
in vLLM. The next request, on another event loop, starts a new loop, which
first aborts whatever the old one left in the engine.

Where ours differs from vLLM v0's, and why:
- The whole `LLMEngine.step()` runs in a worker thread
  (`_step_in_thread`). vLLM schedules and processes outputs on the event
  loop and hands only the model's forward pass to a thread (its executor's
  `execute_model_async`). Our `step()` is one call, not split into awaitable
  phases, and running it off the loop keeps the loop free to accept
  requests and write streams while the model runs.
- One engine: no pipeline-parallel virtual engines, no Ray.
- The tracker's queues are a dict and a set: only the event loop's thread
  touches them.
- Aborts before new requests, and a reused id held back a step (above):
  vLLM v0.6 adds new requests first and drops a new one whose id matches
  a queued abort, so "abort a, new a" cancels the new request and leaves
  the old one running (lessons/vllm_differences.md, row 72).
- Stat loggers (`add_logger`; the server's Prometheus one) are called here
  after each step with its `Stats` and outputs: `LLMEngine` keeps its own
  `StatLogger` for the periodic log line.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncGenerator, Callable

from minivllm import envs
from minivllm.engine.arg_utils import AsyncEngineArgs
from minivllm.engine.llm_engine import LLMEngine, PromptType
from minivllm.engine.protocol import EngineClient, StepStatLogger
from minivllm.inputs.preprocess import check_request_id
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class AsyncEngineDeadError(RuntimeError):
    """The background loop has stopped (a step failed, or it was shut down):
    no request can run any more (vLLM has the same error)."""


_STOP = object()  # what a stream's queue holds after its last output


def engine_iteration_timeout_s() -> float:
    """The longest one engine step may run, in seconds:
    MINIVLLM_ENGINE_ITERATION_TIMEOUT_S, or 60 (vLLM's default)."""
    return envs.positive_number(
        "MINIVLLM_ENGINE_ITERATION_TIMEOUT_S", "60", "seconds (the longest one engine step may run)"
    )


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
        # Not yet in the engine, by id, in arrival order.
        self._new_requests: dict[str, tuple[AsyncStream, dict]] = {}
        self._aborted_requests: set[str] = set()  # for the engine to abort
        self.new_requests_event = asyncio.Event()

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._request_streams or request_id in self._new_requests

    def __len__(self) -> int:
        return len(self._request_streams) + len(self._new_requests)

    def add_request(self, request_id: str, **engine_add_request_kwargs) -> AsyncStream:
        """Queue a request for the next step; returns the stream of its
        outputs. An id in use, in the engine or queued, is refused with
        vLLM's KeyError (vLLM checks only those in the engine)."""
        if request_id in self:
            raise KeyError(f"Request {request_id} already exists.")
        stream = AsyncStream(request_id, self.abort_request)
        request = {"request_id": request_id, **engine_add_request_kwargs}
        self._new_requests[request_id] = (stream, request)
        self.new_requests_event.set()
        return stream

    def abort_request(self, request_id: str, exception: BaseException | None = None) -> None:
        """Abort a request at the next step. Its stream ends now: with
        `exception` if given, else with asyncio.CancelledError (as vLLM's).

        A request still queued only leaves the queue: the engine never saw
        it, and the engine may hold an older request of that id, aborted
        just before, which this abort is not about."""
        queued = self._new_requests.pop(request_id, None)
        if queued is not None:
            queued[0].finish(exception or asyncio.CancelledError())
            return
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
        streams = list(self._request_streams.values())
        streams += [stream for stream, _ in self._new_requests.values()]
        self._request_streams.clear()
        self._new_requests.clear()
        for stream in streams:
            stream.finish(exception)

    def get_new_and_aborted_requests(self) -> tuple[list[dict], set[str]]:
        """Take the queues: the add_request kwargs of each new request, and
        the ids to abort, which the loop hands the engine first. A new
        request whose id is aborted now (an id reused at once) stays queued
        for the next step: the engine keeps an aborted id until the step
        that returns its final output."""
        aborted, self._aborted_requests = self._aborted_requests, set()
        new_requests = []
        for request_id, (stream, request) in list(self._new_requests.items()):
            if request_id not in aborted:
                del self._new_requests[request_id]
                self._request_streams[request_id] = stream
                new_requests.append(request)
        return new_requests, aborted

    def engine_request_ids(self) -> set[str]:
        """The ids the engine may still hold for this tracker: the requests
        handed to it, and the aborts it has not applied yet."""
        return set(self._request_streams) | self._aborted_requests

    def has_new_requests(self) -> bool:
        return bool(self._new_requests)

    async def wait_for_new_requests(self) -> None:
        if not self.has_new_requests():
            await self.new_requests_event.wait()
        self.new_requests_event.clear()


class AsyncLLMEngine(EngineClient):
    """An `LLMEngine` driven by a background asyncio task (see the module's
    docstring). The loop starts with the first request, on the event loop
    that makes it, and stops when that event loop ends; the next request
    starts another. A failed or hung step, or `shutdown`, stops it for good.
    It is the server's `EngineClient` (engine/protocol.py) on the classic
    engine.

    `log_requests`: log a line when a request is added and when it ends.
    The step timeout is read from the environment here (see
    `engine_iteration_timeout_s`).
    """

    def __init__(self, engine: LLMEngine, log_requests: bool = False) -> None:
        self.engine = engine
        self.log_requests = log_requests
        self.stat_loggers: dict[str, StepStatLogger] = {}
        self.background_loop: asyncio.Task | None = None
        self._request_tracker: RequestTracker | None = None
        # Why the loop stopped for good: a step's exception, or
        # AsyncEngineDeadError after shutdown_background_loop (None: it may run).
        self._errored_with: BaseException | None = None
        self._iteration_timeout_s = engine_iteration_timeout_s()
        # Clear while a step runs in its worker thread (see _step_in_thread).
        self._engine_idle = threading.Event()
        self._engine_idle.set()
        # What a cancelled loop left in the engine: the next loop aborts it.
        self._orphaned_request_ids: set[str] = set()

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
        """A step failed or hung: the engine refuses all work (vLLM's name)."""
        return self._errored_with is not None and not isinstance(
            self._errored_with, AsyncEngineDeadError
        )

    @property
    def is_stopped(self) -> bool:
        """The loop has ended for good, by a failed or hung step or by a
        shutdown (not when its event loop ended: the next request starts
        another)."""
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

    def _check_event_loop(self) -> None:
        """Refuse a request on another event loop while the loop is still a
        pending task of the first: that event loop will never run it again
        (it was closed, or left, without cancelling its tasks, which
        `asyncio.run` does), so the request would wait forever."""
        task = self.background_loop
        elsewhere = task is not None and task.get_loop() is not asyncio.get_running_loop()
        if elsewhere and not task.done():
            raise RuntimeError(
                "the engine's loop is still a task of another event loop, which was closed or "
                "left without cancelling its tasks: use one event loop, or end each with "
                "asyncio.run (which cancels them) before the next"
            )

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
        """Show the engine's log line and every stat logger the state now,
        with no outputs and no step (vLLM v0.6's forced log): the gauges
        are refreshed, nothing is counted twice. A step may be running in
        its thread meanwhile: its own stats follow when it ends."""
        stats = self.engine.do_log_stats()
        for stat_logger in self.stat_loggers.values():
            stat_logger.log(stats, [])

    # -- the background loop -------------------------------------------------

    def start_background_loop(self) -> None:
        self._check_alive()
        if self.is_running:
            raise RuntimeError("the background loop is already running")
        self._request_tracker = RequestTracker()
        # Before any new request is queued, so these aborts reach only the old ones.
        for request_id in sorted(self._orphaned_request_ids):
            self._request_tracker.abort_request(request_id)
        self._orphaned_request_ids = set()
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
        """The loop only ends by an exception, a shutdown, or a cancel with
        its event loop. Every request still waiting fails, so no client
        hangs. A plain cancel is a graceful stop (as vLLM's): what the loop
        left in the engine is aborted by the next loop, which the next
        request starts."""
        tracker = self._request_tracker
        if task.cancelled() and self._errored_with is None:
            logger.info("Engine loop cancelled; the next request starts a new one.")
            self._orphaned_request_ids |= tracker.engine_request_ids()
            error = AsyncEngineDeadError(
                "the engine loop was cancelled (its event loop ended, or its task was "
                "cancelled); a new request starts a new loop"
            )
        elif task.cancelled():
            error = self._errored_with
        else:
            error = task.exception()
            logger.error("Engine background loop failed", exc_info=error)
            self._errored_with = error
        tracker.propagate_exception(error)

    async def run_engine_loop(self) -> None:
        """Step while requests are in flight; sleep until a new one comes."""
        if not self._engine_idle.is_set():  # a cancelled loop's step still runs
            await asyncio.to_thread(self._engine_idle.wait)
        has_requests_in_progress = False
        while True:
            if not has_requests_in_progress:
                await self._request_tracker.wait_for_new_requests()
            has_requests_in_progress = await self._step_with_timeout()
            await asyncio.sleep(0)  # let handlers run between steps

    async def _step_with_timeout(self) -> bool:
        """`engine_step`, failed with TimeoutError past the iteration timeout
        (vLLM's ENGINE_ITERATION_TIMEOUT_S), which ends the loop: a hung step
        then fails its requests and turns /health to 503. Its thread cannot
        be stopped; it is left to end by itself."""
        step = asyncio.ensure_future(self.engine_step())
        try:
            done, _ = await asyncio.wait({step}, timeout=self._iteration_timeout_s)
        finally:
            step.cancel()  # a no-op once done; else the timeout, or our own cancel
        if not done:
            logger.error("Engine iteration timed out. The step is probably hung.")
            raise TimeoutError(
                f"an engine step ran longer than {self._iteration_timeout_s:g} s "
                "(MINIVLLM_ENGINE_ITERATION_TIMEOUT_S): it is probably hung, so the engine "
                "was stopped"
            )
        return step.result()

    async def engine_step(self) -> bool:
        """Hand the queued aborts, then the new requests, to the engine and
        run one step (in a thread). Returns whether requests remain in
        flight. Aborts first: a new request may reuse the id of one aborted
        since the last step, and that abort is meant for the old one."""
        tracker = self._request_tracker
        new_requests, aborted = tracker.get_new_and_aborted_requests()
        if aborted:
            self.engine.abort_request(sorted(aborted))
            if self.log_requests:
                logger.info("Aborted request(s) %s.", ", ".join(sorted(aborted)))
        for request in new_requests:
            try:
                self.engine.add_request(**request)
            except Exception as e:  # refused: nothing was queued, the rest go on
                tracker.process_exception(request["request_id"], e)
            else:
                if self.log_requests:
                    logger.info("Added request %s.", request["request_id"])
        if not self.engine.has_unfinished_requests():
            return False
        request_outputs = await self._step_in_thread()
        for request_output in request_outputs:
            tracker.process_request_output(request_output)
            if self.log_requests and request_output.finished:
                logger.info("Finished request %s.", request_output.request_id)
        stats = self.engine.get_stats()
        for stat_logger in self.stat_loggers.values():
            stat_logger.log(stats, request_outputs)
        return self.engine.has_unfinished_requests()

    async def _step_in_thread(self) -> list[RequestOutput]:
        """`LLMEngine.step()` in a worker thread, shielded from cancellation:
        a cancelled loop never drops a step queued to start nor stops one
        half-way (no thread can be), so `_engine_idle` is always set again
        when it ends, and a later loop waits for that."""
        self._engine_idle.clear()
        try:
            step = asyncio.get_running_loop().run_in_executor(None, self._step_then_idle)
        except BaseException:
            self._engine_idle.set()
            raise
        return await asyncio.shield(step)

    def _step_then_idle(self) -> list[RequestOutput]:
        try:
            return self.engine.step()
        finally:
            self._engine_idle.set()

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
        comes out of the stream. An id in use raises KeyError now, one that
        is not a string WrongTypeError (the tracker keys streams by it)."""
        check_request_id(request_id)
        self._check_alive()
        self._check_event_loop()
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

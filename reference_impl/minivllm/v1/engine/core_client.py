"""How the front end talks to the `EngineCore` (vLLM's `vllm/v1/engine/core_client.py`).

`InprocClient`: the engine core in this process; `get_output()` runs one
step. Simple to step through in a notebook or a debugger.

`SyncMPClient` (for `LLMEngine`) and `AsyncMPClient` (for `AsyncLLM`): the
engine core in a process of its own (`EngineCoreProc`, started with
"spawn": a fresh interpreter, no inherited threads or CUDA state), busy
stepping while the front end tokenizes, detokenizes and serves HTTP. They
send requests on one ZMQ socket and read each step's outputs from another:

    client  input_socket  (ROUTER, bound)  -> engine core (DEALER): ADD, ABORT, ...
    client  output_socket (PULL, bound)    <- engine core (PUSH):   EngineCoreOutputs

Both are ipc:// files in a private temp dir: loopback only. The engine
core's first message on the input socket is the handshake: READY, or the
exception that stopped it starting, which the client raises.

If the engine core dies (killed, or a step failed), every pending and
later call raises `EngineDeadError`, naming why and the exit code. What
must be cleaned up (the process, the sockets, their files) is held by a
`BackgroundResources` that a `weakref.finalize` calls: at `shutdown()`,
when the client is garbage collected, or at interpreter exit, whichever
comes first. The engine core also exits if the front end's process dies.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import pickle
import queue
import shutil
import signal
import tempfile
import threading
import time
import uuid
import weakref
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from typing import Any

import zmq
import zmq.asyncio

from minivllm.config import EngineConfig
from minivllm.engine.llm_engine import EngineDeadError
from minivllm.model_executor.models import ModelRegistry
from minivllm.v1.engine import EngineCoreOutputs, EngineCoreRequest
from minivllm.v1.engine.core import (
    EngineCore,
    EngineCoreProc,
    EngineCoreRequestType,
    UtilityOutput,
)

logger = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_MINS = 5  # loading a model can be slow; a dead process is seen at once
SHUTDOWN_TIMEOUT_S = 5.0


class EngineCoreClient:
    @staticmethod
    def make_client(
        multiprocess_mode: bool, asyncio_mode: bool, engine_config: EngineConfig
    ) -> EngineCoreClient:
        if asyncio_mode and not multiprocess_mode:
            raise NotImplementedError(
                "Running EngineCore in asyncio without multiprocessing is not supported"
            )
        if multiprocess_mode and asyncio_mode:
            return AsyncMPClient(engine_config)
        if multiprocess_mode:
            return SyncMPClient(engine_config)
        return InprocClient(engine_config)


class InprocClient(EngineCoreClient):
    def __init__(self, engine_config: EngineConfig) -> None:
        self.engine_core = EngineCore(engine_config)

    def get_output(self) -> EngineCoreOutputs:
        outputs, _ = self.engine_core.step()
        return outputs

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine_core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.engine_core.abort_requests(request_ids)

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        return self.engine_core.reset_prefix_cache(reset_running_requests)

    def shutdown(self) -> None:
        self.engine_core.shutdown()


# -- the engine core in another process ----------------------------------------


@dataclass
class BackgroundResources:
    """What a multiprocess client must clean up, kept apart from the client
    so that the finalizer and the background threads hold no reference to
    it (the client can then be garbage collected, which shuts it down)."""

    ctx: zmq.Context
    socket_dir: str
    proc: BaseProcess | None = None
    input_socket: zmq.Socket | None = None
    output_socket: zmq.Socket | None = None
    output_queue_task: asyncio.Task | None = None
    shutdown_path: str | None = None  # sync: wakes the output thread to exit
    output_thread: threading.Thread | None = None
    utility_results: dict[int, Any] = field(default_factory=dict)
    # Set once the engine core cannot serve: why (None: it can).
    engine_dead: bool = False
    dead_reason: str | None = None
    _waited_for_exit: bool = False
    # Set once cleaned up. The monitor thread may be cleaning up when the
    # user calls shutdown(): that call must not return before it is done.
    cleaned_up: threading.Event = field(default_factory=threading.Event)

    def mark_dead(self, reason: str) -> None:
        if not self.engine_dead:
            self.engine_dead, self.dead_reason = True, reason

    def dead_error(self) -> EngineDeadError:
        """The error every call gets once the engine core is gone."""
        reason = self.dead_reason or "the engine core was shut down"
        # A core that reported its failure exits a moment later: wait for
        # its exit code once, not at every call.
        exit_code = _exit_code(self.proc, patience=0.0 if self._waited_for_exit else 1.0)
        self._waited_for_exit = True
        if exit_code is not None and "exit code" not in reason:
            reason += f" (its process exited with {_describe_exit_code(exit_code)})"
        return EngineDeadError(
            f"EngineCore is dead: {reason}. Its requests are lost; create a new engine."
        )

    def __call__(self) -> None:
        """Stop the process, close the sockets, remove their files."""
        try:
            self.mark_dead("the engine core was shut down")
            _stop_process(self.proc)
            if isinstance(self.output_socket, zmq.asyncio.Socket):
                self._close_async()
            else:
                self._close_sync()
            shutil.rmtree(self.socket_dir, ignore_errors=True)
        finally:
            self.cleaned_up.set()

    def _close_sync(self) -> None:
        if self.input_socket is not None:
            self.input_socket.close(linger=0)
        if self.output_thread is not None:
            # The output thread owns the output socket: ask it to close it.
            # (NOBLOCK: a thread that already ended would never take it.)
            with self.ctx.socket(zmq.PAIR) as shutdown_sender:
                shutdown_sender.setsockopt(zmq.LINGER, 0)
                shutdown_sender.connect(self.shutdown_path)
                with contextlib.suppress(zmq.Again):
                    shutdown_sender.send(b"", flags=zmq.NOBLOCK)
            self.output_thread.join(timeout=SHUTDOWN_TIMEOUT_S)
            if self.output_thread.is_alive():
                return  # its sockets are still open: leave the context be
        elif self.output_socket is not None:
            self.output_socket.close(linger=0)
        self.ctx.term()

    def _close_async(self) -> None:
        """zmq.asyncio sockets and the output task belong to their event
        loop: close them there, or now if this is that loop's thread or the
        loop is not running (between `run_until_complete` calls: left for it,
        they would stay open, and the context's `term()` when collected
        would then block forever)."""
        task, sockets = self.output_queue_task, (self.input_socket, self.output_socket)
        ctx = self.ctx

        def close_sockets_and_tasks() -> None:
            if task is not None and not task.done():
                task.cancel()
            for socket in sockets:
                if socket is not None:
                    socket.close(linger=0)
            ctx.term()

        loop = task.get_loop() if task is not None else None
        if loop is None or not loop.is_running() or _in_loop(loop):  # closed: not running
            close_sockets_and_tasks()
        else:
            loop.call_soon_threadsafe(close_sockets_and_tasks)

    def fail_pending(self, error: Exception) -> None:
        """Fail every utility call still waiting for its answer."""
        for call_id in list(self.utility_results):
            future = self.utility_results.pop(call_id, None)
            if future is not None and not future.done():
                future.set_exception(error)


class MPClient(EngineCoreClient):
    """The engine core in a background process, talked to over ZMQ (see the
    module's docstring). `SyncMPClient` and `AsyncMPClient` read the output
    socket in a thread or an asyncio task."""

    def __init__(self, asyncio_mode: bool, engine_config: EngineConfig) -> None:
        self.engine_config = engine_config
        sync_ctx = zmq.Context()
        self.ctx = zmq.asyncio.Context(sync_ctx) if asyncio_mode else sync_ctx
        # Cleans up whatever exists so far if construction fails part-way.
        self.resources = BackgroundResources(
            ctx=sync_ctx, socket_dir=tempfile.mkdtemp(prefix="minivllm-engine-")
        )
        self._finalizer = weakref.finalize(self, self.resources)
        success = False
        try:
            input_address = f"ipc://{self.resources.socket_dir}/input.sock"
            output_address = f"ipc://{self.resources.socket_dir}/output.sock"
            self.input_socket = self.resources.input_socket = make_zmq_socket(
                self.ctx, input_address, zmq.ROUTER
            )
            self.resources.output_socket = make_zmq_socket(self.ctx, output_address, zmq.PULL)
            self.core_engine = b"\x00\x00"  # the engine core's ZMQ identity (rank 0)
            self.resources.proc = launch_core_engine(
                engine_config, input_address, output_address, self.core_engine
            )
            self._wait_for_engine_startup()
            self.utility_results = self.resources.utility_results
            self.start_engine_core_monitor()
            success = True
        finally:
            if not success:
                self._finalizer()

    def _wait_for_engine_startup(self) -> None:
        """Wait for the handshake, or the process's death, whichever first."""
        proc = self.resources.proc
        socket = zmq.Socket.shadow(self.input_socket)
        poller = zmq.Poller()
        poller.register(socket, zmq.POLLIN)
        poller.register(proc.sentinel, zmq.POLLIN)
        if not poller.poll(timeout=HANDSHAKE_TIMEOUT_MINS * 60_000):
            raise TimeoutError(
                f"The engine core process did not start within {HANDSHAKE_TIMEOUT_MINS} minutes"
            )
        if not socket.poll(timeout=1000):  # it died: its last message may still be arriving
            raise RuntimeError(
                "Engine core initialization failed: its process exited with "
                f"{_describe_exit_code(_exit_code(proc))} before it was ready (see its "
                "output above; a script must start engines under "
                "`if __name__ == '__main__':`, which spawned processes do not run)"
            )
        _, payload = socket.recv_multipart()
        status, value = pickle.loads(payload)
        if status == "FAILED":
            error, trace = value
            raise error from RemoteTraceback(trace)
        self.engine_config.cache_config.num_gpu_blocks = value["num_gpu_blocks"]

    def start_engine_core_monitor(self) -> None:
        """A thread that waits on the process: if it exits while we still
        need it, mark the engine dead and shut down, which wakes every
        waiting call with EngineDeadError."""
        self_ref = weakref.ref(self)
        resources = self.resources
        proc = resources.proc

        def monitor_engine_cores() -> None:
            multiprocessing.connection.wait([proc.sentinel])
            client = self_ref()
            if client is None or not client._finalizer.alive or resources.engine_dead:
                return
            resources.mark_dead(
                f"the engine core process (pid {proc.pid}) died unexpectedly with "
                f"{_describe_exit_code(_exit_code(proc))}"
            )
            logger.error("%s; shutting down the client", resources.dead_reason)
            client.shutdown()

        threading.Thread(
            target=monitor_engine_cores, daemon=True, name="MPClientEngineMonitor"
        ).start()

    def ensure_alive(self) -> None:
        if self.resources.engine_dead:
            raise self.resources.dead_error()

    def _format_exception(self, error: Exception) -> Exception:
        """Once the engine core is dead, any failure is EngineDeadError."""
        return self.resources.dead_error() if self.resources.engine_dead else error

    def _encode(self, request_type: EngineCoreRequestType, request: Any) -> tuple[bytes, ...]:
        return (self.core_engine, request_type.value, pickle.dumps(request))

    def _new_call(self, future) -> int:
        """Register a utility call's future, then check that the engine is
        alive: a death after this point fails the future (fail_pending)."""
        call_id = uuid.uuid4().int >> 64
        self.utility_results[call_id] = future
        if self.resources.engine_dead:
            self.utility_results.pop(call_id, None)
            raise self.resources.dead_error()
        return call_id

    def shutdown(self) -> None:
        """Ask the engine core to stop, then clean up (terminating it if it
        has not exited). Safe to call twice, and from any thread."""
        if not self._finalizer.alive:
            self.resources.cleaned_up.wait(timeout=2 * SHUTDOWN_TIMEOUT_S)  # the monitor's
            return
        resources, proc = self.resources, self.resources.proc
        if proc is not None and proc.is_alive() and not resources.engine_dead:
            # Marked first, so the monitor takes the exit as asked for.
            resources.mark_dead("the engine core was shut down")
            with contextlib.suppress(zmq.ZMQError):
                sync_socket = zmq.Socket.shadow(self.input_socket)
                sync_socket.send_multipart(
                    self._encode(EngineCoreRequestType.SHUTDOWN, None), flags=zmq.NOBLOCK
                )
            proc.join(SHUTDOWN_TIMEOUT_S)
        self._finalizer()


class SyncMPClient(MPClient):
    """For `LLMEngine`: a thread reads the output socket into a queue, from
    which `get_output()` takes one step's outputs (blocking until the next
    step's are in)."""

    def __init__(self, engine_config: EngineConfig) -> None:
        super().__init__(asyncio_mode=False, engine_config=engine_config)
        self.outputs_queue: queue.Queue = queue.Queue()
        resources = self.resources
        resources.shutdown_path = f"inproc://shutdown-{uuid.uuid4().hex}"
        # The thread gets what it needs, not the client (which it would keep alive).
        shutdown_socket = self.ctx.socket(zmq.PAIR)
        shutdown_socket.bind(resources.shutdown_path)
        self.output_queue_thread = resources.output_thread = threading.Thread(
            target=process_outputs_socket,
            args=(resources, resources.output_socket, shutdown_socket, self.outputs_queue),
            name="EngineCoreOutputQueueThread",
            daemon=True,
        )
        self.output_queue_thread.start()

    def get_output(self) -> EngineCoreOutputs:
        outputs = self.outputs_queue.get()
        if isinstance(outputs, Exception):
            self.outputs_queue.put_nowait(outputs)  # every later call fails the same way
            raise self._format_exception(outputs) from None
        return outputs

    def _send_input(self, request_type: EngineCoreRequestType, request: Any) -> None:
        self.ensure_alive()
        try:
            self.input_socket.send_multipart(self._encode(request_type, request))
        except zmq.ZMQError as error:  # closed meanwhile by a shutdown
            raise self._format_exception(error) from None

    def call_utility(self, method: str, *args: Any) -> Any:
        future: Future = Future()
        call_id = self._new_call(future)
        self._send_input(EngineCoreRequestType.UTILITY, (call_id, method, args))
        return future.result()

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send_input(EngineCoreRequestType.ADD, request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and not self.resources.engine_dead:
            self._send_input(EngineCoreRequestType.ABORT, request_ids)

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        return self.call_utility("reset_prefix_cache", reset_running_requests)


def process_outputs_socket(
    resources: BackgroundResources, output_socket: zmq.Socket, shutdown_socket: zmq.Socket,
    outputs_queue: queue.Queue,
) -> None:
    """SyncMPClient's output thread: unpickle each message; a utility's
    answer completes its future, a step's outputs go to the queue. It ends
    at shutdown or when the engine core dies, and then leaves an
    EngineDeadError for every caller still waiting."""
    poller = zmq.Poller()
    poller.register(shutdown_socket, zmq.POLLIN)
    poller.register(output_socket, zmq.POLLIN)
    try:
        while shutdown_socket not in dict(poller.poll()):
            _handle_output_message(resources, output_socket.recv_multipart(), outputs_queue)
    except Exception as error:
        outputs_queue.put_nowait(error)
    finally:
        shutdown_socket.close(linger=0)
        output_socket.close(linger=0)
        error = resources.dead_error()
        resources.mark_dead("the engine core was shut down")
        resources.fail_pending(error)
        outputs_queue.put_nowait(error)


def _handle_output_message(resources: BackgroundResources, frames: list[bytes], outputs) -> None:
    """One message from the engine core: a step's outputs, a utility's
    answer, or ENGINE_CORE_DEAD (the core's loop failed: raises)."""
    if frames[0] == EngineCoreProc.ENGINE_CORE_DEAD:
        resources.mark_dead(f"the engine core failed: {frames[1].decode()}")
        raise resources.dead_error()
    message = pickle.loads(frames[0])
    if isinstance(message, UtilityOutput):
        _process_utility_output(message, resources.utility_results)
    else:
        outputs.put_nowait(message)


def _process_utility_output(output: UtilityOutput, utility_results: dict[int, Any]) -> None:
    future = utility_results.pop(output.call_id, None)
    if future is None or future.done():  # its caller was cancelled
        return
    if output.failure_message is not None:
        future.set_exception(RuntimeError(output.failure_message))
    else:
        future.set_result(output.result)


class AsyncMPClient(MPClient):
    """For `AsyncLLM`: an asyncio task reads the output socket into an
    asyncio queue; every call is a coroutine. The task starts with the
    first call, on the event loop that makes it, which the client then
    belongs to."""

    def __init__(self, engine_config: EngineConfig) -> None:
        super().__init__(asyncio_mode=True, engine_config=engine_config)
        self.outputs_queue: asyncio.Queue | None = None

    def _ensure_output_queue_task(self) -> None:
        resources = self.resources
        if resources.output_queue_task is not None:
            return
        self.outputs_queue = asyncio.Queue()
        resources.output_queue_task = asyncio.get_running_loop().create_task(
            process_outputs_socket_async(resources, self.outputs_queue),
            name="EngineCoreOutputQueueTask",
        )

    async def get_output_async(self) -> EngineCoreOutputs:
        self._ensure_output_queue_task()
        outputs = await self.outputs_queue.get()
        if isinstance(outputs, Exception):
            self.outputs_queue.put_nowait(outputs)
            raise self._format_exception(outputs) from None
        return outputs

    async def _send_input(self, request_type: EngineCoreRequestType, request: Any) -> None:
        self.ensure_alive()
        self._ensure_output_queue_task()
        await self.input_socket.send_multipart(self._encode(request_type, request))

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        future = asyncio.get_running_loop().create_future()
        call_id = self._new_call(future)
        await self._send_input(EngineCoreRequestType.UTILITY, (call_id, method, args))
        return await future

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        await self._send_input(EngineCoreRequestType.ADD, request)

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        if request_ids and not self.resources.engine_dead:
            await self._send_input(EngineCoreRequestType.ABORT, request_ids)

    async def reset_prefix_cache_async(self, reset_running_requests: bool = False) -> bool:
        return await self.call_utility_async("reset_prefix_cache", reset_running_requests)


async def process_outputs_socket_async(
    resources: BackgroundResources, outputs_queue: asyncio.Queue
) -> None:
    """AsyncMPClient's output task (as the sync thread). Cancelled at
    shutdown, or when the monitor finds the engine core dead."""
    try:
        while True:
            frames = await resources.output_socket.recv_multipart()
            _handle_output_message(resources, frames, outputs_queue)
    except asyncio.CancelledError:
        pass
    except Exception as error:
        outputs_queue.put_nowait(error)
    error = resources.dead_error()
    resources.mark_dead("the engine core was shut down")
    resources.fail_pending(error)
    outputs_queue.put_nowait(error)


# -- helpers ------------------------------------------------------------------------


class RemoteTraceback(Exception):
    """Where, in the engine core's process, a startup failure was raised."""

    def __str__(self) -> str:
        return "\n\nThe engine core process's traceback:\n" + self.args[0]


def make_zmq_socket(ctx: zmq.Context, path: str, socket_type: int) -> zmq.Socket:
    """A bound socket that never blocks a close on undelivered messages and
    queues without limit (a ROUTER drops what exceeds its high-water mark:
    a burst of requests must not), as vLLM's `make_zmq_socket`."""
    socket = ctx.socket(socket_type)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.SNDHWM, 0)
    socket.setsockopt(zmq.RCVHWM, 0)
    socket.bind(path)
    return socket


def launch_core_engine(
    engine_config: EngineConfig, input_address: str, output_address: str, identity: bytes
) -> BaseProcess:
    """Start `EngineCoreProc.run_engine_core` in a spawned process. The
    models registered here are registered there too (spawn starts with
    none). Daemonic, so multiprocessing also stops it at exit; the engine
    core starts no processes of its own (V1 runs on one device here)."""
    context = multiprocessing.get_context("spawn")
    proc = context.Process(
        target=EngineCoreProc.run_engine_core,
        name="EngineCore_DP0",
        kwargs=dict(
            engine_config=engine_config,
            input_address=input_address,
            output_address=output_address,
            identity=identity,
            registered_models=ModelRegistry.registered(),
            log_config=_logging_config(),
        ),
        daemon=True,
    )
    proc.start()
    return proc


def _logging_config() -> tuple[int, str | None] | None:
    """The root logger's level and format, if this process set logging up
    (the server does): a spawned process starts without it, and the engine
    core's lines (its start, its failures) should show as the front end's do."""
    root = logging.getLogger()
    if not root.handlers:
        return None
    formatter = root.handlers[0].formatter
    return root.level, formatter._fmt if formatter is not None else None


def _stop_process(proc: BaseProcess | None) -> None:
    """SIGTERM (the engine core exits its loop cleanly), then SIGKILL."""
    if proc is None or proc.pid is None:
        return
    if proc.is_alive():
        proc.terminate()
        proc.join(SHUTDOWN_TIMEOUT_S)
    if proc.is_alive():
        proc.kill()
    proc.join()


def _exit_code(proc: BaseProcess | None, patience: float = 1.0) -> int | None:
    """The exit code of a process that has exited or is exiting (None: it
    still runs). Another thread may be reaping it at this moment (the
    monitor, a shutdown): until it has stored the code, `exitcode` reads
    None although the process is gone, so wait for that too."""
    if proc is None or proc.pid is None:
        return None
    proc.join(patience)
    deadline = time.monotonic() + max(patience, 0.5)
    while proc.exitcode is None and time.monotonic() < deadline:
        if not multiprocessing.connection.wait([proc.sentinel], 0):
            break  # still running
        time.sleep(0.01)
    return proc.exitcode


def _describe_exit_code(code: int | None) -> str:
    if code is None:
        return "no exit code yet"
    if code < 0:
        return f"exit code {code} ({signal.Signals(-code).name})"
    return f"exit code {code}"


def _in_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False

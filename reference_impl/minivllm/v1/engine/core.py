"""`EngineCore`: V1's inner loop, schedule → execute → update (vLLM's
`vllm/v1/engine/core.py`).

It knows token ids only. The front end (`LLMEngine`, `AsyncLLM`) tokenizes,
detokenizes and finds stop strings, and talks to it through a client
(core_client.py): in the same process, or in a process of its own so that
the model runs while the front end handles text and HTTP.

`EngineCoreProc` is that process: an `EngineCore` in a busy loop, fed and
read over ZMQ sockets by `SyncMPClient` / `AsyncMPClient`.
"""

from __future__ import annotations

import enum
import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import queue
import signal
import threading
import traceback
from dataclasses import dataclass
from typing import Any

import zmq

import minivllm
from minivllm.config import EngineConfig, SchedulerConfig
from minivllm.core.scheduler import Scheduler as ClassicScheduler
from minivllm.utils import cdiv
from minivllm.v1.core.kv_cache_utils import get_request_block_hasher
from minivllm.v1.core.sched.scheduler import Scheduler
from minivllm.v1.engine import EngineCoreOutputs, EngineCoreRequest
from minivllm.v1.executor.uniproc_executor import UniProcExecutor
from minivllm.v1.request import Request, RequestStatus

logger = logging.getLogger(__name__)


def get_scheduler_cls(scheduler_config: SchedulerConfig) -> type[Scheduler]:
    """The scheduler class: V1's own, unless `scheduler_cls` names a
    subclass of it (a lab plugs a learner's in this way, as vLLM's
    `scheduler_cls` option does). The option's default is the classic
    engine's scheduler, which means V1's here."""
    cls = scheduler_config.scheduler_cls
    if isinstance(cls, type) and issubclass(cls, Scheduler):
        return cls
    if cls is ClassicScheduler:
        return Scheduler
    raise ValueError(
        f"scheduler_cls={getattr(cls, '__qualname__', cls)} is not a V1 scheduler; with "
        "use_v1=True it must subclass minivllm.v1.core.sched.scheduler.Scheduler"
    )


class EngineCore:
    def __init__(self, engine_config: EngineConfig) -> None:
        logger.info(
            "Initializing a V1 LLM engine (v%s) with config: %s",
            minivllm.__version__,
            engine_config,
        )
        self.engine_config = engine_config
        self.model_executor = UniProcExecutor(engine_config)
        self._initialize_kv_caches()
        # kv_events_config only when given, so that a scheduler_cls whose
        # __init__ takes the two configs alone (a lab's) still works.
        events = engine_config.kv_events_config
        self.scheduler = get_scheduler_cls(engine_config.scheduler_config)(
            engine_config.scheduler_config,
            engine_config.cache_config,
            **({} if events is None else {"kv_events_config": events}),
        )
        cache_config = engine_config.cache_config
        self.block_hasher = (
            get_request_block_hasher(cache_config.block_size)
            if cache_config.enable_prefix_caching
            else None
        )
        # Aborts that arrive while a step runs (EngineCoreProc's input thread
        # puts each here as well as in its input queue): applied before the
        # step's outputs are made, so a request aborted while the model ran
        # gets nothing from that step (vLLM's _process_aborts_queue).
        self.aborts_queue: queue.Queue[list[str]] = queue.Queue()

    def _initialize_kv_caches(self) -> None:
        """Size the KV cache from the worker's memory budget; refuse one that
        cannot hold a single request of max_model_len tokens (it would wait
        forever: V1 cannot swap it out to make room)."""
        config = self.engine_config
        num_gpu_blocks = self.model_executor.determine_num_available_blocks()
        block_size = config.cache_config.block_size
        max_model_len = config.scheduler_config.max_model_len
        needed = cdiv(max_model_len, block_size) + 1  # + the null block
        if num_gpu_blocks < needed:
            raise ValueError(
                f"The KV cache holds {num_gpu_blocks} blocks of {block_size} tokens, one of them "
                f"the null block: too few for one request of max_model_len={max_model_len} "
                f"tokens ({needed} blocks). Raise kv_cache_memory_bytes / "
                "num_gpu_blocks_override, or lower max_model_len."
            )
        self.model_executor.initialize_cache(num_gpu_blocks)
        # vLLM's words (GPU whatever the device, as the classic engine's
        # "# GPU blocks"); the null block, which holds no tokens, left out.
        num_tokens = (num_gpu_blocks - 1) * block_size
        logger.info("GPU KV cache size: %s tokens", f"{num_tokens:,}")
        logger.info(
            "Maximum concurrency for %s tokens per request: %.2fx",
            f"{max_model_len:,}",
            num_tokens / max_model_len,
        )

    def add_request(self, request: EngineCoreRequest) -> None:
        self.scheduler.add_request(Request.from_engine_core_request(request, self.block_hasher))

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def step(self) -> tuple[EngineCoreOutputs, bool]:
        """One step: (the outputs, whether the model ran)."""
        if not self.scheduler.has_requests():
            return EngineCoreOutputs(), False
        scheduler_output = self.scheduler.schedule()
        model_output = self.model_executor.execute_model(scheduler_output)
        self._process_aborts_queue()
        outputs = self.scheduler.update_from_output(scheduler_output, model_output)
        return outputs, scheduler_output.total_num_scheduled_tokens > 0

    def _process_aborts_queue(self) -> None:
        """Abort, in one batch, whatever was aborted during the step. The
        same aborts come again through the input queue, in their order
        among the other messages (an abort of a request whose ADD is still
        queued must wait for it); finishing a request twice does nothing."""
        request_ids: list[str] = []
        while not self.aborts_queue.empty():
            request_ids += self.aborts_queue.get_nowait()
        if request_ids:
            self.abort_requests(request_ids)

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """See `Scheduler.reset_prefix_cache`. Called between two steps, so
        a request it preempts is rescheduled in the next."""
        return self.scheduler.reset_prefix_cache(reset_running_requests)

    def shutdown(self) -> None:
        self.model_executor.shutdown()
        self.scheduler.shutdown()


# -- the engine core in a process of its own ---------------------------------


class EngineCoreRequestType(enum.Enum):
    """The first frame of every message to the engine core: what the rest is.

    vLLM keeps this (and `UtilityOutput`) in `vllm/v1/engine/__init__.py`.
    vLLM stops its engine core with SIGTERM; SHUTDOWN lets our client ask
    first, so the core leaves its loop between steps (SIGTERM remains the
    fallback, handled the same way)."""

    ADD = b"\x00"
    ABORT = b"\x01"
    UTILITY = b"\x03"
    SHUTDOWN = b"\x04"


@dataclass
class UtilityOutput:
    """The answer to one UTILITY call (`reset_prefix_cache`, ...): the
    method's result, or why it failed. `call_id` matches it to the waiting
    caller. vLLM sends it inside an `EngineCoreOutputs`; ours goes alone."""

    call_id: int
    result: Any = None
    failure_message: str | None = None


_STOP_OUTPUT_THREAD = object()


class EngineCoreProc(EngineCore):
    """An `EngineCore` driven by a busy loop in a background process, talking
    to its client over two ZMQ sockets (vLLM's `EngineCoreProc`).

    Three threads, so that socket I/O and (un)pickling overlap the model:

        input thread:  socket -> unpickle -> input_queue
        main thread:   drain input_queue (ADD, ABORT, UTILITY, SHUTDOWN);
                       step while there is work -> output_queue
        output thread: output_queue -> pickle -> socket

    The main thread blocks on the input queue when nothing is scheduled, so
    an idle engine uses no CPU. Each socket is touched by one thread only,
    as ZMQ requires.

    Serialization is pickle. vLLM uses msgpack (msgspec) with custom
    encoders: faster, zero-copy for tensors, and safe to decode from a peer
    it does not trust. Here both ends are the same program on the same
    machine, the sockets are loopback-only (ipc:// files in a private temp
    dir), and the messages are small dataclasses of lists, so pickle is
    simpler and fast enough.
    """

    ENGINE_CORE_DEAD = b"ENGINE_CORE_DEAD"  # first frame of the last message

    def __init__(
        self, engine_config: EngineConfig, input_address: str, output_address: str,
        identity: bytes,
    ) -> None:
        self.input_queue: queue.Queue = queue.Queue()
        self.output_queue: queue.Queue = queue.Queue()
        self.shutdown_requested = False
        self._stop_input = threading.Event()
        super().__init__(engine_config)  # loads the model: may raise
        self.output_thread = threading.Thread(
            target=self.process_output_sockets, args=(output_address,),
            name="EngineCoreOutputThread", daemon=True,
        )
        self.input_thread = threading.Thread(
            target=self.process_input_sockets, args=(input_address, identity),
            name="EngineCoreInputThread", daemon=True,
        )
        self.output_thread.start()
        self.input_thread.start()  # its first message tells the client we are ready

    @staticmethod
    def run_engine_core(
        engine_config: EngineConfig, input_address: str, output_address: str,
        identity: bytes, registered_models: dict,
        log_config: tuple[int, str | None] | None = None,
    ) -> None:
        """The process's target: build the engine core, run its loop until
        SHUTDOWN or SIGTERM. A startup failure is sent to the client (which
        raises it); a failure in the loop is logged and sent as
        ENGINE_CORE_DEAD before the process exits with code 1. `log_config`:
        the front end's logging (level, format), set up here too."""
        from minivllm.model_executor.models import ModelRegistry

        if log_config is not None:
            level, fmt = log_config
            logging.basicConfig(level=level, format=fmt)

        for architecture, model_cls in registered_models.items():
            ModelRegistry.register_model(architecture, model_cls)
        threading.Thread(target=_exit_with_parent, daemon=True).start()
        # Ctrl-C reaches the whole process group: the front end handles it
        # and shuts us down. SIGTERM (the client's fallback) exits cleanly.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, _raise_system_exit)
        engine_core = None
        try:
            engine_core = EngineCoreProc(engine_config, input_address, output_address, identity)
            engine_core.run_busy_loop()
        except SystemExit:
            pass
        except BaseException as error:
            if engine_core is None:
                logger.exception("EngineCore failed to start.")
                _send_startup_failure(input_address, identity, error)
            else:
                logger.exception("EngineCore encountered a fatal error.")
                engine_core._send_engine_dead(error)
            raise SystemExit(1) from None
        finally:
            if engine_core is not None:
                engine_core.shutdown()

    def run_busy_loop(self) -> None:
        """Take the client's messages; step while there is work."""
        while not self.shutdown_requested:
            self._process_input_queue()
            if self.has_work():
                self._process_engine_step()

    def has_work(self) -> bool:
        return self.scheduler.has_requests()

    def _process_input_queue(self) -> None:
        """Block while idle; then handle every message already queued, so
        that a step sees all the requests and aborts sent before it."""
        while not self.has_work() and not self.shutdown_requested:
            self._handle_client_request(*self.input_queue.get())
        while not self.input_queue.empty():
            self._handle_client_request(*self.input_queue.get_nowait())

    def _process_engine_step(self) -> None:
        outputs, _ = self.step()
        self.output_queue.put_nowait(outputs)

    def _handle_client_request(self, request_type: EngineCoreRequestType, request: Any) -> None:
        if request_type is EngineCoreRequestType.ADD:
            self.add_request(request)
        elif request_type is EngineCoreRequestType.ABORT:
            self.abort_requests(request)
        elif request_type is EngineCoreRequestType.UTILITY:
            call_id, method_name, args = request
            self.output_queue.put_nowait(self._invoke_utility_method(call_id, method_name, args))
        elif request_type is EngineCoreRequestType.SHUTDOWN:
            self.shutdown_requested = True

    def _invoke_utility_method(self, call_id: int, method_name: str, args: tuple) -> UtilityOutput:
        """A failing utility fails its caller only; the engine goes on."""
        try:
            return UtilityOutput(call_id, result=getattr(self, method_name)(*args))
        except Exception as error:
            logger.exception("Invocation of %s method failed", method_name)
            return UtilityOutput(
                call_id, failure_message=f"Call to {method_name} method failed: {error}"
            )

    def _send_engine_dead(self, error: BaseException) -> None:
        """Tell the client why we are dying, before the process exits."""
        description = f"{type(error).__name__}: {error}".encode()
        self.output_queue.put_nowait((self.ENGINE_CORE_DEAD, description))

    def process_input_sockets(self, input_address: str, identity: bytes) -> None:
        """Input thread. Its first message is the handshake: READY."""
        with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as socket:
            socket.setsockopt(zmq.IDENTITY, identity)
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.RCVHWM, 0)
            socket.connect(input_address)
            cache_config = self.engine_config.cache_config
            socket.send(pickle.dumps(("READY", {"num_gpu_blocks": cache_config.num_gpu_blocks})))
            while not self._stop_input.is_set():
                if not socket.poll(timeout=100):
                    continue
                request_type, payload = socket.recv_multipart()
                request = pickle.loads(payload)
                request_type = EngineCoreRequestType(request_type)
                if request_type is EngineCoreRequestType.ABORT:
                    self.aborts_queue.put_nowait(request)  # for a step running now
                self.input_queue.put_nowait((request_type, request))

    def process_output_sockets(self, output_address: str) -> None:
        """Output thread: sends until told to stop. Linger a little on
        close so a last ENGINE_CORE_DEAD still leaves, but never hang on a
        client that has gone."""
        with zmq.Context() as ctx, ctx.socket(zmq.PUSH) as socket:
            socket.setsockopt(zmq.LINGER, 2000)
            socket.setsockopt(zmq.SNDHWM, 0)
            socket.connect(output_address)
            for output in iter(self.output_queue.get, _STOP_OUTPUT_THREAD):
                if isinstance(output, tuple):  # (ENGINE_CORE_DEAD, description)
                    socket.send_multipart(output)
                else:
                    socket.send(pickle.dumps(output))

    def shutdown(self) -> None:
        """Flush and stop both I/O threads, then the executor."""
        self.output_queue.put_nowait(_STOP_OUTPUT_THREAD)
        self.output_thread.join(timeout=5.0)
        self._stop_input.set()
        self.input_thread.join(timeout=5.0)
        super().shutdown()


def _raise_system_exit(signum, frame) -> None:
    raise SystemExit()


def _exit_with_parent() -> None:
    """In the engine core's process: exit as soon as the front end's process
    is gone (killed, say), so no engine core outlives it."""
    multiprocessing.connection.wait([multiprocessing.parent_process().sentinel])
    os._exit(1)


def _send_startup_failure(input_address: str, identity: bytes, error: BaseException) -> None:
    """The handshake's other answer: the exception, for the client to raise
    with its own type and message, and the traceback of where it happened.
    An exception that does not survive pickling is sent as a RuntimeError
    with the same text."""
    trace = traceback.format_exc()
    try:
        payload = pickle.dumps(("FAILED", (error, trace)))
        pickle.loads(payload)
    except Exception:
        error = RuntimeError(f"{type(error).__name__}: {error}")
        payload = pickle.dumps(("FAILED", (error, trace)))
    with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as socket:
        socket.setsockopt(zmq.IDENTITY, identity)
        socket.setsockopt(zmq.LINGER, 5000)  # deliver it before the process exits
        socket.connect(input_address)
        socket.send(payload)

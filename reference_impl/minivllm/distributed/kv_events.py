"""KV-cache events (vLLM's `vllm/distributed/kv_events.py`): what V1's prefix
cache gains and loses, published for whoever routes requests to engines.

A router that knows which blocks each engine has cached can send a request
to the engine that already holds its prefix. The engine tells it, block by
block:

- `BlockStored`: blocks that filled and entered the prefix cache, with their
  hashes, the hash of the block before the first of them (None at a
  request's start) and their tokens;
- `BlockRemoved`: a cached block evicted, its slots about to be overwritten;
- `AllBlocksCleared`: `reset_prefix_cache` emptied the cache.

`BlockPool` queues the events as it caches and evicts. The scheduler takes
them at the end of `update_from_output()` and publishes them as one
`KVEventBatch`. `ZmqEventPublisher` sends each batch from a
thread of its own, as three frames: the topic, a sequence number (8 bytes,
big-endian) and the batch in msgpack (msgspec, as vLLM), so a subscriber
can decode it with vLLM's own classes. Hashes go out as integers, the last 8
bytes of our sha256 block hashes (vLLM's default,
`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from itertools import count
from typing import Any

import msgspec
import zmq

from minivllm.config import KVEventsConfig

logger = logging.getLogger(__name__)

MEDIUM_GPU = "GPU"  # where a stored block lives (vLLM's name, a CPU's cache too)


def external_block_hash(block_hash: bytes) -> int:
    """A block hash as events carry it: its last 8 bytes, as an integer."""
    return int.from_bytes(block_hash, "big") & ((1 << 64) - 1)


class EventBatch(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float  # time.time() when the scheduler published it
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """One change to the prefix cache (msgpack'd with its class name as tag)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]  # block_size tokens per block, in order
    block_size: int
    lora_id: int | None  # no LoRA here: always None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


class EventPublisher:
    """Where the scheduler's batches go."""

    def publish(self, events: EventBatch) -> None:
        raise NotImplementedError

    def shutdown(self) -> None:
        raise NotImplementedError


class NullEventPublisher(EventPublisher):
    """Events off, or `publisher="null"`: batches are dropped."""

    def publish(self, events: EventBatch) -> None:
        return

    def shutdown(self) -> None:
        return


def binds(endpoint: str) -> bool:
    """vLLM's rule for the PUB socket: an address with a wildcard, or a local
    transport, is bound ("bind stable, connect volatile"); any other is
    connected to (a collector that binds it)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher(EventPublisher):
    """A PUB socket fed by a thread, and an optional ROUTER socket that
    resends the batches still buffered from a given sequence number.

    A replay request is three frames: the client's identity (the ROUTER
    adds it), an empty frame and the first sequence number wanted (8 bytes,
    big-endian). The answer is `(identity, b"", seq, payload)` for each
    buffered batch from there on, then `(identity, b"", END_SEQ, b"")`. A
    DEALER client sends `(b"", seq)` and receives every answer as
    `(b"", seq, payload)` (a REQ socket would take only the first).

    The sockets are opened here, so that a bad endpoint fails at once, and
    from then on used by the thread alone (a ZMQ socket must not be used by
    two threads), which also closes them when it ends.
    """

    SHUTDOWN_TIMEOUT = 1.0  # seconds for the thread to send what is queued
    END_SEQ = (-1).to_bytes(8, "big", signed=True)

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        self._data_parallel_rank = data_parallel_rank
        self._event_queue: queue.Queue[EventBatch | None] = queue.Queue(config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._seq_gen = count()
        self._topic = config.topic.encode()
        # The process's shared context, as vLLM's: an inproc:// subscriber in
        # this process must use the same one to reach the socket.
        self._ctx = zmq.Context.instance()
        self._pub: zmq.Socket | None = None
        self._replay: zmq.Socket | None = None
        self._socket_setup(config)
        self._running = True
        self._abandon = threading.Event()  # shutdown gave up waiting: stop now
        self._thread = threading.Thread(
            target=self._publisher_thread, daemon=True, name="zmq-publisher"
        )
        self._thread.start()

    def _socket_setup(self, config: KVEventsConfig) -> None:
        """Open the PUB socket and, if asked, the ROUTER one."""
        self._pub = self._open(
            zmq.PUB, "endpoint", config.endpoint, binds(config.endpoint), config.hwm
        )
        if config.replay_endpoint is not None:
            self._replay = self._open(
                zmq.ROUTER, "replay_endpoint", config.replay_endpoint, bind=True
            )

    def _open(
        self, kind: int, field: str, endpoint: str, bind: bool, hwm: int | None = None
    ) -> zmq.Socket:
        """One socket, bound or connected; a failure closes what is open and
        names the field."""
        socket = self._ctx.socket(kind)
        try:
            if hwm is not None:
                socket.set_hwm(hwm)
            (socket.bind if bind else socket.connect)(endpoint)
        except zmq.ZMQError as e:
            socket.close(linger=0)
            self._close_sockets()
            raise ValueError(f"kv_events_config.{field}={endpoint!r} cannot be opened: {e}") from e
        return socket

    def publish(self, events: EventBatch) -> None:
        """Queue a batch for the thread; waits while `max_queue_size` batches
        are queued (as vLLM's), so a stalled publisher slows the engine down
        rather than losing events."""
        if not self._running:
            raise RuntimeError("the KV-event publisher is shut down")
        if events.data_parallel_rank is None:
            events.data_parallel_rank = self._data_parallel_rank
        self._event_queue.put(events)

    def shutdown(self) -> None:
        """Let the thread send what is queued (for up to SHUTDOWN_TIMEOUT),
        then close the sockets; past the timeout, the rest is dropped."""
        if not self._running:
            return
        self._running = False
        try:
            self._event_queue.put(None, timeout=self.SHUTDOWN_TIMEOUT)
            self._thread.join(timeout=self.SHUTDOWN_TIMEOUT)
        except queue.Full:
            pass
        if self._thread.is_alive():
            logger.warning(
                "KV-event publisher: %d batches dropped at shutdown", self._event_queue.qsize()
            )
            self._abandon.set()
            self._thread.join(timeout=self.SHUTDOWN_TIMEOUT)

    def _close_sockets(self) -> None:
        # A second's linger for what the socket has not yet handed to a
        # subscriber (vLLM closes with linger=0, which may drop it).
        for socket in (self._pub, self._replay):
            if socket is not None:
                socket.close(linger=int(self.SHUTDOWN_TIMEOUT * 1000))

    def _publisher_thread(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        try:
            while not self._abandon.is_set():
                if self._replay is not None and self._replay.poll(0):
                    try:
                        self._service_replay()
                    except Exception:  # a bad request must not stop the publishing
                        logger.exception("KV-event publisher: a replay request failed")
                try:
                    batch = self._event_queue.get(timeout=0.1)
                except queue.Empty:
                    continue
                if batch is None:
                    return  # shutdown's sentinel: everything before it was sent
                try:
                    seq = next(self._seq_gen)
                    payload = encoder.encode(batch)
                    self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                    self._buffer.append((seq, payload))
                except Exception:
                    # Go on draining (a dead thread would let the queue fill up
                    # and block the scheduler), after vLLM's short back-off.
                    logger.exception("KV-event publisher: a batch could not be sent")
                    self._abandon.wait(0.1)
        finally:
            self._close_sockets()

    def _service_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            logger.warning("KV-event publisher: a replay request of %d frames ignored", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in self._buffer:
            if seq >= start_seq:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", self.END_SEQ, b""))


def create_event_publisher(config: KVEventsConfig | None) -> EventPublisher:
    """vLLM's `EventPublisherFactory.create`: ZMQ when events are on and the
    publisher is "zmq", else one that drops every batch."""
    if config is None or not config.enable_kv_cache_events or config.publisher == "null":
        return NullEventPublisher()
    return ZmqEventPublisher(config)

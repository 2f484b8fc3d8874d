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
them at the end of `schedule()` and of `update_from_output()` and publishes
them as one `KVEventBatch`. `ZmqEventPublisher` sends each batch from a
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
    """Where the scheduler's batches go. Publishing must not block a step."""

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


class ZmqEventPublisher(EventPublisher):
    """A PUB socket fed by a thread, and an optional ROUTER socket that
    resends the batches still buffered from a given sequence number.

    A replay request is three frames: the client's identity (the ROUTER
    adds it), an empty frame and the first sequence number wanted (8 bytes,
    big-endian). The answer is `(identity, b"", seq, payload)` for each
    buffered batch from there on, then `(identity, b"", END_SEQ, b"")`. A
    DEALER client sends `(b"", seq)` and receives every answer as
    `(b"", seq, payload)` (a REQ socket would take only the first).
    """

    SHUTDOWN_TIMEOUT = 1.0  # seconds to wait for the queue to drain
    END_SEQ = (-1).to_bytes(8, "big", signed=True)

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        self._data_parallel_rank = data_parallel_rank
        self._event_queue: queue.Queue[EventBatch | None] = queue.Queue(config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._seq_gen = count()
        self._topic = config.topic.encode()
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay: zmq.Socket | None = None
        try:
            endpoint = config.endpoint
            # vLLM's rule: an address with a wildcard (or a local transport)
            # is bound, any other is connected to.
            if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
                self._pub.bind(endpoint)
            else:
                self._pub.connect(endpoint)
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ValueError(
                f"kv_events_config: cannot open endpoint {config.endpoint!r} / replay_endpoint "
                f"{config.replay_endpoint!r}: {e}"
            ) from e
        self._running = True
        self._thread = threading.Thread(
            target=self._publisher_thread, daemon=True, name="zmq-publisher"
        )
        self._thread.start()

    def publish(self, events: EventBatch) -> None:
        if not self._running:
            raise RuntimeError("the KV-event publisher is shut down")
        if events.data_parallel_rank is None:
            events.data_parallel_rank = self._data_parallel_rank
        self._event_queue.put(events)

    def shutdown(self) -> None:
        """Send what is queued (for up to SHUTDOWN_TIMEOUT), then close."""
        if not self._running:
            return
        self._running = False
        self._event_queue.put(None)
        self._thread.join(timeout=self.SHUTDOWN_TIMEOUT)
        if self._thread.is_alive():
            logger.warning("KV-event publisher: %d batches unsent at shutdown",
                           self._event_queue.qsize())
        self._close_sockets()

    def _close_sockets(self) -> None:
        # A second for what the socket has not yet handed to subscribers
        # (vLLM closes with linger=0, and may drop the last batches).
        for socket in (self._pub, self._replay):
            if socket is not None:
                socket.close(linger=int(self.SHUTDOWN_TIMEOUT * 1000))
        self._ctx.term()

    def _publisher_thread(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        while True:
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
                # Keep draining: a dead thread would let the queue fill up and
                # block the scheduler's next publish (vLLM logs and goes on too).
                logger.exception("KV-event publisher: a batch could not be sent")

    def _service_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            logger.warning("KV-event publisher: a replay request of %d frames ignored",
                           len(frames))
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

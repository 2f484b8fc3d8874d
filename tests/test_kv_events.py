"""V1's KV-cache events (`distributed/kv_events.py`), as vLLM publishes them.

The block pool's events on scenarios worked by hand; then the engine over a
real ZMQ socket, decoded as plain msgpack (not with our classes): a router
that replays the events must end up with exactly the blocks the engine has
cached. The replay socket, the options and their refusals, and the
publisher's shutdown.
"""

from __future__ import annotations

import argparse
import logging
import random
import re
from collections import Counter
from dataclasses import dataclass

import msgspec
import pytest
import zmq

from minivllm import LLM, SamplingParams
from minivllm.config import KVEventsConfig
from minivllm.distributed.kv_events import (
    AllBlocksCleared,
    KVEventBatch,
    NullEventPublisher,
    ZmqEventPublisher,
    binds,
    create_event_publisher,
)
from minivllm.engine.arg_utils import EngineArgs
from minivllm.v1.core.block_pool import BlockPool
from minivllm.v1.core.kv_cache_utils import hash_request_tokens


@dataclass
class FakeRequest:
    """What the pool reads of a request: its full blocks' hashes, its tokens."""

    block_hashes: list[bytes]
    all_token_ids: list[int]


def as_int(block_hash: bytes) -> int:
    """What a hash looks like in an event: its last 8 bytes, big-endian."""
    return int.from_bytes(block_hash[-8:], "big")


def stored(hashes, parent, tokens, block_size) -> dict:
    return {
        "type": "BlockStored",
        "block_hashes": [as_int(h) for h in hashes],
        "parent_block_hash": None if parent is None else as_int(parent),
        "token_ids": tokens,
        "block_size": block_size,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }


def plain(events) -> list[dict]:
    """Events as a subscriber without our classes decodes them."""
    return msgspec.msgpack.decode(msgspec.msgpack.encode(events))


# -- the block pool ----------------------------------------------------------


def test_the_pool_queues_stored_removed_and_cleared_in_order():
    """Blocks of 2. A caches its first two blocks, later its third (chained
    to the second); freed, its blocks are evicted as new blocks are taken
    (tail first: A's last block was freed first); reset empties the rest."""
    pool = BlockPool(5, enable_kv_cache_events=True)
    tokens = [1, 2, 3, 4, 5, 6]
    a = FakeRequest(hash_request_tokens(2, tokens), tokens)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(a, blocks, 0, 2, block_size=2)
    pool.cache_full_blocks(a, blocks, 2, 3, block_size=2)
    h1, h2, h3 = a.block_hashes
    assert plain(pool.take_events()) == [
        stored([h1, h2], None, [1, 2, 3, 4], 2),
        stored([h3], h2, [5, 6], 2),
    ]
    assert pool.take_events() == []  # taken once
    pool.free_blocks(reversed(blocks))  # queue: 4, then 3, 2, 1 (cached, tail first)
    pool.get_new_blocks(3)  # block 4, then 3 and 2 evicted
    assert plain(pool.take_events()) == [
        {"type": "BlockRemoved", "block_hashes": [as_int(h)], "medium": "GPU"} for h in (h3, h2)
    ]
    pool.free_blocks([pool.blocks[i] for i in (4, 3, 2)])
    assert pool.reset_prefix_cache()
    assert plain(pool.take_events()) == [{"type": "AllBlocksCleared"}]


def test_a_pool_without_events_queues_none():
    pool = BlockPool(4)
    a = FakeRequest(hash_request_tokens(2, [1, 2]), [1, 2])
    blocks = pool.get_new_blocks(1)
    pool.cache_full_blocks(a, blocks, 0, 1, block_size=2)
    pool.free_blocks(blocks)
    taken = pool.get_new_blocks(3)  # the cached block among them: evicted
    assert pool.get_cached_block(a.block_hashes[0]) is None
    pool.free_blocks(taken)
    assert pool.reset_prefix_cache()
    assert pool.take_events() == []


# -- the engine over ZMQ -----------------------------------------------------


def subscriber(endpoint: str) -> zmq.Socket:
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(endpoint)
    return sub


def connect(llm: LLM, sub: zmq.Socket) -> None:
    """Until the subscriber is connected, a message sent is lost to it (ZMQ's
    slow joiner). Empty the cache and run a step until a batch arrives: the
    router's view then starts from AllBlocksCleared, like the engine's cache."""
    probe = {"prompt_token_ids": [3, 4]}  # less than a block: nothing cached
    for _ in range(50):
        assert llm.llm_engine.reset_prefix_cache()
        llm.generate(probe, SamplingParams(max_tokens=1))
        if sub.poll(200):
            receive_all(sub, 200)
            return
    raise AssertionError("the subscriber never received a batch")


def receive_all(sub: zmq.Socket, timeout_ms: int = 2000) -> list[tuple[int, dict]]:
    """(sequence number, batch as plain msgpack) of every message, until quiet."""
    messages = []
    while sub.poll(timeout_ms):
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv"
        messages.append((int.from_bytes(seq, "big"), msgspec.msgpack.decode(payload)))
        timeout_ms = 1000  # then quiet for a second: every batch has come
    return messages


def events_engine(model: str, endpoint: str, **events) -> LLM:
    """V1 with events on, topic "kv", on an ipc endpoint (bound: it starts
    with ipc://), and a pool of 11 usable blocks of 4 tokens."""
    return LLM(
        model,
        use_v1=True,
        block_size=4,
        num_gpu_blocks_override=12,
        max_model_len=40,
        kv_events_config={
            "enable_kv_cache_events": True,
            "endpoint": endpoint,
            "topic": "kv",
            **events,
        },
    )


@pytest.fixture
def events_llm(tiny_model_dir, tmp_path):
    endpoint = f"ipc://{tmp_path}/kv-events"
    llm = events_engine(
        tiny_model_dir("llama"), endpoint, replay_endpoint=f"ipc://{tmp_path}/replay"
    )
    sub = subscriber(endpoint)
    connect(llm, sub)
    yield llm, sub, tmp_path
    sub.close()
    llm.llm_engine.shutdown()


def replay_router_view(batches: list[dict]) -> set[int]:
    """The cached blocks a router knows of after applying the batches in
    order. It counts copies: two requests may cache the same content in two
    blocks, and evicting one leaves the other."""
    copies: Counter[int] = Counter()
    for batch in batches:
        for event in batch["events"]:
            if event["type"] == "BlockStored":
                copies.update(event["block_hashes"])
            elif event["type"] == "BlockRemoved":
                copies.subtract(event["block_hashes"])
            else:
                copies.clear()
    assert min(copies.values(), default=0) >= 0, "a block removed more often than stored"
    return {h for h, n in copies.items() if n > 0}


def engine_cached_hashes(llm: LLM) -> set[int]:
    pool = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
    return {as_int(h) for h in pool.cached_block_hash_to_block}


def test_a_router_replaying_the_events_knows_the_engines_cache(events_llm):
    """Prompts of 10 tokens sharing their first 8, 3 tokens each, then more
    prompts than the 11 blocks hold, so that blocks are evicted, then a
    reset: after each phase, the blocks the events describe are the ones
    the engine has cached, and each request's stored tokens are its prompt
    and output, block by block, each run chained to the block before."""
    llm, sub, _ = events_llm
    greedy = SamplingParams(temperature=0, max_tokens=3)
    shared = list(range(5, 13))
    prompts = [shared + [20, 21], shared + [30, 31]]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy)
    batches = [b for _, b in receive_all(sub)]
    assert replay_router_view(batches) == engine_cached_hashes(llm) != set()
    by_request = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs, strict=True)]
    stored_events = [e for b in batches for e in b["events"] if e["type"] == "BlockStored"]
    for tokens in by_request:
        hashes = hash_request_tokens(4, tokens)
        mine = [
            e
            for e in stored_events
            if as_int(hashes[-1]) in e["block_hashes"]
            or set(e["block_hashes"]) & {as_int(h) for h in hashes[2:]}
        ]
        assert mine, "each request stored its own blocks past the shared prefix"
        for event in mine:
            first = [as_int(h) for h in hashes].index(event["block_hashes"][0])
            assert event["parent_block_hash"] == (as_int(hashes[first - 1]) if first else None)
            n = len(event["block_hashes"])
            assert event["token_ids"] == tokens[4 * first : 4 * (first + n)]
    # The shared prefix was stored once, by whichever request cached it first.
    prefix = {as_int(h) for h in hash_request_tokens(4, shared)}
    assert sum(len(prefix & set(e["block_hashes"])) for e in stored_events) == 2

    llm.generate(
        [{"prompt_token_ids": [50 + 10 * i + j for j in range(10)]} for i in range(4)], greedy
    )
    batches += [b for _, b in receive_all(sub)]
    assert any(e["type"] == "BlockRemoved" for b in batches for e in b["events"])
    assert replay_router_view(batches) == engine_cached_hashes(llm)

    assert llm.llm_engine.reset_prefix_cache()
    llm.generate({"prompt_token_ids": [90, 91, 92, 93, 94]}, greedy)
    batches += [b for _, b in receive_all(sub)]
    assert {"type": "AllBlocksCleared"} in batches[-1]["events"]
    assert replay_router_view(batches) == engine_cached_hashes(llm)
    assert all(b["data_parallel_rank"] == 0 and b["ts"] > 0 for b in batches)


@pytest.mark.parametrize("seed", range(3))
def test_after_every_step_the_events_describe_the_cache(tiny_model_dir, seed):
    """Random prompts over 3 token values (so they share prefixes and
    duplicate blocks), random lengths, a pool of 15 blocks of 2 tokens (so
    blocks are evicted all the time), a reset now and then: after every
    step, a router's view from the published batches is the engine's cache."""
    rng = random.Random(seed)
    llm = LLM(
        tiny_model_dir("llama"),
        use_v1=True,
        block_size=2,
        num_gpu_blocks_override=16,
        max_model_len=24,
        max_num_seqs=4,
        kv_events_config={"enable_kv_cache_events": True, "publisher": "null"},
    )
    engine = llm.llm_engine
    published: list[KVEventBatch] = []
    scheduler = engine.engine_core.engine_core.scheduler
    scheduler.kv_event_publisher.publish = published.append
    for i in range(60):
        if rng.random() < 0.5:
            prompt = [rng.randrange(3, 6) for _ in range(rng.randint(1, 12))]
            engine.add_request(
                f"r{i}",
                {"prompt_token_ids": prompt},
                SamplingParams(max_tokens=rng.randint(1, 8), seed=i),
            )
        if rng.random() < 0.05 and not engine.has_unfinished_requests():
            assert engine.reset_prefix_cache()
        engine.step()
        assert replay_router_view(plain(published)) == engine_cached_hashes(llm)
    assert any(type(e).__name__ == "BlockRemoved" for b in published for e in b.events)
    llm.llm_engine.shutdown()


def test_sequence_numbers_count_up_and_the_replay_socket_resends_from_one(events_llm):
    llm, sub, tmp_path = events_llm
    greedy = SamplingParams(temperature=0, max_tokens=6)
    llm.generate([{"prompt_token_ids": list(range(5, 15))}], greedy)
    messages = receive_all(sub)
    first = messages[0][0]  # after connect()'s probes
    assert [seq for seq, _ in messages] == list(range(first, first + len(messages)))
    assert len(messages) >= 2
    # One request, many replies: a DEALER, which (unlike REQ) may receive
    # them all; it writes the empty frame a REQ would add.
    replay = zmq.Context.instance().socket(zmq.DEALER)
    replay.setsockopt(zmq.LINGER, 0)
    replay.connect(f"ipc://{tmp_path}/replay")
    replay.send_multipart((b"", (first + 1).to_bytes(8, "big")))
    resent = []
    while True:
        assert replay.poll(5000)
        empty, seq, payload = replay.recv_multipart()
        assert empty == b""
        if seq == (-1).to_bytes(8, "big", signed=True):
            break
        resent.append((int.from_bytes(seq, "big"), msgspec.msgpack.decode(payload)))
    replay.close()
    assert resent == messages[1:]


def test_the_engine_core_process_publishes_too(tiny_model_dir, tmp_path, monkeypatch):
    """V1 with its engine core in a process of its own: the scheduler, and
    so the publisher, live there."""
    monkeypatch.setenv("MINIVLLM_ENABLE_V1_MULTIPROCESSING", "1")
    endpoint = f"ipc://{tmp_path}/kv-events-mp"
    llm = events_engine(tiny_model_dir("llama"), endpoint)
    sub = subscriber(endpoint)
    try:
        connect(llm, sub)
        prompt = list(range(5, 15))
        out = llm.generate(
            {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=3)
        )
        tokens = prompt + list(out[0].outputs[0].token_ids)
        batches = [b for _, b in receive_all(sub)]
    finally:
        sub.close()
        llm.llm_engine.shutdown()
    hashes = [as_int(h) for h in hash_request_tokens(4, tokens)]
    assert replay_router_view(batches) == set(hashes)


# -- options -----------------------------------------------------------------


def test_the_config_follows_vllms_defaults_and_names_bad_fields():
    assert KVEventsConfig().publisher == "null"
    assert KVEventsConfig(enable_kv_cache_events=True).publisher == "zmq"
    # 0 as in vLLM: no replay buffer, an unbounded queue, no high-water mark.
    zeros = KVEventsConfig.from_option({"buffer_steps": 0, "max_queue_size": 0, "hwm": 0})
    assert (zeros.buffer_steps, zeros.max_queue_size, zeros.hwm) == (0, 0, 0)
    for value, words in [
        ({"publisher": "kafka"}, "kv_events_config.publisher must be 'null' or 'zmq', got 'kafka'"),
        ({"enable_kv_cache_events": "yes"}, "kv_events_config.enable_kv_cache_events"),
        ({"buffer_steps": -1}, "kv_events_config.buffer_steps must be an integer in [0, "),
        ({"hwm": 2**31}, "kv_events_config.hwm must be an integer in [0, 2147483647], got"),
        ({"endpoint": 5557}, "kv_events_config.endpoint must be a ZMQ address"),
        ({"endpoint": "localhost"}, "kv_events_config.endpoint must be a ZMQ address"),
        ({"endpoint": "tcp://*:99999"}, "endpoint must have a port from 1 to 65535 or '*'"),
        (
            {"endpoint": "ipc:///x", "replay_endpoint": "ipc:///x"},
            "replay_endpoint must differ from endpoint, got 'ipc:///x' for both",
        ),
        ({"topic": "\ud800"}, "kv_events_config.topic must be printable text"),
        ({"endpiont": "x"}, "kv_events_config has no field 'endpiont'"),
        ("on", "kv_events_config must be a KVEventsConfig, a dict of its fields or None"),
    ]:
        with pytest.raises(ValueError, match=re.escape(words)):
            KVEventsConfig.from_option(value)


def test_the_endpoint_is_bound_or_connected_by_vllms_rule():
    assert all(binds(e) for e in ("tcp://*:5557", "tcp://[::]:5557", "ipc:///tmp/x", "inproc://x"))
    assert not any(binds(e) for e in ("tcp://127.0.0.1:5557", "tcp://collector:5557"))


def test_a_connecting_publisher_reaches_a_collector_that_binds():
    """An address without a wildcard is connected to: a collector (here a SUB
    socket on loopback) binds it and receives the batches."""
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.setsockopt(zmq.LINGER, 0)
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    config = KVEventsConfig(
        enable_kv_cache_events=True, endpoint=f"tcp://127.0.0.1:{port}", topic="kv"
    )
    publisher = ZmqEventPublisher(config)
    try:
        assert wait_connected(publisher, sub)
        publisher.publish(KVEventBatch(ts=7.0, events=[AllBlocksCleared()]))
        assert [b["events"] for _, b in receive_all(sub)] == [[{"type": "AllBlocksCleared"}]]
    finally:
        publisher.shutdown()
        sub.close()


def test_an_endpoint_that_cannot_be_opened_is_named(tmp_path):
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"ipc://{tmp_path}/no/such/dir")
    with pytest.raises(ValueError, match=r"kv_events_config\.endpoint='ipc://.*' cannot be opened"):
        ZmqEventPublisher(config)


def test_an_inproc_subscriber_in_the_same_process_receives(tmp_path):
    """The publisher uses the process's shared ZMQ context, as vLLM's, so
    an inproc:// address reaches it from this process."""
    endpoint = f"inproc://kv-events-{tmp_path.name}"
    publisher = ZmqEventPublisher(
        KVEventsConfig(enable_kv_cache_events=True, endpoint=endpoint, topic="kv")
    )
    sub = subscriber(endpoint)
    try:
        assert wait_connected(publisher, sub)
    finally:
        publisher.shutdown()
        sub.close()


def test_the_flag_takes_json_and_the_classic_engine_refuses_events(tiny_model_dir, capsys):
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--kv-events-config", '{"enable_kv_cache_events": true}'])
    assert args.kv_events_config == {"enable_kv_cache_events": True}
    for bad, says in (("[1]", "expected a JSON object"), ("{bad", "not JSON (Expecting")):
        with pytest.raises(SystemExit):
            parser.parse_args(["--kv-events-config", bad])
        assert says in capsys.readouterr().err
    with pytest.raises(ValueError, match="kv_events_config.*use_v1=True"):
        EngineArgs(
            model=tiny_model_dir("llama"),
            use_v1=False,
            kv_events_config=KVEventsConfig(enable_kv_cache_events=True),
        ).create_engine_config()
    # Off, the option is accepted by both engines, and nothing is published.
    config = EngineArgs(
        model=tiny_model_dir("llama"), use_v1=False, kv_events_config={"endpoint": "tcp://*:1"}
    ).create_engine_config()
    assert isinstance(create_event_publisher(config.kv_events_config), NullEventPublisher)


def test_events_without_prefix_caching_warn_and_publish_nothing(tiny_model_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="minivllm.engine.arg_utils"):
        llm = LLM(
            tiny_model_dir("llama"),
            use_v1=True,
            enable_prefix_caching=False,
            block_size=4,
            max_model_len=40,
            kv_events_config={"enable_kv_cache_events": True, "publisher": "null"},
        )
    assert "prefix caching is off" in caplog.text
    published: list[KVEventBatch] = []
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    scheduler.kv_event_publisher.publish = published.append
    llm.generate({"prompt_token_ids": list(range(5, 15))}, SamplingParams(max_tokens=6))
    assert published == []
    llm.llm_engine.shutdown()


def test_shutdown_sends_what_is_queued_and_closes_the_sockets(tmp_path):
    endpoint = f"ipc://{tmp_path}/pub"
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=endpoint, topic="kv")
    publisher = ZmqEventPublisher(config)
    sub = subscriber(endpoint)
    assert wait_connected(publisher, sub)
    for ts in range(3):
        publisher.publish(KVEventBatch(ts=float(ts), events=[AllBlocksCleared()]))
    publisher.shutdown()  # at once: the thread may not have sent any of them yet
    assert [b["ts"] for _, b in receive_all(sub)] == [0.0, 1.0, 2.0]
    with pytest.raises(RuntimeError, match="shut down"):
        publisher.publish(KVEventBatch(ts=0.0, events=[]))
    # The thread has ended and closed its sockets (it alone uses them).
    assert not publisher._thread.is_alive() and publisher._pub.closed
    sub.close()


def wait_connected(publisher: ZmqEventPublisher, sub: zmq.Socket) -> bool:
    """Publish probes until one arrives (a new subscriber misses what was
    sent before it joined: ZMQ's slow joiner), then drain them."""
    for _ in range(50):
        publisher.publish(KVEventBatch(ts=-1.0, events=[]))
        if sub.poll(100):
            while sub.poll(200):
                sub.recv_multipart()
            return True
    return False

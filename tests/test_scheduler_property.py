"""Property test: random workloads through the scheduler, invariants at every step.

No model runs: `simulate_model_step` does what `LLMEngine._process_model_outputs`
does after a forward pass. Each request finishes when it has generated its
target number of tokens or reaches max_model_len tokens in all (as the
engine's StopChecker does), is ignored by the scheduler, or is aborted.

The "model" is greedy and deterministic: the token a sequence samples is a
function of its tokens so far (`model_token`), so a preemption, a cache hit or
a chunked prefill may change the batches but never the tokens.

Requests with n=2 sequences sharing one prompt are drawn only with SWAP
preemption (what preemption_mode=None picks for them): they exercise shared,
ref-counted blocks, copy-on-write and the swapping of shared blocks.

Random workloads also draw prefix caching (with prompts built from a few
shared prefixes over a small alphabet, so that they share blocks), chunked
prefill (token budgets down to max_num_seqs), the batching without chunking
(vLLM's default, or the course's MixedBatchScheduler) and aborts of random
requests between steps.

`ShadowKV` mirrors the KV cache: each slot holds the tokens whose K/V it
stores (the token and everything before it). It applies the step's swaps and
copies as the worker does, writes the scheduled tokens, then checks that
every scheduled sequence reads its own tokens at every position it attends
to, and that every prefix-cached block holds what its hash says.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from minivllm.config import CacheConfig, PreemptionMode, SchedulerConfig
from minivllm.core.block_manager import Device
from minivllm.core.prefix_caching import hash_block_tokens
from minivllm.core.scheduler import MixedBatchScheduler, Scheduler, SchedulerOutputs
from minivllm.sampling_params import SamplingParams
from minivllm.sequence import (
    Sequence,
    SequenceGroup,
    SequenceGroupMetadata,
    SequenceStatus,
)

MAX_STEPS = 2000
BIG_VOCAB = 1 << 20


@dataclass
class Request:
    arrival_step: int
    prompt_len: int
    target: int  # output tokens to generate
    n: int  # sequences sharing the prompt
    # The prompt; None: `prompt_len` tokens no other request has.
    tokens: tuple[int, ...] | None = None


@dataclass
class Workload:
    block_size: int
    num_gpu_blocks: int
    num_cpu_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    preemption_mode: str | None
    watermark: float
    requests: list[Request]
    enable_prefix_caching: bool = False
    enable_chunked_prefill: bool = False
    # Without chunking: "default" (vLLM's prefill-or-decode steps) or "mixed"
    # (MixedBatchScheduler).
    batching: str = "default"
    # (step, request index): abort f"req{index}" before that step's schedule()
    # (a no-op unless it is live then).
    aborts: list[tuple[int, int]] = field(default_factory=list)
    # Output tokens are drawn from range(vocab): a small one makes the
    # generated tokens of different requests collide, so blocks holding
    # output tokens are shared through the prefix cache too.
    vocab: int = BIG_VOCAB


def model_token(tokens: list[int], index_in_group: int, vocab: int) -> int:
    """The greedy "model": the next token of a sequence holding `tokens`.

    The sequences of one group (index_in_group 0, 1) sample different tokens.
    """
    h = 0
    for t in tokens:
        h = (h * 1_000_003 + t + 1) % (2**61 - 1)
    return (h + index_in_group) % vocab


@st.composite
def workloads(draw) -> Workload:
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    # Half the pools are small, so that requests preempt one another.
    num_gpu_blocks = draw(st.integers(4, draw(st.sampled_from([12, 40]))))
    num_cpu_blocks = draw(st.integers(0, 40))
    max_model_len = draw(st.integers(2, 48))
    max_num_seqs = draw(st.integers(1, 8))
    caching = draw(st.booleans())
    chunked = draw(st.booleans())
    batching = "default" if chunked else draw(st.sampled_from(["default", "mixed"]))
    if chunked:
        # Budgets below max_model_len: long prompts take several steps.
        # With caching too, the scheduler refuses a budget below block_size
        # (see test_chunked_prefix_caching_budget_below_block_size_is_refused).
        low = max(max_num_seqs, block_size) if caching else max_num_seqs
        high = max(max_model_len, low) + draw(st.sampled_from([0, 24]))
        max_num_batched_tokens = draw(st.integers(low, high))
    else:
        max_num_batched_tokens = max(max_model_len, max_num_seqs) + draw(st.integers(0, 24))
    # None means RECOMPUTE for the single-sequence requests it is drawn with.
    mode = draw(st.sampled_from(["recompute", "swap", "swap", None]))
    watermark = draw(st.sampled_from([0.0, 0.01, 0.1, 0.25]))

    # Shared prompts: a few "system" prefixes over a small alphabet, each
    # prompt one of them plus a random suffix. Drawn often with caching.
    shared = draw(st.integers(0, 3)) > 0 if caching else draw(st.integers(0, 3)) == 0
    if shared:
        alphabet = st.integers(0, draw(st.integers(0, 3)))
        prefixes = draw(
            st.lists(st.lists(alphabet, max_size=max_model_len), min_size=1, max_size=3)
        )
    vocab = draw(st.sampled_from([4, BIG_VOCAB])) if shared else BIG_VOCAB

    requests = []
    for _ in range(draw(st.integers(1, 12))):
        tokens = None
        if shared:
            prompt = draw(st.sampled_from(prefixes)) + draw(st.lists(alphabet, max_size=8))
            prompt = prompt[:max_model_len] or [0]
            tokens = tuple(prompt)
            prompt_len = len(prompt)
        else:
            prompt_len = draw(st.integers(1, max_model_len))
        requests.append(
            Request(
                arrival_step=draw(st.integers(0, 8)),
                prompt_len=prompt_len,
                target=draw(st.integers(1, 20)),
                # A group needs all its sequences admitted at once (n <= max_num_seqs).
                n=draw(st.sampled_from([1, 2])) if mode == "swap" and max_num_seqs >= 2 else 1,
                tokens=tokens,
            )
        )
    aborts = draw(
        st.lists(st.tuples(st.integers(0, 24), st.integers(0, len(requests) - 1)), max_size=6)
    )
    if mode == "swap":
        # Swapped requests hold CPU blocks while others keep growing; a
        # sequence never holds more than ceil(max_model_len / block_size)
        # blocks, so this pool can never run out (running out raises).
        per_seq = math.ceil(max_model_len / block_size)
        num_cpu_blocks = max(num_cpu_blocks, sum(r.n for r in requests) * per_seq)
    return Workload(
        block_size,
        num_gpu_blocks,
        num_cpu_blocks,
        max_num_seqs,
        max_num_batched_tokens,
        max_model_len,
        mode,
        watermark,
        requests,
        enable_prefix_caching=caching,
        enable_chunked_prefill=chunked,
        batching=batching,
        aborts=aborts,
        vocab=vocab,
    )


def simulate_model_step(
    scheduler: Scheduler,
    out: SchedulerOutputs,
    metadata: list[SequenceGroupMetadata],
    targets: dict[str, int],
    w: Workload,
) -> list[SequenceGroup]:
    """What the engine does after the forward pass; returns the groups it finished."""
    finished = []
    for scheduled, meta in zip(out.scheduled_seq_groups, metadata, strict=True):
        group = scheduled.seq_group
        for j, seq in enumerate(group.seqs):
            if seq.status != SequenceStatus.RUNNING:
                continue
            seq.data.update_num_computed_tokens(scheduled.token_chunk_size)
            if seq.get_num_new_tokens() > 0:
                # A chunk that does not finish the prompt samples nothing.
                assert not meta.do_sample, meta
                continue
            assert meta.do_sample, meta
            seq.append_token_id(model_token(seq.get_token_ids(), j, w.vocab), 0.0)
            if (
                seq.get_output_len() >= targets[group.request_id]
                or seq.get_len() >= w.max_model_len
            ):
                seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED
                scheduler.free_seq(seq)
        if group.is_finished():
            finished.append(group)
    scheduler.free_finished_seq_groups()
    return finished


def check_block_pools(scheduler: Scheduler, groups: list[SequenceGroup]) -> None:
    bm = scheduler.block_manager
    holders = {
        seq.seq_id
        for g in groups
        for seq in g.seqs
        if seq.status in (SequenceStatus.RUNNING, SequenceStatus.SWAPPED)
    }
    # Running and swapped sequences hold blocks; waiting and finished ones none.
    assert set(bm.block_tables) == holders, "block tables do not match the live sequences"
    objects: dict[tuple[Device, int], set[int]] = {}
    references: Counter = Counter()
    by_id = {}
    for block_table in bm.block_tables.values():
        assert len({id(b) for b in block_table}) == len(block_table)
        for block in block_table:
            objects.setdefault((block.device, block.block_number), set()).add(id(block))
            references[id(block)] += 1
            by_id[id(block)] = block
    for key, object_ids in objects.items():
        # One block number is one block: two sequences may only share it
        # through the same ref-counted object.
        assert len(object_ids) == 1, f"block {key} handed out twice"
    for object_id, count in references.items():
        assert by_id[object_id].ref_count == count, by_id[object_id]
    for device, allocator, total in (
        (Device.GPU, bm.gpu_allocator, bm.num_total_gpu_blocks),
        (Device.CPU, bm.cpu_allocator, bm.num_total_cpu_blocks),
    ):
        used = {number for dev, number in objects if dev == device}
        free = allocator.free_block_numbers
        # Cached blocks nobody maps: free, but still findable until evicted.
        evictor = getattr(allocator, "evictor", {})
        evictable = [b.block_number for b in evictor.values()]
        assert len(set(free)) == len(free), f"{device} block freed twice"
        assert len(set(evictable)) == len(evictable), f"{device} block evictable twice"
        assert not used & set(free), f"{device} block both used and free"
        assert not used & set(evictable), f"{device} block both used and evictable"
        assert not set(free) & set(evictable), f"{device} block both free and evictable"
        assert all(0 <= n < total for n in used | set(free) | set(evictable))
        assert allocator.get_num_free_blocks() == len(free) + len(evictable)
        assert allocator.get_num_free_blocks() + len(used) == total


def check_prefix_cache(
    scheduler: Scheduler,
    groups: list[SequenceGroup],
    computed_end: dict[int, int],
    known_hashes: dict[int, tuple[int, ...]],
) -> None:
    """The hashes of blocks tell the truth, and the cache index is consistent.

    computed_end: seq_id -> tokens whose K/V exists once this step's batch
    has run (the scheduler marks blocks computed as it schedules them).
    known_hashes: filled in, hash -> the tokens up to the end of that block.
    """
    bm = scheduler.block_manager
    bs = bm.block_size
    mapped = {}
    for g in groups:
        for seq in g.seqs:
            table = bm.block_tables.get(seq.seq_id)
            if table is None:
                continue
            tokens = seq.get_token_ids()
            parent = None
            for i, block in enumerate(table):
                mapped[id(block)] = block
                if (i + 1) * bs > len(tokens):
                    # The last, partial block: never hashed.
                    assert block.block_hash is None, (seq, i, block)
                    continue
                parent = hash_block_tokens(parent, tuple(tokens[i * bs : (i + 1) * bs]))
                known_hashes.setdefault(parent, tuple(tokens[: (i + 1) * bs]))
                if block.block_hash is None:
                    continue
                assert bm.enable_caching
                # A hashed block is full, holds this sequence's tokens (for
                # every sequence that maps it), and is computed.
                assert block.block_hash == parent, f"{seq} block {i}: hash of other tokens"
                if seq.status == SequenceStatus.RUNNING:
                    assert (i + 1) * bs <= computed_end[seq.seq_id], (seq, i)
    if not bm.enable_caching:
        return
    alloc = bm.gpu_allocator
    assert 0 <= bm.prefix_cache_hits <= bm.prefix_cache_queries
    for h, block in alloc.cached_blocks.items():
        assert block.block_hash == h
        assert block.device == Device.GPU
        assert h in known_hashes, f"{block} cached under a hash no sequence ever had"
        if block.ref_count == 0:
            assert alloc.evictor.get(h) is block, f"{block} cached, unused, not evictable"
        else:
            assert h not in alloc.evictor
            assert mapped.get(id(block)) is block, f"{block} has users but no block table"
    for h, block in alloc.evictor.items():
        assert block.ref_count == 0, f"evictable {block} in use"
        assert alloc.cached_blocks.get(h) is block
        assert id(block) not in mapped


class ShadowKV:
    """What each KV-cache slot holds: the tokens up to and including the
    token whose K/V it is (None: never written)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.pools: dict[Device, dict[int, list[tuple[int, ...] | None]]] = {
            Device.GPU: {},
            Device.CPU: {},
        }

    def _block(self, device: Device, number: int) -> list[tuple[int, ...] | None]:
        return self.pools[device].setdefault(number, [None] * self.block_size)

    def _copy(self, src: Device, dst: Device, pairs: list[tuple[int, int]]) -> None:
        # As CacheEngine does: gather every source, then scatter.
        assert len({d for _, d in pairs}) == len(pairs), f"two copies into one block: {pairs}"
        contents = [list(self._block(src, s)) for s, _ in pairs]
        for (_, d), content in zip(pairs, contents, strict=True):
            self.pools[dst][d] = content

    def run_step(self, scheduler: Scheduler, out: SchedulerOutputs) -> None:
        """The worker's copies in its order, then the batch's writes, then its reads."""
        self._copy(Device.CPU, Device.GPU, out.blocks_to_swap_in)
        self._copy(Device.GPU, Device.CPU, out.blocks_to_swap_out)
        self._copy(Device.GPU, Device.GPU, out.blocks_to_copy)
        bm, bs = scheduler.block_manager, self.block_size
        # Every layer writes the whole batch's K/V before attention reads it.
        reads = []
        for scheduled in out.scheduled_seq_groups:
            for seq in scheduled.seq_group.get_seqs(SequenceStatus.RUNNING):
                table = bm.block_tables[seq.seq_id]
                tokens = tuple(seq.get_token_ids())
                start = seq.data.num_computed_tokens
                end = start + scheduled.token_chunk_size
                for pos in range(start, end):
                    assert table[pos // bs].device == Device.GPU
                    self._block(Device.GPU, table[pos // bs].block_number)[pos % bs] = tokens[
                        : pos + 1
                    ]
                reads.append((seq, table, tokens, end))
        for seq, table, tokens, end in reads:
            for pos in range(end):
                held = self._block(Device.GPU, table[pos // bs].block_number)[pos % bs]
                assert held == tokens[: pos + 1], (
                    f"{seq} reads the wrong K/V at position {pos}: {held} != {tokens[: pos + 1]}"
                )

    def check_cached_blocks(
        self, scheduler: Scheduler, known_hashes: dict[int, tuple[int, ...]]
    ) -> None:
        """A block found by its hash holds the K/V of the tokens hashed."""
        bm, bs = scheduler.block_manager, self.block_size
        if not bm.enable_caching:
            return
        for h, block in bm.gpu_allocator.cached_blocks.items():
            tokens = known_hashes[h]
            held = self._block(Device.GPU, block.block_number)
            first = len(tokens) - bs
            for s in range(bs):
                assert held[s] == tokens[: first + s + 1], f"cached {block} holds other K/V"


def check_queues(
    scheduler: Scheduler, groups: list[SequenceGroup], scheduled: set[int] | None = None
) -> None:
    """scheduled: ids of the groups in the batch just scheduled (None: between steps)."""
    bm = scheduler.block_manager
    queues = {
        SequenceStatus.WAITING: scheduler.waiting,
        SequenceStatus.RUNNING: scheduler.running,
        SequenceStatus.SWAPPED: scheduler.swapped,
    }
    placed = Counter(id(g) for q in queues.values() for g in q)
    for group in groups:
        if group.is_finished():
            assert placed[id(group)] == 0
            continue
        assert placed[id(group)] == 1, f"{group} is in {placed[id(group)]} queues"
    # No order is asserted: as in vLLM, the queues keep the order things
    # happened in (tests/test_scheduler_vllm_scenarios.py works it by hand).
    for status, queue in queues.items():
        for group in queue:
            for seq in group.get_unfinished_seqs():
                assert seq.status == status, (group, seq)
                if status == SequenceStatus.WAITING:
                    assert seq.seq_id not in bm.block_tables
                    assert seq.data.num_computed_tokens == 0
                else:
                    block_table = bm.block_tables[seq.seq_id]
                    if status == SequenceStatus.RUNNING:
                        assert all(b.device == Device.GPU for b in block_table)
                        if scheduled is not None and id(group) in scheduled:
                            # A slot for every token, the newest (uncomputed) one included.
                            assert len(block_table) == seq.n_blocks
                        else:
                            # A decode not scheduled yet (between steps, or held
                            # back by a prefill step) may lack its newest token's slot.
                            assert len(block_table) in (seq.n_blocks - 1, seq.n_blocks)
                    else:
                        # Swapped out before or after its newest token got a slot.
                        assert all(b.device == Device.CPU for b in block_table)
                        assert len(block_table) in (seq.n_blocks - 1, seq.n_blocks)
    # Without chunking every running group holds its slots (the step reserves
    # them first). With it, as in vLLM, a group the token budget did not reach
    # is not charged, so new prompts may join beside it: only the batch
    # itself is bounded by max_num_seqs (check_step).
    if not scheduler.scheduler_config.enable_chunked_prefill:
        num_running = sum(g.num_seqs(SequenceStatus.RUNNING) for g in scheduler.running)
        assert num_running <= scheduler.scheduler_config.max_num_seqs


def check_step(
    scheduler: Scheduler,
    metadata: list[SequenceGroupMetadata],
    out: SchedulerOutputs,
    w: Workload,
    groups: list[SequenceGroup],
    done: set[str],
    was_waiting: set[int],
    counters_before: tuple[int, int],
    events: Counter,
) -> dict[int, int]:
    """Check one schedule() result (before the model runs).

    was_waiting: ids of the groups waiting before this schedule().
    Returns seq_id -> tokens computed by the end of this step, for every
    running sequence.
    """
    config = scheduler.scheduler_config
    bm = scheduler.block_manager
    bs = w.block_size
    check_block_pools(scheduler, groups)
    check_queues(scheduler, groups, {id(s.seq_group) for s in out.scheduled_seq_groups})

    assert out.num_batched_tokens <= config.max_num_batched_tokens
    assert len(metadata) == len(out.scheduled_seq_groups)
    num_running = 0
    expected_tokens = 0
    admitted = []
    computed_end = {
        seq.seq_id: seq.data.num_computed_tokens
        for g in scheduler.running
        for seq in g.get_seqs(SequenceStatus.RUNNING)
    }
    for i, (scheduled, meta) in enumerate(zip(out.scheduled_seq_groups, metadata, strict=True)):
        group = scheduled.seq_group
        chunk = scheduled.token_chunk_size
        assert group.request_id not in done
        running = group.get_seqs(SequenceStatus.RUNNING)
        assert running, f"{group} scheduled with no running sequence"
        assert group in scheduler.running
        num_running += len(running)
        assert meta.request_id == group.request_id
        assert meta.token_chunk_size == chunk
        assert meta.is_prompt == group.is_prefill()
        assert set(meta.seq_data) == {s.seq_id for s in running}
        assert meta.block_tables == {s.seq_id: bm.get_block_table(s) for s in running}
        assert len({s.data.num_computed_tokens for s in running}) == 1
        computed = running[0].data.num_computed_tokens
        length = running[0].get_len()
        assert chunk >= 1
        if i < out.num_prefill_groups:
            # A prefill computes tokens the sequence has: the prompt, plus
            # the generated tokens after a RECOMPUTE preemption.
            assert group.is_prefill()
            assert all(s.get_len() == length for s in running)
            assert chunk <= length - computed, "a chunk beyond the uncomputed tokens"
            if not w.enable_chunked_prefill:
                assert chunk == length - computed
            if id(group) in was_waiting:
                admitted.append(group)
                # Admitted: the cache supplied whole blocks, never all tokens.
                assert computed % bs == 0 and computed < length
                if not w.enable_prefix_caching:
                    assert computed == 0
            else:
                assert w.enable_chunked_prefill, f"{group} prefilled over two steps"
            completes = computed + chunk == length
            assert meta.do_sample == completes
            if not completes:
                events["partial_chunk"] += 1
                events["unaligned_partial_chunk"] += (computed + chunk) % bs != 0
                if w.enable_prefix_caching:
                    # The next chunk starts on a block boundary.
                    assert (computed + chunk) % bs == 0
            # The budget counts a group's prompt once, however many sequences
            # share it (n=2 groups are drawn here; the engine itself forks).
            expected_tokens += chunk
        else:
            assert not group.is_prefill()
            assert chunk == 1
            assert meta.do_sample
            for seq in running:
                assert seq.get_len() - seq.data.num_computed_tokens == 1
            expected_tokens += len(running)
        for seq in running:
            computed_end[seq.seq_id] = seq.data.num_computed_tokens + chunk
    assert num_running <= config.max_num_seqs
    assert out.num_batched_tokens == expected_tokens
    assert len({id(s.seq_group) for s in out.scheduled_seq_groups}) == len(out.scheduled_seq_groups)
    num_decodes = len(out.scheduled_seq_groups) - out.num_prefill_groups
    if out.num_prefill_groups and num_decodes:
        events["mixed_step"] += 1
    if w.batching == "default" and not w.enable_chunked_prefill:
        assert not (out.num_prefill_groups and num_decodes), "vLLM's default mixed a step"
        if out.num_prefill_groups and any(not g.is_prefill() for g in scheduler.running):
            events["decodes_held_back"] += 1

    # Prefix-cache counters: per admitted group, its cacheable blocks are
    # looked up and the cached ones found.
    queries, hits = counters_before
    if w.enable_prefix_caching:
        num_queries = sum((g.seqs[0].get_len() - 1) // bs for g in admitted)
        num_hits = sum(
            g.get_seqs(SequenceStatus.RUNNING)[0].data.num_computed_tokens for g in admitted
        )
        assert bm.prefix_cache_queries - queries == num_queries
        assert bm.prefix_cache_hits - hits == num_hits // bs
        events["cache_hit_blocks"] += num_hits // bs
    else:
        assert bm.prefix_cache_queries == bm.prefix_cache_hits == 0

    if out.preempted:
        # Nothing is swapped in beside a preemption; without chunking (vLLM's
        # default flow) a step that preempts is a decode step: nothing is
        # admitted either. A victim is not in the batch.
        assert not out.blocks_to_swap_in
        if w.batching == "default" and not w.enable_chunked_prefill:
            assert not admitted
        batch = {id(s.seq_group) for s in out.scheduled_seq_groups}
        for victim, mode in out.preempted:
            assert id(victim) not in batch
            expected_queue = (
                scheduler.waiting if mode == PreemptionMode.RECOMPUTE else scheduler.swapped
            )
            assert victim in expected_queue
    # Each pair's destination is a distinct block (ShadowKV checks that);
    # a source is copied once too, except a block shared by two requests
    # through the prefix cache, which each preempted request copies out.
    if not w.enable_prefix_caching:
        assert len(out.blocks_to_swap_out) == len({gpu for gpu, _ in out.blocks_to_swap_out})
    assert len(out.blocks_to_swap_in) == len({cpu for cpu, _ in out.blocks_to_swap_in})

    for group in out.ignored_seq_groups:
        assert group.request_id not in done
        assert all(s.status == SequenceStatus.FINISHED_IGNORED for s in group.seqs)
        assert group not in [s.seq_group for s in out.scheduled_seq_groups]
    return computed_end


def abort(
    scheduler: Scheduler, request_id: str, groups: list[SequenceGroup], events: Counter
) -> SequenceGroup | None:
    """Abort `request_id` and check it is gone at once; returns the aborted group."""
    queues = {
        "waiting": scheduler.waiting,
        "running": scheduler.running,
        "swapped": scheduler.swapped,
    }
    where = [name for name, q in queues.items() for g in q if g.request_id == request_id]
    group = next((g for g in groups if g.request_id == request_id), None)
    finished_before = {} if group is None else {s.seq_id: s.status for s in group.seqs}
    aborted = scheduler.abort_seq_group(request_id)
    if not where:
        # Not arrived yet, or already finished: nothing happens.
        assert aborted == []
        if group is not None:
            assert {s.seq_id: s.status for s in group.seqs} == finished_before
        events["abort_noop"] += 1
        return None
    assert len(where) == 1
    events[f"abort_{where[0]}"] += 1
    assert len(aborted) == 1 and aborted[0] is group
    for seq in group.seqs:
        if SequenceStatus.is_finished(finished_before[seq.seq_id]):
            assert seq.status == finished_before[seq.seq_id]  # finished before
        else:
            assert seq.status == SequenceStatus.FINISHED_ABORTED
        assert seq.seq_id not in scheduler.block_manager.block_tables
    assert group.is_finished()
    assert all(g is not group for q in queues.values() for g in q)
    # Its blocks are free now.
    check_block_pools(scheduler, groups)
    check_queues(scheduler, groups)
    return group


def run_workload(w: Workload) -> Counter:
    """Run `w` to completion, checking every step; returns what happened."""
    cache_config = CacheConfig(
        block_size=w.block_size, enable_prefix_caching=w.enable_prefix_caching
    )
    cache_config.num_gpu_blocks = w.num_gpu_blocks
    cache_config.num_cpu_blocks = w.num_cpu_blocks
    config = SchedulerConfig(
        max_num_seqs=w.max_num_seqs,
        max_num_batched_tokens=w.max_num_batched_tokens,
        max_model_len=w.max_model_len,
        preemption_mode=w.preemption_mode,
        enable_chunked_prefill=w.enable_chunked_prefill,
    )
    scheduler_cls = MixedBatchScheduler if w.batching == "mixed" else Scheduler
    scheduler = scheduler_cls(config, cache_config, watermark=w.watermark)
    bm = scheduler.block_manager

    order = sorted(range(len(w.requests)), key=lambda i: (w.requests[i].arrival_step, i))
    pending: list[tuple[int, SequenceGroup]] = []
    targets: dict[str, int] = {}
    next_seq_id = 0
    for arrival, i in enumerate(order):
        r = w.requests[i]
        if r.tokens is None:
            prompt = [100 * i + k for k in range(r.prompt_len)]
        else:
            assert len(r.tokens) == r.prompt_len
            prompt = list(r.tokens)
        seqs = []
        for _ in range(r.n):
            seqs.append(Sequence(next_seq_id, None, prompt, w.block_size))
            next_seq_id += 1
        if r.n == 1:
            params = SamplingParams(temperature=0, max_tokens=r.target)
        else:
            params = SamplingParams(n=r.n, temperature=1.0, max_tokens=r.target)
        group = SequenceGroup(f"req{i}", seqs, params, float(arrival))
        targets[group.request_id] = r.target
        pending.append((r.arrival_step, group))
    aborts: dict[int, list[int]] = {}
    for step, index in w.aborts:
        aborts.setdefault(step, []).append(index)

    added: list[SequenceGroup] = []
    events: Counter = Counter()
    finished: Counter = Counter()
    ignored: Counter = Counter()
    aborted: Counter = Counter()
    kv = ShadowKV(w.block_size)
    known_hashes: dict[int, tuple[int, ...]] = {}
    step = 0
    while pending or scheduler.has_unfinished_seqs():
        assert step < MAX_STEPS, f"not done after {MAX_STEPS} steps"
        while pending and pending[0][0] <= step:
            group = pending.pop(0)[1]
            scheduler.add_seq_group(group)
            added.append(group)
        for index in aborts.get(step, []):
            group = abort(scheduler, f"req{index}", added, events)
            if group is not None:
                aborted[group.request_id] += 1
        done = set(finished) | set(ignored) | set(aborted)
        was_waiting = {id(g) for g in scheduler.waiting}
        counters = (bm.prefix_cache_queries, bm.prefix_cache_hits)
        metadata, out = scheduler.schedule()
        for group in out.ignored_seq_groups:
            ignored[group.request_id] += 1
        computed_end = check_step(
            scheduler, metadata, out, w, added, done, was_waiting, counters, events
        )
        check_prefix_cache(scheduler, added, computed_end, known_hashes)
        kv.run_step(scheduler, out)
        kv.check_cached_blocks(scheduler, known_hashes)
        events.update(mode.value for _, mode in out.preempted)
        events["ignored"] += len(out.ignored_seq_groups)
        events["swap_in"] += bool(out.blocks_to_swap_in)
        events["copy_on_write"] += len(out.blocks_to_copy)
        for group in simulate_model_step(scheduler, out, metadata, targets, w):
            finished[group.request_id] += 1
        step += 1

    all_ids = {g.request_id for g in added}
    assert len(added) == len(w.requests)
    assert set(finished) | set(ignored) | set(aborted) == all_ids
    assert not set(finished) & set(ignored), "a request both finished and ignored"
    assert not set(aborted) & (set(finished) | set(ignored)), "an aborted request also finished"
    for counter in (finished, ignored, aborted):
        assert all(c == 1 for c in counter.values()), counter
    for group in added:
        assert group.is_finished()
        target = targets[group.request_id]
        for j, seq in enumerate(group.seqs):
            # Every token is the model's for the tokens before it: a
            # preemption, cache hit or chunk neither lost nor repeated one.
            tokens = seq.get_token_ids()
            for k in range(seq.get_prompt_len(), seq.get_len()):
                assert tokens[k] == model_token(tokens[:k], j, w.vocab), (seq, k)
            assert seq.get_output_len() <= target
            assert seq.get_len() <= max(w.max_model_len, seq.get_prompt_len() + 1)
            if group.request_id in finished:
                # Stopped by its target or by max_model_len
                # (a prompt of max_model_len tokens still gets its one token).
                assert seq.get_output_len() == target or seq.get_len() >= w.max_model_len
    assert bm.block_tables == {}
    assert bm.get_num_free_gpu_blocks() == w.num_gpu_blocks
    assert bm.get_num_free_cpu_blocks() == w.num_cpu_blocks
    events["prefix_cache_hits"] = bm.prefix_cache_hits
    return events


@settings(max_examples=1000, deadline=None)
@given(workloads())
def test_random_workloads_keep_invariants_and_all_finish(w: Workload) -> None:
    events = run_workload(w)
    event("prefix caching" if w.enable_prefix_caching else "no prefix caching")
    event("chunked prefill" if w.enable_chunked_prefill else "whole prefills")
    event(f"batching {w.batching}")
    for name, count in events.items():
        if count:
            event(name)


def test_run_workload_exercises_preemption_paths():
    """The harness itself on hand-picked workloads that must preempt.

    6 blocks of 2. r0 and r1 (3 tokens, 2 blocks each) start at step 0 and
    r2 (2 tokens, 1 block) at step 1, taking the last block. At step 2 r0
    and r1 have 5 tokens and each need a third block: r0 takes the one free
    block and r1 can only get one by preempting r2.
    """
    requests = [Request(0, 3, 8, 1), Request(0, 3, 8, 1), Request(1, 2, 8, 1)]
    for mode in ("recompute", "swap"):
        w = Workload(2, 6, 40, 4, 16, 16, mode, 0.0, requests)
        events = run_workload(w)
        assert events[mode] >= 1
        assert events["ignored"] == 0
    assert events["swap_in"] >= 1

    # A 2-sequence group: its shared, half-full last prompt block is copied
    # on the first decode; it is the last arrival, so it is swapped out.
    requests = [Request(0, 3, 8, 1), Request(0, 3, 6, 2)]
    events = run_workload(Workload(2, 7, 40, 4, 16, 16, "swap", 0.0, requests))
    assert events["copy_on_write"] >= 1
    assert events["swap"] >= 1
    assert events["swap_in"] >= 1


def test_run_workload_reports_never_fitting_request_as_ignored():
    # 16 tokens in blocks of 4 need 4 blocks; the pool has 4 but a watermark
    # of int(0.25 * 4) = 1 block must stay free, so it can never be admitted.
    requests = [Request(0, 16, 3, 1), Request(0, 4, 3, 1)]
    events = run_workload(Workload(4, 4, 0, 2, 16, 16, "recompute", 0.25, requests))
    assert events["ignored"] == 1


def test_run_workload_exercises_prefix_caching():
    """Blocks of 2. r0 and r1 share a 4-token prefix and arrive together: r1
    reuses the two blocks r0 computes in that same step. r2 arrives after
    both finished and finds the two blocks in the evictor."""
    prefix = (7, 7, 8, 8)
    requests = [
        Request(0, 5, 2, 1, prefix + (1,)),
        Request(0, 6, 2, 1, prefix + (2, 3)),
        Request(6, 5, 2, 1, prefix + (4,)),
    ]
    w = Workload(2, 8, 0, 4, 16, 16, "recompute", 0.0, requests, enable_prefix_caching=True)
    assert run_workload(w)["prefix_cache_hits"] == 2 + 2
    w.enable_prefix_caching = False
    assert run_workload(w)["prefix_cache_hits"] == 0

    # 5 blocks of 2; two 3-token prompts take 2 blocks each. At step 2 both
    # have 5 tokens and need a third block: r0 takes the last one and r1 is
    # preempted by RECOMPUTE, its two full blocks going to the evictor. r0
    # finishes in that step (3 tokens generated), and r1, readmitted with its
    # 5 tokens, finds its own 2 blocks.
    requests = [Request(0, 3, 3, 1, (1, 2, 3)), Request(0, 3, 6, 1, (4, 5, 6))]
    events = run_workload(
        Workload(2, 5, 0, 4, 16, 16, "recompute", 0.0, requests, enable_prefix_caching=True)
    )
    assert events["recompute"] == 1
    assert events["prefix_cache_hits"] == 2


def test_run_workload_exercises_chunked_prefill():
    """A 12-token prompt under a budget of 6 tokens, beside a decode: chunks
    of 5, 5 and 2. With caching (blocks of 2) the chunks that do not finish
    the prompt are cut to whole blocks: 4, 4 and 4."""
    requests = [Request(0, 3, 10, 1), Request(1, 12, 3, 1)]
    for caching in (False, True):
        w = Workload(
            2,
            20,
            0,
            4,
            6,
            16,
            "recompute",
            0.0,
            requests,
            enable_prefix_caching=caching,
            enable_chunked_prefill=True,
        )
        events = run_workload(w)
        assert events["partial_chunk"] == 2
        # The first chunk of 5 ends inside a block.
        assert events["unaligned_partial_chunk"] == (0 if caching else 1)
        assert events["mixed_step"] == 3


def test_run_workload_exercises_both_batchings():
    """vLLM's default: r1's prefill runs alone while r0 waits to decode;
    MixedBatchScheduler: they share a step."""
    requests = [Request(0, 3, 6, 1), Request(2, 3, 6, 1)]
    w = Workload(2, 20, 0, 4, 16, 16, "recompute", 0.0, requests)
    events = run_workload(w)
    assert events["decodes_held_back"] >= 1
    assert events["mixed_step"] == 0
    w.batching = "mixed"
    assert run_workload(w)["mixed_step"] >= 1


def test_run_workload_exercises_aborts_from_every_queue():
    """Swap mode, 6 blocks of 2. Step 0 prefills r0 and r1, step 1 r2 alone
    (vLLM's default: a prefill step); at step 2 all three decode, r2 taking
    the last free block; at step 3 r0 finds no free block and r2 (the tail)
    is swapped out. r3 (12 tokens, 6 blocks) cannot be admitted meanwhile.
    Before step 4: r3 is waiting, r0 running, r2 swapped: abort all three,
    and r4, which has not arrived yet (a no-op: it arrives and finishes
    later). Before step 5, abort r0 again (a no-op)."""
    requests = [
        Request(0, 3, 8, 1),
        Request(0, 3, 8, 1),
        Request(1, 2, 8, 1),
        Request(1, 12, 2, 1),
        Request(5, 2, 2, 1),
    ]
    aborts = [(4, 3), (4, 0), (4, 2), (4, 4), (5, 0)]
    w = Workload(2, 6, 40, 4, 16, 16, "swap", 0.0, requests, aborts=aborts)
    events = run_workload(w)
    assert events["swap"] >= 1
    for where in ("waiting", "running", "swapped"):
        assert events[f"abort_{where}"] == 1, events
    assert events["abort_noop"] == 2


def test_chunked_prefix_caching_budget_below_block_size_is_refused():
    """Blocks of 4, a budget of 2 tokens (max_num_seqs=1): the first chunk
    of a 6-token prompt, min(6, 2) = 2 tokens, would be cut to whole blocks,
    0 tokens, and wait forever. The scheduler refuses the configuration."""
    requests = [Request(0, 6, 2, 1)]
    w = Workload(
        4,
        8,
        0,
        1,
        2,
        16,
        "recompute",
        0.0,
        requests,
        enable_prefix_caching=True,
        enable_chunked_prefill=True,
    )
    with pytest.raises(
        ValueError, match=r"max_num_batched_tokens \(2\) must be >= block_size \(4\)"
    ):
        run_workload(w)


def test_victims_of_both_modes_run_to_completion():
    """preemption_mode=None (vLLM's default): SWAP for n=2, RECOMPUTE for n=1.
    4 blocks of 2, r1 (n=2) and r2 (n=1) first, r0 (n=2) a step later: under
    pressure both modes are used in one run, the queues keep the order
    things happened in (no re-sorting, as in vLLM), and every request still
    finishes with the tokens the invariants demand."""
    requests = [Request(1, 1, 2, 2), Request(0, 1, 3, 2), Request(0, 1, 3, 1)]
    events = run_workload(Workload(2, 4, 10, 5, 5, 4, None, 0.0, requests))
    assert events["swap"] >= 1 and events["recompute"] >= 1, events
